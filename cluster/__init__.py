"""Cluster bring-up on Ray: the one floor that imports Ray and wires everything together.

config.py    ClusterConfig / PoolConfig: the YAML file, then command-line flags; checked once
pool.py      Pool: a placement group and one rank actor per rank, joined into the pool's
             torch.distributed group (its expert-parallel group)
handles.py   PrefillHandle / DecodeHandle: the router's async view of a rank actor
launcher.py  Cluster: starts (or joins) Ray, both pools and the gRPC router; shuts them down
cli.py       the `epcluster` command: serve, generate, status
"""
