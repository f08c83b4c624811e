"""One request whose rows fail (preparing, sampling, postprocessing) ends alone with an error:
the step goes on for the others, whose tokens equal a run without it (token-exact), no block
stays held, and the engine keeps serving. A failure that stops the engine names the requests of
its step (RankStopped.suspects), and no call is ever left without an answer."""

import concurrent.futures
import pickle
import threading

import pytest
import torch

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loop import EngineLoop
from engine.messages import RankStopped, RequestFailed, RequestOutput
from engine.request import Request

POISON = "2"  # the request id that fails
POISON_SEED = 4242


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny-random", block_size=4, max_num_batched_tokens=64))


def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 500, (int(n),), generator=gen).tolist() for n in (9, 30, 14, 5, 21)]
    params = [
        SamplingParams(
            max_tokens=12,
            ignore_eos=True,
            temperature=0.0 if i % 2 else 0.8,
            top_p=0.9,
            seed=POISON_SEED if str(i) == POISON else 100 + i,
            logprobs=2 if i == 3 else None,
        )
        for i in range(len(prompts))
    ]
    return prompts, params


def run(engine: LLMEngine, ids: list[str]) -> dict[str, RequestOutput]:
    """The requests `ids` of the workload, run together to the end; -> each one's output."""
    prompts, params = workload()
    for rid in ids:
        engine.add_request(rid, prompts[int(rid)], params[int(rid)])
    out: dict[str, RequestOutput] = {}
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for d in engine.step().outputs:
            out[d.request_id] = out[d.request_id].merge(d) if d.request_id in out else d
    assert not engine.has_unfinished()
    return out


ALL = ["0", "1", "2", "3", "4"]
OTHERS = [rid for rid in ALL if rid != POISON]


@pytest.fixture(scope="module")
def alone(engine: LLMEngine) -> dict[str, RequestOutput]:
    """The oracle: the other requests, run without the poison one."""
    out = run(engine, OTHERS)
    engine.assert_no_leaks()
    return out


def assert_others_exact(got: dict[str, RequestOutput], alone: dict[str, RequestOutput]) -> None:
    for rid in OTHERS:
        assert got[rid].finish_reason == "length", rid
        assert got[rid].token_ids == alone[rid].token_ids, rid
        assert got[rid].logprobs == alone[rid].logprobs, rid
        assert got[rid].failure is None


def poisoned_sample(real, after: int, error: BaseException):
    """engine.runner.sample that raises `error` for the poison seed's rows from the token at
    `after` past the prompt on (the batch call and the row's own call alike)."""
    prompt_len = len(workload()[0][int(POISON)])

    def sample(logits, params, seeds, positions):
        for seed, pos in zip(seeds, positions):
            if seed == POISON_SEED and pos >= prompt_len + after:
                raise error
        return real(logits, params, seeds, positions)

    return sample


@pytest.mark.parametrize(
    ("error", "invalid"),
    [(RuntimeError("Overflow when unpacking long"), False), (ValueError("bad row"), True)],
)
def test_a_sampling_failure_fails_that_request_only(engine, alone, monkeypatch, error, invalid):
    monkeypatch.setattr(engine.runner, "sample", poisoned_sample(engine.runner.sample, 3, error))
    failed_before = engine.num_failed
    got = run(engine, ALL)
    bad = got[POISON]
    assert bad.finish_reason == "error" and len(bad.token_ids) == 3  # 3 tokens, then the error
    assert isinstance(bad.failure, RequestFailed) and bad.failure.invalid is invalid
    assert f"request {POISON} failed in sampling: {type(error).__name__}: " in bad.failure.message
    assert_others_exact(got, alone)
    assert engine.num_failed == failed_before + 1
    engine.assert_no_leaks()
    monkeypatch.undo()
    assert_others_exact(run(engine, OTHERS), alone)  # the engine goes on serving


def test_a_request_past_validation_overflows_the_sampler_alone(engine, alone):
    """The issue's poison (top_k 2**63), put straight into the scheduler past every check:
    torch overflows filling the top-k tensor (a ValueError in this torch, a RuntimeError in
    older ones); that request fails alone (INVALID_ARGUMENT: its own parameter); the others run."""
    prompts, params = workload()
    bad = SamplingParams(temperature=1.0, seed=1)
    bad.top_k = 2**63  # set after construction: no check ran
    req = Request("bad", [7, 8, 9], bad, 1, arrival=-1)
    engine.requests["bad"] = req
    engine.scheduler.add(req)
    got = run(engine, OTHERS)
    assert got["bad"].finish_reason == "error" and got["bad"].token_ids == []
    failure = got["bad"].failure
    assert "failed in sampling" in failure.message and "Overflow" in failure.message
    assert failure.invalid is ("failed in sampling: ValueError" in failure.message)
    assert_others_exact(got, alone)
    engine.assert_no_leaks()


