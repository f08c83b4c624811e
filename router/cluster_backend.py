"""ClusterBackend: the Backend over a prefill pool and a decode pool.

Per request: pick a decode rank and reserve KV blocks there; pick a prefill rank and run the
prompt; stream the first token (time to first token); hand the prompt's KV, unopened, to the
decode rank; then stream the decode rank's deltas, which arrive once per step on one stream per
decode rank. However the request ends (finish, client cancel, deadline, failure), both ranks are
told, so no block stays held.

The rank handles are duck-typed (cluster/ wraps Ray actors in them); this module imports no Ray.
"""

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Protocol

from engine.messages import (
    ClusterStatus,
    GenerateRequest,
    ModelInfo,
    PoolStatus,
    RankStatus,
    RequestOutput,
)
from engine.model_info import PromptLimits
from engine.tokenizer import Tokenizer
from router.routing import decode_preference, prefill_choice, prefix_key

log = logging.getLogger(__name__)


class PrefillRank(Protocol):
    async def prefill(self, request: GenerateRequest, kv_dst: int) -> tuple[RequestOutput, Any]: ...
    async def abort(self, request_id: str) -> None: ...
    async def status(self) -> RankStatus: ...


class DecodeRank(Protocol):
    kv_rank: int  # where the prefill rank sends this rank's KV (the transport's numbering)

    async def reserve(self, request_id: str, prompt: list[int], timeout_s: float) -> bool: ...
    async def start(
        self, request: GenerateRequest, first: RequestOutput, kv: Any, router_id: str
    ) -> None: ...
    async def abort(self, request_id: str) -> None: ...
    async def discard_kv(self, kv: Any) -> None: ...
    async def status(self) -> RankStatus: ...
    async def register_router(self, router_id: str) -> None: ...
    def stream(self, router_id: str) -> AsyncIterator[list[RequestOutput]]: ...


