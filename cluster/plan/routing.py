"""Routing statistics as an input of the cost model: tokens per expert per layer (as a running
cluster counts them, or any measured or assumed load) -> the EPLB imbalance of an EP size,
max / mean tokens per rank after DeepSeek's EPLB places the experts and their redundant copies
(moe/eplb/, the placement the cluster itself runs).

File format (JSON): {"tokens_per_expert": [[...E numbers...], ...one list per MoE layer]}, or
one list of E numbers for every layer. Legend: L MoE layers, E experts, R ranks, S slots.
"""

import json
from pathlib import Path

import torch

from moe.eplb import gpu_loads, rebalance_experts


def load_expert_tokens(path: str | Path, num_experts: int) -> torch.Tensor:
    """-> [L, E] float tokens per expert (L = 1 when the file gives one list)."""
    raw = json.loads(Path(path).read_text())
    rows = raw["tokens_per_expert"] if isinstance(raw, dict) else raw
    weight = torch.tensor(rows, dtype=torch.float64)
    if weight.dim() == 1:
        weight = weight[None]
    if weight.dim() != 2 or weight.shape[1] != num_experts or (weight < 0).any():
        raise ValueError(
            f"{path}: tokens_per_expert must be [layers][{num_experts}] non-negative numbers "
            f"(got shape {tuple(weight.shape)})"
        )
    if (weight.sum(dim=1) == 0).any():
        raise ValueError(f"{path}: a layer with no tokens")
    return weight


def eplb_imbalance(
    weight: torch.Tensor, ranks: int, redundant: int, n_group: int, gpus_per_node: int
) -> float:
    """weight [L, E] -> the mean over layers of max / mean rank load after EPLB (greedy) places
    E + redundant slots on `ranks` ranks; 1 for one rank. Every MoE layer waits for its busiest
    rank, so the mean of the per-layer ratios is what a step pays."""
    if ranks == 1:
        return 1.0
    num_experts = weight.shape[1]
    slots = num_experts + redundant
    assert slots % ranks == 0, (slots, ranks)  # [S] spread evenly: S / R slots per rank
    nodes = max(1, ranks // gpus_per_node)
    phy2log, _, _ = rebalance_experts(weight, slots, n_group, nodes, ranks, method="greedy")
    loads = gpu_loads(weight, phy2log, ranks)  # [L, R]
    return float((loads.max(dim=1).values / loads.mean(dim=1)).mean())
