"""ClusterBackend without Ray: fake prefill and decode ranks that record every call, and a fake
PoolControl that re-forms a pool with new fakes. The success path, an abort or a deadline in each
phase, a failed KV start and a closed stream end with every rank told (nothing held); a rank that
dies or hangs costs a pause and the stream goes on with the same tokens; no room is
RESOURCE_EXHAUSTED-worthy (Overloaded), a pool that does not come back is Unavailable.

The fakes sample token 100 + position (as seeded sampling is a function of the position), so a
resumed stream is right only if it resumes at the right position."""

import asyncio
import time

import pytest

from engine.kv_transfer import KVTransferError
from engine.messages import GenerateRequest, ModelInfo, RankStatus, RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from router.backend import Overloaded, Unavailable
from router.backends.cluster import ClusterBackend
from router.backends.pools import HealthConfig, RankFailed
from router.backends.routing import RoutingConfig

BLOCK = 4
INFO = ModelInfo("fake", "deepseek_v3", 512, 2048, 3, 16, 4, 1, 480)


class FakeRank:
    pool = ""
    kernels = "cpu-avx2"  # what its engine reports (GetModelInfo.kernels)

    def __init__(self, rank: int, total_blocks: int = 100) -> None:
        self.rank, self.total_blocks = rank, total_blocks
        self.aborted: list[str] = []
        self.dead = False
        self.stalled_s = 0.0
        self.num_status = 0

    def _check(self) -> None:
        if self.dead:
            raise RankFailed(self.pool, self.rank, "its process died")

    async def abort(self, request_id: str) -> None:
        self._check()
        self.aborted.append(request_id)

    async def status(self) -> RankStatus:
        self._check()
        self.num_status += 1
        return RankStatus(
            self.pool,
            self.rank,
            True,
            0,
            0,
            0,
            self.total_blocks,
            block_size=BLOCK,
            stalled_s=self.stalled_s,
            kernels=self.kernels,
        )


class FakePrefill(FakeRank):
    """Samples token 100 + position; the KV handle is ("kv", request id). `gate` holds it."""

    pool = "prefill"

    def __init__(self, rank: int, total_blocks: int = 100) -> None:
        super().__init__(rank, total_blocks)
        self.calls: list[GenerateRequest] = []
        self.gate: asyncio.Event | None = None

    async def prefill(self, request: GenerateRequest, kv_dst: int):
        self._check()
        self.calls.append(request)
        if self.gate is not None:
            await self.gate.wait()
        self._check()
        position = len(request.resume.token_ids) if request.resume else 0
        done = "length" if position + 1 == request.params.max_tokens else None
        n = len(request.prompt_token_ids)
        first = RequestOutput(request.request_id, [100 + position], "a", done, n, position + 1, 0)
        return first, (None if done else ("kv", request.request_id))


class FakeDecode(FakeRank):
    """Decodes 100 + position, one delta per `go` permit (all at once when go is None)."""

    pool = "decode"
    kv_rank = 7

    def __init__(self, rank: int = 0, total_blocks: int = 100) -> None:
        super().__init__(rank, total_blocks)
        self.reserved: set[str] = set()
        self.running: set[str] = set()
        self.discarded: list[object] = []
        self.started: list[tuple[GenerateRequest, object]] = []
        self.renewed: list[list[str]] = []
        self.fail_start = False
        self.go: asyncio.Semaphore | None = None
        self._out: asyncio.Queue = asyncio.Queue()

    async def reserve(self, request_id, token_ids, lease_s, router_id) -> bool:
        self._check()
        if len(self.reserved) * 2 >= self.total_blocks:  # room for a few fake requests
            return False
        self.reserved.add(request_id)
        return True

    async def renew(self, router_id, request_ids, lease_s) -> int:
        self._check()
        self.renewed.append(list(request_ids))
        return len(set(request_ids) & self.reserved)

    async def start(self, request, first, kv, router_id) -> None:
        self._check()
        self.started.append((request, kv))
        if self.fail_start:  # the real rank releases the reservation before raising
            self.fail_start -= 1
            self.reserved.discard(request.request_id)
            raise KVTransferError("the link to the prefill rank is down")
        self.reserved.remove(request.request_id)
        self.running.add(request.request_id)
        asyncio.get_running_loop().create_task(self._decode(request))

    async def _decode(self, request: GenerateRequest) -> None:
        rid, n = request.request_id, len(request.prompt_token_ids)
        start = (len(request.resume.token_ids) if request.resume else 0) + 1
        for position in range(start, request.params.max_tokens):
            if self.go is not None:
                await self.go.acquire()
            if rid not in self.running or self.dead:
                return
            done = "length" if position == request.params.max_tokens - 1 else None
            delta = RequestOutput(rid, [100 + position], "b", done, n, position + 1, 0)
            self._out.put_nowait([delta])
        self.running.discard(rid)

    async def abort(self, request_id: str) -> None:
        await super().abort(request_id)
        self.reserved.discard(request_id)
        self.running.discard(request_id)

    async def discard_kv(self, kv) -> None:
        self._check()
        self.discarded.append(kv)

    async def register_router(self, router_id: str, lease_s: float) -> None:
        self._check()

    async def stream(self, router_id: str):
        while True:
            item = await self._out.get()
            if isinstance(item, BaseException):
                raise item
            yield item

    def die(self) -> None:
        self.dead = True
        self._out.put_nowait(RankFailed("decode", self.rank, "its process died"))


