"""A request's KV reservation on a decode rank: the best rank with room as the router sees it
(router/backends/decode_room.py), granted by the rank before the prefill starts, so a request
never arrives to a full cache; without room, a FIFO wait that costs the ranks no calls."""

import time
from collections.abc import Callable, Coroutine
from typing import Any

from engine.block_manager import blocks_for
from engine.messages import RankStatus
from router.backend import Overloaded
from router.backends.attempt_waits import ABORTED, wait_for_pools, within
from router.backends.decode_room import Turn
from router.backends.pools import Pools
from router.backends.route_table import Route, RouteTable
from router.backends.routing import RoutingConfig, decode_preference


class DecodeReservations:
    def __init__(
        self,
        pools: Pools,
        routes: RouteTable,
        routing: RoutingConfig,
        router_id: str,
        block_size: int,
        in_background: Callable[[Coroutine[Any, Any, Any], str], None],
    ) -> None:
        """in_background(coro, what): runs a cleanup nobody waits for (the backend's)."""
        self.pools, self.routes, self.routing = pools, routes, routing
        self.router_id, self.block_size = router_id, block_size
        self.in_background = in_background

    async def reserve(self, route: Route) -> int | None:
        """Reserve the known tokens' blocks on the best decode rank with room; -> the decode
        rank, None when the deadline passes or the request is aborted first.

        Without room it waits in the room's FIFO queue (Overloaded at once when the queue is
        full, and after reserve_wait_s): only the head tries again, when the router's view of
        the free blocks changes (router/backends/decode_room.py), so waiting costs the ranks no
        calls.
        Past reserve_wait_s while a pool re-forms it waits for the pool as a new request does
        (Unavailable after recovery_wait_s), then for room again."""
        needed = blocks_for(len(route.wire.known_token_ids) + 1, self.block_size)
        room, wait_s = self.routes.room, self.routing.reserve_wait_s
        give_up = time.monotonic() + wait_s
        turn: Turn | None = None
        try:
            while True:
                if room.may_try(turn):
                    if turn is not None:
                        turn.event.clear()  # a change while it tries: it tries once more
                    i = await self._try(route, needed)
                    if i is not None:
                        return i
                if time.monotonic() >= give_up:
                    if self.pools.ready():
                        raise Overloaded(
                            f"no decode rank has room for {needed} KV blocks (the most free "
                            f"is {self.most_free()}) after {wait_s:.0f} s: retry later"
                        )
                    if (
                        await wait_for_pools(
                            self.pools, self.routing.recovery_wait_s, route.request
                        )
                        is None
                    ):
                        return None  # the deadline passed while a pool re-formed
                    give_up = time.monotonic() + wait_s
                    continue
                if turn is None:
                    turn = room.enqueue()
                left = give_up - time.monotonic()
                if await within(route, room.wait(turn, left)) is ABORTED:
                    return None
        finally:
            if turn is not None:
                room.leave(turn)

    async def _try(self, route: Route, needed: int) -> int | None:
        """Ask the decode ranks the view says have room, best first; -> the one that granted
        the reservation, or None."""
        wire, decode, room = route.wire, self.pools["decode"], self.routes.room
        live = self.decode_statuses()
        for i in decode_preference(live, room.taken(), needed):
            # NOTE: counted before the await: requests that arrive together must see each
            # other's choices (counted after it, a burst of 32 all reserved on one rank).
            # route.decode is set first so that a cancel during the call aborts it (M10).
            taken = room.take(i, needed)
            route.decode, route.decode_gen = i, decode.generation
            ok = False
            try:
                lease = self.routing.kv_lease_s
                ok = await decode.ranks[i].reserve(
                    wire.request_id, wire.known_token_ids, lease, self.router_id
                )
            finally:
                if not ok:
                    room.untake(taken)
            if ok:
                if decode.generation == route.decode_gen:
                    room.hold(wire.request_id, taken)
                return i
            # NOTE: decode_gen too: a request cancelled while it waits held nothing, so
            # forget() has nothing to abort on the pool's ranks
            route.decode, route.decode_gen = None, -1
            room.refused(i, needed, live[i])
        return None

    def decode_statuses(self) -> list[RankStatus]:
        """Each decode rank's last status (one not ready where there is none)."""
        n = len(self.pools["decode"].ranks)
        statuses = [self.pools.status.get(("decode", i)) for i in range(n)]
        return [s or RankStatus.down("decode", i) for i, s in enumerate(statuses)]

    def most_free(self) -> int:
        taken = self.routes.room.taken()
        free = [s.kv_free_blocks - t for s, t in zip(self.decode_statuses(), taken, strict=False)]
        return max(free, default=0)

    def on_status(self, pool: str, rank: int) -> None:
        """A fresh status of a rank: the room's view of a decode rank changes."""
        if pool == "decode":
            self.routes.room.refreshed(rank, self.pools.status.get(("decode", rank)))

    def forget(self, route: Route) -> None:
        """A reserve call may have been in flight when the attempt ended (a cancel, no answer):
        its rank may still grant it, and route.decode does not say which rank that is, so
        the id is aborted on every rank of the pool (it would hold blocks for a lease)."""
        decode, rid = self.pools["decode"], route.wire.request_id
        if decode.generation == route.decode_gen:
            for rank in decode.ranks:
                self.in_background(rank.abort(rid), f"abort of {rid}'s reservation")
