"""Expert-parallel pools of spawned ranks (gloo): each rank's outputs for its own prompts equal
the EP = 1 engine's, with and without two-batch overlap, with replicas, with an idle rank."""

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.ep import build_ep_engine
from moe.dispatch import AllToAllDispatcher
from moe.placement import Placement
from moe.presets import ensure_preset
from tests.procs import run_ranks

NUM_PROMPTS = 12


def workload():
    gen = torch.Generator().manual_seed(5)
    prompts = [
        torch.randint(2, 512, (int(n),), generator=gen).tolist()
        for n in torch.randint(3, 60, (NUM_PROMPTS,), generator=gen)
    ]
    params = [
        SamplingParams(max_tokens=12, temperature=0 if i % 3 else 0.9, seed=i, ignore_eos=True)
        for i in range(NUM_PROMPTS)
    ]
    return prompts, params


@pytest.fixture(scope="module")
def expected():
    ensure_preset("tiny-random")  # written once, before ranks race to read it
    prompts, params = workload()
    return [o.token_ids for o in LLM("tiny-random", block_size=4).generate(prompts, params)]


def ep_rank(rank, num_ranks, tbo, num_slots, share):
    config = EngineConfig(
        model="tiny-random",
        block_size=4,
        two_batch_overlap=tbo,
        tbo_min_tokens=8,
        max_num_batched_tokens=64,
    )
    placement = None
    if num_slots:
        placement = Placement.contiguous((1, 2), 16, num_ranks, num_slots)
    engine = build_ep_engine(config, None, rank, num_ranks, placement)
    prompts, params = workload()
    mine = [i for i in range(NUM_PROMPTS) if share(i, num_ranks) == rank]
    for i in mine:
        engine.add_request(str(i), prompts[i], params[i])
    outputs: dict[str, list[int]] = {str(i): [] for i in mine}
    steps = 0
    while True:
        for delta in engine.step().outputs:
            outputs[delta.request_id] += delta.token_ids
        steps += 1
        if not engine.pool_has_unfinished:
            break
    engine.assert_no_leaks()
    slots = {moe.experts.w13.shape[0] for moe in engine.model.moe_layers()}
    overlapped = all(
        isinstance(m.dispatcher, AllToAllDispatcher) for m in engine.model.moe_layers()
    )
    return {
        "outputs": outputs,
        "steps": steps,
        "slots": slots,
        "split_steps": engine.runner.num_split_steps,
        "overlapped": overlapped,
    }


def round_robin(i, num_ranks):
    return i % num_ranks


def all_on_rank0(i, num_ranks):
    return 0


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "num_ranks, tbo, num_slots, share",
    [
        (2, "off", None, round_robin),
        (2, "on", None, round_robin),
        (4, "off", None, round_robin),
        (4, "on", 24, round_robin),  # redundant replicas: 24 slots for 16 experts
        (2, "auto", 20, all_on_rank0),  # rank 1 has no requests at all
    ],
)
def test_ep_pool_matches_single_engine(expected, num_ranks, tbo, num_slots, share):
    results = run_ranks(ep_rank, num_ranks, tbo, num_slots, share)
    steps = {r["steps"] for r in results}
    assert len(steps) == 1  # lockstep: every rank took the same number of steps
    split_steps = {r["split_steps"] for r in results}
    assert len(split_steps) == 1 and all(r["overlapped"] for r in results)
    if tbo == "on":
        assert split_steps == {results[0]["steps"] - 1}  # all but the final agreement-only step
    elif tbo == "off":
        assert split_steps == {0}
    for rank, result in enumerate(results):
        assert result["slots"] == {(num_slots or 16) // num_ranks}
        for rid, tokens in result["outputs"].items():
            assert tokens == expected[int(rid)], (rank, rid)
    assert sum(len(r["outputs"]) for r in results) == NUM_PROMPTS
