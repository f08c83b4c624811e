"""The expert load of a skewed workload, as operators see it: a cluster of the trained `tiny`
model (2 prefill + 2 decode ranks) serves English text (Python's language reference topics,
whose routing the model learned to skew), then `GetExpertLoad` gives each pool's tokens per
expert slot, drawn as heatmaps the way `epcluster status --expert-load` draws them.

    .venv/bin/python -m bench.expert_load [--requests 48]
"""

import argparse
import asyncio
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # local Ray on loopback

from bench.common import RESULTS, record
from engine import SamplingParams


def prompts(n: int) -> list[str]:
    """n passages of English from pydoc_data.topics (what `help()` shows)."""
    import pydoc_data.topics as topics

    text = " ".join(topics.topics[k] for k in sorted(topics.topics))
    words = text.split()
    return [" ".join(words[i * 97 : i * 97 + 60]) for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--requests", type=int, default=48)
    args = ap.parse_args()
    from cluster.config import ClusterConfig
    from cluster.launcher import Cluster
    from cluster.plots import draw_expert_load
    from router.client import AsyncInferenceClient, InferenceClient

    config = ClusterConfig.load(
        None,
        {
            "model": "tiny",
            "ports.port": 0,
            "ports.http_port": 0,
            "ports.metrics_port": 0,  # beside a running epcluster
            "ports.rank_metrics_port": 0,
        },
    )
    with Cluster(config) as cluster:

        async def run() -> None:
            async with AsyncInferenceClient(cluster.address, timeout=600) as client:
                params = SamplingParams(max_tokens=32, temperature=0)
                await asyncio.gather(*(client.complete(p, params) for p in prompts(args.requests)))

        asyncio.run(run())
        with InferenceClient(cluster.address, timeout=60) as client:
            pools = client.expert_load()
    png = draw_expert_load(pools, RESULTS / "expert_load_tiny.png")
    summary = {}
    for pool in pools:
        per_rank = {
            str(layer): [round(n / (sum(row) or 1), 3) for n in row]
            for layer, row in sorted(pool.rank_tokens().items())
        }
        per_expert = {}
        for layer, row in sorted(pool.expert_tokens().items()):
            mean = sum(row) / len(row)
            ordered = sorted(row, reverse=True)
            per_expert[str(layer)] = {
                "max_over_mean": round(ordered[0] / mean, 2),
                "min_over_mean": round(ordered[-1] / mean, 2),
                "top2_share": round(sum(ordered[:2]) / sum(row), 3),
            }
        summary[pool.pool] = {"rank_share_per_layer": per_rank, "expert_skew_per_layer": per_expert}
        print(pool.pool, per_rank, per_expert)
    print(png)
    print(record("expert_load_tiny", {"requests": args.requests, "heatmap": png.name, **summary}))


if __name__ == "__main__":
    main()
