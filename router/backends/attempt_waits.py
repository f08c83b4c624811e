"""How an attempt at a request waits, the same everywhere on its path: until what it awaits is
done, the request's deadline passes, or an abort or a rank failure arrives on its route's queue
(within); for pools that re-form (wait_for_pools)."""

import asyncio
import time
from typing import Any

from engine.messages import GenerateRequest
from router.backend import Unavailable
from router.backends.pools import Pools, RankFailed
from router.backends.route_table import Route

ABORTED = object()  # within: the deadline passed or the request was aborted
NOTHING = object()  # within: nothing came from the route's queue


async def within(
    route: Route, awaitable: Any, watch_queue: bool = True, cancel: bool = True
) -> Any:
    """Await `awaitable` until the request's deadline, or (watch_queue) until an abort or a
    rank failure arrives on the route's queue; -> its result, or ABORTED. A RankFailed or
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
    item = marker.result() if marker is not None and marker in finished else NOTHING
    if task in finished:
        if item is not NOTHING and not (
            isinstance(item, RankFailed) and item.pool == "prefill"
        ):  # both at once: keep the marker (a prefill failure is moot: its result is in)
            route.queue.put_nowait(item)
        return task.result()
    if item is NOTHING:
        return ABORTED  # the deadline
    return queued(item)


def queued(item: Any) -> Any:
    """What came from a route's queue: a delta; None (an abort) -> ABORTED; a RankFailed or
    an AttemptLost is raised."""
    if isinstance(item, BaseException):
        raise item
    return ABORTED if item is None else item


async def wait_for_pools(
    pools: Pools, recovery_wait_s: float, request: GenerateRequest
) -> bool | None:
    """True once both pools can take work; None if the deadline passes first. Raises
    Unavailable after recovery_wait_s."""
    if pools.ready():
        return True
    wait = recovery_wait_s
    left = None if request.deadline is None else request.deadline - time.time()
    if await pools.wait_ready(wait if left is None else max(0.0, min(wait, left))):
        return True
    if left is not None and left <= wait:
        return None
    raise Unavailable(
        f"a pool is re-forming after a rank failure ({_last_failure(pools)}): retry in a "
        "few seconds"
    )


def _last_failure(pools: Pools) -> str:
    return "; ".join(f"{p.name}: {p.last_failure}" for p in pools.pools.values() if p.last_failure)