class FakeControl:
    """Re-forms a pool with fresh fakes (after `delay` seconds); `fail` makes it never finish."""

    def __init__(self, delay: float = 0.05) -> None:
        self.delay, self.calls, self.new = delay, [], {}
        self.hang = False
        self.kv_rebuilds = 0

    async def rebuild_kv(self) -> None:
        self.kv_rebuilds += 1

    async def reform(self, pool: str, placement=None):
        self.calls.append(pool)
        await asyncio.sleep(self.delay)
        while self.hang:
            await asyncio.sleep(0.05)
        ranks = [FakePrefill(0)] if pool == "prefill" else [FakeDecode(0)]
        self.new[pool] = ranks[0]
        return ranks


def request(rid: str = "r", max_tokens: int = 4, deadline: float | None = None):
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return GenerateRequest(rid, [5, 6, 7, 8, 9], params, seed=1, deadline=deadline)


async def started_backend(prefill_blocks=(100,), decode_blocks=100, control=None, **routing):
    prefill = [FakePrefill(i, n) for i, n in enumerate(prefill_blocks)]
    decode = FakeDecode(0, decode_blocks)
    backend = ClusterBackend(
        prefill,
        [decode],
        INFO,
        Tokenizer(None, 512, 1, None),
        BLOCK,
        RoutingConfig(**routing),
        HealthConfig(status_interval_s=0.01, stall_timeout_s=0.5),
        control,
    )
    await backend.start()
    return backend, prefill[0], decode


def tokens(deltas: list[RequestOutput]) -> list[int]:
    return sum((d.token_ids for d in deltas), [])


async def wait_for(condition) -> None:
    for _ in range(2000):
        if condition():
            return
        await asyncio.sleep(0.002)
    raise AssertionError("condition never held")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 20))


def test_success_streams_first_then_decode_and_holds_nothing():
    async def main():
        backend, prefill, decode = await started_backend()
        deltas = [d async for d in backend.generate(request("ok", max_tokens=4))]
        assert tokens(deltas) == [100, 101, 102, 103]
        assert deltas[-1].finish_reason == "length"
        assert {d.request_id for d in deltas} == {"ok"}  # the client's id on its messages
        (sent,) = prefill.calls
        assert sent.request_id.startswith(backend.router_id)  # the ranks see the router's id
        assert [(r.request_id, kv) for r, kv in decode.started] == [
            (sent.request_id, ("kv", sent.request_id))
        ]
        assert (prefill.aborted, decode.aborted, decode.discarded) == ([], [], [])
        assert not decode.reserved and not decode.running and not backend.routes.by_wire
        await backend.close()

    run(main())


def test_done_on_the_prefill_rank_releases_the_decode_reservation():
    async def main():
        backend, prefill, decode = await started_backend()
        deltas = [d async for d in backend.generate(request("one", max_tokens=1))]
        assert [d.finish_reason for d in deltas] == ["length"]
        assert decode.started == [] and decode.aborted == [prefill.calls[0].request_id]
        assert prefill.aborted == [] and not decode.reserved
        await backend.close()

    run(main())


