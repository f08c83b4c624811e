"""ClusterBackend: the Backend over a prefill pool and a decode pool.

An attempt at a request: reserve KV blocks on a decode rank; run the prompt on a prefill rank;
stream the first token (time to first token); hand the prompt's KV, unopened, to the decode rank;
stream the decode rank's deltas (one stream per decode rank, a list of deltas per step). However
an attempt ends (finish, client cancel, deadline, failure), both ranks are told, so no block
stays held.

Faults: when a rank fails (router/pools.py), every request placed on its pool is resumed: a new
attempt, on the re-formed pool, that carries what the client already received (Resume). The
prefill rank recomputes that KV, and sampling, a function of (seed, position), goes on with the
same tokens: the client sees a pause. A reservation is a lease the router renews while the
prefill runs, so a router that dies leaves nothing held for long.

Requests reach the ranks under ids this router issues (router id + a counter + the attempt), so
any number of routers can share the pools; the client's id stays on its own messages.
The rank handles are duck-typed (cluster/ wraps Ray actors in them); this module imports no Ray.
"""

import asyncio
import dataclasses
import itertools
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from engine.messages import (
    GenerateRequest,
    ModelInfo,
    RankStatus,
    RequestOutput,
    Resume,
)
from engine.model_info import PromptLimits
from engine.tokenizer import Tokenizer
from router.backend import Overloaded, Unavailable
from router.cluster_admin import ClusterAdmin
from router.cluster_streams import ClusterStreams
from router.cluster_types import (
    DecodeRank,
    KVTransferFailed,
    P2PTransferFailed,
    PrefillRank,
    Route,
    RoutingConfig,
)
from router.metrics import RouterMetrics
from router.pools import HealthConfig, PoolControl, Pools, RankFailed
from router.routing import decode_preference, prefill_choice, prefix_key

log = logging.getLogger(__name__)


_ABORTED = object()  # _within: the deadline passed or the request was aborted


