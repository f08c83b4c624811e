"""The scheduler alone, against a real BlockManager: a table of small cases whose batches are
worked out by hand (the token budget, FCFS admission, the seat cap, chunked prefill, and
preemption of the youngest running request when blocks run out). A step "runs" its batch the
way the engine does: the scheduled tokens are computed, and a request whose tokens are all
computed samples one more."""

from dataclasses import dataclass, field

import pytest

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.request import Request, Status
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler


@dataclass(frozen=True)
class Case:
    prompts: dict[str, int]  # request id -> prompt length, in arrival order
    steps: list[list[tuple[str, int]]]  # each step's batch: (request id, new tokens)
    max_num_batched_tokens: int = 100
    max_num_seqs: int = 8
    num_blocks: int = 64
    block_size: int = 4
    waiting: list[str] = field(default_factory=list)  # after the last step
    preempted: dict[str, int] = field(default_factory=dict)  # request id -> its preemptions


CASES = {
    # 20 prompt tokens through a budget of 8: two full chunks, the rest, then one decode
    "chunked prefill": Case(
        {"a": 20}, [[("a", 8)], [("a", 8)], [("a", 4)], [("a", 1)]], max_num_batched_tokens=8
    ),
    # a takes 6 of 10, b the 4 left (a chunk), c waits; then a decodes, b finishes, c fits
    "token budget, FCFS": Case(
        {"a": 6, "b": 6, "c": 3},
        [[("a", 6), ("b", 4)], [("a", 1), ("b", 2), ("c", 3)]],
        max_num_batched_tokens=10,
    ),
    # budget left over, but one seat: b waits for it
    "seat cap": Case({"a": 4, "b": 4}, [[("a", 4)], [("a", 1)]], max_num_seqs=1, waiting=["b"]),
    # a waiting request whose blocks are not there is not admitted (nor anyone behind it)
    "no blocks, no admission": Case(
        {"a": 8, "b": 12, "c": 1}, [[("a", 8)]], num_blocks=3, waiting=["b", "c"]
    ),
    # four prompts take 4 of 5 blocks; the first decodes of a and b need a block each (c's and
    # d's fit theirs): a takes the last, b preempts the youngest (d), not the next in line (c)
    "youngest preempted": Case(
        {"a": 4, "b": 4, "c": 3, "d": 3},
        [[("a", 4), ("b", 4), ("c", 3), ("d", 3)], [("a", 1), ("b", 1), ("c", 1)]],
        num_blocks=5,
        waiting=["d"],
        preempted={"d": 1},
    ),
    # the youngest running request that finds no block preempts itself: b is not batched
    "preempts itself": Case(
        {"a": 4, "b": 4},
        [[("a", 4), ("b", 4)], [("a", 1)]],
        num_blocks=3,
        waiting=["b"],
        preempted={"b": 1},
    ),
}


def run_batch(batch: ScheduledBatch) -> None:
    for req, n in zip(batch.requests, batch.num_new_tokens, strict=True):
        req.num_computed_tokens += n
        if req.num_computed_tokens == req.num_tokens:
            req.output_token_ids.append(0)


@pytest.mark.parametrize("name", list(CASES))
def test_schedule(name: str) -> None:
    case = CASES[name]
    config = EngineConfig(
        max_num_batched_tokens=case.max_num_batched_tokens,
        max_num_seqs=case.max_num_seqs,
        block_size=case.block_size,
    )
    blocks = BlockManager(case.num_blocks, case.block_size, enable_prefix_caching=False)
    scheduler = Scheduler(config, blocks)
    requests = {}
    for arrival, (rid, length) in enumerate(case.prompts.items()):
        requests[rid] = Request(rid, list(range(1, length + 1)), SamplingParams(), 0, arrival)
        scheduler.add(requests[rid])
    for step, expected in enumerate(case.steps):
        batch = scheduler.schedule()
        got = [(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens)]
        assert got == expected, f"step {step}"
        assert sum(batch.num_new_tokens) <= case.max_num_batched_tokens
        assert len(scheduler.running) <= case.max_num_seqs
        run_batch(batch)
        blocks.assert_consistent()
    assert [r.request_id for r in scheduler.waiting] == case.waiting
    for rid, req in requests.items():
        assert req.num_preemptions == case.preempted.get(rid, 0), rid
        if rid in case.waiting:
            assert req.status is Status.WAITING and req.block_table == []
        else:
            assert req.status is Status.RUNNING and req.block_table
    assert scheduler.num_preemptions == sum(case.preempted.values())


def test_a_preempted_request_recomputes_its_tokens() -> None:
    """After preemption a request comes back with its prompt and its sampled tokens to compute
    again (its KV is gone), ahead of requests that arrived after it."""
    config = EngineConfig(max_num_batched_tokens=100, block_size=4)
    blocks = BlockManager(3, 4, enable_prefix_caching=False)
    scheduler = Scheduler(config, blocks)
    a, b = (Request(r, [1, 2, 3, 4], SamplingParams(), 0, i) for i, r in enumerate("ab"))
    scheduler.add(a)
    scheduler.add(b)
    run_batch(scheduler.schedule())  # both prefill; a's and b's first tokens sampled
    run_batch(scheduler.schedule())  # a decodes into the last block; b preempts itself
    late = Request("late", [1], SamplingParams(), 0, 2)
    scheduler.add(late)
    scheduler.finish(a, "stop")  # a's two blocks come back
    batch = scheduler.schedule()
    got = [(r.request_id, n) for r, n in zip(batch.requests, batch.num_new_tokens)]
    assert got == [("b", 5), ("late", 1)]  # 4 prompt tokens and 1 sampled, again; then late
