"""ClusterBackend: the Backend over a prefill pool and a decode pool.

An attempt at a request: reserve KV blocks on a decode rank; run the prompt on a prefill rank;
stream the first token (time to first token); hand the prompt's KV, unopened, to the decode rank;
stream the decode rank's deltas (one stream per decode rank, a list of deltas per step). However
an attempt ends (finish, client cancel, deadline, failure), both ranks are told, so no block
stays held.

Faults: when a rank fails (router/backends/pools.py), every request placed on its pool is
resumed: a new attempt, on the re-formed pool, that carries what the client already received
(Resume). The
prefill rank recomputes that KV, and sampling, a function of (seed, position), goes on with the
same tokens: the client sees a pause. A reservation is a lease the router renews while the
prefill runs, so a router that dies leaves nothing held for long.

Requests reach the ranks under ids this router issues (router id + a counter + the attempt), so
any number of routers can share the pools; the client's id stays on its own messages.
The rank handles are Protocols (router/backends/ranks.py: cluster/ wraps Ray actors in them);
this module imports no Ray.
"""

import asyncio
import dataclasses
import itertools
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from engine.messages import (
    ClusterStatus,
    GenerateRequest,
    ModelInfo,
    PoolLoad,
    RebalanceStatus,
    RequestFailed,
    RequestOutput,
    Resume,
)
from engine.model_info import PromptLimits
from engine.tokenizer import Tokenizer
from router.backend import Unavailable
from router.backends.attempt_errors import AttemptLost, P2PTransferFailed
from router.backends.attempt_phases import AttemptPhases
from router.backends.attempt_waits import wait_for_pools
from router.backends.cluster_admin import ClusterAdmin
from router.backends.decode_streams import DecodeStreams
from router.backends.lease_renewer import LeaseRenewer
from router.backends.pools import HealthConfig, PoolControl, Pools, RankCallFailed, RankFailed
from router.backends.prefix_index import IndexSize, PrefixIndex
from router.backends.ranks import DecodeRank, PrefillRank
from router.backends.reservations import DecodeReservations
from router.backends.route_table import Route, RouteTable
from router.backends.routing import RoutingConfig
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)
DEFAULT_INDEX_BLOCKS = 4096  # per prefill rank, when the caller does not size the prefix index


