"""Prefill ranks: a shell over the engine of one rank. It takes prompts from the router, hands
them to its engine (which batches them under a token budget, chunks long ones and reuses cached
prefix blocks), and returns each request's first token with the prompt's latent KV for a decode
rank."""

from prefill_workers.worker import PrefillWorker

__all__ = ["PrefillWorker"]
