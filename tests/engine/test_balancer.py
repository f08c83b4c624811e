"""Live expert re-placement: the transfer plan by hand, and spawned EP = 2 pools that rebalance in
the middle of decoding. Every request's tokens equal the single engine's, every rank then holds
exactly the weights of its new slots, and the pool's balance improves."""

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.ep import build_ep_engine
from moe import load_model
from moe.placement import Placement
from moe.presets import ensure_preset
from moe.replacement import Transfer, plan_layer
from tests.procs import run_ranks

NUM_PROMPTS = 8


def test_plan_layer_by_hand():
    # 2 ranks x 2 slots: rank 0 held experts {0, 1}, rank 1 {2, 3}
    old, new = [0, 1, 2, 3], [3, 1, 0, 2]
    assert plan_layer(old, new, 2) == [Transfer(0, 3, 1, 0), Transfer(2, 0, 0, 1)]
    # rank 0 held {0, 1}, rank 1 {0, 2}: rank 1 keeps both copies of expert 0 locally, and
    # rank 0's expert 2 comes from rank 1
    assert plan_layer([0, 1, 0, 2], [1, 2, 0, 0], 2) == [Transfer(1, 2, 1, 0)]
    assert plan_layer(old, old, 2) == []


def workload():
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(2, 512, (int(n),), generator=gen).tolist()
               for n in torch.randint(20, 80, (NUM_PROMPTS,), generator=gen)]  # fmt: skip
    params = [
        SamplingParams(max_tokens=30, temperature=0 if i % 2 else 0.8, seed=i, ignore_eos=True)
        for i in range(NUM_PROMPTS)
    ]
    return prompts, params


@pytest.fixture(scope="module")
def expected():
    ensure_preset("tiny-random")  # written once, before ranks race to read it
    prompts, params = workload()
    return [o.token_ids for o in LLM("tiny-random", block_size=4).generate(prompts, params)]


def rebalancing_rank(rank, num_ranks, layers_per_round):
    config = EngineConfig(
        model="tiny-random",
        block_size=4,
        eplb_min_gain=0.0,  # apply whatever the algorithm finds
        eplb_layers_per_round=layers_per_round,
    )
    placement = Placement.contiguous((1, 2), 16, num_ranks, num_slots=20)  # replicas too
    engine = build_ep_engine(config, None, rank, num_ranks, placement)
    prompts, params = workload()
    mine = [i for i in range(NUM_PROMPTS) if i % num_ranks == rank]
    for i in mine:
        engine.add_request(str(i), prompts[i], params[i])
    outputs: dict[str, list[int]] = {str(i): [] for i in mine}
    steps = 0
    while True:
        if steps == 12 and rank == 1:  # mid-decoding, asked on one rank only
            engine.balancer.request()
        for delta in engine.step().outputs:
            outputs[delta.request_id] += delta.token_ids
        steps += 1
        if not engine.pool_has_unfinished and not engine.balancer._moves:
            break
    engine.assert_no_leaks()
    held = {
        layer: (list(m.experts.expert_ids), m.experts.w13.clone(), m.experts.w2.clone())
        for layer, m in zip(engine.model.config.moe_layers, engine.model.moe_layers())
    }
    return {"outputs": outputs, "last": engine.balancer.last, "held": held,
            "placement": engine.balancer.placement.phy2log, "steps": steps}  # fmt: skip


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("layers_per_round", [0, 1])
def test_a_rebalance_mid_decoding_changes_no_token(expected, layers_per_round):
    results = run_ranks(rebalancing_rank, 2, layers_per_round)
    full = load_model("tiny-random")
    for rank, result in enumerate(results):
        for rid, tokens in result["outputs"].items():
            assert tokens == expected[int(rid)], (rank, rid)
        last = result["last"]
        assert (last.number, last.outcome) == (1, "applied"), last
        assert last.slots_moved > 0 and last.balancedness_after > last.balancedness_before
        assert last.from_checkpoint == 0
        placement = Placement(
            (1, 2), result["placement"], 2, 16
        )  # the pool's new placement: this rank holds exactly its slots' weights
        for layer, (ids, w13, w2) in result["held"].items():
            assert ids == placement.rank_experts(rank)[layer]
            experts = full.model.layers[layer].mlp.experts
            assert torch.equal(w13, experts.w13[ids]) and torch.equal(w2, experts.w2[ids])
    assert torch.equal(results[0]["placement"], results[1]["placement"])
    assert results[0]["last"].slots_moved == results[1]["last"].slots_moved
