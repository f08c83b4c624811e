"""Poison recognition in ClusterBackend (fake ranks, no Ray): a request that was in the step that
stopped a rank's engine twice is not resumed a third time (INTERNAL, "failed a rank twice"),
while the others of those steps resume with the same tokens; a request that failed alone on its
rank (RequestOutput.failure) ends with its own error and no pool re-forms; the frontend maps
RequestFailed to INVALID_ARGUMENT or INTERNAL."""

import asyncio

from engine.messages import GenerateRequest, RequestFailed, RequestOutput
from engine.sampling_params import SamplingParams
from router.backends.pools import RankFailed
from router.frontend import INTERNAL, INVALID, _refused_by
from tests.router.backends.test_cluster_backend import (
    FakeControl,
    FakeDecode,
    FakePrefill,
    run,
    started_backend,
    tokens,
    wait_for,
)

POISON_PROMPT = [66, 66, 66]


def request(rid: str, prompt: list[int], max_tokens: int = 4) -> GenerateRequest:
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), 1)


class PoisonPrefill(FakePrefill):
    """Its engine stops when it prefills the poison prompt: every prefill waiting on it then
    raises RankFailed naming the requests of that step (the poison and those in `stepping`)."""

    def __init__(self, rank: int, stepping: set[str] | None = None) -> None:
        super().__init__(rank)
        self.stepping = stepping if stepping is not None else set()
        self.suspects: tuple[str, ...] = ()

    def _check(self) -> None:
        if self.dead:
            raise RankFailed(self.pool, self.rank, "the engine stopped", self.suspects)

    async def prefill(self, request: GenerateRequest, kv_dst: int):
        if request.prompt_token_ids == POISON_PROMPT and not self.dead:
            self.suspects = (request.request_id, *sorted(self.stepping))
            self.dead = True
            if self.gate is not None:
                self.gate.set()  # the others waiting here see the death
        return await super().prefill(request, kv_dst)


class PoisonControl(FakeControl):
    """Re-forms the prefill pool with PoisonPrefill ranks, the decode pool with FakeDecode;
    `hold`: the new ranks wait (a prefill on its gate, a decode on its `go` permits)."""

    def __init__(self) -> None:
        super().__init__()
        self.hold = False
        self.made: list = []

    async def reform(self, pool: str, placement=None):
        self.calls.append(pool)
        await asyncio.sleep(self.delay)
        rank = PoisonPrefill(0) if pool == "prefill" else FakeDecode(0)
        if self.hold and pool == "prefill":
            rank.gate = asyncio.Event()
        elif self.hold:
            rank.go = asyncio.Semaphore(0)
        self.made.append(rank)
        self.new[pool] = rank
        return [rank]

    def release(self) -> None:
        self.hold = False
        for rank in self.made:
            if isinstance(rank, FakePrefill) and rank.gate is not None:
                rank.gate.set()
            elif isinstance(rank, FakeDecode) and rank.go is not None:
                for _ in range(100):
                    rank.go.release()


def test_a_request_that_stops_a_rank_twice_is_not_resumed_a_third_time():
    async def main():
        control = PoisonControl()
        backend, _, decode = await started_backend(control=control, max_resumes=3)
        first = PoisonPrefill(0)
        first.gate = asyncio.Event()  # the bystander's prefill waits until the rank dies
        backend.pools["prefill"].ranks[0] = first
        bystander = asyncio.create_task(_collect(backend, request("b", [5, 6, 7, 8], 6)))
        await wait_for(lambda: len(first.calls) == 1)
        # the bystander was in the poison's step on the first death: one strike, resumed
        first.stepping.add(first.calls[0].request_id)
        try:
            async for _ in backend.generate(request("p", POISON_PROMPT)):
                raise AssertionError("the poison request streamed a token")
            raise AssertionError("the poison request ended without an error")
        except RequestFailed as e:
            assert "this request failed a rank twice: not resumed" in e.message
            assert not e.invalid
            assert _refused_by(request("p", POISON_PROMPT), e, written=False).status == INTERNAL
        assert tokens(await bystander) == [100, 101, 102, 103, 104, 105]
        # two deaths, two re-forms: not max_resumes + 1 = 4
        await wait_for(lambda: backend.pools.ready())
        assert control.calls == ["prefill", "prefill"]
        await wait_for(lambda: not decode.reserved and not backend.routes.by_wire)
        await backend.close()

    run(main())


async def _collect(backend, req: GenerateRequest) -> list[RequestOutput]:
    return [d async for d in backend.generate(req)]


