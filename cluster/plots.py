"""Pictures for operators: the expert load of every pool as heatmaps (matplotlib, no display).

For each pool two panels: the share of each MoE layer's routed tokens that each rank computed
(what sets a step's pace: the busiest rank), and that each logical expert received (what a
re-placement can spread). A uniform load is 1/R and 1/E everywhere.
"""

from pathlib import Path

from engine.messages import PoolLoad


def draw_expert_load(pools: list[PoolLoad], path: str | Path) -> Path:
    """Write the heatmaps of `pools` to `path` (PNG); -> the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    pools = [p for p in pools if p.layers]
    fig, axes = plt.subplots(len(pools), 2, figsize=(12, 1.2 + 0.9 * len(pools) * 3), squeeze=False)
    for row, pool in enumerate(pools):
        layers = sorted(pool.layers)
        for col, (title, table) in enumerate(
            (("rank", pool.rank_tokens()), ("logical expert", pool.expert_tokens()))
        ):
            shares = []
            for layer in layers:
                total = sum(table[layer]) or 1
                shares.append([n / total for n in table[layer]])
            ax = axes[row][col]
            image = ax.imshow(shares, aspect="auto", cmap="viridis", vmin=0)
            ax.set_yticks(range(len(layers)), [str(layer) for layer in layers])
            width = len(shares[0]) if shares else 0
            ax.set_xticks(range(0, width, max(1, width // 16)))
            ax.set_ylabel("MoE layer")
            ax.set_xlabel(title)
            tokens = sum(sum(table[layer]) for layer in layers) // max(len(layers), 1)
            worst = max(max(s) * len(s) for s in shares) if shares else 0.0
            ax.set_title(
                f"{pool.pool}: share of routed tokens per {title} "
                f"({tokens} per layer; busiest {worst:.2f}x the mean)",
                fontsize=9,
            )
            fig.colorbar(image, ax=ax, fraction=0.04)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