@pytest.mark.parametrize("how", ["abort", "deadline"])
def test_abort_or_deadline_during_the_prefill_ends_it_on_both_ranks(how):
    async def main():
        backend, prefill, decode = await started_backend()
        prefill.gate = asyncio.Event()  # the prefill never finishes
        deadline = time.time() + 0.2 if how == "deadline" else None
        out = []

        async def consume():
            out.extend([d async for d in backend.generate(request("p", deadline=deadline))])

        task = asyncio.create_task(consume())
        await wait_for(lambda: prefill.calls)
        if how == "abort":
            await backend.abort("p")
        await task
        wire = prefill.calls[0].request_id
        assert [d.finish_reason for d in out] == ["abort"] and tokens(out) == []
        assert prefill.aborted == [wire] and decode.aborted == [wire]
        assert decode.started == [] and not decode.reserved and not backend.routes.by_wire
        await backend.close()

    run(main())


@pytest.mark.parametrize("how", ["abort", "deadline", "close"])
def test_abort_deadline_or_close_during_the_decode_ends_it_on_both_ranks(how):
    async def main():
        backend, prefill, decode = await started_backend()
        decode.go = asyncio.Semaphore(1)  # one decode token, then it waits
        deadline = time.time() + 0.3 if how == "deadline" else None
        stream = backend.generate(request("d", max_tokens=50, deadline=deadline))
        got = [await anext(stream), await anext(stream)]
        assert tokens(got) == [100, 101]
        if how == "close":
            await stream.aclose()
        else:
            if how == "abort":
                await backend.abort("d")
            rest = [d async for d in stream]
            assert [d.finish_reason for d in rest] == ["abort"]
        wire = prefill.calls[0].request_id
        assert prefill.aborted == [wire] and decode.aborted == [wire]
        assert not decode.running and not decode.reserved and not backend.routes.by_wire
        await backend.close()

    run(main())


def test_a_failed_kv_start_resumes_the_request_and_no_pool_reforms():
    async def main():
        control = FakeControl()
        backend, prefill, decode = await started_backend(control=control)
        decode.fail_start = 1
        deltas = [d async for d in backend.generate(request("f", max_tokens=4))]
        assert tokens(deltas) == [100, 101, 102, 103]  # one pause, the same tokens
        lost, resumed = (c.request_id for c in prefill.calls)
        assert prefill.calls[1].resume.token_ids == [100]  # the first token was sent already
        assert prefill.aborted == [lost] and decode.aborted == [lost]
        assert control.calls == [] and backend.pools["decode"].num_reforms == 0
        assert decode.discarded == [] and not decode.reserved and not backend.routes.by_wire
        await backend.close()

    run(main())


def test_a_kv_start_that_keeps_failing_ends_unavailable_after_max_resumes():
    async def main():
        backend, prefill, decode = await started_backend(control=FakeControl(), max_resumes=1)
        decode.fail_start = 5
        with pytest.raises(Unavailable, match="resumed 1 times .* the link to the prefill"):
            [d async for d in backend.generate(request("f2"))]
        assert len(prefill.calls) == 2 and backend.pools["decode"].num_reforms == 0
        assert not decode.reserved and not backend.routes.by_wire
        await backend.close()

    run(main())


def test_a_stream_closed_after_the_first_token_still_hands_the_kv_over_and_aborts_it():
    async def main():
        backend, prefill, decode = await started_backend()
        stream = backend.generate(request("c"))
        await anext(stream)  # the KV goes to the decode rank while the client takes this
        await stream.aclose()
        wire = prefill.calls[0].request_id
        assert [(r.request_id, kv) for r, kv in decode.started] == [(wire, ("kv", wire))]
        assert decode.discarded == [] and decode.aborted == [wire] and prefill.aborted == [wire]
        assert not decode.reserved and not decode.running and not backend.routes.by_wire
        await backend.close()

    run(main())


