"""A live rebalance on the Ray cluster: router + EP = 2 prefill and decode pools of `--model`
stream a skewed workload (prompts drawn from six tokens: their routing piles onto a few experts)
twice, undisturbed and with a Rebalance of both pools asked for once a quarter of the tokens
have arrived. Every stream must equal the undisturbed one, token for token. Reported: each
pool's outcome (slots moved, predicted balancedness), the measured balancedness (mean over MoE
layers of mean rank load / max rank load) of the same workload on the old and on the new
placement, the Rebalance call's duration, and the longest gap between two tokens of a stream
in each run (the pause a client saw).

    .venv/bin/python -m bench.eplb_cluster [--model small] [--requests 16]
"""

import argparse
import asyncio
import os
import threading
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # local Ray on loopback

import torch

from bench.common import record
from bench.recovery import max_gap, spread, stream_all


def skewed_workload(num: int, vocab: int, seed: int) -> list[tuple[list[int], int]]:
    gen = torch.Generator().manual_seed(seed)
    alphabet = torch.randint(2, vocab, (6,), generator=gen)
    return [
        (alphabet[torch.randint(0, 6, (int(torch.randint(64, 257, (1,), generator=gen)),),
                                generator=gen)].tolist(),
         int(torch.randint(64, 129, (1,), generator=gen)))
        for _ in range(num)
    ]  # fmt: skip


def quiet(client, timeout: float = 120.0) -> None:
    """Until no request is in flight and no pool is moving experts."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        status = client.cluster_status()
        moving = any(r.rebalance and r.rebalance.moving for p in status.pools for r in p.ranks)
        if status.num_in_flight == 0 and not moving:
            return
        time.sleep(0.1)
    raise TimeoutError("the cluster did not go quiet")


def measured(client, run) -> dict[str, float]:
    """Balancedness per pool of the load `run()` adds."""
    mark = client.expert_load()
    run()
    return {a.pool: round(a.since(b).balancedness(), 3) for b, a in zip(mark, client.expert_load())}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="small")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from cluster.config import ClusterConfig
    from cluster.launcher import Cluster
    from moe import ModelConfig, resolve_model_path
    from router.client import InferenceClient

    vocab = ModelConfig.from_file(resolve_model_path(args.model)).vocab_size
    requests = skewed_workload(args.requests, vocab, args.seed)
    tokens = sum(n for _, n in requests)
    config = ClusterConfig.load(
        None,
        {
            "model": args.model,
            "ports.port": 0,
            "ports.http_port": 0,
            "ports.metrics_port": 0,  # beside a running epcluster
            "ports.rank_metrics_port": 0,
            "prefill.num_ranks": 2,
            "decode.num_ranks": 2,
            "engine.eplb_min_gain": 0.0,
            # every run prefills for real: the prefill pool's load too
            "engine.enable_prefix_caching": False,
        },
    )
    with Cluster(config) as cluster, InferenceClient(cluster.address, timeout=600) as client:
        asyncio.run(stream_all(cluster.address, requests))  # warm-up
        base_box = {}
        before = measured(
            client, lambda: base_box.update(r=asyncio.run(stream_all(cluster.address, requests)))
        )
        base = base_box["r"][0]
        quiet(client)

        outcome: dict = {}

        def rebalance() -> None:
            start = time.monotonic()
            outcome["pools"] = client.rebalance()
            outcome["call_s"] = time.monotonic() - start

        thread = threading.Thread(target=rebalance)
        hit, _ = asyncio.run(stream_all(cluster.address, requests, thread.start, tokens // 4))
        thread.join(600)
        quiet(client)
        after = measured(client, lambda: asyncio.run(stream_all(cluster.address, requests)))

    exact = [b[0] for b in base] == [h[0] for h in hit]
    assert exact, "a stream differs from the undisturbed run"
    pools = {
        pool: {
            "outcome": s.outcome,
            "slots_moved": s.slots_moved,
            "from_checkpoint": s.from_checkpoint,
            "predicted_balancedness": [
                round(s.balancedness_before, 3),
                round(s.balancedness_after, 3),
            ],
        }
        for pool, s in outcome["pools"]
    }
    base_gaps = [max_gap(t) for _, t in base]
    hit_gaps = [max_gap(t) for _, t in hit]
    result = {
        "model": args.model,
        "requests": args.requests,
        "output_tokens": tokens,
        "streams_identical_to_undisturbed_run": exact,
        "rebalance": pools,
        "measured_balancedness_old_placement": before,
        "measured_balancedness_new_placement": after,
        "rebalance_call_s": round(outcome["call_s"], 2),
        "longest_token_gap_s": spread(base_gaps, hit_gaps, "with_rebalance"),
    }
    for key, value in result.items():
        print(f"{key}: {value}")
    print(record(f"eplb_cluster_{args.model}", result))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
