"""The renewal of the leases of the KV reservations whose prefill runs (and of this router), each
decode rank on its own clock: a router that dies leaves nothing held for longer than a lease."""

import asyncio

from router.backends.pools import Pools
from router.backends.route_table import RouteTable
from router.backends.routing import RoutingConfig


class LeaseRenewer:
    def __init__(
        self, pools: Pools, routes: RouteTable, routing: RoutingConfig, router_id: str
    ) -> None:
        self.pools, self.routes, self.routing, self.router_id = pools, routes, routing, router_id
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._renew_forever())

    def close(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _renew_forever(self) -> None:
        lease = self.routing.kv_lease_s
        period = min(1.0, lease / 4)
        while True:
            await asyncio.sleep(period)
            decode = self.pools["decode"]
            if not decode.ready.is_set():
                continue
            waiting = self.routes.reserved_not_started(len(decode.ranks), decode.generation)
            # NOTE: each rank on its own clock: one slow rank must not hold the others'
            # renewals (their leases would lapse with it); a renewal that misses is retried
            # next period, well within the lease
            calls = [
                asyncio.wait_for(rank.renew(self.router_id, ids, lease), period)
                for rank, ids in zip(decode.ranks, waiting, strict=True)
            ]
            await asyncio.gather(*calls, return_exceptions=True)  # failures: the health watch