def test_a_prepare_failure_fails_that_request_only(engine, alone, monkeypatch):
    real = engine.runner.prepare

    def prepare(requests, num_new):
        if any(r.request_id == POISON and r.output_token_ids for r in requests):
            raise IndexError("block table too short")
        return real(requests, num_new)

    monkeypatch.setattr(engine.runner, "prepare", prepare)
    got = run(engine, ALL)
    assert got[POISON].finish_reason == "error" and len(got[POISON].token_ids) == 1
    assert "failed in preparing: IndexError: block table too short" in got[POISON].failure.message
    assert_others_exact(got, alone)
    engine.assert_no_leaks()


def test_a_postprocessing_failure_fails_that_request_only(engine, alone, monkeypatch):
    real = engine._finish_reason

    def finish_reason(req):
        if req.request_id == POISON and len(req.output_token_ids) == 5:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "detokenizing")
        return real(req)

    monkeypatch.setattr(engine, "_finish_reason", finish_reason)
    got = run(engine, ALL)
    assert got[POISON].finish_reason == "error"
    assert "failed in postprocessing: UnicodeDecodeError" in got[POISON].failure.message
    assert got[POISON].failure.invalid  # UnicodeDecodeError is a ValueError
    assert_others_exact(got, alone)
    engine.assert_no_leaks()


def test_add_request_checks_again_on_the_rank(engine):
    """Fields set after construction skipped SamplingParams' checks: the rank runs them."""
    for field, value in [("top_k", 2**63), ("max_tokens", 2**64), ("temperature", float("nan"))]:
        p = SamplingParams()
        setattr(p, field, value)
        with pytest.raises(ValueError, match=field):
            engine.add_request("x", [5, 6], p)
    with pytest.raises(ValueError, match="seed"):
        engine.add_request("x", [5, 6], SamplingParams(), seed=2**64)
    with pytest.raises(ValueError, match="prompt token 1"):
        engine.add_request("x", [5, 2**63], SamplingParams())
    with pytest.raises(ValueError, match="prompt token"):
        engine.reserve("x", [5, -1], deadline=0.0)
    assert not engine.requests and not engine.reservations
    engine.assert_no_leaks()


def test_a_step_that_stops_the_loop_names_its_requests(monkeypatch):
    """An exception in the forward pass (not one request's rows) stops the engine: the waiting
    calls and every later one get RankStopped with the step's requests as suspects."""
    engine = LLMEngine(EngineConfig(model="tiny-random", block_size=4))
    real = engine.runner.forward

    def forward(requests, num_new, split, pre_norm=None):
        if any(r.request_id == "p" for r in requests):
            raise RuntimeError("CUDA out of memory")
        return real(requests, num_new, split, pre_norm)

    monkeypatch.setattr(engine.runner, "forward", forward)
    stopped = threading.Event()
    loop = EngineLoop(engine, lambda _: None, on_stop=lambda _: stopped.set()).start()
    params = SamplingParams(max_tokens=50, ignore_eos=True, temperature=0)
    loop.submit(lambda e: e.add_request("a", [5, 6, 7], params)).result(10)
    loop.submit(lambda e: e.add_request("p", [8, 9], params)).result(10)
    assert stopped.wait(30)
    assert set(loop.suspects) == {"a", "p"}  # both were in the step that raised
    with pytest.raises(RankStopped, match="not running") as info:
        loop.submit(lambda e: None).result(10)
    assert set(info.value.suspects) == {"a", "p"}
    again = pickle.loads(pickle.dumps(info.value))  # it crosses Ray with its suspects
    assert (str(again), again.suspects) == (str(info.value), info.value.suspects)


class _RacingInbox:
    """The loop's inbox, whose next put first lets the engine's step raise and waits (up to
    2 s) for the loop thread to end: the loop dies between submit's check and its put."""

    def __init__(self, loop: EngineLoop, go: threading.Event) -> None:
        self.inner, self.loop, self.go = loop._inbox, loop, go

    def put(self, item) -> None:
        self.go.set()
        self.loop._thread.join(2.0)
        self.inner.put(item)

    def get(self, timeout: float | None = None):
        return self.inner.get(timeout=timeout)

    def get_nowait(self):
        return self.inner.get_nowait()

    def empty(self) -> bool:
        return self.inner.empty()


def test_a_call_submitted_as_the_loop_dies_is_answered(monkeypatch):
    """L10: submit checked that the loop was alive, then put; a loop that died in between had
    already failed its inbox, and the call's future never resolved."""
    engine = LLMEngine(EngineConfig(model="tiny-random", block_size=4))
    go = threading.Event()

    def step():
        go.wait(10)
        raise RuntimeError("the step raised")

    monkeypatch.setattr(engine, "step", step)
    loop = EngineLoop(engine, lambda _: None).start()
    params = SamplingParams(max_tokens=2, temperature=0)
    loop.submit(lambda e: e.add_request("a", [5, 6], params)).result(10)  # its step waits on go
    loop._inbox = _RacingInbox(loop, go)
    future = loop.submit(lambda e: "ran")
    done, _ = concurrent.futures.wait([future], timeout=10)
    assert done, "the future was never resolved"
    assert future.exception() is None or isinstance(future.exception(), RankStopped)
    loop._thread.join(10)
    assert not loop.alive and isinstance(loop.error, RuntimeError)
    with pytest.raises(RankStopped):
        loop.submit(lambda e: None).result(1)
