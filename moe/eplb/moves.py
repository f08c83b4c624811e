"""Rebalancing under a budget of moved slots: every slot whose expert changes costs a weight
transfer, so from the placement the cluster has now, change few slots.

Legend (kernels/__init__.py): L MoE layers, E logical experts, S physical slots, R GPUs (ranks),
ND nodes, k = S / R slots per GPU.

A slot "moves" when its logical expert changes. Relabeling GPUs (or whole nodes, in a
hierarchical placement) and reordering a GPU's slots change no load, so a new placement is first
aligned to the current one (`align_placement`) before its moves are counted.
"""

import torch

from moe.eplb.rebalance import gpu_loads, rebalance_experts
from moe.eplb.search import local_search
from moe.placement import build_log2phy


def count_moves(current: torch.Tensor, phy2log: torch.Tensor) -> torch.Tensor:
    """current, phy2log [L, S] -> [L] int64: the slots whose logical expert differs."""
    return (current != phy2log).sum(dim=1)


def rebalance_experts_with_moves(
    weight: torch.Tensor,
    current: torch.Tensor,
    max_moves: int | torch.Tensor,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The best placement found that differs from `current` in at most max_moves slots per layer.

    weight [L, E]: tokens per logical expert. current [L, S] int64: the placement now (every
    expert has a slot). max_moves: int or [L]. Per layer the result is the best (smallest max GPU
    load, then fewest moves) of: current (0 moves); local search from current (moe.eplb.search)
    with the budget; and rebalance_experts' placement aligned to current, when its moves fit.
    So it is never worse than current, and with max_moves >= S never worse than
    rebalance_experts (up to float rounding: aligning reorders each GPU's sum).
    Hierarchical policy (num_groups % num_nodes == 0): the local search keeps each expert on its
    node, in the layers where current already does (in the others it moves them freely).
    Returns phy2log [L, S], log2phy [L, E, X], logcnt [L, E] int64, like rebalance_experts.
    """
    num_layers, num_log = weight.shape
    num_slots = current.shape[1]
    assert current.shape[0] == num_layers and num_slots % num_gpus == 0, (current.shape, num_gpus)
    weight = weight.float().cpu()
    current = current.long().cpu()
    budget = torch.as_tensor(max_moves, dtype=torch.int64).expand(num_layers).clone()
    assert bool((budget >= 0).all()), budget
    if not bool(budget.any()):
        return current, *build_log2phy(current, num_log)
    nodes = num_nodes if num_groups % num_nodes == 0 else 1
    expert_node, rank_node = _node_constraint(current, num_log, num_gpus, nodes)
    searched = local_search(
        weight,
        current,
        num_gpus,
        expert_node=expert_node,
        rank_node=rank_node,
        reference=current,
        max_moves=budget,
    )
    target, _, _ = rebalance_experts(weight, num_slots, num_groups, num_nodes, num_gpus)
    target = align_placement(target, current, num_gpus, nodes)
    candidates = torch.stack([current, searched, target], dim=1)  # [L, 3, S]
    moves = (candidates != current[:, None, :]).sum(dim=-1)  # [L, 3]
    peak = (
        gpu_loads(weight.repeat_interleave(3, dim=0), candidates.flatten(0, 1), num_gpus)
        .max(dim=1)
        .values.view(num_layers, 3)
    )  # [L, 3]
    peak = torch.where(moves <= budget[:, None], peak, torch.inf)
    best = _lexicographic_argmin(peak, moves)  # [L]: smallest peak, then fewest moves
    phy2log = candidates[torch.arange(num_layers), best]
    log2phy, logcnt = build_log2phy(phy2log, num_log)
    return phy2log, log2phy, logcnt


def _lexicographic_argmin(first: torch.Tensor, second: torch.Tensor) -> torch.Tensor:
    """first, second [L, C] -> [L]: argmin of first, ties broken by the smaller second."""
    least = first.min(dim=1, keepdim=True).values
    return torch.where(first == least, second, torch.iinfo(second.dtype).max).argmin(dim=1)


def _node_constraint(
    current: torch.Tensor, num_log: int, num_gpus: int, num_nodes: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert_node [L, E], rank_node [L, R]) for local_search: each expert's node in the layers
    where all its slots share one node; zeros (no constraint) in the other layers."""
    num_layers, num_slots = current.shape
    slot_node = torch.arange(num_slots) // (num_slots // num_nodes)  # [S]
    rank_node = (torch.arange(num_gpus) // (num_gpus // num_nodes)).expand(num_layers, -1)
    nodes = slot_node.expand(num_layers, -1)
    first = torch.full((num_layers, num_log), num_nodes).scatter_reduce(1, current, nodes, "amin")
    last = torch.full((num_layers, num_log), -1).scatter_reduce(1, current, nodes, "amax")
    consistent = (first == last).all(dim=1, keepdim=True)  # [L, 1]
    expert_node = torch.where(consistent, first, 0)
    return expert_node, torch.where(consistent, rank_node, 0)


def align_placement(
    phy2log: torch.Tensor, current: torch.Tensor, num_gpus: int, num_nodes: int = 1
) -> torch.Tensor:
    """Relabel the nodes, the GPUs within each node and the slots within each GPU of phy2log
    [L, S] so that many slots keep current's [L, S] expert; every GPU keeps its load.

    Greedy matching: the node pairs, then the GPU pairs within matched nodes, that share the most
    experts first; then within each GPU the slots that can keep their expert do.
    """
    num_layers, num_slots = phy2log.shape
    k = num_slots // num_gpus
    per_node = num_gpus // num_nodes
    new = phy2log.view(num_layers, num_gpus, k)
    cur = current.view(num_layers, num_gpus, k)
    # shared[l, a, b]: slots of new GPU a whose expert is also on current GPU b
    shared = (new[:, :, None, :, None] == cur[:, None, :, None, :]).any(-1).sum(-1)  # [L, R, R]
    node_shared = shared.view(num_layers, num_nodes, per_node, num_nodes, per_node).sum((2, 4))
    node_of = _greedy_match(node_shared)  # [L, ND]: new node -> current node
    gpu_of = torch.empty(num_layers, num_gpus, dtype=torch.int64)  # new GPU -> current GPU
    local = torch.arange(per_node)
    for node in range(num_nodes):
        rows = node * per_node + local  # new GPUs of this node
        cols = node_of[:, node, None] * per_node + local  # [L, R/ND]: their current GPUs
        sub = shared[:, rows].gather(2, cols[:, None, :].expand(-1, per_node, -1))
        gpu_of[:, rows] = cols.gather(1, _greedy_match(sub))
    moved = torch.empty_like(new)
    moved.scatter_(1, gpu_of[:, :, None].expand(-1, -1, k), new)  # [L, R, k] at current GPUs
    return _align_slots(moved, cur).view(num_layers, num_slots)


def _greedy_match(score: torch.Tensor) -> torch.Tensor:
    """score [L, n, n] -> [L, n]: a permutation per layer, row a -> column, taking the largest
    remaining score first."""
    num_layers, n, _ = score.shape
    score = score.double().clone()
    match = torch.empty(num_layers, n, dtype=torch.int64)
    layers = torch.arange(num_layers)
    for _ in range(n):
        flat = score.view(num_layers, -1).argmax(dim=1)
        row, col = flat // n, flat % n
        match[layers, row] = col
        score[layers, row, :] = -torch.inf
        score[layers, :, col] = -torch.inf
    return match


def _align_slots(new: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
    """new, cur [L, R, k] -> new with each GPU's slots reordered to keep cur's expert where it
    can."""
    k = new.shape[-1]
    same = new[..., :, None] == cur[..., None, :]  # [L, R, k_new, k_cur]
    pick = torch.full_like(new, -1)  # pick[..., j]: the new slot placed at position j
    used = torch.zeros_like(new, dtype=torch.bool)
    for j in range(k):
        can = same[..., j] & ~used  # [L, R, k]
        has = can.any(dim=-1)
        i = can.long().argmax(dim=-1)
        pick[..., j] = torch.where(has, i, -1)
        used |= torch.nn.functional.one_hot(i, k).bool() & has[..., None]
    # the rest, in order: unused new slots into the positions nothing kept
    unused = torch.sort(used.long(), dim=-1, stable=True).indices  # unused slots first
    free_rank = ((pick == -1).long().cumsum(dim=-1) - 1).clamp(min=0)
    pick = torch.where(pick == -1, unused.gather(-1, free_rank), pick)
    return new.gather(-1, pick)
