"""Expert-parallel load balancing: which experts get replicas, and which GPU holds each slot.

Legend (kernels/__init__.py): L MoE layers, E logical experts, S physical slots (replicas), G
expert groups, ND nodes,
R GPUs (ranks), X max replicas of one expert (or independent rows of a batched step).

Given the tokens each logical expert received, the greedy (DeepSeek's EPLB) gives the redundant
slots to the hottest experts, then packs the physical experts onto GPUs with the same number of
slots per GPU, heaviest first onto the lightest GPU. When the expert groups divide over the nodes
it first packs whole groups onto nodes (hierarchical: group-limited routing then keeps most traffic
inside a node); otherwise it packs globally.

The greedy's pieces live in moe.eplb.greedy. `rebalance_experts` (method "search", the default)
starts from the greedy and improves it: which groups share a node (moe.eplb.groups), then local
search on each node (moe.eplb.search: slot swaps between GPUs, moving a replica from one expert to
another, and new replica counts repacked). It keeps, layer by layer, whichever of the greedy and
the searched placements has the smaller largest GPU load, so it is never worse than the greedy.
moe.eplb.bound gives a lower bound for each layer; moe.eplb.moves rebalances under a budget of
moved slots.
"""

import torch

from moe.eplb.greedy import balanced_packing, inverse_permutation, replicate_experts
from moe.eplb.groups import pack_groups
from moe.eplb.search import count_search
from moe.placement import build_log2phy


def rebalance_hierarchical(
    weight: torch.Tensor,
    num_phy: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    search: bool = False,
    group_search: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [L, E] float -> (phy2log [L, S], logcnt [L, E]); S = num_phy.

    Slots are numbered GPU by GPU (S / R per GPU), and GPUs node by node (R / N per node).
    search: refine each node's slots by local search after the greedy packing; group_search:
    choose which groups share a node by moe.eplb.groups instead of the greedy's node loads.
    """
    num_layers, num_log = weight.shape
    assert num_log % num_groups == 0, (num_log, num_groups)
    assert num_groups % num_nodes == 0, (num_groups, num_nodes)
    assert num_gpus % num_nodes == 0, (num_gpus, num_nodes)
    assert num_phy % num_gpus == 0, (num_phy, num_gpus)
    group_size = num_log // num_groups
    groups_per_node = num_groups // num_nodes
    log_per_node, phy_per_node = num_log // num_nodes, num_phy // num_nodes
    phy_per_gpu = num_phy // num_gpus

    # Step 1: pack whole expert groups onto nodes. "Node-major" order numbers the logical
    # experts node by node; log2nm [L, E] maps a logical id to its node-major position.
    group_load = weight.view(num_layers, num_groups, group_size).sum(dim=-1)  # [L, G]
    node, pos = balanced_packing(group_load, num_nodes)  # [L, G]
    if group_search:
        node, pos = pack_groups(weight, num_phy, num_groups, num_nodes, num_gpus, node, pos)
    group_start = (node * groups_per_node + pos) * group_size  # [L, G]
    log2nm = (group_start[:, :, None] + torch.arange(group_size)).flatten(1)  # [L, E]
    nm2log = inverse_permutation(log2nm)  # [L, E]

    # Step 2: replicate the hottest experts within each node: one row per (layer, node).
    node_weight = weight.gather(1, nm2log).view(-1, log_per_node)  # [L * ND, E / ND]
    phy2nm, nm_cnt = replicate_experts(node_weight, phy_per_node)  # [L * ND, S / ND]

    # Step 3: pack each node's physical experts onto its GPUs, by load per replica.
    phy_load = (node_weight / nm_cnt).gather(1, phy2nm)  # [L * ND, S / ND]
    gpu, pos = balanced_packing(phy_load, num_gpus // num_nodes)  # [L * ND, S / ND]
    packed2phy = inverse_permutation(
        gpu * phy_per_gpu + pos
    )  # [L * ND, S / ND]: slot -> physical expert
    slot2nm = phy2nm.gather(1, packed2phy)  # [L * ND, S / ND]: slot -> node-local expert
    if search:
        slot2nm = count_search(node_weight, slot2nm, num_gpus // num_nodes)
        nm_cnt = torch.zeros_like(nm_cnt).scatter_add_(1, slot2nm, torch.ones_like(slot2nm))

    node_base = torch.arange(num_nodes)[None, :, None] * log_per_node  # [1, ND, 1]
    slot2nm = slot2nm.view(num_layers, num_nodes, -1) + node_base
    phy2log = nm2log.gather(1, slot2nm.flatten(1))  # [L, S]
    logcnt = nm_cnt.view(num_layers, -1).gather(1, log2nm)  # [L, E]
    return phy2log, logcnt


def rebalance_experts(
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    method: str = "search",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The placement for the observed load.

    weight [L, E]: tokens per logical expert (any float or int dtype). num_replicas: S physical
    slots, a multiple of num_gpus. num_groups: the gate's expert groups (n_group).
    method: "greedy" (DeepSeek's EPLB) or "search" (the greedy refined by local search; per layer
    never a larger max GPU load than "greedy").
    Returns phy2log [L, S], log2phy [L, E, X] (each expert's slots ascending, -1 padded) and
    logcnt [L, E], all int64 on CPU.
    """
    num_layers, num_log = weight.shape
    assert num_replicas >= num_log, (num_replicas, num_log)
    assert num_replicas % num_gpus == 0, (num_replicas, num_gpus)
    assert method in ("greedy", "search"), method
    weight = weight.float().cpu()
    if num_groups % num_nodes != 0:
        num_groups, num_nodes = 1, 1  # global policy
    policy = (num_replicas, num_groups, num_nodes, num_gpus)
    phy2log, _ = rebalance_hierarchical(weight, *policy)
    if method == "search":
        for group_search in (False, True) if num_nodes > 1 else (False,):
            found, _ = rebalance_hierarchical(weight, *policy, True, group_search)
            phy2log = better_placement(weight, phy2log, found, num_gpus)
    log2phy, logcnt = build_log2phy(phy2log, num_log)
    return phy2log, log2phy, logcnt


def better_placement(
    weight: torch.Tensor, phy2log: torch.Tensor, other: torch.Tensor, num_gpus: int
) -> torch.Tensor:
    """weight [L, E], phy2log [L, S], other [L, S] -> [L, S]: per layer `other` where its max GPU
    load is strictly smaller, else phy2log."""
    best = gpu_loads(weight, phy2log, num_gpus).max(dim=1).values  # [L]
    new = gpu_loads(weight, other, num_gpus).max(dim=1).values  # [L]
    return torch.where((new < best)[:, None], other, phy2log)


def gpu_loads(weight: torch.Tensor, phy2log: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """weight [L, E], phy2log [L, S] -> [L, R]: the load each GPU gets when every expert's
    tokens split evenly over its replicas."""
    num_layers, num_log = weight.shape
    logcnt = torch.zeros(num_layers, num_log).scatter_add_(
        1, phy2log, torch.ones(phy2log.shape)
    )  # [L, E]
    per_slot = (weight.float() / logcnt).gather(1, phy2log)  # [L, S]
    return per_slot.view(num_layers, num_gpus, -1).sum(dim=-1)
