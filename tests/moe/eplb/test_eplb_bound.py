"""Lower bounds on the max GPU load: hand-computed cases where each test of the bound is the one
that binds, and validity against brute force and both algorithms on random loads."""

import pytest
import torch

from moe.eplb import rebalance_experts
from moe.eplb.bound import group_bound, lower_bound, slot_bound
from tests.moe.eplb.eplb_cases import brute_force_optimum, max_load, zipf_weight

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_mean_bound():
    """[10, 1, 1, 1] on 2 GPUs, 6 slots: the mean 6.5 binds (and is reached, see test_eplb)."""
    assert float(lower_bound(torch.tensor([[10.0, 1, 1, 1]]), 6, 1, 1, 2)) == pytest.approx(6.5)


def test_replica_bound_is_the_least_max_replica_load():
    """Test (0): [12, 0, 0] with 5 slots on 5 GPUs of 1 slot: expert 0 gets at most 3 replicas
    (the others need one each), so some GPU holds 12 / 3 = 4; the mean is only 12 / 5."""
    bound = lower_bound(torch.tensor([[12.0, 0.0, 0.0]]), 5, 1, 1, 5)
    assert float(bound) == pytest.approx(4.0, rel=1e-5)


def test_pigeonhole_bound():
    """Test (j = 1). [10, 10, 10, 0] on 2 GPUs of 2 slots: no room for replicas, two 10s share a
    GPU: 20 (the mean is 15). [2, 1, 0], same GPUs: counts (2, 1, 1) give replicas 1 1 1 0 and two
    1s share a GPU, (1, 2, 1) and (1, 1, 2) leave 2 with at best 0: the optimum is 2, while the
    mean is 1.5 and the least max replica 1. Below T = 2, three replicas exceed T / 2."""
    assert float(lower_bound(torch.tensor([[10.0, 10, 10, 0]]), 4, 1, 1, 2)) == pytest.approx(
        20, rel=1e-5
    )
    weight = torch.tensor([[2.0, 1.0, 0.0]])
    assert brute_force_optimum(weight[0], 4, 1, 1, 2) == pytest.approx(2.0)
    assert float(lower_bound(weight, 4, 1, 1, 2)) == pytest.approx(2.0, rel=1e-5)


def test_pairing_bound():
    """Test (y). [3, 1, 0] on 2 GPUs of 2 slots: counts (2, 1, 1) give 1.5 1.5 1 0, best paired
    1.5 + 1 / 1.5 + 0 = 2.5; the other counts leave 3 whole: the optimum is 2.5. The mean (2), the
    least max replica (1.5) and test (j) (at most 2 replicas above T / 2) allow 2. Below 2.5 both
    1.5s need a partner <= T - 1.5 < 1, and only the 0 is."""
    weight = torch.tensor([[3.0, 1.0, 0.0]])
    assert brute_force_optimum(weight[0], 4, 1, 1, 2) == pytest.approx(2.5)
    assert float(lower_bound(weight, 4, 1, 1, 2)) == pytest.approx(2.5, rel=1e-5)


def test_group_bound():
    """Groups of 2 with loads 16, 2, 2, 8 on 2 nodes of 2 GPUs: the node with the group of 16
    also takes another group, at least 2: (16 + 2) / 2 GPUs = 9, which the greedy reaches.
    Loads 5 5 5 5 1 1 on 3 nodes of 2 groups: of the 4 heaviest, 2 share a node: 10 (j = 1)."""
    weight = torch.tensor([[8.0, 8.0, 1.0, 1.0, 1.0, 1.0, 4.0, 4.0]])
    assert group_bound(torch.tensor([[16.0, 2.0, 2.0, 8.0]]), 2).tolist() == [18.0]
    assert float(lower_bound(weight, 8, 4, 2, 4)) == pytest.approx(9.0, rel=1e-5)
    phy2log, _, _ = rebalance_experts(weight, 8, 4, 2, 4, method="greedy")
    assert float(max_load(weight, phy2log, 4)) == 9.0
    assert group_bound(torch.tensor([[5.0, 5, 5, 5, 1, 1]]), 3).tolist() == [10.0]


def test_free_slots_only_lower_the_bound():
    """Other groups' slots on the node may hold light replicas: counting them can only help."""
    weight = torch.tensor([[3.0, 1.0, 0.0], [5.0, 5.0, 2.0]])
    assert bool((slot_bound(weight, 4, 2, free_slots=2) <= slot_bound(weight, 4, 2)).all())


def test_bound_below_brute_force_optimum():
    """On seeded tiny problems (hierarchical with several groups a node included) the bound
    never exceeds the optimum, and equals it (to 1e-4) in most."""
    gen = torch.Generator().manual_seed(3)
    tight = total = 0
    for num_log, num_phy, num_groups, num_nodes, num_gpus in [
        (4, 6, 4, 2, 2),
        (6, 6, 6, 3, 3),
        (4, 8, 4, 2, 4),
        (3, 6, 1, 1, 3),
        (4, 6, 1, 1, 2),
    ]:
        for _ in range(12):
            weight = (torch.rand(1, num_log, generator=gen) ** 3 * 10).round()
            args = (num_phy, num_groups, num_nodes, num_gpus)
            best = brute_force_optimum(weight[0], *args)
            bound = float(lower_bound(weight, *args))
            assert bound <= best * (1 + 1e-6) + 1e-9
            tight += bound >= best * (1 - 1e-4)
            total += 1
    assert tight >= 0.8 * total, (tight, total)


def test_bound_holds_on_zipf_loads():
    """Both algorithms stay above the bound on 64 seeded layers of several shapes, and the bound
    is close: within 25% of the search on average."""
    gen = torch.Generator().manual_seed(7)
    for num_log, num_phy, num_groups, num_nodes, num_gpus in [
        (64, 72, 8, 4, 36),
        (64, 80, 8, 2, 16),
        (32, 40, 4, 4, 8),
        (16, 24, 1, 1, 12),
    ]:
        weight = zipf_weight(16, num_log, gen)
        args = (num_phy, num_groups, num_nodes, num_gpus)
        greedy, _, _ = rebalance_experts(weight, *args, method="greedy")
        found, _, _ = rebalance_experts(weight, *args)
        bound = lower_bound(weight, *args)
        for phy2log in (greedy, found):
            assert bool((bound <= max_load(weight, phy2log, num_gpus) * (1 + 1e-6)).all())
        assert float((max_load(weight, found, num_gpus) / bound).mean()) < 1.25
