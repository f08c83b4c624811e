"""One delta stream per decode rank, read into the route table: a stream that ends or breaks
fails its rank; one the rank ends because it dropped this router's lease (LeaseLapsed) is opened
again, the requests it held resumed."""

import asyncio
import logging

from engine.handoff import LeaseLapsed
from router.backends.pools import Pools, RankFailed
from router.backends.ranks import DecodeRank
from router.backends.route_table import RouteTable

log = logging.getLogger(__name__)


class DecodeStreams:
    def __init__(self, pools: Pools, routes: RouteTable, router_id: str, lease_s: float) -> None:
        self.pools, self.routes, self.router_id, self.lease_s = pools, routes, router_id, lease_s
        self._readers: list[asyncio.Task] = []

    async def open(self) -> None:
        """Register this router with every rank of the current decode pool and read its
        streams (the readers of an older pool are stopped)."""
        self.close()
        decode = self.pools["decode"]
        await asyncio.gather(
            *(d.register_router(self.router_id, self.lease_s) for d in decode.ranks)
        )
        self._readers = [
            asyncio.create_task(self._read(i, d, decode.generation))
            for i, d in enumerate(decode.ranks)
        ]

    def close(self) -> None:
        for task in self._readers:
            task.cancel()

    def alive(self) -> bool:
        """No reader has ended (each ends only by failing its rank, or by close())."""
        return not any(t.done() for t in self._readers)

    async def _read(self, i: int, rank: DecodeRank, generation: int) -> None:
        """Route rank i's deltas to their requests. A stream that ends or breaks fails the
        rank, except when the rank dropped this router's lease (LeaseLapsed): then the
        requests it held resume and a new stream is opened."""
        while True:
            try:
                async for deltas in rank.stream(self.router_id):
                    for delta in deltas:
                        self.routes.deliver(delta)
                why = "its delta stream ended"
            except asyncio.CancelledError:
                raise
            except LeaseLapsed as e:
                log.warning("%s: its requests resume, a new stream opens", e)
                self.routes.lose_attempts(i, generation, str(e))
                await self._register_again(i, rank, generation)
                continue
            except Exception as e:
                why = f"its delta stream broke: {e.why if isinstance(e, RankFailed) else e}"
                self.routes.mark_suspects(getattr(e, "suspects", ()))  # poison recognition
            self.pools.fail("decode", i, why, generation=generation)
            return

    async def _register_again(self, i: int, rank: DecodeRank, generation: int) -> None:
        """Until the rank takes this router again (its status calls judge whether it lives)."""
        while self.pools["decode"].generation == generation:
            try:
                await rank.register_router(self.router_id, self.lease_s)
                return
            except Exception as e:
                log.warning("registering with decode rank %d again failed: %s", i, e)
                await asyncio.sleep(self.pools.health.reform_retry_s)
