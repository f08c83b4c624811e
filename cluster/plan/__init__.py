"""Capacity planning: hardware and models as data, a step cost model from first principles, the
memory plan per GPU, a discrete-event simulator of a unit, the deployment search and the
`epcluster plan` report (docs/planning.md)."""
