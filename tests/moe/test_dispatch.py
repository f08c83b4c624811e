"""Expert-parallel dispatch/combine over gloo: R spawned ranks, each holding only its slots'
experts, must reproduce the MoE layers of the full model (all experts local) on their own batches.
"""

import pytest
import torch

from moe import load_model
from moe.dispatch import AllToAllDispatcher, LocalDispatcher
from moe.eplb import rebalance_experts
from moe.placement import Placement
from moe.presets import ensure_preset
from tests.procs import run_ranks

HIDDEN, NUM_EXPERTS, TOP_K = 64, 16, 4
MOE_LAYERS = (1, 2)  # the tiny preset: layer 0 is dense


def _hidden(case: int, rank: int, layer: int, num_tokens: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * case + 10 * rank + layer)
    return torch.randn(num_tokens, HIDDEN, generator=gen)  # [T, D]


def _skewed_placement(num_slots: int, num_ranks: int) -> Placement:
    """An EPLB placement for skewed loads: hot experts get replicas, slots shuffled."""
    gen = torch.Generator().manual_seed(num_slots)
    load = torch.rand(len(MOE_LAYERS), NUM_EXPERTS, generator=gen) ** 4 * 1000  # [L, E]
    phy2log, _, _ = rebalance_experts(load, num_slots, 4, 1, num_ranks)
    return Placement.from_phy2log(MOE_LAYERS, phy2log, num_ranks, NUM_EXPERTS)


# (placement, tokens per rank) per case
CASES = {
    2: [
        (Placement.contiguous(MOE_LAYERS, NUM_EXPERTS, 2), [7, 0]),
        (Placement.contiguous(MOE_LAYERS, NUM_EXPERTS, 2), [0, 9]),
        (_skewed_placement(20, 2), [11, 3]),
        (Placement.contiguous(MOE_LAYERS, NUM_EXPERTS, 2, num_slots=20), [6, 8]),
    ],
    4: [
        (Placement.contiguous(MOE_LAYERS, NUM_EXPERTS, 4), [5, 0, 13, 1]),
        (_skewed_placement(24, 4), [3, 9, 0, 6]),
        (_skewed_placement(24, 4), [8, 2, 5, 0]),
        (Placement.contiguous(MOE_LAYERS, NUM_EXPERTS, 4, num_slots=24), [0, 4, 10, 2]),
    ],
}


