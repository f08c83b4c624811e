"""Back-pressure without polling: requests waiting for decode room wait on the router's view of the
free blocks (router/backends/decode_room.py), woken in FIFO order as blocks free, and never call the
ranks themselves. Fake decode ranks that count their blocks (a status that tells the truth) and
every status call; a request's status calls are told apart from the poller's by a context variable
that every task a request starts inherits."""

import asyncio
import contextvars

import pytest

from engine.messages import RankStatus
from engine.tokenizer import Tokenizer
from router.backend import Overloaded, Unavailable
from router.backends.cluster import ClusterBackend
from router.backends.decode_room import DecodeRoom
from router.backends.pools import HealthConfig
from router.backends.routing import RoutingConfig, decode_preference
from tests.router.backends.test_cluster_backend import (
    BLOCK,
    INFO,
    FakeControl,
    FakeDecode,
    FakePrefill,
    request,
    run,
    tokens,
    wait_for,
)

ON_BEHALF_OF: contextvars.ContextVar[str | None] = contextvars.ContextVar("on_behalf_of")
NEEDED = -(-(5 + 1) // BLOCK)  # blocks of a request(): 5 prompt tokens and the first output


class CountingDecode(FakeDecode):
    """A decode rank whose blocks are counted: reserve grants only what fits, a status reports
    it. Calls run one at a time in order (as on a rank's engine thread), and a reserve goes on
    when its caller stops waiting (as a Ray call does)."""

    def __init__(self, rank: int, total_blocks: int) -> None:
        super().__init__(rank, total_blocks)
        self.blocks: dict[str, int] = {}  # request id -> blocks held
        self.granted: list[str] = []  # reservations, in the order granted
        self.status_callers: list[str | None] = []
        self.gate: asyncio.Event | None = None  # holds reserve calls while closed
        self._turns = asyncio.Lock()

    async def status(self) -> RankStatus:
        self.status_callers.append(ON_BEHALF_OF.get(None))
        self._check()
        used = sum(self.blocks.values())
        return RankStatus(
            "decode", self.rank, True, 0, 0, used, self.total_blocks, block_size=BLOCK
        )

    async def reserve(self, request_id, token_ids, lease_s, router_id) -> bool:
        return await asyncio.shield(self._reserve(request_id, token_ids))

    async def _reserve(self, request_id: str, token_ids: list[int]) -> bool:
        async with self._turns:
            if self.gate is not None:
                await self.gate.wait()
            self._check()
            needed = -(-(len(token_ids) + 1) // BLOCK)
            if self.total_blocks - sum(self.blocks.values()) < needed:
                return False
            self.blocks[request_id] = needed
            self.reserved.add(request_id)
            self.granted.append(request_id)
            return True

    async def abort(self, request_id: str) -> None:
        async with self._turns:
            await super().abort(request_id)
            self.blocks.pop(request_id, None)

    async def _decode(self, request) -> None:
        await super()._decode(request)
        self.blocks.pop(request.request_id, None)  # finished: its blocks are free


async def full_backend(
    num_waiters_cap: int = 1024,
    status_interval_s: float = 3600.0,
    control: FakeControl | None = None,
    **routing: object,
) -> tuple[ClusterBackend, FakePrefill, CountingDecode]:
    """One prefill rank, one decode rank of 2 * NEEDED blocks."""
    prefill, decode = FakePrefill(0), CountingDecode(0, 2 * NEEDED)
    routing.setdefault("reserve_wait_s", 30)
    backend = ClusterBackend(
        [prefill], [decode], INFO, Tokenizer(None, 512, 1, None), BLOCK,
        RoutingConfig(max_reserve_waiters=num_waiters_cap, **routing),
        HealthConfig(status_interval_s=status_interval_s, stall_timeout_s=60), control,
    )  # fmt: skip
    await backend.start()
    return backend, prefill, decode


def consume(backend: ClusterBackend, rid: str, max_tokens: int = 3) -> asyncio.Task:
    """A request's stream in a task of its own, marked as that request's."""

    async def go() -> list:
        ON_BEHALF_OF.set(rid)
        return [d async for d in backend.generate(request(rid, max_tokens=max_tokens))]

    return asyncio.create_task(go(), name=rid)


async def queue_waiters(backend: ClusterBackend, num: int, max_tokens: int = 3) -> list:
    """`num` requests that find no room, started one after the other (the queue's order)."""
    waiters = []
    for i in range(num):
        waiters.append(consume(backend, f"w{i}", max_tokens))
        await wait_for(lambda n=i + 1: backend.routes.room.num_waiting == n)
    return waiters


async def fill_and_queue(backend, prefill, decode, num_waiters: int) -> tuple[list, list]:
    """Two requests hold every block (their prefill held by the gate); then `num_waiters`
    more wait."""
    prefill.gate = asyncio.Event()
    holders = [consume(backend, f"h{i}") for i in range(2)]
    await wait_for(lambda: len(prefill.calls) == 2)
    return holders, await queue_waiters(backend, num_waiters)


def test_waiters_make_no_status_calls_and_are_served_in_order_as_blocks_free():
    """No poller after the start: the waiters learn of free blocks from the streams alone."""

    async def main():
        backend, prefill, decode = await full_backend()
        calls_at_start = len(decode.status_callers)
        polls = []
        backend.pools.poll_once = lambda: polls.append(1)  # a waiter that polls fails here
        holders, waiters = await fill_and_queue(backend, prefill, decode, 8)
        assert decode.granted == [c.request_id for c in prefill.calls]  # the holders only
        prefill.gate.set()  # the holders finish, their blocks free, the waiters go in turn
        outs = await asyncio.gather(*holders, *waiters)
        assert all(tokens(out) == [100, 101, 102] for out in outs)
        assert [_seq(w) for w in decode.granted] == list(range(10))  # in arrival order
        assert len(decode.status_callers) == calls_at_start and polls == []
        assert (
            not decode.blocks
            and not backend.routes.room._held
            and backend.routes.room.num_waiting == 0
        )
        await backend.close()

    run(main())


def _seq(wire_id: str) -> int:
    return int(wire_id.rsplit("-", 1)[1])


def test_with_a_poller_only_the_poller_calls_status():
    """Blocks freed outside this router show only in a fresh status: the waiters are woken by
    the poller's statuses, and not one status call is made on behalf of a request."""

    async def main():
        backend, prefill, decode = await full_backend(status_interval_s=0.01)
        decode.blocks["another-router"] = 2 * NEEDED  # full, and not by this router
        waiters = await queue_waiters(backend, 6, 1)
        seen = len(decode.status_callers)
        await wait_for(lambda: len(decode.status_callers) >= seen + 5)  # polls while they wait
        assert decode.granted == []
        del decode.blocks["another-router"]  # freed elsewhere: the next status shows it
        outs = await asyncio.gather(*waiters)
        assert [tokens(out) for out in outs] == [[100]] * 6
        assert [_seq(w) for w in decode.granted] == sorted(_seq(w) for w in decode.granted)
        assert set(decode.status_callers) == {None}  # the poller's, none a request's
        await backend.close()

    run(main())


def test_the_waiter_cap_refuses_at_once():
    async def main():
        backend, prefill, decode = await full_backend(num_waiters_cap=3)
        holders, waiters = await fill_and_queue(backend, prefill, decode, 3)
        with pytest.raises(Overloaded, match=r"too many requests wait for decode KV room \(3 of 3"):
            await anext(backend.generate(request("one-too-many")))
        assert backend.routes.room.num_waiting == 3 and not any(w.done() for w in waiters)
        prefill.gate.set()
        outs = await asyncio.gather(*holders, *waiters)
        assert all(tokens(out) == [100, 101, 102] for out in outs)
        await backend.close()

    run(main())


def test_waiters_during_a_decode_reform_keep_waiting_then_are_served():
    """The re-form outlasts reserve_wait_s: the waiters wait for the pool (recovery_wait_s),
    not RESOURCE_EXHAUSTED, and the new ranks serve them."""

    async def main():
        control = FakeControl(delay=0.5)
        backend, prefill, decode = await full_backend(control=control, reserve_wait_s=0.1)
        decode.blocks["another-router"] = 2 * NEEDED
        waiters = await queue_waiters(backend, 4)
        decode.die()
        outs = await asyncio.gather(*waiters)
        assert all(tokens(out) == [100, 101, 102] for out in outs)
        assert control.calls == ["decode"] and len(control.new["decode"].started) == 4
        await backend.close()

    run(main())


def test_waiters_during_a_reform_that_does_not_end_get_unavailable():
    async def main():
        control = FakeControl()
        control.hang = True
        backend, prefill, decode = await full_backend(
            control=control, reserve_wait_s=0.1, recovery_wait_s=0.3
        )
        decode.blocks["another-router"] = 2 * NEEDED
        waiters = await queue_waiters(backend, 3)
        decode.die()
        results = await asyncio.gather(*waiters, return_exceptions=True)
        assert [type(r) for r in results] == [Unavailable] * 3
        assert all("re-forming" in str(r) for r in results)
        assert backend.routes.room.num_waiting == 0
        await backend.close()

    run(main())


def test_a_cancelled_waiter_leaves_the_queue_and_holds_nothing():
    async def main():
        backend, prefill, decode = await full_backend()
        holders, waiters = await fill_and_queue(backend, prefill, decode, 3)
        waiters[0].cancel()  # the head goes: the next one becomes the head
        await wait_for(lambda: backend.routes.room.num_waiting == 2)
        prefill.gate.set()
        outs = await asyncio.gather(*holders, *waiters[1:])
        assert all(tokens(out) == [100, 101, 102] for out in outs)
        assert len(decode.granted) == 4  # 2 holders, the 2 waiters left: none for w0
        assert not decode.blocks and not decode.reserved and not backend.routes.room._held
        await backend.close()

    run(main())


def test_a_request_cancelled_while_its_reserve_is_in_flight_holds_nothing():
    """The rank grants the reservation after the client left: it is aborted, not held for a
    lease (audit M10)."""

    async def main():
        backend, prefill, decode = await full_backend()
        decode.gate = asyncio.Event()
        task = consume(backend, "gone")
        await wait_for(
            lambda: backend.routes.room.pending() == [NEEDED]
        )  # its reserve is in flight
        task.cancel()
        await asyncio.sleep(0)
        decode.gate.set()  # the rank grants it now
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_for(lambda: decode.granted and not decode.blocks)
        assert set(decode.aborted) == set(decode.granted) and not decode.reserved
        assert backend.routes.room.pending() == [0] and not backend.routes.room._held
        await backend.close()

    run(main())


def test_the_view_counts_what_a_status_does_not_show_yet():
    """Hand-computed: an adjustment counts until the rank's second status after it."""
    room = DecodeRoom(2, BLOCK, 8)

    def status(used: int) -> RankStatus:
        return RankStatus("decode", 0, True, 0, 0, used, 10, block_size=BLOCK)

    room.refreshed(0, status(4))  # rank 0: 6 free
    taken = room.take(0, 3)
    room.hold("a", taken)
    assert room.taken() == [3, 0] and room.pending() == [3, 0]
    room.refreshed(0, status(7))  # may have been asked before the reserve: still counted
    assert room.taken() == [3, 0]
    room.refreshed(0, status(7))  # asked after: includes it
    assert room.taken() == [0, 0] and room.pending() == [0, 0]
    room.forget("a", num_tokens=17)  # finished with 17 tokens: 5 blocks free
    room.forget("a", num_tokens=17)  # idempotent
    assert room.taken() == [-5, 0]
    room.refused(0, 9, status(7))  # the view said 3 + 5 = 8 free; the rank refused 9: fine
    assert room.taken() == [-5, 0]
    room.refused(0, 4, status(7))  # refused 4 while the view said 8: at most 3 free
    assert 10 - 7 - room.taken()[0] == 3


def test_no_new_reservation_on_a_rank_whose_preempted_requests_wait():
    ranks = [
        RankStatus("decode", 0, True, 2, 1, 10, 100),  # 90 free, 1 preempted request waiting
        RankStatus("decode", 1, True, 2, 0, 50, 100),
    ]
    assert decode_preference(ranks, [0, 0], 5) == [1]
    assert decode_preference(ranks, [0, 48], 5) == []


def test_a_waiter_refused_then_cancelled_sends_no_abort():
    """Its one reserve was refused, so it holds nothing: leaving costs the ranks no call."""

    async def main():
        backend, prefill, decode = await full_backend()  # no poller: the view says 2 free
        decode.blocks["another-router"] = 2 * NEEDED
        (waiter,) = await queue_waiters(backend, 1)
        assert decode.granted == [] and backend.routes.room.taken() == [2 * NEEDED - 1]  # refused
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        for _ in range(20):  # background calls, had any been made, would have run
            await asyncio.sleep(0)
        assert decode.aborted == [] and backend.routes.room.num_waiting == 0
        await backend.close()

    run(main())