def test_a_decode_rank_that_dies_mid_stream_costs_a_pause_not_a_token():
    async def main():
        control = FakeControl()
        backend, prefill, decode = await started_backend(control=control)
        decode.go = asyncio.Semaphore(2)
        stream = backend.generate(request("x", max_tokens=8))
        got = [await anext(stream) for _ in range(3)]  # first token + 2 decode steps
        decode.die()
        got += [d async for d in stream]
        assert tokens(got) == list(range(100, 108))  # identical to an undisturbed run
        assert got[-1].finish_reason == "length" and control.calls == ["decode"]
        resumed = prefill.calls[-1]  # re-prefilled with what the client already had
        assert resumed.resume.token_ids == [100, 101, 102] and resumed.resume.text == "abb"
        assert resumed.request_id != prefill.calls[0].request_id
        assert backend.pools["decode"].num_reforms == 1 and backend.ready()
        new = control.new["decode"]
        assert not new.reserved and not new.running and not backend.routes.by_wire
        await backend.close()

    run(main())


def test_a_prefill_rank_that_dies_while_prompts_wait_on_it_resumes_them():
    async def main():
        control = FakeControl()
        backend, prefill, decode = await started_backend(control=control)
        prefill.gate = asyncio.Event()  # prompts queue on the prefill rank

        async def consume(i):
            return [d async for d in backend.generate(request(f"q{i}", max_tokens=3))]

        tasks = [asyncio.create_task(consume(i)) for i in range(3)]
        await wait_for(lambda: len(prefill.calls) == 3)
        prefill.dead = True  # the next status poll finds it gone
        results = await asyncio.gather(*tasks)
        assert all(tokens(out) == [100, 101, 102] for out in results)
        assert control.calls == ["prefill"] and len(control.new["prefill"].calls) == 3
        assert not decode.reserved and not decode.running and not backend.routes.by_wire
        await backend.close()

    run(main())


def test_a_hung_rank_is_detected_health_drops_and_comes_back():
    async def main():
        control = FakeControl(delay=0.2)
        backend, prefill, decode = await started_backend(control=control)
        decode.go = asyncio.Semaphore(1)
        stream = backend.generate(request("h", max_tokens=6))
        got = [await anext(stream), await anext(stream)]
        decode.stalled_s = 5.0  # its engine thread has had work and no progress
        await wait_for(lambda: not backend.ready())
        got += [d async for d in stream]
        assert tokens(got) == list(range(100, 106))
        assert control.calls == ["decode"] and backend.ready()
        assert "hung" in backend.pools["decode"].last_failure
        await backend.close()

    run(main())


def test_no_decode_room_is_overloaded_not_an_error():
    async def main():
        backend, prefill, decode = await started_backend(decode_blocks=2, reserve_wait_s=0.2)
        decode.reserved.add("someone-else")  # the fake holds one reservation per 2 blocks
        with pytest.raises(Overloaded, match="no decode rank has room .* retry later"):
            await anext(backend.generate(request("full")))
        assert not backend.routes.by_wire and prefill.calls == []
        await backend.close()

    run(main())


def test_a_pool_that_does_not_come_back_in_time_is_unavailable():
    async def main():
        control = FakeControl()
        control.hang = True
        backend, prefill, decode = await started_backend(control=control, recovery_wait_s=0.3)
        decode.die()
        await wait_for(lambda: not backend.ready())
        with pytest.raises(Unavailable, match="re-forming after a rank failure"):
            await anext(backend.generate(request("u")))
        await backend.close()

    run(main())


def test_reservations_are_renewed_while_their_prefill_runs():
    async def main():
        backend, prefill, decode = await started_backend(kv_lease_s=0.2)
        prefill.gate = asyncio.Event()
        task = asyncio.create_task(anext(backend.generate(request("lease"))))
        await wait_for(lambda: prefill.calls)
        wire = prefill.calls[0].request_id
        await wait_for(lambda: any(wire in ids for ids in decode.renewed))
        prefill.gate.set()
        await task
        await backend.close()

    run(main())


def test_prompt_limits_take_the_smallest_cache_of_any_rank():
    async def main():
        backend, _, _ = await started_backend(prefill_blocks=(100, 6), decode_blocks=50)
        limits = backend.prompt_limits()
        assert (limits.max_blocks, limits.block_size, limits.max_prompt_tokens) == (6, 4, 23)
        assert backend.ready()
        await backend.close()

    run(main())


def test_model_info_names_the_kernels_the_ranks_report():
    async def main():
        backend, prefill, decode = await started_backend(prefill_blocks=(100, 100))
        assert backend.model_info().kernels == "cpu-avx2"  # one value, however many ranks
        decode.kernels = "reference"  # e.g. a GPU whose triton does not import
        await wait_for(lambda: backend.model_info().kernels == "cpu-avx2,reference")
        assert backend.model_info().num_layers == INFO.num_layers  # the rest as configured
        await backend.close()

    run(main())


