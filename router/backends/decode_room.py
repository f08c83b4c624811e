"""The router's view of the decode ranks' free KV blocks, and the requests waiting for room.

The view is each decode rank's last status (router/backends/pools.py polls every rank once per
status_interval_s) adjusted by what this router did since: a reservation it was granted counts
against its rank, a request of its that ended (its last delta, or its release) gives its blocks
back, a rank that refused a reservation the view thought would fit is taken to have less than
that. Requests that find no room wait in one FIFO queue; only its head is woken, when the view
changes (fresh statuses, a request ending, the pool re-formed), and tries. No waiter polls the
ranks: W waiters cost the ranks no more status calls than none, and the router's loop O(1) work
per change.

When a status includes an adjustment: polls of one rank do not overlap, so the rank's (n+2)-th
status was asked for after its (n+1)-th answered, which was after an adjustment made while it
had answered n. Until then the adjustment counts.
"""

import asyncio
import contextlib
from collections import deque
from dataclasses import dataclass, field

from engine.block_manager import blocks_for
from engine.messages import RankStatus
from router.backend import Overloaded

RESERVED, FREED, REFUSED = "reserved", "freed", "refused"


@dataclass(slots=True, eq=False)
class Adjustment:
    """Blocks the view takes from a rank's status (negative: gives back) until the status
    that includes it."""

    rank: int
    blocks: int
    seen: int  # the rank's statuses counted when it was made
    kind: str  # RESERVED | FREED | REFUSED


@dataclass(slots=True, eq=False)
class Turn:
    """A request's place in the queue: `event` is set when it is the head and the view
    changed."""

    event: asyncio.Event = field(default_factory=asyncio.Event)
    gone: bool = False


class DecodeRoom:
    def __init__(self, num_ranks: int, block_size: int, max_waiters: int) -> None:
        self.block_size, self.max_waiters = block_size, max_waiters
        self._queue: deque[Turn] = deque()
        self.num_waiting = 0
        self.reset(num_ranks)

    def reset(self, num_ranks: int) -> None:
        """A re-formed decode pool: its ranks hold nothing of this router's yet."""
        self._seen = [0] * num_ranks
        self._last: list[RankStatus | None] = [None] * num_ranks
        self._adjust: list[list[Adjustment]] = [[] for _ in range(num_ranks)]
        self._held: dict[str, Adjustment] = {}  # wire request id -> its reservation
        self.wake()

    # ---- the view ----

    def refreshed(self, rank: int, status: RankStatus | None) -> None:
        """The pools' poller stored a fresh status of `rank` (its hook): drop the adjustments
        it includes, and wake the head."""
        if rank >= len(self._seen) or status is None or status is self._last[rank]:
            return
        self._last[rank], self._seen[rank] = status, self._seen[rank] + 1
        self._adjust[rank] = [a for a in self._adjust[rank] if a.seen + 2 > self._seen[rank]]
        self.wake()

    def taken(self) -> list[int]:
        """Blocks to take off each rank's status (negative: freed since)."""
        return [sum(a.blocks for a in adjust) for adjust in self._adjust]

    def pending(self) -> list[int]:
        """Blocks reserved by this router on each rank and not yet in its status."""
        return [sum(a.blocks for a in adj if a.kind == RESERVED) for adj in self._adjust]

    def take(self, rank: int, blocks: int) -> Adjustment:
        """Count a reservation being asked for (before the call: requests that arrive together
        must see each other's choices)."""
        return self._add(rank, blocks, RESERVED)

    def untake(self, taken: Adjustment) -> None:
        """The reservation was not granted (or its answer was lost: the request's release
        aborts it on the rank)."""
        adjust = self._adjust[taken.rank] if taken.rank < len(self._adjust) else []
        adjust[:] = [a for a in adjust if a is not taken]

    def hold(self, request_id: str, taken: Adjustment) -> None:
        self._held[request_id] = taken

    def refused(self, rank: int, blocks: int, status: RankStatus) -> None:
        """The rank refused `blocks`: it has fewer free than that, whatever the view said."""
        free = status.kv_free_blocks - self.taken()[rank]
        if free >= blocks:
            self._add(rank, free - blocks + 1, REFUSED)

    def forget(self, request_id: str, num_tokens: int = 0) -> None:
        """A request of this router ended on its decode rank (finished: its `num_tokens`, or
        released): its blocks are free. Idempotent."""
        taken = self._held.pop(request_id, None)
        if taken is None:
            return
        if any(a is taken for a in self._adjust[taken.rank]):
            self.untake(taken)  # no status has counted it yet
        else:
            blocks = max(taken.blocks, blocks_for(num_tokens, self.block_size))
            self._add(taken.rank, -blocks, FREED)
        self.wake()

    def _add(self, rank: int, blocks: int, kind: str) -> Adjustment:
        adjustment = Adjustment(rank, blocks, self._seen[rank], kind)
        self._adjust[rank].append(adjustment)
        return adjustment

    # ---- the waiters ----

    def may_try(self, turn: Turn | None) -> bool:
        """A new request may try when nobody waits; a waiting one when it is the head."""
        self._drop_gone()
        if turn is None:
            return not self._queue
        return bool(self._queue) and self._queue[0] is turn

    def enqueue(self) -> Turn:
        """A place at the back of the queue; Overloaded at once when the queue is full."""
        if self.num_waiting >= self.max_waiters:
            raise Overloaded(
                f"too many requests wait for decode KV room ({self.num_waiting} of "
                f"{self.max_waiters}): retry later"
            )
        turn = Turn()
        self._queue.append(turn)
        self.num_waiting += 1
        return turn

    def leave(self, turn: Turn) -> None:
        """The request got its room, gave up or went away: the next one may fit."""
        if not turn.gone:
            turn.gone = True
            self.num_waiting -= 1
            self.wake()

    def wake(self) -> None:
        """The view changed: the head tries again."""
        self._drop_gone()
        if self._queue:
            self._queue[0].event.set()

    async def wait(self, turn: Turn, timeout: float) -> bool:
        """Until the view changes while `turn` is the head (True), or `timeout` (False)."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(turn.event.wait(), max(0.0, timeout))
        return turn.event.is_set()

    def _drop_gone(self) -> None:
        while self._queue and self._queue[0].gone:
            self._queue.popleft()