class KVTransferFailed(RuntimeError):
    """The prompt's KV did not reach the decode rank; the request ends with an error."""


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    kv_transfer_timeout_s: float = 30.0  # a reservation whose KV does not come is released
    reserve_wait_s: float = 10.0  # how long a request waits for room on a decode rank
    prefill_max_imbalance: int = 4096  # queued prompt tokens before affinity gives way to load
    affinity_blocks: int = 1  # prompt blocks whose hash picks the preferred prefill rank
    status_interval_s: float = 0.1  # how often the ranks' load is polled

    def __post_init__(self) -> None:
        for name in ("kv_transfer_timeout_s", "reserve_wait_s", "status_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"routing {name} must be > 0 (got {getattr(self, name)!r})")
        if self.prefill_max_imbalance < 0 or self.affinity_blocks < 1:
            raise ValueError(
                "routing prefill_max_imbalance must be >= 0 and affinity_blocks >= 1 "
                f"(got {self.prefill_max_imbalance!r}, {self.affinity_blocks!r})"
            )


@dataclass(slots=True)
class _Route:
    """Where one request runs, and what it holds on the ranks until the backend releases it."""

    request: GenerateRequest
    queue: asyncio.Queue  # the decode rank's deltas for it, or None for an abort
    decode: int | None = None  # the decode rank holding its reservation (then its blocks)
    prefill: int | None = None
    first: RequestOutput | None = None  # the first token's delta, from the prefill rank
    kv: Any = None  # the transport's handle of the prompt's KV until the decode rank has it
    done: bool = False  # finished on a rank: nothing left to abort there
    started: bool = False  # the decode rank took the request (its reservation is used)


class ClusterBackend:
    def __init__(
        self,
        prefill: list[PrefillRank],
        decode: list[DecodeRank],
        model_info: ModelInfo,
        tokenizer: Tokenizer,
        block_size: int,
        routing: RoutingConfig | None = None,
    ) -> None:
        self.prefill, self.decode = prefill, decode
        self._model_info, self.tokenizer = model_info, tokenizer
        self.block_size = block_size
        self.routing = routing or RoutingConfig()
        self.router_id = uuid.uuid4().hex
        self._routes: dict[str, _Route] = {}
        self._prefill_load = [0] * len(prefill)  # prompt tokens this router has in flight
        self._decode_pending = [0] * len(decode)  # blocks reserved since the last status
        self._status: dict[tuple[str, int], RankStatus] = {}
        self._tasks: list[asyncio.Task] = []
        self._started = False

    # ---- lifecycle ----

    async def start(self) -> None:
        """Open the delta streams and the status poller (on the server's event loop)."""
        await asyncio.gather(*(d.register_router(self.router_id) for d in self.decode))
        self._tasks = [asyncio.create_task(self._read_stream(d)) for d in self.decode]
        await self._poll_status_once()
        self._tasks.append(asyncio.create_task(self._poll_status()))
        self._started = True

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._started = False

    def ready(self) -> bool:
        return (
            self._started
            and len(self._status) == len(self.prefill) + len(self.decode)
            and all(s.ready for s in self._status.values())
            and not any(t.done() for t in self._tasks)
        )

    def model_info(self) -> ModelInfo:
        return self._model_info

    def prompt_limits(self) -> PromptLimits:
        """A prompt must fit the smallest KV cache of any rank that may hold it (both pools)."""
        sizes = [s.kv_total_blocks for s in self._status.values() if s.kv_total_blocks > 0]
        info = self._model_info
        return PromptLimits(
            info.vocab_size, info.max_model_len, self.block_size, min(sizes, default=1 << 62)
        )

    async def status(self) -> ClusterStatus:
        await self._poll_status_once()
        pools = [
            PoolStatus(name, [self._status[(name, i)] for i in range(n)])
            for name, n in (("prefill", len(self.prefill)), ("decode", len(self.decode)))
        ]
        return ClusterStatus(pools, num_in_flight=len(self._routes))

    async def _poll_status_once(self) -> None:
        ranks = [("prefill", i, r) for i, r in enumerate(self.prefill)]
        ranks += [("decode", i, r) for i, r in enumerate(self.decode)]
        results = await asyncio.gather(*(r.status() for _, _, r in ranks), return_exceptions=True)
        for (pool, i, _), result in zip(ranks, results):
            if isinstance(result, BaseException):
                old = self._status.get((pool, i))
                self._status[(pool, i)] = RankStatus(
                    pool, i, False, 0, 0, 0, old.kv_total_blocks if old else 0
                )
            else:
                self._status[(pool, i)] = result
        self._decode_pending = [0] * len(self.decode)

    async def _poll_status(self) -> None:
        while True:
            await asyncio.sleep(self.routing.status_interval_s)
            with contextlib.suppress(Exception):
                await self._poll_status_once()

    async def _read_stream(self, rank: DecodeRank) -> None:
        async for deltas in rank.stream(self.router_id):
            for delta in deltas:
                route = self._routes.get(delta.request_id)
                if route is not None:
                    route.queue.put_nowait(delta)

    # ---- requests ----

    async def abort(self, request_id: str) -> None:
        route = self._routes.get(request_id)
        if route is not None:
            route.queue.put_nowait(None)  # generate() sees it, aborts on the ranks, ends "abort"

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Prefill phase (reserve on a decode rank, prefill, first token), then decode phase
        (start on the decode rank, stream its deltas); releasing the route is the cleanup."""
        rid = request.request_id
        if rid in self._routes:
            raise ValueError(f"request id {rid!r} is already in flight")
        route = self._routes[rid] = _Route(request, asyncio.Queue())
        try:
            first = await self._prefill_phase(route)
            if first is None:  # deadline or abort during the prefill
                yield self._aborted(request)
                return
            yield first
            if not route.done:
                async for delta in self._decode_phase(route):
                    yield delta
        finally:
            del self._routes[rid]
            await asyncio.shield(self._release(route))

    async def _prefill_phase(self, route: _Route) -> RequestOutput | None:
        """Reserve the prompt's blocks on a decode rank, run the prompt on a prefill rank; -> the
        first token's delta, or None when the deadline passed or the request was aborted."""
        request, prompt = route.request, route.request.prompt_token_ids
        route.decode = await self._reserve(request)
        cfg = self.routing
        key = prefix_key(prompt, self.block_size, cfg.affinity_blocks)
        route.prefill = prefill_choice(key, self._prefill_load, cfg.prefill_max_imbalance)
        self._prefill_load[route.prefill] += len(prompt)
        try:
            kv_dst = self.decode[route.decode].kv_rank
            call = self.prefill[route.prefill].prefill(request, kv_dst)
            result = await self._within(request, call, abort_queue=route.queue)
        finally:
            self._prefill_load[route.prefill] -= len(prompt)
        if result is None:
            return None
        route.first, route.kv = result
        route.done = route.first.finished  # finished on the prefill rank (EOS, a stop, ...)
        return route.first

    async def _decode_phase(self, route: _Route) -> AsyncIterator[RequestOutput]:
        """Hand the prompt's KV to the decode rank and stream its deltas until the finish, the
        deadline or an abort."""
        request, rank = route.request, self.decode[route.decode]
        try:
            handle, route.kv = route.kv, None
            await rank.start(request, route.first, handle, self.router_id)
        except Exception as e:
            raise KVTransferFailed(
                f"the prompt's KV cache did not reach decode rank {route.decode}: {e}"
            ) from e
        route.started = True
        while not route.done:
            delta = await self._within(request, route.queue.get())
            if delta is None:  # deadline or abort
                yield self._aborted(request)
                return
            route.done = delta.finished
            yield delta

    async def _release(self, route: _Route) -> None:
        """However the request ended: abort it where it may still hold blocks (an unused decode
        reservation included), and take delivery of a KV transfer nobody started."""
        calls = []
        if not route.done and route.prefill is not None:
            calls.append(self.prefill[route.prefill].abort(route.request.request_id))
        if route.decode is not None and not (route.done and route.started):
            calls.append(self.decode[route.decode].abort(route.request.request_id))
        if route.kv is not None:  # sent but never started: a p2p send must still be matched
            calls.append(self.decode[route.decode].discard_kv(route.kv))
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException):
                log.warning("cleanup of %s failed: %r", route.request.request_id, result)

    async def _reserve(self, request: GenerateRequest) -> int:
        """Reserve the prompt's blocks on the best decode rank with room, waiting for room up
        to reserve_wait_s. -> the decode rank."""
        needed = -(-(len(request.prompt_token_ids) + 1) // self.block_size)
        give_up = time.monotonic() + self.routing.reserve_wait_s
        while True:
            ranks = [self._status.get(("decode", i)) for i in range(len(self.decode))]
            live = [r or RankStatus("decode", i, False, 0, 0, 0, 0) for i, r in enumerate(ranks)]
            for i in decode_preference(live, self._decode_pending, needed):
                ok = await self.decode[i].reserve(
                    request.request_id,
                    request.prompt_token_ids,
                    self.routing.kv_transfer_timeout_s,
                )
                if ok:
                    self._decode_pending[i] += needed
                    return i
            if time.monotonic() > give_up:
                raise RuntimeError(
                    f"no decode rank has room for {needed} KV blocks after "
                    f"{self.routing.reserve_wait_s:.0f} s"
                )
            await asyncio.sleep(0.05)
            await self._poll_status_once()

    async def _within(
        self, request: GenerateRequest, awaitable: Any, abort_queue: asyncio.Queue | None = None
    ) -> Any:
        """Await `awaitable` until the request's deadline, or until an abort marker arrives on
        abort_queue; -> None in those cases."""
        timeout = None if request.deadline is None else max(0.0, request.deadline - time.time())
        task = asyncio.ensure_future(awaitable)
        waits = {task}
        if abort_queue is not None:
            waits.add(asyncio.ensure_future(abort_queue.get()))
        try:
            finished, _ = await asyncio.wait(
                waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for waiter in waits:
                waiter.cancel()
        return task.result() if task in finished else None

    def _aborted(self, request: GenerateRequest) -> RequestOutput:
        return RequestOutput(
            request.request_id, [], "", "abort", len(request.prompt_token_ids), 0, 0
        )
