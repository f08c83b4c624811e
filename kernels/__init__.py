"""Leaf ops. Each module holds one op: a plain-torch reference (the CPU path) and, where written,
a Triton kernel behind the same function (backend.py chooses between them)."""
