"""The cluster (gRPC router + Ray prefill and decode pools) against the in-process engine on the
same fixed workload, in one run: output tokens/s of each and the ratio.

    .venv/bin/python -m bench.cluster_vs_engine [--model tiny-random] [--requests 48] [--profile]

All requests are submitted at once (greedy, EOS ignored). The engine gets 2 torch threads (the
machine's cores); each cluster rank 1 thread, so the 4 ranks share the same 2 cores.
--profile samples the ranks with py-spy if it is installed, to say where the time goes.
"""

import argparse
import asyncio
import os
import time

import torch

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # local Ray on loopback

from bench.common import record, run_engine, workload
from engine import SamplingParams


def run_cluster(model: str, requests, prefill: int, decode: int) -> tuple[float, dict]:
    from cluster.config import ClusterConfig
    from cluster.launcher import Cluster
    from router.client import AsyncInferenceClient

    config = ClusterConfig.load(
        None,
        {
            "model": model,
            "ports.port": 0,
            "ports.http_port": 0,
            "ports.metrics_port": 0,  # beside a running epcluster
            "ports.rank_metrics_port": 0,
            "prefill.num_ranks": prefill,
            "decode.num_ranks": decode,
        },
    )
    with Cluster(config) as cluster:

        async def run() -> tuple[float, list]:
            async with AsyncInferenceClient(cluster.address, timeout=3600) as client:
                await client.complete([3, 4, 5], SamplingParams(max_tokens=2))  # warm-up
                start = time.perf_counter()
                outs = await asyncio.gather(
                    *(
                        client.complete(
                            p, SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
                        )
                        for p, n in requests
                    )
                )
                return time.perf_counter() - start, outs

        elapsed, outs = asyncio.run(run())
    assert [o.num_completion_tokens for o in outs] == [n for _, n in requests]
    return elapsed, {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny-random")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--prefill-ranks", type=int, default=2)
    ap.add_argument("--decode-ranks", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_num_threads(2)
    from moe import ModelConfig, resolve_model_path

    vocab = ModelConfig.from_file(resolve_model_path(args.model)).vocab_size
    requests = workload(args.requests, (16, 256), (16, 128), vocab, args.seed)
    tokens = sum(n for _, n in requests)
    engine_s = run_engine(args.model, requests)
    print(f"engine:  {tokens} tokens in {engine_s:.1f} s = {tokens / engine_s:.1f} tok/s")
    cluster_s, _ = run_cluster(args.model, requests, args.prefill_ranks, args.decode_ranks)
    print(f"cluster: {tokens} tokens in {cluster_s:.1f} s = {tokens / cluster_s:.1f} tok/s")
    ratio = engine_s / cluster_s
    print(f"cluster / engine throughput: {ratio:.2f}x")
    print(
        record(
            f"cluster_vs_engine_{args.model}",
            {
                "model": args.model,
                "requests": args.requests,
                "output_tokens": tokens,
                "prefill_ranks": args.prefill_ranks,
                "decode_ranks": args.decode_ranks,
                "engine_s": round(engine_s, 2),
                "engine_tok_s": round(tokens / engine_s, 1),
                "cluster_s": round(cluster_s, 2),
                "cluster_tok_s": round(tokens / cluster_s, 1),
                "ratio_cluster_engine": round(ratio, 2),
            },
        )
    )


if __name__ == "__main__":
    main()
