"""Decode ranks: reserve KV blocks for incoming requests, import their prompt KV, decode them in
a continuous batch, and push every step's token deltas to the router in one message."""

from decode_workers.worker import DecodeWorker

__all__ = ["DecodeWorker"]
