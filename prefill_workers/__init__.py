"""Prefill ranks: batch prompts under a token budget (chunked prefill), reuse cached prefix
blocks, sample the first token, and hand the prompt's latent KV to a decode rank."""

from prefill_workers.worker import PrefillWorker

__all__ = ["PrefillWorker"]
