"""ClusterBackend without Ray: fake prefill and decode rank handles that record every call. The
success path, an abort or a deadline in each phase, a failed KV start and a closed stream all end
with every rank told (nothing held) and no route left behind."""

import asyncio
import time

import pytest

from engine.kv_transfer import KVTransferError
from engine.messages import GenerateRequest, ModelInfo, RankStatus, RequestOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from router.cluster_backend import ClusterBackend, KVTransferFailed, RoutingConfig

BLOCK = 4
INFO = ModelInfo("fake", "deepseek_v3", 512, 2048, 3, 16, 4, 1, 480)


class FakePrefill:
    """Samples token 100 first; the KV handle is ("kv", request id). `gate` holds prefills."""

    def __init__(self, rank: int, total_blocks: int = 100) -> None:
        self.rank, self.total_blocks = rank, total_blocks
        self.calls: list[tuple[str, int]] = []
        self.aborted: list[str] = []
        self.gate: asyncio.Event | None = None

    async def prefill(self, request: GenerateRequest, kv_dst: int):
        self.calls.append((request.request_id, kv_dst))
        if self.gate is not None:
            await self.gate.wait()
        done = "length" if request.params.max_tokens == 1 else None
        n = len(request.prompt_token_ids)
        first = RequestOutput(request.request_id, [100], "a", done, n, 1, 0)
        return first, (None if done else ("kv", request.request_id))

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)

    async def status(self) -> RankStatus:
        return RankStatus("prefill", self.rank, True, 0, 0, 0, self.total_blocks, block_size=BLOCK)


class FakeDecode:
    """Decodes tokens 101, 102, ... one delta per `go` permit (all at once when go is None)."""

    kv_rank = 7

    def __init__(self, total_blocks: int = 100) -> None:
        self.total_blocks = total_blocks
        self.reserved: set[str] = set()
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.discarded: list[object] = []
        self.started: list[tuple[str, object]] = []
        self.fail_start = False
        self.go: asyncio.Semaphore | None = None
        self._out: asyncio.Queue = asyncio.Queue()

    async def reserve(self, request_id: str, prompt: list[int], timeout_s: float) -> bool:
        self.reserved.add(request_id)
        return True

    async def start(self, request, first, kv, router_id) -> None:
        self.started.append((request.request_id, kv))
        if self.fail_start:  # the real rank releases the reservation before raising
            self.reserved.discard(request.request_id)
            raise KVTransferError("the link to the prefill rank is down")
        self.reserved.remove(request.request_id)
        self.running.add(request.request_id)
        asyncio.get_running_loop().create_task(self._decode(request))

    async def _decode(self, request: GenerateRequest) -> None:
        rid, n = request.request_id, len(request.prompt_token_ids)
        for i in range(1, request.params.max_tokens):
            if self.go is not None:
                await self.go.acquire()
            if rid not in self.running:
                return
            done = "length" if i == request.params.max_tokens - 1 else None
            self._out.put_nowait([RequestOutput(rid, [100 + i], "b", done, n, i + 1, 0)])
        self.running.discard(rid)

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        self.reserved.discard(request_id)
        self.running.discard(request_id)

    async def discard_kv(self, kv) -> None:
        self.discarded.append(kv)

    async def status(self) -> RankStatus:
        return RankStatus(
            "decode", 0, True, len(self.running), 0, 0, self.total_blocks, block_size=BLOCK
        )

    async def register_router(self, router_id: str) -> None:
        pass

    async def stream(self, router_id: str):
        while True:
            yield await self._out.get()


def request(rid: str = "r", max_tokens: int = 4, deadline: float | None = None):
    params = SamplingParams(max_tokens=max_tokens, temperature=0)
    return GenerateRequest(rid, [5, 6, 7, 8, 9], params, seed=1, deadline=deadline)


async def started_backend(prefill_blocks=(100,), decode_blocks=100):
    prefill = [FakePrefill(i, n) for i, n in enumerate(prefill_blocks)]
    decode = FakeDecode(decode_blocks)
    routing = RoutingConfig(status_interval_s=0.01)
    backend = ClusterBackend(prefill, [decode], INFO, Tokenizer(None, 512, 1, None), BLOCK, routing)
    await backend.start()
    return backend, prefill[0], decode


def tokens(deltas: list[RequestOutput]) -> list[int]:
    return sum((d.token_ids for d in deltas), [])


async def wait_for(condition) -> None:
    for _ in range(1000):
        if condition():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("condition never held")


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_success_streams_first_then_decode_and_holds_nothing():
    async def main():
        backend, prefill, decode = await started_backend()
        deltas = [d async for d in backend.generate(request("ok", max_tokens=4))]
        assert tokens(deltas) == [100, 101, 102, 103]
        assert deltas[-1].finish_reason == "length"
        assert prefill.calls == [("ok", FakeDecode.kv_rank)]
        assert decode.started == [("ok", ("kv", "ok"))]
        assert (prefill.aborted, decode.aborted, decode.discarded) == ([], [], [])
        assert not decode.reserved and not decode.running and not backend._routes
        await backend.close()

    run(main())


def test_done_on_the_prefill_rank_releases_the_decode_reservation():
    async def main():
        backend, prefill, decode = await started_backend()
        deltas = [d async for d in backend.generate(request("one", max_tokens=1))]
        assert [d.finish_reason for d in deltas] == ["length"]
        assert decode.started == [] and decode.aborted == ["one"] and not decode.reserved
        assert prefill.aborted == []
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
        assert [d.finish_reason for d in out] == ["abort"] and tokens(out) == []
        assert prefill.aborted == ["p"] and decode.aborted == ["p"]
        assert decode.started == [] and not decode.reserved and not backend._routes
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
        assert prefill.aborted == ["d"] and decode.aborted == ["d"]
        assert not decode.running and not decode.reserved and not backend._routes
        await backend.close()

    run(main())


def test_failed_kv_start_raises_and_aborts_on_both_ranks():
    async def main():
        backend, prefill, decode = await started_backend()
        decode.fail_start = True
        stream = backend.generate(request("f"))
        assert tokens([await anext(stream)]) == [100]  # the first token reached the client
        with pytest.raises(KVTransferFailed, match="did not reach decode rank 0: the link"):
            await anext(stream)
        assert prefill.aborted == ["f"] and decode.aborted == ["f"]
        assert decode.discarded == [] and not decode.reserved and not backend._routes
        await backend.close()

    run(main())


def test_a_stream_closed_after_the_first_token_discards_the_unsent_kv():
    async def main():
        backend, prefill, decode = await started_backend()
        stream = backend.generate(request("c"))
        await anext(stream)
        await stream.aclose()  # the decode never started: the KV must still be taken off
        assert decode.discarded == [("kv", "c")] and decode.started == []
        assert decode.aborted == ["c"] and prefill.aborted == ["c"] and not decode.reserved
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
