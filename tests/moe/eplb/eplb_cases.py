"""Shared by the eplb tests: seeded Zipf loads, the validity check and a brute-force optimum."""

import torch

from moe.eplb import gpu_loads


def zipf_weight(
    num_layers: int, num_experts: int, gen: torch.Generator, skew: tuple[float, float] = (0.4, 1.5)
) -> torch.Tensor:
    """[L, E] float32: per layer, expert i gets 1 / rank_i ** s (rank_i a random permutation of
    1..E, s uniform in `skew`), scaled to a random total of 1e3 to 1e5 tokens."""
    rows = []
    for _ in range(num_layers):
        s = skew[0] + (skew[1] - skew[0]) * float(torch.rand(1, generator=gen))
        ranks = torch.randperm(num_experts, generator=gen).double() + 1
        row = 1 / ranks**s
        rows.append(row / row.sum() * 10 ** (3 + 2 * float(torch.rand(1, generator=gen))))
    return torch.stack(rows).float()


def max_load(weight: torch.Tensor, phy2log: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """[L]: the largest GPU load of each layer."""
    return gpu_loads(weight, phy2log, num_gpus).max(dim=1).values


def assert_valid(
    phy2log: torch.Tensor,
    log2phy: torch.Tensor,
    logcnt: torch.Tensor,
    num_log: int,
    num_gpus: int,
    num_groups: int = 1,
    num_nodes: int = 1,
) -> None:
    """Every expert has a slot, GPUs hold S / R slots each, the three maps agree, and in a
    hierarchical placement every group sits on one node, G / N groups a node."""
    num_layers, num_phy = phy2log.shape
    assert phy2log.dtype == log2phy.dtype == logcnt.dtype == torch.int64
    assert num_phy % num_gpus == 0  # slot s is on GPU s // (S / R): S / R slots each
    assert logcnt.shape == (num_layers, num_log) and bool((logcnt >= 1).all())
    assert logcnt.sum(dim=1).tolist() == [num_phy] * num_layers
    counted = torch.zeros(num_layers, num_log, dtype=torch.int64)
    counted.scatter_add_(1, phy2log, torch.ones_like(phy2log))
    assert torch.equal(counted, logcnt)
    replica = torch.arange(log2phy.shape[2])
    filled = replica[None, None, :] < logcnt[:, :, None]  # [L, E, X]
    assert bool((log2phy[~filled] == -1).all())
    slots = log2phy.clamp(min=0)
    owner = phy2log.gather(1, slots.flatten(1)).view_as(slots)
    expert = torch.arange(num_log)[None, :, None].expand_as(slots)
    assert torch.equal(owner[filled], expert[filled])  # every listed slot holds its expert
    assert bool((log2phy[:, :, 1:] > log2phy[:, :, :-1])[filled[:, :, 1:]].all())  # ascending
    if num_nodes > 1 and num_groups % num_nodes == 0:
        group_size = num_log // num_groups
        node = (torch.arange(num_phy) // (num_phy // num_nodes)).expand(num_layers, -1)
        group = phy2log // group_size
        first = torch.full((num_layers, num_groups), num_nodes).scatter_reduce(
            1, group, node, "amin"
        )
        last = torch.full((num_layers, num_groups), -1).scatter_reduce(1, group, node, "amax")
        assert torch.equal(first, last)
        per_node = torch.zeros(num_layers, num_nodes, dtype=torch.int64)
        per_node.scatter_add_(1, first, torch.ones_like(first))
        assert bool((per_node == num_groups // num_nodes).all())


def brute_force_optimum(
    weight: torch.Tensor, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int
) -> float:
    """The least max GPU load over every phy2log of one layer (weight [E]); E ** S candidates,
    so tiny shapes only. Hierarchical when num_groups % num_nodes == 0 and num_nodes > 1: each
    group on one node, G / N groups a node (the policy of rebalance_experts)."""
    num_log = weight.shape[0]
    seqs = torch.cartesian_prod(*[torch.arange(num_log)] * num_phy).view(-1, num_phy)
    cnt = torch.zeros(len(seqs), num_log).scatter_add_(1, seqs, torch.ones(seqs.shape))
    keep = (cnt >= 1).all(dim=1)
    if num_nodes > 1 and num_groups % num_nodes == 0:
        group = seqs // (num_log // num_groups)
        node = (torch.arange(num_phy) // (num_phy // num_nodes)).expand_as(seqs)
        first = torch.full((len(seqs), num_groups), num_nodes).scatter_reduce(
            1, group, node, "amin"
        )
        last = torch.full((len(seqs), num_groups), -1).scatter_reduce(1, group, node, "amax")
        keep &= (first == last).all(dim=1)  # each group on one node (and present: cnt >= 1)
        per_node = torch.zeros(len(seqs), num_nodes).scatter_add_(
            1, first.clamp(max=num_nodes - 1), torch.ones(first.shape)
        )
        keep &= (per_node == num_groups // num_nodes).all(dim=1)
    seqs, cnt = seqs[keep], cnt[keep]
    per_slot = (weight.double()[None] / cnt.double()).gather(1, seqs)
    return float(per_slot.view(len(seqs), num_gpus, -1).sum(dim=-1).max(dim=1).values.min())
