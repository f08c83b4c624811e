"""Expert load balancing: imbalance (max GPU load / mean) of the greedy (DeepSeek's EPLB), the
local search and the lower bound, their run times, and the moves-budget trade-off.

    .venv/bin/python -m bench.eplb [--layers 58] [--skews 0.4 0.8 1.0 1.2 1.5] [--seed 0]

Loads: in each layer expert i gets 1 / rank_i ** s, rank_i a random permutation (seeded) per
layer. (In the global policy every layer is then the same problem up to relabeling; in the
hierarchical one the groups differ.) Imbalance is averaged over the layers; "worst" is the
largest layer. One torch thread. The trade-off: the placement of rebalance_experts for one load,
then the load drifts (each expert times exp(0.5 N(0, 1))), then rebalance_experts_with_moves
at several budgets of slots moved per layer. Writes bench/results/eplb.json and, with
matplotlib (the `bench` extra), bench/results/eplb_moves.png.
"""

import argparse
import time

import torch

from bench.common import RESULTS, record
from moe.eplb import (
    align_placement,
    count_moves,
    gpu_loads,
    rebalance_experts,
    rebalance_experts_with_moves,
)
from moe.eplb.bound import lower_bound

SHAPES = [  # (name, E, S, G, N, R)
    ("V3 prefill EP32, hierarchical", 256, 288, 8, 4, 32),
    ("V3 decode EP144, hierarchical", 256, 288, 8, 4, 144),
    ("V3 prefill EP32, global", 256, 288, 1, 1, 32),
    ("V3 decode EP144, global", 256, 288, 1, 1, 144),
    ("64 experts EP16, hierarchical", 64, 80, 8, 2, 16),
    ("32 experts EP8, global", 32, 48, 1, 1, 8),
]
MOVE_SHAPES = [0, 1, 3]  # indices into SHAPES for the trade-off curve
BUDGETS = [0, 1, 2, 4, 8, 16, 32, 64, 128, 288]


def zipf_loads(num_layers: int, num_experts: int, skew: float, seed: int) -> torch.Tensor:
    """[L, E] float32: 1 / rank ** skew, ranks a seeded random permutation per layer, x 1e4."""
    gen = torch.Generator().manual_seed(seed)
    base = 1 / torch.arange(1, num_experts + 1, dtype=torch.float64) ** skew
    rows = [base[torch.randperm(num_experts, generator=gen)] for _ in range(num_layers)]
    return (torch.stack(rows) / base.sum() * 1e4).float()


def imbalance(weight: torch.Tensor, phy2log: torch.Tensor, num_gpus: int) -> torch.Tensor:
    """[L]: max GPU load / mean GPU load."""
    loads = gpu_loads(weight, phy2log, num_gpus)
    return loads.max(dim=1).values / loads.mean(dim=1)


def timed(fn, *args, **kwargs):
    start = time.perf_counter()
    out = fn(*args, **kwargs)
    return out, time.perf_counter() - start


def compare(weight: torch.Tensor, num_phy: int, num_groups: int, num_nodes: int, num_gpus: int):
    """Greedy vs search vs bound on one load: a result row."""
    args = (num_phy, num_groups, num_nodes, num_gpus)
    (greedy, _, _), t_greedy = timed(rebalance_experts, weight, *args, method="greedy")
    (found, _, _), t_search = timed(rebalance_experts, weight, *args)
    ratio_greedy, ratio_search = (
        imbalance(weight, greedy, num_gpus),
        imbalance(weight, found, num_gpus),
    )
    peak = gpu_loads(weight, found, num_gpus).max(dim=1).values
    bound, t_bound = timed(lower_bound, weight, *args, upper=peak)
    ratio_bound = bound / (weight.double().sum(dim=1) / num_gpus)
    gap = (ratio_greedy - ratio_bound).clamp(min=1e-12)
    assert bool((ratio_search <= ratio_greedy).all()) and bool(
        (ratio_bound <= ratio_search + 1e-5).all()
    )
    return {
        "greedy": round(float(ratio_greedy.mean()), 4),
        "search": round(float(ratio_search.mean()), 4),
        "bound": round(float(ratio_bound.mean()), 4),
        "greedy_worst": round(float(ratio_greedy.max()), 4),
        "search_worst": round(float(ratio_search.max()), 4),
        "layers_improved": int((ratio_search < ratio_greedy * (1 - 1e-6)).sum()),
        "gap_closed": round(float(((ratio_greedy - ratio_search) / gap).mean()), 3),
        "greedy_s": round(t_greedy, 3),
        "search_s": round(t_search, 3),
        "bound_s": round(t_bound, 3),
    }


