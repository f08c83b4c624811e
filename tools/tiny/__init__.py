"""Training the `tiny` preset (its checkpoint is committed in moe/weights/tiny):
train.py (`python -m tools.tiny.train`), report.py (greedy samples, the loss curve) and
routing.py (the routed load while it trains)."""
