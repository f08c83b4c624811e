"""The phases of one attempt at a request (ClusterBackend's, router/backends/cluster.py): the
prefill phase (reserve KV blocks on a decode rank, run the prompt on a prefill rank), the hand
over of the prompt's KV to the decode rank, the decode phase (stream its deltas), and the
release that leaves no block held however the attempt ends, with the p2p KV of an abandoned
prefill taken off the decode rank.

A mixin over ClusterBackend's parts (the annotations below): the backend holds the state, this
module the request path's middle, so each file stays one job.
"""

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from engine.messages import RequestOutput
from router.backends.attempt_errors import AttemptLost, KVTransferFailed, P2PTransferFailed
from router.backends.attempt_waits import ABORTED, queued, within
from router.backends.pools import Pools, RankCallFailed, RankFailed
from router.backends.prefix_index import PrefixIndex
from router.backends.reservations import DecodeReservations
from router.backends.route_table import Route, RouteTable
from router.backends.routing import RoutingConfig, prefill_choice, prefix_key
from router.metrics import RouterMetrics

log = logging.getLogger(__name__)


class AttemptPhases:
    """An attempt's phases over the backend's parts (set by ClusterBackend.__init__)."""

    pools: Pools
    routes: RouteTable
    reservations: DecodeReservations
    prefix_index: PrefixIndex
    routing: RoutingConfig
    metrics: RouterMetrics | None
    block_size: int
    router_id: str
    num_kv_discards: int
    _in_background: Callable[[Any, str], None]  # runs a cleanup nobody awaits

    async def _prefill_phase(self, route: Route) -> RequestOutput | None:
        """Reserve the blocks on a decode rank, run the prompt on a prefill rank; -> the first
        token's delta, or None when the deadline passed or the request was aborted."""
        wire = route.wire
        waited = time.monotonic()
        ranks = self.pools["decode"].ranks  # a re-form installs a new list: these stay
        try:
            route.decode = await self.reservations.reserve(route)
        except (asyncio.CancelledError, RankCallFailed):
            self.reservations.forget(route)
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
        tokens = wire.known_token_ids
        known = len(tokens)
        key = prefix_key(wire.prompt_token_ids, self.block_size, self.routing.affinity_blocks)
        hashes = self.prefix_index.hashes(tokens)
        hits = self.prefix_index.expected_hits(hashes, known)
        route.prefill = prefill_choice(
            key, self.routes.prefill_load, hits, known, self.routing.prefill_max_imbalance
        )
        self.prefix_index.sent(route.prefill, hashes)
        self.routes.prefill_load[route.prefill] += known
        p2p = self.routing.kv_p2p and not route.kv_fallback
        kv_dst = self.pools["decode"].ranks[route.decode].kv_rank
        task = asyncio.ensure_future(prefill.ranks[route.prefill].prefill(wire, kv_dst))
        try:
            result = await within(route, task, cancel=not p2p)
        except BaseException:
            if p2p:
                self._settle_prefill(route, task)
            raise
        finally:
            if prefill.generation == route.prefill_gen:
                self.routes.prefill_load[route.prefill] -= known
        if result is ABORTED:
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
            started = await within(route, start, watch_queue=False)
        except (RankFailed, asyncio.CancelledError):
            raise
        except Exception as e:
            if self.routing.kv_p2p and not route.kv_fallback:
                # a handle of an older transport group says nothing about the current one
                raise P2PTransferFailed(str(e), "older transport group" not in str(e)) from e
            raise KVTransferFailed(
                f"the prompt's KV cache did not reach decode rank {route.decode}: {e}"
            ) from e
        if started is ABORTED:  # the deadline, while the KV was on its way
            yield self._aborted(route)
            return
        route.started = True
        while not route.done:
            delta = await within(route, route.queue.get(), watch_queue=False)
            delta = ABORTED if delta is ABORTED else queued(delta)
            if delta is ABORTED:
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
        self.routes.room.forget(rid)  # its decode blocks are free (if it held any)

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


def _retrieved(task: asyncio.Future) -> None:
    """Mark a task's exception retrieved (whoever needs it awaits the task)."""
    if not task.cancelled():
        task.exception()