class ClusterBackend(ClusterStreams, ClusterAdmin):
    def __init__(
        self,
        prefill: list[PrefillRank],
        decode: list[DecodeRank],
        model_info: ModelInfo,
        tokenizer: Tokenizer,
        block_size: int,
        routing: RoutingConfig | None = None,
        health: HealthConfig | None = None,
        control: PoolControl | None = None,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self._model_info, self.tokenizer = model_info, tokenizer
        self.block_size = block_size
        self.routing = routing or RoutingConfig()
        self.pools = Pools(
            prefill,
            decode,
            control,
            health or HealthConfig(),
            self._on_pool_failed,
            self._on_pool_reformed,
            model_info.num_routed_experts,
        )
        self.metrics = metrics
        self.router_id = uuid.uuid4().hex
        self._seq = itertools.count()
        self._routes: dict[str, Route] = {}  # wire id -> route
        self._by_client: dict[str, Route] = {}  # client's request id -> route
        self._prefill_load = [0] * len(prefill)  # prompt tokens this router has in flight
        self._decode_pending = [0] * len(decode)  # blocks reserved since the last status
        self._pending_poll = -1  # the status poll _decode_pending counts from
        self._readers: list[asyncio.Task] = []
        self._renewer: asyncio.Task | None = None
        self._periodic: asyncio.Task | None = None
        self._kv_rebuild: asyncio.Task | None = None
        self.num_kv_fallbacks = 0  # requests resumed through the object store after a p2p error
        self.num_kv_rebuilds = 0
        self._started = False

    def model_info(self) -> ModelInfo:
        return dataclasses.replace(self._model_info, max_model_len=self._max_model_len())

    def prompt_limits(self) -> PromptLimits:
        """A prompt must fit the smallest KV cache of any rank that may hold it (both pools)."""
        sizes = [s.kv_total_blocks for s in self.pools.status.values() if s.kv_total_blocks > 0]
        info = self._model_info
        return PromptLimits(
            info.vocab_size, self._max_model_len(), self.block_size, min(sizes, default=1 << 62)
        )

    def _max_model_len(self) -> int:
        ranks = [s.max_model_len for s in self.pools.status.values() if s.max_model_len > 0]
        return min([self._model_info.max_model_len, *ranks])

    # ---- requests ----

    async def abort(self, request_id: str) -> None:
        route = self._by_client.get(request_id)
        if route is not None:
            route.queue.put_nowait(None)  # generate() sees it, aborts on the ranks, ends "abort"

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Attempts until one ends: a rank failure resumes the request on the re-formed pool
        from what the client has (up to max_resumes times)."""
        cid = request.request_id
        if cid in self._by_client:
            raise ValueError(f"request id {cid!r} is already in flight")
        route = self._by_client[cid] = Route(request, request)
        try:
            while True:
                self._begin_attempt(route)
                try:
                    async for delta in self._attempt(route):
                        route.token_ids += delta.token_ids
                        route.text += delta.text
                        delta.request_id = cid
                        yield delta
                    return
                except RankFailed as e:
                    self.pools.fail(e.pool, e.rank, e.why)
                    await asyncio.shield(self._release(route))
                    if route.resumes >= self.routing.max_resumes:
                        raise Unavailable(
                            f"the request was resumed {route.resumes} times after rank "
                            f"failures and the last one failed too ({e}): retry later"
                        ) from e
                    route.resumes += 1
                    if self.metrics is not None:
                        self.metrics.child("epcluster_request_resumes_total", e.pool).inc()
                    log.info("resuming %s after %s (%d tokens sent)", cid, e, len(route.token_ids))
                except P2PTransferFailed as e:
                    await asyncio.shield(self._release(route))
                    route.kv_fallback = True
                    self.num_kv_fallbacks += 1
                    if self.metrics is not None:
                        self.metrics.child("epcluster_kv_transfer_fallbacks_total").inc()
                    self._rebuild_kv_group()
                    log.warning("resuming %s through the object store: %s", cid, e)
        finally:
            del self._by_client[cid]
            self._routes.pop(route.wire.request_id, None)
            await asyncio.shield(self._release(route))

    def _begin_attempt(self, route: Route) -> None:
        self._routes.pop(route.wire.request_id, None)
        resume = Resume(list(route.token_ids), route.text) if route.token_ids else None
        wire_id = f"{self.router_id}-{next(self._seq)}"
        route.wire = dataclasses.replace(
            route.request, request_id=wire_id, resume=resume, kv_fallback=route.kv_fallback
        )
        route.queue = asyncio.Queue()
        route.first = route.kv = None
        route.done = route.started = False
        self._routes[wire_id] = route

    async def _attempt(self, route: Route) -> AsyncIterator[RequestOutput]:
        request = route.request
        waited = await self._wait_for_pools(request)
        if waited is None:
            yield self._aborted(route)  # the deadline passed while a pool re-formed
            return
        if len(route.token_ids) >= request.params.max_tokens:  # resumed at its very end
            yield self._finished(route, "length")
            return
        first = await self._prefill_phase(route)
        if first is None:  # deadline or abort during the prefill
            yield self._aborted(route)
            return
        yield first
        if not route.done:
            async for delta in self._decode_phase(route):
                yield delta

    async def _wait_for_pools(self, request: GenerateRequest) -> bool | None:
        """True once both pools can take work; None if the deadline passes first. Raises
        Unavailable after recovery_wait_s."""
        if self.pools.ready():
            return True
        wait = self.routing.recovery_wait_s
        left = None if request.deadline is None else request.deadline - time.time()
        if await self.pools.wait_ready(wait if left is None else max(0.0, min(wait, left))):
            return True
        if left is not None and left <= wait:
            return None
        raise Unavailable(
            f"a pool is re-forming after a rank failure ({self._last_failure()}): retry in a "
            "few seconds"
        )

    def _last_failure(self) -> str:
        return "; ".join(
            f"{p.name}: {p.last_failure}" for p in self.pools.pools.values() if p.last_failure
        )

    async def _prefill_phase(self, route: Route) -> RequestOutput | None:
        """Reserve the blocks on a decode rank, run the prompt on a prefill rank; -> the first
        token's delta, or None when the deadline passed or the request was aborted."""
        wire = route.wire
        waited = time.monotonic()
        route.decode = await self._reserve(route)
        if route.decode is None:
            return None
        asked = time.monotonic()
        if self.metrics is not None:
            self.metrics.child("epcluster_kv_reservation_wait_seconds").observe(asked - waited)
            self.metrics.child("epcluster_request_queue_time_seconds").observe(
                asked - route.arrival
            )
        prefill = self.pools["prefill"]
        route.prefill_gen = prefill.generation
        known = len(wire.known_token_ids)
        key = prefix_key(wire.prompt_token_ids, self.block_size, self.routing.affinity_blocks)
        route.prefill = prefill_choice(key, self._prefill_load, self.routing.prefill_max_imbalance)
        self._prefill_load[route.prefill] += known
        try:
            kv_dst = self.pools["decode"].ranks[route.decode].kv_rank
            result = await self._within(route, prefill.ranks[route.prefill].prefill(wire, kv_dst))
        finally:
            if prefill.generation == route.prefill_gen:
                self._prefill_load[route.prefill] -= known
        if result is _ABORTED:
            return None
        if self.metrics is not None:
            took = time.monotonic() - asked
            self.metrics.child("epcluster_request_prefill_time_seconds").observe(took)
        route.first, route.kv = result
        route.done = route.first.finished  # finished on the prefill rank (EOS, a stop, ...)
        return route.first

    async def _decode_phase(self, route: Route) -> AsyncIterator[RequestOutput]:
        """Hand the prompt's KV to the decode rank and stream its deltas until the finish, the
        deadline or an abort."""
        rank = self.pools["decode"].ranks[route.decode]
        handle, route.kv = route.kv, None
        try:
            await rank.start(route.wire, route.first, handle, self.router_id)
        except (RankFailed, asyncio.CancelledError):
            raise
        except Exception as e:
            if self.routing.kv_p2p and not route.kv_fallback:
                raise P2PTransferFailed(str(e)) from e
            raise KVTransferFailed(
                f"the prompt's KV cache did not reach decode rank {route.decode}: {e}"
            ) from e
        finally:
            del handle  # the decode rank has the KV: its object can go
        route.started = True
        while not route.done:
            delta = await self._within(route, route.queue.get(), watch_queue=False)
            if delta is _ABORTED:
                yield self._aborted(route)
                return
            route.done = delta.finished
            yield delta

    async def _release(self, route: Route) -> None:
        """Abort the current attempt where it may still hold blocks (an unused decode
        reservation included), and take delivery of a KV transfer nobody started. Idempotent."""
        rid = route.wire.request_id
        calls = []
        if route.prefill is not None and not route.done:
            prefill = self.pools["prefill"]
            if prefill.generation == route.prefill_gen:
                calls.append(prefill.ranks[route.prefill].abort(rid))
        if route.decode is not None and not (route.done and route.started):
            decode = self.pools["decode"]
            if decode.generation == route.decode_gen:
                calls.append(decode.ranks[route.decode].abort(rid))
                if route.kv is not None:  # sent, never started: a p2p send must be matched
                    calls.append(decode.ranks[route.decode].discard_kv(route.kv))
        route.prefill = route.decode = route.kv = None
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException):
                log.warning("cleanup of %s failed: %r", rid, result)

    async def _reserve(self, route: Route) -> int | None:
        """Reserve the known tokens' blocks on the best decode rank with room, waiting for room
        up to reserve_wait_s (Overloaded after that); -> the decode rank, None when the
        deadline passes or the request is aborted first."""
        wire, decode = route.wire, self.pools["decode"]
        needed = -(-(len(wire.known_token_ids) + 1) // self.block_size)
        give_up = time.monotonic() + self.routing.reserve_wait_s
        while True:
            route.decode_gen = decode.generation
            if self._pending_poll != self.pools.num_polls:  # fresh statuses count them
                self._pending_poll = self.pools.num_polls
                self._decode_pending = [0] * len(decode.ranks)
            ranks = [self.pools.status.get(("decode", i)) for i in range(len(decode.ranks))]
            live = [r or RankStatus("decode", i, False, 0, 0, 0, 0) for i, r in enumerate(ranks)]
            for i in decode_preference(live, self._decode_pending, needed):
                # NOTE: counted before the await: requests that arrive together must see each
                # other's choices (counted after it, a burst of 32 all reserved on one rank)
                self._decode_pending[i] += needed
                poll = self._pending_poll
                ok = False
                try:
                    ok = await decode.ranks[i].reserve(
                        wire.request_id, wire.known_token_ids, self.routing.kv_lease_s,
                        self.router_id,
                    )  # fmt: skip
                finally:
                    if not ok and poll == self._pending_poll:  # not reset by a fresh status
                        self._decode_pending[i] = max(0, self._decode_pending[i] - needed)
                if ok:
                    return i
            if time.monotonic() > give_up:
                free = max((r.kv_free_blocks for r in live), default=0)
                raise Overloaded(
                    f"no decode rank has room for {needed} KV blocks (the most free is {free}) "
                    f"after {self.routing.reserve_wait_s:.0f} s: retry later"
                )
            if await self._within(route, asyncio.sleep(0.05)) is _ABORTED:
                return None
            await self.pools.poll_once()

    async def _within(self, route: Route, awaitable: Any, watch_queue: bool = True) -> Any:
        """Await `awaitable` until the request's deadline, or (watch_queue) until an abort or a
        rank failure arrives on the route's queue; -> its result, or _ABORTED. A RankFailed,
        from the queue or from the awaitable, is raised."""
        request = route.request
        timeout = None if request.deadline is None else max(0.0, request.deadline - time.time())
        task = asyncio.ensure_future(awaitable)
        waits = {task}
        marker = asyncio.ensure_future(route.queue.get()) if watch_queue else None
        if marker is not None:
            waits.add(marker)
        try:
            finished, _ = await asyncio.wait(
                waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for waiter in waits:
                waiter.cancel()
        if task in finished:
            result = task.result()
            if marker is not None and marker in finished:  # both at once: keep the marker
                route.queue.put_nowait(marker.result())
            if watch_queue:
                return result
        elif marker is not None and marker in finished:
            result = marker.result()
        else:
            return _ABORTED  # the deadline
        # from the route's queue: a delta, None (an abort) or a RankFailed
        if isinstance(result, RankFailed):
            raise result
        return _ABORTED if result is None else result

    def _aborted(self, route: Route) -> RequestOutput:
        return self._finished(route, "abort")

    def _finished(self, route: Route, reason: str) -> RequestOutput:
        request = route.request
        return RequestOutput(
            request.request_id,
            [],
            "",
            reason,
            len(request.prompt_token_ids),
            len(route.token_ids),
            0,
        )
