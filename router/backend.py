"""What the gRPC server needs from whatever generates tokens: one engine in this process
(router.backends.local.LocalBackend) or the prefill and decode pools on Ray (cluster/).

The server validates and tokenizes every request, resolves its seed and deadline, and admits it
before calling `generate`; a backend never sees a request the router has refused.
"""

from collections.abc import AsyncIterator
from typing import Protocol

from engine.messages import (
    ClusterStatus,
    GenerateRequest,
    ModelInfo,
    PoolLoad,
    RebalanceStatus,
    RequestOutput,
)
from engine.model_info import PromptLimits
from engine.tokenizer import Tokenizer


class Overloaded(RuntimeError):
    """No capacity for the request now (the server answers RESOURCE_EXHAUSTED: retry later)."""


class Unavailable(RuntimeError):
    """The backend cannot serve right now, e.g. a pool is re-forming after a rank failure (the
    server answers UNAVAILABLE with a retry hint)."""


class Backend(Protocol):
    tokenizer: Tokenizer  # encodes text prompts in the router; immutable, safe from any thread

    def model_info(self) -> ModelInfo:
        """The served model's facts; cheap and constant once constructed."""
        ...

    def prompt_limits(self) -> PromptLimits:
        """What a prompt must fit (the vocabulary, the context, the smallest KV cache of the
        ranks that hold it); cheap, polled per request."""
        ...

    def ready(self) -> bool:
        """True when `generate` can take requests (drives the gRPC health status); cheap,
        polled from the event loop."""
        ...

    def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Stream one request's deltas (an async generator: `async def` with `yield`).

        Each delta holds the new token ids and text since the previous one; num_* counters
        are totals so far. The last delta has finish_reason set ("stop" | "length" | "abort");
        after the deadline (request.deadline, time.time() seconds) the backend ends the
        request with "abort". Raises ValueError (before any delta) when the request cannot
        be served as given (the server answers INVALID_ARGUMENT with its message), Overloaded
        (RESOURCE_EXHAUSTED) or Unavailable (UNAVAILABLE); any other exception is an internal
        failure (INTERNAL).
        NOTE: closing the iterator early (aclose, or cancellation while awaiting it) must
        abort the request and free its KV blocks, like `abort`.
        """
        ...

    async def abort(self, request_id: str) -> None:
        """Stop a request and free its KV blocks on every rank. Idempotent: unknown or finished
        ids are ignored. The request's stream, if still open, ends with finish_reason "abort"."""
        ...

    async def expert_load(self) -> list[PoolLoad]:
        """Each pool's tokens per expert slot and MoE layer (a few RPCs: not per request)."""
        ...

    async def rebalance(self, pool: str | None = None) -> list[tuple[str, RebalanceStatus]]:
        """Re-place the experts of a pool (None: all) now and return each pool's outcome;
        ValueError when a pool has nothing to balance."""
        ...

    async def status(self) -> ClusterStatus:
        """Pools, ranks and the requests in flight; the server adds its admission counters."""
        ...
