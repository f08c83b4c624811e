"""Expert load balancing: hand-computed cases, and properties on random loads."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe.eplb import (
    balanced_packing,
    gpu_loads,
    rebalance_experts,
    rebalance_hierarchical,
    replicate_experts,
)


def test_hot_expert_gets_the_redundant_slots():
    weight = torch.tensor([[10.0, 1.0, 1.0, 1.0]])
    phy2log, log2phy, logcnt = rebalance_experts(weight, 6, 1, 1, 2, method="greedy")
    # Replicas: expert 0 twice (10/2 = 5 > 1, then 10/3 > 1). Items per slot: 10/3 x 3, 1 x 3.
    # Greedy packing, heaviest first: 10/3 -> A, 10/3 -> B, 10/3 -> A (tie), 1 -> B, 1 -> B
    # (B full), 1 -> A.
    assert logcnt.tolist() == [[3, 1, 1, 1]]
    assert phy2log.tolist() == [[0, 0, 3, 0, 1, 2]]
    assert log2phy.tolist() == [[[0, 1, 3], [4, -1, -1], [5, -1, -1], [2, -1, -1]]]
    loads = gpu_loads(weight, phy2log, 2)
    torch.testing.assert_close(loads, torch.tensor([[2 * 10 / 3 + 1, 10 / 3 + 2]]))
    assert loads.max() < gpu_loads(weight, torch.arange(4)[None], 2).max()  # 11 contiguous


def test_replicas_can_balance_perfectly():
    weight = torch.tensor([[6.0, 2.0, 2.0, 2.0]])
    phy2log, _, logcnt = rebalance_experts(weight, 6, 1, 1, 2)
    assert logcnt.tolist() == [[3, 1, 1, 1]]  # six items of load 2
    assert gpu_loads(weight, phy2log, 2).tolist() == [[6.0, 6.0]]


def test_balanced_packing_greedy():
    pack, pos = balanced_packing(torch.tensor([[4.0, 3.0, 3.0, 2.0, 2.0, 2.0]]), 2)
    # 4 -> A, 3 -> B, 3 -> B, 2 -> A, 2 -> A (tie: first pack; A full), 2 -> B.
    assert pack.tolist() == [[0, 1, 1, 0, 0, 1]]
    assert pos.tolist() == [[0, 0, 1, 1, 2, 2]]


def test_hierarchical_packs_groups_onto_nodes():
    weight = torch.tensor([[8.0, 8.0, 1.0, 1.0, 1.0, 1.0, 4.0, 4.0]])  # groups of 2: 16, 2, 2, 8
    phy2log, logcnt = rebalance_hierarchical(weight, 8, 4, 2, 4)
    # Groups to nodes: 16 -> node 0, 8 -> node 1, 2 (group 1) -> node 1 (now full), 2 -> node 0.
    # Node 0 holds experts 0 1 4 5 (loads 8 8 1 1) -> GPUs {0, 4}, {1, 5};
    # node 1 holds experts 6 7 2 3 (loads 4 4 1 1) -> GPUs {6, 2}, {7, 3}.
    assert phy2log.tolist() == [[0, 4, 1, 5, 6, 2, 7, 3]]
    assert logcnt.tolist() == [[1] * 8]
    assert gpu_loads(weight, phy2log, 4).tolist() == [[9.0, 9.0, 5.0, 5.0]]


def test_global_policy_when_groups_do_not_divide_nodes():
    weight = torch.rand(2, 6)
    got = rebalance_experts(weight, 8, 3, 2, 4)  # 3 groups over 2 nodes
    expected = rebalance_experts(weight, 8, 1, 1, 4)
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)


@st.composite
def problems(draw):
    """(weight [L, E], S, groups, nodes, gpus) satisfying the divisibility rules."""
    num_nodes = draw(st.sampled_from([1, 2]))
    num_gpus = num_nodes * draw(st.sampled_from([1, 2, 4]))
    num_groups = num_nodes * draw(st.sampled_from([1, 2]))
    group_size = draw(st.sampled_from([1, 2, 4]))
    num_log = num_groups * group_size
    num_phy = num_gpus * draw(
        st.integers(math.ceil(num_log / num_gpus), 2 * num_log // num_gpus + 2)
    )
    num_layers = draw(st.integers(1, 3))
    loads = st.floats(0, 1000, allow_nan=False, width=32)
    weight = torch.tensor(
        draw(st.lists(loads, min_size=num_log * num_layers, max_size=num_log * num_layers))
    )
    return weight.view(num_layers, num_log), num_phy, num_groups, num_nodes, num_gpus


@settings(max_examples=150, deadline=None)
@given(problems())
def test_placement_invariants(problem):
    weight, num_phy, num_groups, num_nodes, num_gpus = problem
    num_layers, num_log = weight.shape
    phy2log, log2phy, logcnt = rebalance_experts(weight, num_phy, num_groups, num_nodes, num_gpus)
    assert phy2log.shape == (num_layers, num_phy)
    assert bool((logcnt >= 1).all())
    assert logcnt.sum(dim=1).tolist() == [num_phy] * num_layers
    for layer in range(num_layers):
        assert torch.equal(torch.bincount(phy2log[layer], minlength=num_log), logcnt[layer])
        for expert in range(num_log):
            cnt = int(logcnt[layer, expert])
            slots = log2phy[layer, expert]
            assert bool((slots[cnt:] == -1).all())
            assert slots[:cnt].tolist() == (phy2log[layer] == expert).nonzero().flatten().tolist()
    if num_nodes > 1:  # hierarchical: every replica of a group's experts on the group's node
        group_size = num_log // num_groups
        node_of_slot = torch.arange(num_phy) // (num_phy // num_nodes)  # [S]
        for layer in range(num_layers):
            group_of_slot = phy2log[layer] // group_size  # [S]
            for group in range(num_groups):
                assert len(node_of_slot[group_of_slot == group].unique()) == 1


def _optimal_max_per_replica(weight: list[float], num_phy: int) -> float:
    """Oracle: the least t with sum(ceil(w / t)) <= num_phy; t is some w / c."""
    candidates = sorted({w / c for w in weight for c in range(1, num_phy + 1) if w > 0})
    for t in candidates:
        if sum(max(1, math.ceil(w / t - 1e-9)) for w in weight) <= num_phy:
            return t
    return 0.0


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(0, 100), min_size=1, max_size=12),
    st.integers(0, 12),
)
def test_replication_minimizes_the_largest_replica_load(loads, extra):
    weight = torch.tensor([loads], dtype=torch.float32)
    phy2log, logcnt = replicate_experts(weight, len(loads) + extra)
    assert torch.equal(torch.bincount(phy2log[0], minlength=len(loads)), logcnt[0])
    got = float((weight / logcnt).max())
    assert math.isclose(got, _optimal_max_per_replica(loads, len(loads) + extra), rel_tol=1e-6)


@settings(max_examples=150, deadline=None)
@given(problems())
def test_global_packing_is_within_one_replica_of_perfect(problem):
    weight, num_phy, _, _, num_gpus = problem
    phy2log, _, logcnt = rebalance_experts(weight, num_phy, 1, 1, num_gpus)
    loads = gpu_loads(weight, phy2log, num_gpus)  # [L, R]
    mean = weight.sum(dim=1) / num_gpus  # [L]
    max_replica = (weight / logcnt).max(dim=1).values  # [L]
    assert bool((loads.max(dim=1).values <= (mean + max_replica) * (1 + 1e-5) + 1e-3).all())


@settings(max_examples=150, deadline=None)
@given(
    num_gpus=st.sampled_from([2, 4, 8]),
    experts_per_gpu=st.sampled_from([1, 2, 4]),
    redundant_per_gpu=st.sampled_from([1, 2]),
    data=st.data(),
)
def test_rebalanced_beats_contiguous_on_skewed_loads(
    num_gpus, experts_per_gpu, redundant_per_gpu, data
):
    """One hot expert carrying >= 3x the rest: contiguous puts all of it on one GPU (max >= hot),
    while the rebalance stays within mean + max replica load <= hot. (On near-balanced loads
    greedy packing can lose to a lucky contiguous split, e.g. [3, 1, 0, 4] on 2 GPUs, S = 6.)"""
    num_log = num_gpus * experts_per_gpu
    rest = data.draw(st.lists(st.floats(0, 1), min_size=num_log, max_size=num_log))
    hot = data.draw(st.integers(0, num_log - 1))
    factor = data.draw(st.floats(3, 20))
    weight = torch.tensor([rest], dtype=torch.float32)
    weight[0, hot] = factor * (weight.sum() - weight[0, hot] + 1)
    num_phy = num_log + redundant_per_gpu * num_gpus
    phy2log, _, _ = rebalance_experts(weight, num_phy, 1, 1, num_gpus)
    rebalanced = gpu_loads(weight, phy2log, num_gpus).max()
    contiguous = gpu_loads(weight, torch.arange(num_log)[None], num_gpus).max()
    assert rebalanced <= contiguous * (1 + 1e-6)
