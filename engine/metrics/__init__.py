"""What the engine and the router export to Prometheus: the catalog of every metric (catalog.py,
its shape in spec.py, the expert-parallel ones in ep.py), a rank's counters and collector
(rank.py), and the HTTP endpoint a process serves them on (server.py)."""
