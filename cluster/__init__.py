"""Cluster bring-up on Ray: config, pools, KV transport, controller, and the `epcluster` CLI."""
