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

from engine.block_manager import blocks_for
from engine.messages import (
    GenerateRequest,
    ModelInfo,
    RankStatus,
    RequestFailed,
    RequestOutput,
    Resume,
)
from engine.model_info import PromptLimits
from engine.tokenizer import Tokenizer
from router.backend import Overloaded, Unavailable
from router.cluster_admin import ClusterAdmin
from router.cluster_streams import ClusterStreams
from router.cluster_types import (
    AttemptLost,
    DecodeRank,
    KVTransferFailed,
    P2PTransferFailed,
    PrefillRank,
    Route,
    RoutingConfig,
    mark_suspects,
)
from router.decode_room import DecodeRoom, Turn
from router.metrics import RouterMetrics
from router.pools import HealthConfig, PoolControl, Pools, RankCallFailed, RankFailed
from router.routing import decode_preference, prefill_choice, prefix_key

log = logging.getLogger(__name__)


_ABORTED = object()  # _within: the deadline passed or the request was aborted
_NOTHING = object()  # _within: nothing came from the route's queue


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
        # the decode ranks' free blocks as this router sees them, and the requests waiting
        self._room = DecodeRoom(len(decode), block_size, self.routing.max_reserve_waiters)
        self.pools.on_status.append(self._on_status)
        self._readers: list[asyncio.Task] = []
        self._renewer: asyncio.Task | None = None
        self._periodic: asyncio.Task | None = None
        self._kv_rebuild: asyncio.Task | None = None
        self.num_kv_fallbacks = 0  # requests resumed through the object store after a p2p error
        self.num_kv_rebuilds = 0
        self.num_kv_discards = 0  # p2p KV of abandoned prefills taken off on the decode rank
        self._background: set[asyncio.Task] = set()  # cleanups no request waits for
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
                        if delta.failure is not None:  # it failed alone on its rank
                            raise delta.failure
                        route.token_ids += delta.token_ids
                        route.text += delta.text
                        delta.request_id = cid
                        yield delta
                    return
                except RankFailed as e:
                    mark_suspects(self._routes, e.suspects)
                    gen = route.prefill_gen if e.pool == "prefill" else route.decode_gen
                    self.pools.fail(e.pool, e.rank, e.why, generation=gen if gen >= 0 else None)
                    await asyncio.shield(self._release(route))
                    if route.strike():  # poison: it was in the step that killed a rank, twice
                        raise RequestFailed(
                            f"this request failed a rank twice: not resumed (last: {e})"
                        ) from e
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
                    if e.rebuild:
                        self._rebuild_kv_group()
                    log.warning("resuming %s through the object store: %s", cid, e)
                except (AttemptLost, RankCallFailed) as e:  # this attempt's loss, no rank's
                    await asyncio.shield(self._release(route))
                    if route.resumes >= self.routing.max_resumes:
                        raise Unavailable(
                            f"the request was resumed {route.resumes} times and its last attempt "
                            f"was lost too ({e}): retry later"
                        ) from e
                    route.resumes += 1
                    if self.metrics is not None:
                        pool = getattr(e, "pool", "decode")
                        self.metrics.child("epcluster_request_resumes_total", pool).inc()
                    log.info("resuming %s after %s (%d tokens sent)", cid, e, len(route.token_ids))
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
        start = None if route.done else self._start_decode(route)
        yield first
        if start is not None:
            async for delta in self._decode_phase(route, start):
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
        ranks = self.pools["decode"].ranks  # a re-form installs a new list: these stay
        try:
            route.decode = await self._reserve(route)
        except (asyncio.CancelledError, RankCallFailed):
            self._forget_reserve(route)
            raise
        if route.decode is None:
            return None
        if route.decode_gen != self.pools["decode"].generation:
            # granted by a rank of a pool that failed while the reserve was in flight: the
            # failure notice missed this route (route.decode was not set yet). Released on
            # that rank if it still answers (a re-form kills it anyway).
            rid = wire.request_id
            self._in_background(ranks[route.decode].abort(rid), f"abort of {rid}'s reservation")
            route.decode = None
            raise AttemptLost("its KV reservation was granted by a decode pool that failed")
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
        p2p = self.routing.kv_p2p and not route.kv_fallback
        kv_dst = self.pools["decode"].ranks[route.decode].kv_rank
        task = asyncio.ensure_future(prefill.ranks[route.prefill].prefill(wire, kv_dst))
        try:
            result = await self._within(route, task, cancel=not p2p)
        except BaseException:
            if p2p:
                self._settle_prefill(route, task)
            raise
        finally:
            if prefill.generation == route.prefill_gen:
                self._prefill_load[route.prefill] -= known
        if result is _ABORTED:
            if p2p:
                self._settle_prefill(route, task)
            return None
        if self.metrics is not None:
            took = time.monotonic() - asked
            self.metrics.child("epcluster_request_prefill_time_seconds").observe(took)
        route.first, route.kv = result
        route.done = route.first.finished  # finished on the prefill rank (EOS, a stop, ...)
        return route.first

    def _start_decode(self, route: Route) -> asyncio.Task:
        """Hand the prompt's KV to the decode rank now, while the client takes the first token:
        a client that stops reading must not keep the KV object pinned, nor (p2p) leave its
        send unmatched. If the attempt ends first, _release aborts it on the decode rank."""
        rank = self.pools["decode"].ranks[route.decode]
        handle, route.kv = route.kv, None
        task = asyncio.ensure_future(rank.start(route.wire, route.first, handle, self.router_id))
        task.add_done_callback(_retrieved)  # nobody may await it (the client went away)
        return task

    async def _decode_phase(
        self, route: Route, start: asyncio.Task
    ) -> AsyncIterator[RequestOutput]:
        """Wait for the decode rank to take the KV (`start`), then stream its deltas until the
        finish, the deadline or an abort."""
        try:
            started = await self._within(route, start, watch_queue=False)
        except (RankFailed, asyncio.CancelledError):
            raise
        except Exception as e:
            if self.routing.kv_p2p and not route.kv_fallback:
                # a handle of an older transport group says nothing about the current one
                raise P2PTransferFailed(str(e), "older transport group" not in str(e)) from e
            raise KVTransferFailed(
                f"the prompt's KV cache did not reach decode rank {route.decode}: {e}"
            ) from e
        if started is _ABORTED:  # the deadline, while the KV was on its way
            yield self._aborted(route)
            return
        route.started = True
        while not route.done:
            delta = await self._within(route, route.queue.get(), watch_queue=False)
            delta = _ABORTED if delta is _ABORTED else _queued(delta)
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
                if route.kv is not None and not route.done:  # sent, never started: a p2p
                    calls.append(decode.ranks[route.decode].discard_kv(route.kv))  # send is matched
        route.prefill = route.decode = route.kv = None
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException):
                log.warning("cleanup of %s failed: %r", rid, result)
        self._room.forget(rid)  # its decode blocks are free (if it held any)

    async def _reserve(self, route: Route) -> int | None:
        """Reserve the known tokens' blocks on the best decode rank with room; -> the decode
        rank, None when the deadline passes or the request is aborted first.

        Without room it waits in the room's FIFO queue (Overloaded at once when the queue is
        full, and after reserve_wait_s): only the head tries again, when the router's view of
        the free blocks changes (router/decode_room.py), so waiting costs the ranks no calls.
        Past reserve_wait_s while a pool re-forms it waits for the pool as a new request does
        (Unavailable after recovery_wait_s), then for room again."""
        needed = blocks_for(len(route.wire.known_token_ids) + 1, self.block_size)
        room, wait_s = self._room, self.routing.reserve_wait_s
        give_up = time.monotonic() + wait_s
        turn: Turn | None = None
        try:
            while True:
                if room.may_try(turn):
                    if turn is not None:
                        turn.event.clear()  # a change while it tries: it tries once more
                    i = await self._try_reserve(route, needed)
                    if i is not None:
                        return i
                if time.monotonic() >= give_up:
                    if self.pools.ready():
                        raise Overloaded(
                            f"no decode rank has room for {needed} KV blocks (the most free "
                            f"is {self._most_free()}) after {wait_s:.0f} s: retry later"
                        )
                    if await self._wait_for_pools(route.request) is None:
                        return None  # the deadline passed while a pool re-formed
                    give_up = time.monotonic() + wait_s
                    continue
                if turn is None:
                    turn = room.enqueue()
                left = give_up - time.monotonic()
                if await self._within(route, room.wait(turn, left)) is _ABORTED:
                    return None
        finally:
            if turn is not None:
                room.leave(turn)

    async def _try_reserve(self, route: Route, needed: int) -> int | None:
        """Ask the decode ranks the view says have room, best first; -> the one that granted
        the reservation, or None."""
        wire, decode, room = route.wire, self.pools["decode"], self._room
        live = self._decode_statuses()
        for i in decode_preference(live, room.taken(), needed):
            # NOTE: counted before the await: requests that arrive together must see each
            # other's choices (counted after it, a burst of 32 all reserved on one rank).
            # route.decode is set first so that a cancel during the call aborts it (M10).
            taken = room.take(i, needed)
            route.decode, route.decode_gen = i, decode.generation
            ok = False
            try:
                ok = await decode.ranks[i].reserve(
                    wire.request_id, wire.known_token_ids, self.routing.kv_lease_s,
                    self.router_id,
                )  # fmt: skip
            finally:
                if not ok:
                    room.untake(taken)
            if ok:
                if decode.generation == route.decode_gen:
                    room.hold(wire.request_id, taken)
                return i
            # NOTE: decode_gen too: a request cancelled while it waits held nothing, so
            # _forget_reserve has nothing to abort on the pool's ranks
            route.decode, route.decode_gen = None, -1
            room.refused(i, needed, live[i])
        return None

    def _decode_statuses(self) -> list[RankStatus]:
        """Each decode rank's last status (one not ready where there is none)."""
        n = len(self.pools["decode"].ranks)
        statuses = [self.pools.status.get(("decode", i)) for i in range(n)]
        return [s or RankStatus("decode", i, False, 0, 0, 0, 0) for i, s in enumerate(statuses)]

    def _most_free(self) -> int:
        taken = self._room.taken()
        free = [s.kv_free_blocks - t for s, t in zip(self._decode_statuses(), taken, strict=False)]
        return max(free, default=0)

    @property
    def _decode_pending(self) -> list[int]:
        """Blocks this router reserved on each decode rank that its status does not show yet."""
        return self._room.pending()

    def _on_status(self, pool: str, rank: int) -> None:
        if pool == "decode":
            self._room.refreshed(rank, self.pools.status.get(("decode", rank)))

    def _forget_reserve(self, route: Route) -> None:
        """A reserve call may have been in flight when the attempt ended (a cancel, no answer):
        its rank may still grant it, and route.decode does not say which rank that is, so
        the id is aborted on every rank of the pool (it would hold blocks for a lease)."""
        decode, rid = self.pools["decode"], route.wire.request_id
        if decode.generation == route.decode_gen:
            for rank in decode.ranks:
                self._in_background(rank.abort(rid), f"abort of {rid}'s reservation")

    def _settle_prefill(self, route: Route, task: asyncio.Future) -> None:
        """p2p: a prefill this attempt stopped waiting for may have sent (or still send) the
        prompt's KV to the reserved decode rank. Wait for its answer (the attempt's abort ends
        it if it still runs) and have that rank take the KV off, so the send is matched and
        the pair's later transfers keep their turns."""
        decode, i, gen = self.pools["decode"], route.decode, route.decode_gen

        async def settle() -> None:
            try:
                first, kv = await asyncio.wait_for(task, self.routing.recovery_wait_s)
            except Exception:  # aborted, failed or never answered: nothing was sent
                return
            if first.finished or kv is None or i is None or decode.generation != gen:
                return  # nothing to take, or that rank is gone (its KV group is rebuilt)
            await decode.ranks[i].discard_kv(kv)
            self.num_kv_discards += 1

        if task.done() and (task.cancelled() or task.exception() is not None):
            return
        self._in_background(settle(), f"the KV of {route.wire.request_id}'s abandoned prefill")

    def _in_background(self, coro: Any, what: str) -> None:
        async def run() -> None:
            try:
                await coro
            except Exception as e:
                log.warning("%s failed: %r", what, e)

        task = asyncio.create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _within(
        self, route: Route, awaitable: Any, watch_queue: bool = True, cancel: bool = True
    ) -> Any:
        """Await `awaitable` until the request's deadline, or (watch_queue) until an abort or a
        rank failure arrives on the route's queue; -> its result, or _ABORTED. A RankFailed or
        an AttemptLost, from the queue or from the awaitable, is raised. cancel=False leaves
        the awaitable running when it is abandoned (the caller settles it)."""
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
                if cancel or waiter is not task:
                    waiter.cancel()
        item = marker.result() if marker is not None and marker in finished else _NOTHING
        if task in finished:
            if item is not _NOTHING and not (
                isinstance(item, RankFailed) and item.pool == "prefill"
            ):  # both at once: keep the marker (a prefill failure is moot: its result is in)
                route.queue.put_nowait(item)
            return task.result()
        if item is _NOTHING:
            return _ABORTED  # the deadline
        return _queued(item)

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


def _queued(item: Any) -> Any:
    """What came from a route's queue: a delta; None (an abort) -> _ABORTED; a RankFailed or
    an AttemptLost is raised."""
    if isinstance(item, BaseException):
        raise item
    return _ABORTED if item is None else item


def _retrieved(task: asyncio.Future) -> None:
    """Mark a task's exception retrieved (whoever needs it awaits the task)."""
    if not task.cancelled():
        task.exception()