class ClusterBackend(AttemptPhases):
    """The request path (below; an attempt's phases in router/backends/attempt_phases.py) over
    its parts, each the owner of its state: the route table, the decode reservations, the
    decode streams, the lease renewer, the admin (status, rebalances, expert load)."""

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
        prefix_index: IndexSize | None = None,
    ) -> None:
        """prefix_index: how many blocks the router's estimate of the prefill ranks' cached
        prefixes remembers (IndexSize.of the pool's budgets; None: DEFAULT_INDEX_BLOCKS per
        rank, no shared disk)."""
        self._model_info, self.tokenizer = model_info, tokenizer
        self.block_size = block_size
        self.routing = routing = routing or RoutingConfig()
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
        self.routes = RouteTable(len(prefill), len(decode), block_size, routing.max_reserve_waiters)
        size = prefix_index or IndexSize(DEFAULT_INDEX_BLOCKS)
        self.prefix_index = PrefixIndex(len(prefill), block_size, size)
        self.streams = DecodeStreams(self.pools, self.routes, self.router_id, routing.kv_lease_s)
        self.renewer = LeaseRenewer(self.pools, self.routes, routing, self.router_id)
        self.admin = ClusterAdmin(self.pools, routing, model_info, self.routes)
        self.reservations = DecodeReservations(
            self.pools, self.routes, routing, self.router_id, block_size, self._in_background
        )
        self.pools.on_status.append(self.reservations.on_status)
        self._kv_rebuild: asyncio.Task | None = None
        self.num_kv_fallbacks = 0  # requests resumed through the object store after a p2p error
        self.num_kv_rebuilds = 0
        self.num_kv_discards = 0  # p2p KV of abandoned prefills taken off on the decode rank
        self._background: set[asyncio.Task] = set()  # cleanups no request waits for
        self._started = False

    # ---- lifecycle: every part starts and stops here ----

    async def start(self) -> None:
        """Open the delta streams, the health watch, the lease renewal and the periodic
        rebalance (on the server's event loop)."""
        await self.streams.open()
        await self.pools.start()
        self.renewer.start()
        self.admin.start()
        self._started = True

    async def close(self) -> None:
        self.streams.close()
        self.renewer.close()
        self.admin.close()
        if self._kv_rebuild is not None:
            self._kv_rebuild.cancel()
        await self.pools.close()
        self._started = False

    def ready(self) -> bool:
        return self._started and self.pools.ready() and self.streams.alive()

    # ---- operators' calls: the admin's ----

    async def status(self) -> ClusterStatus:
        return await self.admin.status()

    async def rebalance(
        self, pool: str | None = None, timeout_s: float = 300.0
    ) -> list[tuple[str, RebalanceStatus]]:
        return await self.admin.rebalance(pool, timeout_s)

    async def expert_load(self) -> list[PoolLoad]:
        return await self.admin.expert_load()

    def pool_ready(self, pool: str) -> float:
        return self.admin.pool_ready(pool)

    def sd_targets(self) -> list[dict[str, Any]]:
        return self.admin.sd_targets()

    # ---- pools failing and coming back (Pools calls these) ----

    def _on_pool_failed(self, pool: str, generation: int) -> None:
        self.routes.fail_pool(pool, generation)

    async def _on_pool_reformed(self, pool: str) -> None:
        if self.metrics is not None:
            self.metrics.child("epcluster_pool_reforms_total", pool).inc()
            recovery = self.pools[pool].recovery_s
            if recovery:
                self.metrics.child("epcluster_pool_recovery_seconds", pool).observe(recovery[-1])
        self.routes.reset_load(len(self.pools["prefill"].ranks), len(self.pools["decode"].ranks))
        if pool == "prefill":
            self.prefix_index.reset(len(self.pools["prefill"].ranks))
        if pool == "decode":
            await self.streams.open()

    def _rebuild_kv_group(self) -> None:
        """One rebuild of the p2p KV group at a time (in the background)."""
        control = self.pools.control
        if control is None or (self._kv_rebuild is not None and not self._kv_rebuild.done()):
            return

        async def rebuild() -> None:
            try:
                await control.rebuild_kv()
                self.num_kv_rebuilds += 1
                if self.metrics is not None:
                    self.metrics.child("epcluster_kv_group_rebuilds_total").inc()
            except Exception:
                log.exception("rebuilding the KV transport group failed")

        self._kv_rebuild = asyncio.create_task(rebuild())

    # ---- limits ----

    def model_info(self) -> ModelInfo:
        kernels = sorted({s.kernels for s in self.pools.status.values() if s.kernels})
        return dataclasses.replace(
            self._model_info, max_model_len=self._max_model_len(), kernels=",".join(kernels)
        )

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
        route = self.routes.by_client.get(request_id)
        if route is not None:
            route.queue.put_nowait(None)  # generate() sees it, aborts on the ranks, ends "abort"

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Attempts until one ends: a rank failure resumes the request on the re-formed pool
        from what the client has (up to max_resumes times)."""
        cid = request.request_id
        if cid in self.routes.by_client:
            raise ValueError(f"request id {cid!r} is already in flight")
        route = self.routes.by_client[cid] = Route(request, request)
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
                    self.routes.mark_suspects(e.suspects)
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
            del self.routes.by_client[cid]
            self.routes.by_wire.pop(route.wire.request_id, None)
            await asyncio.shield(self._release(route))

    def _begin_attempt(self, route: Route) -> None:
        self.routes.by_wire.pop(route.wire.request_id, None)
        resume = Resume(list(route.token_ids), route.text) if route.token_ids else None
        wire_id = f"{self.router_id}-{next(self._seq)}"
        route.wire = dataclasses.replace(
            route.request, request_id=wire_id, resume=resume, kv_fallback=route.kv_fallback
        )
        route.queue = asyncio.Queue()
        route.first = route.kv = None
        route.done = route.started = False
        self.routes.by_wire[wire_id] = route

    async def _attempt(self, route: Route) -> AsyncIterator[RequestOutput]:
        request = route.request
        waited = await wait_for_pools(self.pools, self.routing.recovery_wait_s, request)
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

    def _in_background(self, coro: Any, what: str) -> None:
        async def run() -> None:
            try:
                await coro
            except Exception as e:
                log.warning("%s failed: %r", what, e)

        task = asyncio.create_task(run())
        self._background.add(task)
        task.add_done_callback(self._background.discard)
