"""ClusterBackend's running parts and how it follows its pools: start and close; one delta
stream per decode rank (a stream that ends or breaks fails its rank; one the rank ends because
it dropped this router's lease is opened again, its requests resumed); the renewal of the KV
reservations' leases while their prefill runs, each rank on its own clock; the requests of a
failed pool resumed once it re-forms; the p2p KV group rebuilt after a transfer error."""

import asyncio
import logging

from engine.handoff import LeaseLapsed
from router.cluster_types import AttemptLost, DecodeRank, Route, RoutingConfig, mark_suspects
from router.decode_room import DecodeRoom
from router.metrics import RouterMetrics
from router.pools import Pools, RankFailed

log = logging.getLogger(__name__)


class ClusterStreams:
    """Mixed into ClusterBackend, whose pools, routes and counters it keeps."""

    pools: Pools
    routing: RoutingConfig
    metrics: RouterMetrics | None
    router_id: str
    _routes: dict[str, Route]
    _prefill_load: list[int]
    _room: DecodeRoom
    _readers: list[asyncio.Task]
    _renewer: asyncio.Task | None
    _periodic: asyncio.Task | None
    _kv_rebuild: asyncio.Task | None
    _started: bool
    num_kv_rebuilds: int

    async def start(self) -> None:
        """Open the delta streams, the health watch and the lease renewal (on the server's
        event loop)."""
        await self._open_streams()
        await self.pools.start()
        self._renewer = asyncio.create_task(self._renew_forever())
        if self.routing.eplb_interval_s > 0:  # ClusterAdmin's periodic rebalance
            self._periodic = asyncio.create_task(self._rebalance_forever())
        self._started = True

    async def close(self) -> None:
        for task in [*self._readers, self._renewer, self._periodic, self._kv_rebuild]:
            if task is not None:
                task.cancel()
        await self.pools.close()
        self._started = False

    def ready(self) -> bool:
        return self._started and self.pools.ready() and not any(t.done() for t in self._readers)

    # ---- pools failing and coming back ----

    def _on_pool_failed(self, pool: str, generation: int) -> None:
        """Every request placed on the failed pool's ranks resumes elsewhere (after it
        re-forms)."""
        for route in list(self._routes.values()):
            on_prefill = pool == "prefill" and route.prefill is not None and not route.first
            on_decode = pool == "decode" and route.decode is not None
            gen = route.prefill_gen if pool == "prefill" else route.decode_gen
            if (on_prefill or on_decode) and gen == generation and not route.done:
                rank = route.prefill if pool == "prefill" else route.decode
                route.queue.put_nowait(RankFailed(pool, rank, "its pool is re-forming"))

    async def _on_pool_reformed(self, pool: str) -> None:
        if self.metrics is not None:
            self.metrics.child("epcluster_pool_reforms_total", pool).inc()
            recovery = self.pools[pool].recovery_s
            if recovery:
                self.metrics.child("epcluster_pool_recovery_seconds", pool).observe(recovery[-1])
        self._prefill_load = [0] * len(self.pools["prefill"].ranks)
        self._room.reset(len(self.pools["decode"].ranks))
        if pool == "decode":
            await self._open_streams()

    async def _open_streams(self) -> None:
        for task in self._readers:
            task.cancel()
        decode = self.pools["decode"]
        lease = self.routing.kv_lease_s
        await asyncio.gather(*(d.register_router(self.router_id, lease) for d in decode.ranks))
        self._readers = [
            asyncio.create_task(self._read_stream(i, d, decode.generation))
            for i, d in enumerate(decode.ranks)
        ]

    async def _read_stream(self, i: int, rank: DecodeRank, generation: int) -> None:
        """Route rank i's deltas to their requests. A stream that ends or breaks fails the
        rank, except when the rank dropped this router's lease (LeaseLapsed): then the
        requests it held resume and a new stream is opened."""
        while True:
            try:
                async for deltas in rank.stream(self.router_id):
                    for delta in deltas:
                        if delta.finished:  # its blocks are free: a request waiting may fit
                            tokens = delta.num_prompt_tokens + delta.num_completion_tokens
                            self._room.forget(delta.request_id, tokens)
                        route = self._routes.get(delta.request_id)
                        if route is not None:
                            route.queue.put_nowait(delta)
                why = "its delta stream ended"
            except asyncio.CancelledError:
                raise
            except LeaseLapsed as e:
                log.warning("%s: its requests resume, a new stream opens", e)
                self._lose_attempts(i, generation, str(e))
                await self._register_again(i, rank, generation)
                continue
            except Exception as e:
                why = f"its delta stream broke: {e.why if isinstance(e, RankFailed) else e}"
                mark_suspects(self._routes, getattr(e, "suspects", ()))  # poison recognition
            self.pools.fail("decode", i, why, generation=generation)
            return

    def _lose_attempts(self, i: int, generation: int, why: str) -> None:
        """The attempts placed on decode rank i (of `generation`) resume elsewhere."""
        for route in list(self._routes.values()):
            if route.decode == i and route.decode_gen == generation and not route.done:
                route.queue.put_nowait(AttemptLost(why))

    async def _register_again(self, i: int, rank: DecodeRank, generation: int) -> None:
        """Until the rank takes this router again (its status calls judge whether it lives)."""
        while self.pools["decode"].generation == generation:
            try:
                await rank.register_router(self.router_id, self.routing.kv_lease_s)
                return
            except Exception as e:
                log.warning("registering with decode rank %d again failed: %s", i, e)
                await asyncio.sleep(self.pools.health.reform_retry_s)

    async def _renew_forever(self) -> None:
        """Renew the leases of the reservations whose prefill runs (and of this router)."""
        period = min(1.0, self.routing.kv_lease_s / 4)
        while True:
            await asyncio.sleep(period)
            decode = self.pools["decode"]
            if not decode.ready.is_set():
                continue
            waiting: list[list[str]] = [[] for _ in decode.ranks]
            for rid, route in self._routes.items():
                if (
                    route.decode is not None
                    and not route.started
                    and route.decode_gen == (decode.generation)
                ):
                    waiting[route.decode].append(rid)
            # NOTE: each rank on its own clock: one slow rank must not hold the others'
            # renewals (their leases would lapse with it); a renewal that misses is retried
            # next period, well within the lease
            calls = [
                asyncio.wait_for(rank.renew(self.router_id, ids, self.routing.kv_lease_s), period)
                for rank, ids in zip(decode.ranks, waiting, strict=True)
            ]
            await asyncio.gather(*calls, return_exceptions=True)  # failures: the health watch

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
