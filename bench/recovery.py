"""Recovery from a rank failure: time from a rank's SIGKILL to SERVING again, and what the
resumed requests paid for it, side by side with an undisturbed run of the same workload.

    .venv/bin/python -m bench.recovery [--model tiny] [--pool decode] [--requests 16]

A cluster (router + 2 prefill + 2 decode ranks) streams `--requests` seeded requests: twice
undisturbed (the first run warms up; the second is the baseline), then once with rank 0 of
`--pool` killed (SIGKILL): a decode rank after a quarter of the tokens have arrived, a prefill
rank as soon as the status shows it holding requests (long prompts then still queue on it). Every
stream of the run with the kill must equal the baseline, token for token (the resumed requests
re-prefill prompt + what they had received; sampling depends on (seed, position)).
Reported: kill -> health SERVING (as a client polling every 50 ms sees it), the router's own
failure -> ready time, the longest gap between two tokens of a stream and the time to the first
token in each run (the pause a client saw: a decode kill shows in the gaps, a prefill kill in the
first token), and each run's wall time. Prefix caching is off so that every run prefills for
real (the same prompts repeat).
"""

import argparse
import asyncio
import os
import signal
import statistics
import threading
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # local Ray on loopback

import ray
import torch

from bench.common import record, workload
from engine import SamplingParams


async def stream_all(address: str, requests, fault=None, at_tokens: int = 0):
    """Stream every request; -> per request (token ids, arrival times), and when the fault
    fired (time.monotonic())."""
    from router.client import AsyncInferenceClient

    total = {"tokens": 0, "fired": None}

    async def fire_when_prefilling() -> None:
        """Once prefill rank 0 (the one killed) holds requests (status polled every 20 ms)."""
        while not any(
            r.num_running + r.num_waiting
            for p in (await client.cluster_status()).pools
            if p.name == "prefill"
            for r in p.ranks[:1]
        ):
            await asyncio.sleep(0.02)
        total["fired"] = time.monotonic()
        await asyncio.to_thread(fault)

    async def one(client, i, prompt, n):
        params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.8, seed=i)
        tokens, times = [], [time.monotonic()]  # times[0]: sent
        async for msg in client.generate(prompt, params):
            now = time.monotonic()
            tokens += msg.token_ids
            times += [now] * len(msg.token_ids)
            total["tokens"] += len(msg.token_ids)
            if fault and at_tokens and total["fired"] is None and total["tokens"] >= at_tokens:
                total["fired"] = time.monotonic()
                fault()
        return tokens, times

    async with AsyncInferenceClient(address, timeout=3600) as client:
        calls = [one(client, i, p, n) for i, (p, n) in enumerate(requests)]
        if fault and at_tokens == 0:
            calls.append(fire_when_prefilling())
        outs = await asyncio.gather(*calls)
        outs = outs[: len(requests)]
    return outs, total["fired"]


def watch_serving(address: str, since: list, result: dict, stop: threading.Event) -> None:
    """After since[0] is set (the kill), the first time health is SERVING again."""
    from router.client import InferenceClient

    with InferenceClient(address, timeout=5) as client:
        seen_down = False
        while not stop.is_set():
            if since:
                health = client.health()
                seen_down |= health != "SERVING"
                if seen_down and health == "SERVING":
                    result["serving_after_s"] = time.monotonic() - since[0]
                    return
            time.sleep(0.05)


def max_gap(times: list[float]) -> float:
    """The longest wait between two tokens of a stream (times[0] is when it was sent)."""
    return max((b - a for a, b in zip(times[1:], times[2:])), default=0.0)


def spread(base: list[float], hit: list[float], hit_name: str) -> dict[str, float]:
    """Median and max of a per-stream figure in the undisturbed run and in the run with the
    event (`hit_name`: with_kill, with_rebalance)."""
    return {
        "undisturbed_median": round(statistics.median(base), 3),
        "undisturbed_max": round(max(base), 3),
        f"{hit_name}_median": round(statistics.median(hit), 3),
        f"{hit_name}_max": round(max(hit), 3),
    }


def ttft(times: list[float]) -> float:
    return times[1] - times[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="tiny")
    ap.add_argument("--pool", choices=["prefill", "decode"], default="decode")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from cluster.config import ClusterConfig
    from cluster.launcher import Cluster
    from moe import ModelConfig, resolve_model_path

    vocab = ModelConfig.from_file(resolve_model_path(args.model)).vocab_size
    prompts = (256, 1024) if args.pool == "prefill" else (16, 256)
    requests = workload(args.requests, prompts, (64, 128), vocab, args.seed)
    tokens = sum(n for _, n in requests)
    # No prefix caching: the runs repeat one workload, and a cached prompt would make the
    # baseline's prefill nearly free while a re-formed prefill pool starts with an empty cache.
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
            "engine.enable_prefix_caching": False,
        },
    )
    with Cluster(config) as cluster:
        asyncio.run(stream_all(cluster.address, requests))  # warm-up
        start = time.monotonic()
        base, _ = asyncio.run(stream_all(cluster.address, requests))
        base_s = time.monotonic() - start

        actor = cluster.pools[args.pool].actors[0]
        pid = ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()))
        killed_at: list[float] = []
        serving: dict = {}
        stop = threading.Event()
        watcher = threading.Thread(
            target=watch_serving, args=(cluster.address, killed_at, serving, stop)
        )
        watcher.start()

        def kill() -> None:
            os.kill(pid, signal.SIGKILL)
            killed_at.append(time.monotonic())

        start = time.monotonic()
        at = tokens // 4 if args.pool == "decode" else 0
        hit, _ = asyncio.run(stream_all(cluster.address, requests, kill, at))
        hit_s = time.monotonic() - start
        watcher.join(600)
        stop.set()
        pool = cluster.backend.pools[args.pool]
        router_recovery_s = pool.recovery_s[-1] if pool.recovery_s else None

    exact = [b[0] for b in base] == [h[0] for h in hit]
    assert exact, "a resumed stream differs from the undisturbed run"
    base_gaps = [max_gap(t) for _, t in base]
    hit_gaps = [max_gap(t) for _, t in hit]
    base_ttft = [ttft(t) for _, t in base]
    hit_ttft = [ttft(t) for _, t in hit]
    result = {
        "model": args.model,
        "pool_killed": args.pool,
        "requests": args.requests,
        "output_tokens": tokens,
        "streams_identical_to_undisturbed_run": exact,
        "kill_to_serving_s": round(serving.get("serving_after_s", float("nan")), 2),
        "router_failure_to_ready_s": round(router_recovery_s or float("nan"), 2),
        "undisturbed_run_s": round(base_s, 2),
        "run_with_kill_s": round(hit_s, 2),
        "extra_wall_time_s": round(hit_s - base_s, 2),
        "longest_token_gap_s": spread(base_gaps, hit_gaps, "with_kill"),
        "time_to_first_token_s": spread(base_ttft, hit_ttft, "with_kill"),
    }
    for key, value in result.items():
        print(f"{key}: {value}")
    print(record(f"recovery_{args.model}_{args.pool}", result))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