def tradeoff(shape: tuple, num_layers: int, skew: float, seed: int) -> dict:
    """Imbalance against slots moved per layer, after the load drifts away from the placement."""
    name, num_log, num_phy, num_groups, num_nodes, num_gpus = shape
    args = (num_groups, num_nodes, num_gpus)
    old = zipf_loads(num_layers, num_log, skew, seed)
    current, _, _ = rebalance_experts(old, num_phy, *args)
    gen = torch.Generator().manual_seed(seed + 1)
    weight = old * torch.exp(0.5 * torch.randn(old.shape, generator=gen))
    nodes = num_nodes if num_groups % num_nodes == 0 else 1
    points = []
    for budget in BUDGETS:
        (phy2log, _, _), seconds = timed(
            rebalance_experts_with_moves, weight, current, budget, *args
        )
        moves = count_moves(current, phy2log)
        assert bool((moves <= budget).all())
        points.append(
            {
                "budget": budget,
                "moves": round(float(moves.float().mean()), 2),
                "imbalance": round(float(imbalance(weight, phy2log, num_gpus).mean()), 4),
                "seconds": round(seconds, 3),
            }
        )
    full = {}
    for method in ("greedy", "search"):
        phy2log, _, _ = rebalance_experts(weight, num_phy, *args, method=method)
        aligned = align_placement(phy2log, current, num_gpus, nodes)
        full[method] = {
            "moves": round(float(count_moves(current, aligned).float().mean()), 2),
            "imbalance": round(float(imbalance(weight, aligned, num_gpus).mean()), 4),
        }
    return {"shape": name, "skew": skew, "points": points, "from_scratch": full}


def plot(curves: list[dict], path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, curve in enumerate(curves):
        color = f"C{i}"
        moves = [p["moves"] for p in curve["points"]]
        ratio = [p["imbalance"] for p in curve["points"]]
        ax.plot(moves, ratio, "o-", color=color, label=curve["shape"])
        for method, marker in (("greedy", "x"), ("search", "*")):
            point = curve["from_scratch"][method]
            ax.plot(point["moves"], point["imbalance"], marker, color=color, markersize=10)
    ax.set_xscale("symlog", linthresh=1)
    ax.set_xlabel("slots moved per layer (mean over layers)")
    ax.set_ylabel("imbalance: max GPU load / mean")
    skew = curves[0]["skew"]
    ax.set_title(f"Moves budget after load drift, Zipf s = {skew} (x greedy, * search: all new)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--layers", type=int, default=58)
    ap.add_argument("--skews", type=float, nargs="+", default=[0.4, 0.8, 1.0, 1.2, 1.5])
    ap.add_argument("--move-skew", type=float, default=0.8)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(1)

    rows = []
    for name, num_log, num_phy, num_groups, num_nodes, num_gpus in SHAPES:
        for skew in args.skews:
            weight = zipf_loads(args.layers, num_log, skew, args.seed)
            row = {
                "shape": name,
                "experts": num_log,
                "slots": num_phy,
                "groups": num_groups,
                "nodes": num_nodes,
                "gpus": num_gpus,
                "skew": skew,
            }
            row.update(compare(weight, num_phy, num_groups, num_nodes, num_gpus))
            print(row, flush=True)
            rows.append(row)
    curves = []
    for index in MOVE_SHAPES:
        curves.append(tradeoff(SHAPES[index], args.layers, args.move_skew, args.seed))
        print(curves[-1], flush=True)
    png = RESULTS / "eplb_moves.png"
    plotted = plot(curves, png)
    print(
        record(
            "eplb",
            {
                "layers": args.layers,
                "loads": "Zipf: 1 / rank ** skew, a seeded random permutation per layer",
                "imbalance": "max GPU load / mean, mean over layers (worst: the largest layer)",
                "gap_closed": "(greedy - search) / (greedy - bound), mean over layers",
                "drift": "moves curve: placed for a load, then each expert x exp(0.5 N(0, 1))",
                "comparison": rows,
                "moves_tradeoff": curves,
                "plot": png.name if plotted else None,
            },
        )
    )


if __name__ == "__main__":
    main()