def test_duplicate_request_ids_are_refused():
    async def main():
        backend, prefill, _ = await started_backend()
        prefill.gate = asyncio.Event()
        first = backend.generate(request("dup"))
        task = asyncio.create_task(anext(first))
        await wait_for(lambda: prefill.calls)
        with pytest.raises(ValueError, match="already in flight"):
            await anext(backend.generate(request("dup")))
        prefill.gate.set()
        await task
        await first.aclose()
        await backend.close()

    run(main())


def test_routing_config_is_checked():
    with pytest.raises(ValueError, match="reserve_wait_s must be > 0"):
        RoutingConfig(reserve_wait_s=0)


def test_blocks_reserved_since_the_last_status_count_until_a_fresh_one():
    async def main():
        backend, prefill, decode = await started_backend(decode_blocks=10, reserve_wait_s=2)
        for i in range(12):  # 12 x 2 blocks, one after the other, on a rank of 10 blocks
            out = [d async for d in backend.generate(request(f"s{i}", max_tokens=1))]
            assert out[-1].finish_reason == "length"
        assert backend.routes.decode_pending[0] <= 10
        await backend.close()

    run(main())


def test_with_p2p_a_failed_transfer_resumes_through_the_object_store():
    async def main():
        control = FakeControl()
        backend, prefill, decode = await started_backend(control=control, kv_p2p=True)
        decode.fail_start = 1
        deltas = [d async for d in backend.generate(request("p2p", max_tokens=5))]
        assert tokens(deltas) == [100, 101, 102, 103, 104]
        assert [r.kv_fallback for r in prefill.calls] == [False, True]
        assert prefill.calls[1].resume.token_ids == [100]  # the first token was sent already
        await wait_for(lambda: control.kv_rebuilds == 1)
        assert backend.num_kv_fallbacks == 1 and backend.num_kv_rebuilds == 1
        assert not decode.reserved and not decode.running
        await backend.close()

    run(main())


class GatedDecode(FakeDecode):
    """A decode rank whose reserve answers only once `gate` opens (a burst in flight)."""

    def __init__(self, rank: int, gate: asyncio.Event, refuse: bool = False) -> None:
        super().__init__(rank)
        self.gate, self.refuse, self.asked = gate, refuse, 0

    async def reserve(self, request_id, token_ids, lease_s, router_id) -> bool:
        self.asked += 1
        await self.gate.wait()
        return (
            False
            if self.refuse
            else await super().reserve(request_id, token_ids, lease_s, router_id)
        )


@pytest.mark.parametrize("refuse", [False, True])
def test_a_burst_spreads_over_the_decode_ranks(refuse):
    """8 requests at once, both ranks equally free: each choice counts before its reserve
    returns, so they alternate (4 + 4), not all on rank 0. A refused reserve gives its count
    back."""

    async def main():
        gate = asyncio.Event()
        decode = [GatedDecode(0, gate, refuse), GatedDecode(1, gate)]
        backend = ClusterBackend(
            [FakePrefill(0)], decode, INFO, Tokenizer(None, 512, 1, None), BLOCK,
            RoutingConfig(reserve_wait_s=5),
            HealthConfig(status_interval_s=60, stall_timeout_s=60),  # no fresh status meanwhile
        )  # fmt: skip
        await backend.start()
        streams = [backend.generate(request(f"b{i}", max_tokens=1)) for i in range(8)]
        tasks = [asyncio.ensure_future(s.__anext__()) for s in streams]
        await wait_for(lambda: sum(d.asked for d in decode) == 8)
        assert [d.asked for d in decode] == [4, 4]
        needed = -(-(5 + 1) // BLOCK)  # 5 prompt tokens and the first output token
        assert backend.routes.decode_pending == [4 * needed, 4 * needed]
        gate.set()
        await wait_for(lambda: all(t.done() for t in tasks))
        if refuse:  # rank 0 refused its 4: their counts went back, they went to rank 1
            await wait_for(lambda: len(decode[1].reserved) + len(decode[1].running) >= 4)
            assert backend.routes.decode_pending[0] == 0
        for s in streams:
            await s.aclose()
        await backend.close()

    run(main())
