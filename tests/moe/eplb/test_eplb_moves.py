"""Rebalancing under a budget of moved slots: hand cases, the budget, never worse than staying,
and alignment (relabeling GPUs and slots changes no load)."""

import pytest
import torch

from moe.eplb import (
    align_placement,
    count_moves,
    gpu_loads,
    rebalance_experts,
    rebalance_experts_with_moves,
)
from moe.placement import build_log2phy
from tests.moe.eplb.eplb_cases import assert_valid, max_load, zipf_weight

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_one_swap_is_two_moves():
    """[10, 10, 1, 1] in slots [0 1 | 2 3]: loads 20 / 2. No expert has a spare replica, so one
    moved slot cannot help; two (swap experts 1 and 2) give 11 / 11, the optimum."""
    weight = torch.tensor([[10.0, 10.0, 1.0, 1.0]])
    current = torch.tensor([[0, 1, 2, 3]])
    same, _, _ = rebalance_experts_with_moves(weight, current, 1, 1, 1, 2)
    assert torch.equal(same, current)
    phy2log, log2phy, logcnt = rebalance_experts_with_moves(weight, current, 2, 1, 1, 2)
    assert_valid(phy2log, log2phy, logcnt, 4, 2)
    assert count_moves(current, phy2log).tolist() == [2]
    assert gpu_loads(weight, phy2log, 2).tolist() == [[11.0, 11.0]]


def test_one_move_retargets_a_replica():
    """[1, 1, 8, 1] in slots [0 0 2 | 1 3 0]: expert 0 has 3 replicas, the hot expert 2 one:
    8.67 / 2.33. The best single move gives expert 0's slot on GPU 1 to expert 2: 0 and 2 then
    have 2 replicas each, {0 0 2} = 5 and {1 3 2} = 6 (on GPU 0 it would give 8.5)."""
    weight = torch.tensor([[1.0, 1.0, 8.0, 1.0]])
    current = torch.tensor([[0, 0, 2, 1, 3, 0]])  # GPUs {0, 0, 2} = 9, {1, 3, 0} = 2 + 1/3
    before = gpu_loads(weight, current, 2)
    torch.testing.assert_close(before, torch.tensor([[1 / 3 + 1 / 3 + 8, 1 + 1 + 1 / 3]]))
    phy2log, _, _ = rebalance_experts_with_moves(weight, current, 1, 1, 1, 2)
    assert count_moves(current, phy2log).tolist() == [1]
    # the best single move: a slot of expert 0 on GPU 1 becomes expert 2: {0 0 2} {1 3 2}
    assert gpu_loads(weight, phy2log, 2).tolist() == [[5.0, 6.0]]


def test_budget_on_v3_like_shapes():
    """256 experts, 288 slots (16 layers): the moves never exceed the budget, budget 0 keeps the
    placement, the result is never worse than staying, and with budget >= S never worse than
    rebalance_experts (up to float rounding: aligning reorders the sums)."""
    gen = torch.Generator().manual_seed(11)
    for num_groups, num_nodes, num_gpus in [(8, 4, 32), (1, 1, 144)]:
        args = (num_groups, num_nodes, num_gpus)
        old = zipf_weight(16, 256, gen)
        current, _, _ = rebalance_experts(old, 288, *args)
        weight = old * torch.exp(0.5 * torch.randn(old.shape, generator=gen))  # the load drifts
        stay = max_load(weight, current, num_gpus)
        full, _, _ = rebalance_experts(weight, 288, *args)
        for budget in (0, 4, 288):
            phy2log, log2phy, logcnt = rebalance_experts_with_moves(weight, current, budget, *args)
            assert_valid(phy2log, log2phy, logcnt, 256, num_gpus, num_groups, num_nodes)
            assert bool((count_moves(current, phy2log) <= budget).all())
            peak = max_load(weight, phy2log, num_gpus)
            assert bool((peak <= stay).all())
            if budget == 0:
                assert torch.equal(phy2log, current)
            if budget == 4:
                assert bool((peak < stay).all())  # a few moves already help every layer
            if budget == 288:
                assert bool((peak <= max_load(weight, full, num_gpus) * (1 + 1e-6)).all())


def test_budget_per_layer():
    weight = torch.tensor([[10.0, 10.0, 1.0, 1.0], [10.0, 10.0, 1.0, 1.0]])
    current = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])
    phy2log, _, _ = rebalance_experts_with_moves(weight, current, torch.tensor([0, 2]), 1, 1, 2)
    assert count_moves(current, phy2log).tolist() == [0, 2]


def test_hierarchical_moves_stay_on_the_node():
    """From a hierarchical placement, the search only moves experts within their node."""
    gen = torch.Generator().manual_seed(5)
    old, weight = zipf_weight(16, 64, gen), zipf_weight(16, 64, gen)
    current, _, _ = rebalance_experts(old, 80, 8, 4, 16)
    phy2log, log2phy, logcnt = rebalance_experts_with_moves(weight, current, 6, 8, 4, 16)
    assert_valid(phy2log, log2phy, logcnt, 64, 16, 8, 4)
    assert bool((count_moves(current, phy2log) <= 6).all())


def test_align_recovers_a_relabeled_placement():
    """Shuffling GPUs (whole nodes and GPUs within nodes) and slots within GPUs changes no load;
    aligning the shuffled placement to the original gives it back: 0 moves."""
    gen = torch.Generator().manual_seed(2)
    num_layers, num_gpus, num_nodes, k = 4, 8, 2, 3
    current = torch.stack([torch.randperm(24, generator=gen) for _ in range(num_layers)])
    shuffled = current.view(num_layers, num_nodes, num_gpus // num_nodes, k)
    shuffled = shuffled[:, torch.randperm(num_nodes, generator=gen)]
    shuffled = shuffled[:, :, torch.randperm(num_gpus // num_nodes, generator=gen)]
    shuffled = shuffled[..., torch.randperm(k, generator=gen)].reshape(num_layers, -1)
    assert bool((count_moves(current, shuffled) > 0).all())
    aligned = align_placement(shuffled, current, num_gpus, num_nodes)
    assert torch.equal(aligned, current)


def test_align_keeps_every_gpu_load():
    gen = torch.Generator().manual_seed(4)
    weight = zipf_weight(8, 32, gen)
    new, _, _ = rebalance_experts(weight, 48, 4, 2, 8)
    current, _, _ = rebalance_experts(zipf_weight(8, 32, gen), 48, 4, 2, 8)
    aligned = align_placement(new, current, 8, 2)
    assert_valid(aligned, *build_log2phy(aligned, 32), 32, 8, 4, 2)
    torch.testing.assert_close(
        gpu_loads(weight, aligned, 8).sort(dim=1).values,
        gpu_loads(weight, new, 8).sort(dim=1).values,
    )
    assert bool((count_moves(current, aligned) <= count_moves(current, new)).all())
