"""The one request path every protocol of the router uses (epcluster.v1 and vLLM's engine gRPC,
OpenAI HTTP): refuse while draining, refuse a duplicate id, admit (request and token caps), wait
for a backend that is starting or recovering, stream the backend's deltas, record the request's
metrics; whatever ends the stream early (a client gone, a deadline, a failure) aborts the request
in the backend so its KV blocks are freed, and the admission slot is always released.

Refusals and failures are `Refused(status, message)` with a gRPC status name; each protocol maps
it (gRPC: the code itself; HTTP: 400 / 429 / 503 / 504 / 500).
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from engine.messages import GenerateRequest, RequestFailed, RequestOutput
from router.admission import Admission
from router.backend import Backend, Overloaded, Unavailable
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)

INVALID, EXHAUSTED, UNAVAILABLE = "INVALID_ARGUMENT", "RESOURCE_EXHAUSTED", "UNAVAILABLE"
DEADLINE, INTERNAL = "DEADLINE_EXCEEDED", "INTERNAL"


T = TypeVar("T")
BIG_TEXT = 64 * 1024  # characters of prompt text above which tokenizing leaves the event loop


async def off_loop(text_chars: int, fn: Callable[..., T], *args: object) -> T:
    """fn(*args), the conversion of a request that tokenizes `text_chars` characters: on a
    worker thread when that is more than BIG_TEXT. NOTE: tokenizing 4 MiB of text took 4 s, and
    on the router's event loop it stalled every other stream and health check; `tokenizers`
    releases the GIL while it encodes. Small prompts stay inline (a thread hop costs ~50 us)."""
    if text_chars > BIG_TEXT:
        return await asyncio.to_thread(fn, *args)
    return fn(*args)


class Refused(Exception):
    """The request was refused or failed: `status` a gRPC status name, `message` one line for
    the client, `retry_after_s` a hint when retrying later may succeed."""

    def __init__(self, status: str, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.retry_after_s = status, message, retry_after_s


class Frontend:
    def __init__(
        self,
        backend: Backend,
        admission: Admission,
        ready_wait_s: float = 30.0,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.backend = backend
        self.admission = admission
        self.metrics = metrics
        self.ready_wait_s = ready_wait_s  # a request waits this long for a backend not ready
        self.draining = False  # stopping: new requests are refused, streams in flight go on
        self.in_flight: set[str] = set()  # request ids with an open stream on this router
        self.cleaning = 0  # streams that ended and are still aborting their request

    def refuse(
        self,
        status: str,
        message: str,
        admission: str | None = None,
        retry: float | None = None,
    ) -> Refused:
        """Count a refusal before the request started, and return the exception to raise."""
        if self.metrics is not None:
            self.metrics.refused(status, admission)
        return Refused(status, message, retry)

    async def generate(
        self, req: GenerateRequest, start: float | None = None
    ) -> AsyncIterator[RequestOutput]:
        """The backend's deltas for a validated request (start: its arrival, time.monotonic()).
        Raises Refused before the first delta when it is not admitted, and mid-stream when the
        backend fails. Close the iterator (contextlib.aclosing) to end the request early."""
        start = time.monotonic() if start is None else start
        if self.draining:
            why = "this router is shutting down: retry (on another router)"
            raise self.refuse(UNAVAILABLE, why, "draining", retry=1.0)
        if req.request_id in self.in_flight:
            raise self.refuse(
                INVALID, f"request_id {req.request_id!r} is already in flight: use a unique id"
            )
        num_tokens = len(req.prompt_token_ids)
        refusal = self.admission.try_admit(num_tokens)
        if refusal is not None:
            raise self.refuse(EXHAUSTED, str(refusal), refusal.kind)
        # NOTE: no await between the duplicate check and here, so two streams cannot both pass.
        self.in_flight.add(req.request_id)
        timer = None
        if self.metrics is not None:
            timer = self.metrics.request(start)
            self.metrics.child("epcluster_prompt_tokens_total").inc(num_tokens)
        last: RequestOutput | None = None
        finished = False
        try:
            await self._wait_ready(req.deadline)
            async with contextlib.aclosing(self.backend.generate(req)) as deltas:
                async for last in deltas:
                    finished = last.finished
                    yield last
                    # NOTE: counted once the protocol has sent it (it asks for the next one):
                    # a delta whose write failed (the client left) is not a token served.
                    if timer is not None:
                        timer.tokens(len(last.token_ids))
            if not finished:
                raise Refused(INTERNAL, "the backend ended the stream without a finish")
            if last.finish_reason == "abort" and _past(req.deadline):
                # The backend enforced the deadline a moment before the protocol did.
                raise Refused(DEADLINE, "deadline exceeded: aborted")
            if timer is not None:
                timer.finish(last.finish_reason, "OK", last.num_cached_tokens)
        except (asyncio.CancelledError, GeneratorExit):  # client gone, or the deadline passed
            if timer is not None:
                timer.finish("abort", DEADLINE if _past(req.deadline) else "CANCELLED")
            raise
        except Refused as e:
            if timer is not None:
                timer.finish("abort" if e.status == DEADLINE else "error", e.status)
            raise
        except Exception as e:
            refused = _refused_by(req, e, written=last is not None)
            if timer is not None:
                timer.finish("error", refused.status)
            raise refused from e
        finally:
            self.in_flight.discard(req.request_id)
            self.admission.release(num_tokens)
            if not finished:  # free the request's KV blocks, even while being cancelled
                self.cleaning += 1
                try:
                    await asyncio.shield(self.backend.abort(req.request_id))
                except Exception:
                    log.exception("aborting request %s failed", req.request_id)
                finally:
                    self.cleaning -= 1

    async def settle(self, timeout_s: float = 5.0) -> None:
        """Wait (up to timeout_s) until no stream is open or still aborting its request."""
        end = time.monotonic() + timeout_s
        while (self.in_flight or self.cleaning) and time.monotonic() < end:
            await asyncio.sleep(0.01)

    async def _wait_ready(self, deadline: float | None) -> None:
        """Wait (within the deadline and ready_wait_s) for a backend that is starting or
        recovering; Refused UNAVAILABLE with a retry hint if it does not get ready."""
        end = time.monotonic() + self.ready_wait_s
        if deadline is not None:
            end = min(end, time.monotonic() + deadline - time.time())
        while not self.backend.ready():
            if time.monotonic() >= end:
                if _past(deadline):
                    raise Refused(DEADLINE, "deadline exceeded: not ready yet")
                raise Refused(
                    UNAVAILABLE,
                    "the cluster is not ready (starting, or re-forming a pool after a rank "
                    "failure): retry in a few seconds",
                    retry_after_s=2.0,
                )
            await asyncio.sleep(0.05)


def _refused_by(req: GenerateRequest, e: Exception, written: bool) -> Refused:
    """What a backend failure becomes. The message is one line: the full traceback (and any
    remote one) goes to the log, never to the client."""
    cause = (str(e).strip().splitlines() or [""])[0][:300]
    if isinstance(e, RequestFailed):  # this request alone failed on a rank (or is poison)
        if not e.invalid:
            log.error("request %s failed: %s", req.request_id, cause)
        return Refused(INVALID if e.invalid else INTERNAL, cause)
    if isinstance(e, Overloaded):
        return Refused(EXHAUSTED, cause)
    if isinstance(e, Unavailable):
        return Refused(UNAVAILABLE, cause, retry_after_s=2.0)
    if isinstance(e, ValueError) and not written:  # refused as given, before any delta
        return Refused(INVALID, cause)
    log.error("request %s failed", req.request_id, exc_info=e)
    return Refused(INTERNAL, f"internal error: {type(e).__name__}: {cause}")


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.time() >= deadline