def test_a_bystander_of_two_deaths_not_in_their_steps_is_resumed_both_times():
    """Only the suspects count: a request waiting on the dead rank that was not in the step is
    resumed after each death (no strike), and completes with its tokens."""

    async def main():
        control = PoisonControl()
        control.hold = True  # the bystander waits on every re-formed rank until released
        backend, _, _ = await started_backend(control=control, max_resumes=3)
        first = PoisonPrefill(0)
        first.gate = asyncio.Event()
        backend.pools["prefill"].ranks[0] = first
        bystander = asyncio.create_task(_collect(backend, request("b", [5, 6, 7, 8], 5)))
        await wait_for(lambda: len(first.calls) == 1)
        try:
            await _collect(backend, request("p", POISON_PROMPT))
            raise AssertionError("no error")
        except RequestFailed as e:
            assert "failed a rank twice" in e.message
        await wait_for(lambda: backend.pools.ready())
        control.release()
        assert tokens(await bystander) == [100, 101, 102, 103, 104]
        assert control.calls == ["prefill", "prefill"]
        await backend.close()

    run(main())


class FailingDecode(FakeDecode):
    """Its engine fails the poison prompt's request alone at position 2 (a sampling error)."""

    async def _decode(self, request: GenerateRequest) -> None:
        if request.prompt_token_ids != POISON_PROMPT:
            return await super()._decode(request)
        rid, n = request.request_id, len(request.prompt_token_ids)
        delta = RequestOutput(rid, [101], "b", None, n, 2, 0)
        failed = RequestOutput(rid, [], "", "error", n, 2, 0)
        failed.failure = RequestFailed(f"request {rid} failed in sampling: ValueError: x", True)
        self.running.discard(rid)
        self._out.put_nowait([delta, failed])


def test_a_request_failed_alone_on_its_decode_rank_ends_with_its_error_and_nothing_reforms():
    async def main():
        control = PoisonControl()
        backend, _, _ = await started_backend(control=control)
        decode = FailingDecode(0)
        backend.pools["decode"].ranks[0] = decode
        await backend.streams.open()
        got = []
        try:
            async for d in backend.generate(request("p", POISON_PROMPT, 6)):
                got += d.token_ids
            raise AssertionError("no error")
        except RequestFailed as e:
            assert e.invalid and "failed in sampling: ValueError" in e.message
            # already streaming: still INVALID_ARGUMENT (its own parameters)
            assert _refused_by(request("p", POISON_PROMPT), e, written=True).status == INVALID
        assert got == [100, 101]  # the tokens before the failure reached the client
        assert tokens(await _collect(backend, request("ok", [5, 6, 7], 3))) == [100, 101, 102]
        assert control.calls == [] and backend.pools.ready()
        await wait_for(
            lambda: not decode.reserved and not decode.running and not backend.routes.by_wire
        )
        await backend.close()

    run(main())


def test_a_decode_rank_stopped_by_a_request_names_it_on_its_stream():
    """The decode stream's RankFailed names the suspects: that route gets a strike (a second
    death with it in the step ends it); the other resumes both times and completes."""

    async def main():
        control = PoisonControl()
        control.hold = True
        backend, _, decode = await started_backend(control=control, max_resumes=3)
        decode.go = asyncio.Semaphore(0)  # no decode token until released
        poison = asyncio.create_task(_collect(backend, request("p", POISON_PROMPT, 6)))
        other = asyncio.create_task(_collect(backend, request("o", [5, 6, 7], 6)))
        for _ in range(2):
            await wait_for(
                lambda: (
                    {r.request.request_id for r in backend.routes.by_wire.values() if r.started}
                    == {"p", "o"}
                )
            )
            dying = backend.pools["decode"].ranks[0]
            wire = next(
                r.wire.request_id
                for r in backend.routes.by_wire.values()
                if r.request.request_id == "p"
            )
            dying.dead = True
            dying._out.put_nowait(RankFailed("decode", 0, "the engine stopped", (wire,)))
            await wait_for(lambda d=dying: backend.pools["decode"].ranks[0] is not d)
            await wait_for(lambda: backend.pools.ready())
        try:
            await poison
            raise AssertionError("no error")
        except RequestFailed as e:
            assert "failed a rank twice" in e.message
        control.release()
        assert tokens(await other) == [100, 101, 102, 103, 104, 105]
        assert control.calls == ["decode", "decode"]
        await backend.close()

    run(main())
