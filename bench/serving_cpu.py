"""The serving work of a running cluster, measured for the plan of a local deployment
(cluster/plan/local.py): the cores kept busy besides the ranks' engine threads (the router, the
load generator, the ranks' serving threads, Ray's daemons) on an idle window and at a few
open-loop loads, and a least-squares fit

    serving cores = background + cpu_s_per_request x requests/s + cpu_s_per_step x decode steps/s

(decode steps of all the decode ranks, from their /metrics, found through the router's
/sd/targets: its Prometheus service discovery). Run it on loads apart from the
ones a goodput comparison checks; bench/goodput.py `--serving-cpu RESULT` takes the fit.

    .venv/bin/epcluster serve --model small --prefill-ranks 1 --decode-ranks 1 --http-port 8130 \
        --metrics-port 9430 &
    .venv/bin/python -m bench.serving_cpu --target http://127.0.0.1:8130 --server-pid $! \
        --router-metrics http://127.0.0.1:9430 --loads 0.3,0.6,1.9 --name serving_cpu_small
"""

import argparse
import asyncio
import json
import os
import sys
import time
import urllib.request

import torch

from bench.common import record
from bench.goodput import cpu_seconds
from bench.openloop import OpenLoop, run

SERVING = ("router", "client", "rank_serving", "ray_other")


def decode_steps(router_metrics: str) -> float:
    """Steps with work of every decode rank the router lists in its /sd/targets
    (`router_metrics`: the base URL of its /metrics server)."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"{router_metrics}/sd/targets", timeout=5) as r:
        groups = json.loads(r.read())
    total = 0.0
    for group in groups:
        if group["labels"].get("pool") != "decode":
            continue
        for target in group["targets"]:
            with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as r:
                families = text_string_to_metric_families(r.read().decode())
            for family in families:
                if family.name == "epcluster_step_duration_seconds":
                    total += sum(s.value for s in family.samples if s.name.endswith("_count"))
    return total


def fit(points: list[dict]) -> dict[str, float]:
    """Least squares of serving cores on (1, requests/s, decode steps/s) over the points."""
    a = torch.tensor([[1.0, p["requests_per_s"], p["decode_steps_per_s"]] for p in points],
                     dtype=torch.float64)  # fmt: skip
    b = torch.tensor([[p["serving_cores"]] for p in points], dtype=torch.float64)
    x = torch.linalg.lstsq(a, b, driver="gelsd").solution.flatten().tolist()
    residual = (a @ torch.tensor(x, dtype=torch.float64)[:, None] - b).abs().max().item()
    return {"background_busy": x[0], "cpu_s_per_request": x[1], "cpu_s_per_step": x[2],
            "max_residual_cores": residual}  # fmt: skip


def window(args: argparse.Namespace, load: float, level: int) -> dict:
    """One measured window: idle for --idle seconds (load 0), else an open-loop load."""
    cpu0, steps0, t0 = (
        cpu_seconds(args.server_pid),
        decode_steps(args.router_metrics),
        time.time(),
    )
    done = 0
    if load == 0:
        time.sleep(args.idle)
    else:
        n = max(args.requests, round(load * args.duration))
        cfg = OpenLoop(args.target, args.model, load, n, args.prompt_tokens, args.prefix_tokens,
                       args.output_tokens, args.vocab, args.seed, level)  # fmt: skip
        records = asyncio.run(run(cfg))
        done = sum(1 for r in records if r.error is None)
    wall = time.time() - t0
    cpu1, steps1 = cpu_seconds(args.server_pid), decode_steps(args.router_metrics)
    cores = {k: (cpu1[k] - cpu0[k]) / wall for k in cpu1}
    point = {"load": load, "requests_per_s": done / wall,
             "decode_steps_per_s": (steps1 - steps0) / wall, "wall_s": wall, "cores": cores,
             "serving_cores": sum(cores[k] for k in SERVING)}  # fmt: skip
    print(f"load {load}: {point['requests_per_s']:.3f} req/s, {point['decode_steps_per_s']:.1f} "
          f"decode steps/s, serving {point['serving_cores']:.3f} cores, engines "
          f"{cores['rank_engines']:.3f}", file=sys.stderr)  # fmt: skip
    return point


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--target", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default="small")
    ap.add_argument("--server-pid", type=int, required=True, help="epcluster serve's pid")
    ap.add_argument(
        "--router-metrics",
        default="http://127.0.0.1:9430",
        help="the router's /metrics server (its /sd/targets lists the ranks')",
    )
    ap.add_argument("--loads", default="0.3,0.6,1.9", help="req/s (an idle window comes first)")
    ap.add_argument("--idle", type=float, default=20.0, help="seconds of the idle window")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--prefix-tokens", type=int, default=32)
    ap.add_argument("--requests", type=int, default=30, help="per load (at least)")
    ap.add_argument("--duration", type=float, default=45.0, help="more requests to fill it")
    ap.add_argument("--seed", type=int, default=100, help="apart from the goodput runs' prompts")
    ap.add_argument("--name", default="serving_cpu")
    args = ap.parse_args()
    from moe.presets import ensure_preset

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args.vocab = json.loads((ensure_preset(args.model) / "config.json").read_text())["vocab_size"]
    loads = [0.0] + [float(x) for x in args.loads.split(",")]
    points = [window(args, load, level) for level, load in enumerate(loads)]
    result = {"model": args.model, "points": points, "fit": fit(points)}
    print(json.dumps(result["fit"]), file=sys.stderr)
    print(f"recorded {record(args.name, result)}")


if __name__ == "__main__":
    main()
