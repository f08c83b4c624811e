"""Which expert groups share a node (hierarchical placements).

Legend (kernels/__init__.py): L MoE layers, E logical experts, S physical slots, G expert groups,
ND nodes, R GPUs, GB blocks (sets of G / ND groups that may share a node), NP partitions of the
groups into ND blocks.

A node's GPUs serve only its own groups, so the node with the hot experts bounds the layer: by its
load, and by how thin its S / N slots can slice its hot experts. The greedy balances node loads
and ignores the second. Here each block is scored by the max GPU load of a quick placement of its
experts (replicate_experts' counts, packed by pack_rounds), and the partition whose worst block
scores best wins: over all partitions when there are few (105 for 8 groups on 4 nodes), else by
local search on node loads from the greedy's partition.
"""

import itertools
import math
from collections.abc import Generator

import torch

from moe.eplb.greedy import inverse_permutation, replicate_experts
from moe.eplb.search import local_search, pack_rounds

MAX_PARTITIONS = 1000


def pack_groups(
    weight: torch.Tensor,
    num_phy: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    node: torch.Tensor,
    pos: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [L, E]; the greedy's node, pos [L, G] -> (node, pos) [L, G]: group g goes to
    node[g] at place pos[g] (of G / N). Keeps the greedy's where nothing scores better."""
    num_layers = weight.shape[0]
    per_node = num_groups // num_nodes
    greedy = inverse_permutation(node * per_node + pos)  # [L, G]: node-major group order
    found = group_partitions(num_groups, per_node)
    if found is None:
        group_load = weight.view(num_layers, num_groups, -1).sum(dim=-1)  # [L, G]
        slot2group = local_search(group_load, greedy, num_nodes)
    else:
        blocks, partitions = found
        node_args = (num_phy // num_nodes, num_gpus // num_nodes)
        score = quick_max(block_weights(weight, num_groups, blocks), *node_args)  # [L, GB]
        worst = score[:, partitions].max(dim=-1).values  # [L, NP]
        best, pick = worst.min(dim=1)  # [L]
        own = block_weights(weight, num_groups, greedy.view(num_layers, num_nodes, per_node))
        greedy_worst = quick_max(own, *node_args).max(dim=1).values  # [L]
        chosen = blocks[partitions[pick]].flatten(1)  # [L, G]
        slot2group = torch.where((best < greedy_worst)[:, None], chosen, greedy)
    group2slot = inverse_permutation(slot2group)  # [L, G]
    return group2slot // per_node, group2slot % per_node


def group_partitions(num_groups: int, per_node: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Every split of the G groups into blocks of per_node (blocks unordered):
    (blocks [GB, G / ND] int64, partitions [NP, ND] int64 indices into blocks), or None when there
    are more than MAX_PARTITIONS."""
    count = math.prod(math.comb(n - 1, per_node - 1) for n in range(num_groups, 0, -per_node))
    if count > MAX_PARTITIONS:
        return None
    blocks = list(itertools.combinations(range(num_groups), per_node))
    index = {block: i for i, block in enumerate(blocks)}

    def split(rest: tuple[int, ...]) -> Generator[list[int], None, None]:
        if not rest:
            yield []
            return
        for mates in itertools.combinations(rest[1:], per_node - 1):
            left = tuple(g for g in rest[1:] if g not in mates)
            for tail in split(left):
                yield [index[(rest[0], *mates)], *tail]

    partitions = list(split(tuple(range(num_groups))))
    return torch.tensor(blocks), torch.tensor(partitions)


def block_weights(weight: torch.Tensor, num_groups: int, blocks: torch.Tensor) -> torch.Tensor:
    """weight [L, E], blocks [..., G / ND] group ids -> [L, ..., E / ND]: each block's expert
    loads, or with blocks [L, ND, G / ND] (one partition per layer) -> [L, ND, E / ND]."""
    num_layers = weight.shape[0]
    groups = weight.view(num_layers, num_groups, -1)  # [L, G, E / G]
    if blocks.dim() == 3 and blocks.shape[0] == num_layers:
        return groups[torch.arange(num_layers)[:, None, None], blocks].flatten(2)
    return groups[:, blocks].flatten(2)


def quick_max(rows: torch.Tensor, num_slots: int, num_gpus: int) -> torch.Tensor:
    """rows [..., n] -> [...]: the max GPU load of replicate_experts' counts packed by
    pack_rounds, on num_gpus GPUs with num_slots slots in all."""
    flat = rows.reshape(-1, rows.shape[-1]).double()
    _, counts = replicate_experts(flat, num_slots)
    return pack_rounds(flat, counts, num_gpus)[1].view(rows.shape[:-1])