def _routing(src: int, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank src's batch: x [T, D] with x[:, 0] = src and x[:, 1] = token index, distinct
    topk_idx [T, K], topk_weights [T, K]; every rank can rebuild every other rank's."""
    gen = torch.Generator().manual_seed(src)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    x[:, 0], x[:, 1] = src, torch.arange(num_tokens)
    topk_idx = torch.rand(num_tokens, NUM_EXPERTS, generator=gen).argsort(dim=1)[:, :TOP_K]
    topk_weights = torch.rand(num_tokens, TOP_K, generator=gen)
    return x, topk_idx, topk_weights


LAYOUT_TOKENS = {2: [0, 7], 4: [6, 0, 11, 3]}


def _check_layout(rank: int, num_ranks: int, tokens: list[int]) -> None:
    """dispatch delivers exactly the expected rows, slot by slot; combine weights and sums."""
    placement = _skewed_placement(24, num_ranks)
    slots_per_rank = placement.slots_per_rank
    batches = [_routing(src, tokens[src]) for src in range(num_ranks)]
    for pos in range(len(MOE_LAYERS)):
        for async_op in (False, True):
            dispatcher = AllToAllDispatcher(None, placement, pos, rank)
            x, topk_idx, topk_weights = batches[rank]
            handle = dispatcher.dispatch(x, topk_idx, topk_weights, async_op=async_op)
            handle.wait()
            assert handle.bytes_sent == tokens[rank] * TOP_K * HIDDEN * 4

            # Oracle: slot by slot, the rows of every source in (token, k) order.
            phys = [placement.select_slots(pos, b[1], offset=src) for src, b in enumerate(batches)]
            expected_rows, expected_counts = [], []
            for local in range(slots_per_rank):
                slot = rank * slots_per_rank + local
                rows = [b[0][(p == slot).any(dim=1)] for b, p in zip(batches, phys, strict=True)]
                expected_rows += rows
                expected_counts.append(sum(len(r) for r in rows))
            assert handle.recv_counts == expected_counts
            assert torch.equal(handle.recv_x, torch.cat(expected_rows))

            # Combine with "expert" slot g = multiply by g + 1.
            slot_of_row = torch.repeat_interleave(
                torch.arange(slots_per_rank) + rank * slots_per_rank + 1,
                torch.tensor(handle.recv_counts),
            )
            y = handle.recv_x * slot_of_row[:, None]
            out = dispatcher.combine(y, handle, async_op=async_op).output()  # [T, D]
            scale = (topk_weights * (phys[rank] + 1)).sum(dim=1)  # [T]
            assert torch.allclose(out, x * scale[:, None], rtol=1e-6, atol=1e-6)


def _worker(rank: int, num_ranks: int) -> dict:
    """One spawn per pool size (process start-up dominates): the MoE cases, then the layout
    oracle, which raises in the rank where it fails."""
    results = {}
    for case, (placement, tokens) in enumerate(CASES[num_ranks]):
        model = load_model("tiny-random", experts=placement.rank_experts(rank))
        model.install_expert_parallel(None, placement, rank)
        with torch.inference_mode():
            for layer in MOE_LAYERS:
                x = _hidden(case, rank, layer, tokens[rank])
                results[case, layer] = model.model.layers[layer].mlp(x)
    if num_ranks == 2:  # whole-model forward: attention local, every MoE layer expert-parallel
        ids = torch.randint(
            0, 512, (1, 5 + 3 * rank), generator=torch.Generator().manual_seed(rank)
        )
        results["logits"] = model(ids)
    _check_layout(rank, num_ranks, LAYOUT_TOKENS[num_ranks])
    results["layout_checked"] = True
    return results


@pytest.fixture(scope="module")
def full_model():
    ensure_preset("tiny-random")  # before spawning: the ranks would race to write it
    return load_model("tiny-random")


@pytest.fixture(scope="module")
def rank_results(full_model):
    """num_ranks -> each rank's results, spawning the pool once per size."""
    done: dict[int, list[dict]] = {}

    def run(num_ranks: int) -> list[dict]:
        if num_ranks not in done:
            done[num_ranks] = run_ranks(_worker, num_ranks, timeout=110)
        return done[num_ranks]

    return run


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_expert_parallel_moe_matches_full_model(num_ranks, full_model, rank_results):
    for rank, results in enumerate(rank_results(num_ranks)):
        for case, (_, tokens) in enumerate(CASES[num_ranks]):
            for layer in MOE_LAYERS:
                x = _hidden(case, rank, layer, tokens[rank])
                with torch.inference_mode():
                    expected = full_model.model.layers[layer].mlp(x)
                got = results[case, layer]
                assert got.shape == (tokens[rank], HIDDEN)
                torch.testing.assert_close(got, expected, rtol=0, atol=1e-5)
        if num_ranks == 2:
            ids = torch.randint(
                0, 512, (1, 5 + 3 * rank), generator=torch.Generator().manual_seed(rank)
            )
            torch.testing.assert_close(results["logits"], full_model(ids), rtol=0, atol=1e-5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("num_ranks", [2, 4])
def test_dispatch_layout_and_combine_oracle(num_ranks, rank_results):
    # _check_layout raises in the worker (failing the spawn) when the oracle disagrees.
    assert all(results["layout_checked"] for results in rank_results(num_ranks))


def test_rank_experts_hold_their_slots(full_model):
    placement = _skewed_placement(24, 4)
    assert (placement.logcnt > 1).any(), "the placement should have replicas"
    for rank in range(4):
        model = load_model("tiny-random", experts=placement.rank_experts(rank))
        for pos, layer in enumerate(MOE_LAYERS):
            experts = model.model.layers[layer].mlp.experts
            full = full_model.model.layers[layer].mlp.experts
            ids = placement.phy2log[pos, placement.rank_slots(rank)]  # [S_r]
            assert experts.expert_ids == ids.tolist()
            assert torch.equal(experts.w13, full.w13[ids])
            assert torch.equal(experts.w2, full.w2[ids])


def test_install_rejects_a_model_loaded_for_another_rank():
    placement = Placement.contiguous(MOE_LAYERS, NUM_EXPERTS, 2)
    model = load_model("tiny-random", experts=placement.rank_experts(1))
    with pytest.raises(ValueError, match="rank 0 holds experts"):
        model.install_expert_parallel(None, placement, 0)
    with pytest.raises(ValueError, match="MoE layers"):
        model.install_expert_parallel(None, Placement.contiguous((1,), NUM_EXPERTS, 2), 1)


def test_local_dispatcher_sorts_by_slot_and_combines_by_hand():
    # Slots hold experts [2, 0, 1]; 3 tokens, K = 2.
    dispatcher = LocalDispatcher([2, 0, 1], num_experts=3)
    x = torch.arange(12, dtype=torch.float32).view(3, 4)  # [T, D]
    topk_idx = torch.tensor([[0, 2], [1, 0], [2, 1]])  # slots [[1, 0], [2, 1], [0, 2]]
    topk_weights = torch.tensor([[0.5, 0.25], [1.0, 2.0], [3.0, 0.125]])
    handle = dispatcher.dispatch(x, topk_idx, topk_weights).wait()
    assert handle.recv_counts == [2, 2, 2]
    # slot 0: tokens 0 (k=1), 2 (k=0); slot 1: tokens 0, 1; slot 2: tokens 1, 2
    assert torch.equal(handle.recv_x, x[[0, 2, 0, 1, 1, 2]])
    slot_of_row = torch.tensor([1.0, 1.0, 2.0, 2.0, 3.0, 3.0])[:, None]  # "expert" = x * (s+1)
    out = dispatcher.combine(handle.recv_x * slot_of_row, handle).output()
    scale = torch.tensor([0.5 * 2 + 0.25 * 1, 1.0 * 3 + 2.0 * 2, 3.0 * 1 + 0.125 * 3])
    assert torch.equal(out, x * scale[:, None])


def test_local_dispatcher_refuses_experts_it_does_not_hold():
    dispatcher = LocalDispatcher([0, 1], num_experts=4)
    x = torch.zeros(2, 4)
    with pytest.raises(RuntimeError, match=r"experts \[3\] that this rank does not hold"):
        dispatcher.dispatch(x, torch.tensor([[0, 1], [3, 1]]), torch.ones(2, 2))
