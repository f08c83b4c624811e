"""What ClusterBackend answers operators with: the pools' status, expert rebalances (on demand
and every eplb_interval_s: the admin owns that task), the experts' load, and Prometheus service
discovery."""

import asyncio
import contextlib
import logging
import time
from typing import Any

from engine.messages import (
    ClusterStatus,
    ModelInfo,
    PoolLoad,
    PoolStatus,
    RankStatus,
    RebalanceStatus,
)
from router.backend import Unavailable
from router.backends.pools import Pools, RankCallFailed, RankFailed
from router.backends.route_table import RouteTable
from router.backends.routing import RoutingConfig

RANK_ERRORS = (RankFailed, RankCallFailed)  # a rank gone, or a call to it lost

log = logging.getLogger(__name__)


class ClusterAdmin:
    """Reads the pools (and the route table's count of requests in flight); owns the periodic
    rebalance."""

    def __init__(
        self, pools: Pools, routing: RoutingConfig, model_info: ModelInfo, routes: RouteTable
    ) -> None:
        self.pools, self.routing, self.model_info, self.routes = pools, routing, model_info, routes
        self._periodic: asyncio.Task | None = None

    def start(self) -> None:
        """The periodic rebalance, when eplb_interval_s asks for one."""
        if self.routing.eplb_interval_s > 0:
            self._periodic = asyncio.create_task(self._rebalance_forever())

    def close(self) -> None:
        if self._periodic is not None:
            self._periodic.cancel()

    async def status(self) -> ClusterStatus:
        with contextlib.suppress(Exception):
            await self.pools.poll_once()
        pools = []
        for name in ("prefill", "decode"):
            pool = self.pools[name]
            ranks = [
                self.pools.status.get((name, i)) or RankStatus.down(name, i)
                for i in range(len(pool.ranks))
            ]
            pools.append(PoolStatus(name, ranks))
        return ClusterStatus(pools, num_in_flight=len(self.routes.by_client))

    async def rebalance(
        self, pool: str | None = None, timeout_s: float = 300.0
    ) -> list[tuple[str, RebalanceStatus]]:
        """Re-place the experts of `pool` (None: both) from their measured load, and wait for
        the outcome (each pool's rank 0 reports the pool's plan). ValueError for a pool of one
        rank (nothing to balance); Unavailable when a rank fails meanwhile."""
        try:
            return await self._rebalance(pool, timeout_s)
        except RANK_ERRORS as e:
            raise _unavailable(e) from None

    async def _rebalance(
        self, pool: str | None, timeout_s: float
    ) -> list[tuple[str, RebalanceStatus]]:
        results = []
        for name in [pool] if pool else ["prefill", "decode"]:
            ranks = self.pools[name].ranks
            before = (await ranks[0].status()).rebalance
            if before is None:
                raise ValueError(f"the {name} pool has one rank: there is nothing to balance")
            await asyncio.gather(*(r.request_rebalance() for r in ranks))
            end = time.monotonic() + timeout_s
            while True:
                now = (await ranks[0].status()).rebalance
                if now is not None and now.number > before.number and not now.moving:
                    break
                if time.monotonic() > end:
                    raise Unavailable(f"the {name} pool's rebalance did not end in {timeout_s} s")
                await asyncio.sleep(0.05)
            results.append((name, now))
        return results

    async def _rebalance_forever(self) -> None:
        """Every eplb_interval_s, a rebalance of each pool (skipped by the ranks when the gain
        is too small)."""
        while True:
            await asyncio.sleep(self.routing.eplb_interval_s)
            if not self.pools.ready():
                continue
            try:
                for name, status in await self.rebalance():
                    log.info("periodic rebalance of %s: %s", name, status)
            except Exception:
                log.exception("periodic rebalance failed")

    async def expert_load(self) -> list[PoolLoad]:
        """Each pool's load: the tokens its ranks routed to every physical slot, summed
        (Unavailable when a rank fails)."""
        out = []
        for name in ("prefill", "decode"):
            ranks = self.pools[name].ranks
            try:
                loads = await asyncio.gather(*(r.expert_load() for r in ranks))
            except RANK_ERRORS as e:
                raise _unavailable(e) from None
            layers = {}
            for layer, (tokens, experts) in loads[0].items():
                total = [sum(load[layer][0][s] for load in loads) for s in range(len(tokens))]
                layers[layer] = (total, experts)
            out.append(PoolLoad(name, len(ranks), self.model_info.num_routed_experts, layers))
        return out

    def pool_ready(self, pool: str) -> float:
        return 1.0 if self.pools[pool].ready.is_set() else 0.0

    def sd_targets(self) -> list[dict[str, Any]]:
        """Prometheus HTTP service discovery: every rank's /metrics, labelled by pool and rank
        (read from the ranks' last status; re-formed ranks appear with their new ports)."""
        targets = []
        for (pool, rank), status in sorted(self.pools.status.items()):
            if status.metrics_endpoint:
                labels = {"pool": pool, "rank": str(rank), "model_name": self.model_info.model}
                targets.append({"targets": [status.metrics_endpoint], "labels": labels})
        return targets


def _unavailable(e: RankFailed | RankCallFailed) -> Unavailable:
    """A rank's failure as the backend's Unavailable (the server answers UNAVAILABLE, not UNKNOWN
    with a class name), in one line."""
    why = (e.why.strip().splitlines() or ["no reason given"])[0]
    return Unavailable(
        f"{e.pool} rank {e.rank} failed ({why}): the pool is re-forming, retry in a moment"
    )
