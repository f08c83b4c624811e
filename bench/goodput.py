"""Goodput of a running cluster over its OpenAI HTTP API. The load: open loop, seeded Poisson
arrivals sent at their times whatever the cluster does (bench/openloop.py, the default: it
reports the rate it delivered and how late its sends were), or guidellm (the vLLM project's
load tool, `pip install -e '.[load]'`, `--tool guidellm`; closed loop, N concurrent streams,
always uses it), synthetic prompts of the given lengths with a shared prefix. Per load it
reports TTFT / TPOT (inter-token latency) / e2e percentiles, throughput and goodput (requests/s
that met both SLOs) and the cores the router, the ranks, Ray and the load generator kept busy
(`--server-pid`), writes bench/results/<name>.json (with the command), <name>.md and a plot.
`--plan P,D` sets beside each load the plan's prediction for the same local deployment at the
DELIVERED rate (cluster/plan/local.py); `--capacity-fractions` picks the loads as shares of the
plan's predicted capacity; `--replan RESULT` recomputes that column of a recorded measurement.

The calibration of issue 27 (docs/planning.md has the whole sequence; 2 + 2 ranks of `small`):
    .venv/bin/python -m bench.cpu_overheads --steps 100   # the probe and the overheads, first
    .venv/bin/python -m bench.serving_cpu ...   # the serving work, on a 1 + 1 cluster
    .venv/bin/epcluster serve --model small --prefill-ranks 2 --decode-ranks 2 --http-port 8130 &
    .venv/bin/python -m bench.goodput --target http://127.0.0.1:8130 --model small \
        --prompt-tokens 128 --output-tokens 128 --prefix-tokens 32 --requests 30 --duration 45 \
        --slo-ttft 2 --slo-tpot 0.2 --loads 1.28,2.56,3.84 --plot --plan 2,2 \
        --serving-cpu bench/results/serving_cpu_small.json --server-pid $! --name goodput_small_2p2d
No hub is reached: the tokenizer is the checkpoint's own (HF_HUB_OFFLINE=1).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.common import RESULTS, record
from bench.goodput_report import plot, summarise, summarise_records, write_md


def guidellm_command(
    args: argparse.Namespace, load: float, level: int, out: Path, tokenizer: str
) -> list[str]:
    """guidellm's command for one load; the i-th load (level) of a series draws its own prompts
    (seed + level: one an earlier load sent would hit the prefix cache)."""
    profile = (
        f"kind=poisson,rate={load}"
        if args.mode == "open"
        else f"kind=concurrent,streams={int(load)}"
    )
    data = (
        f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}"
    )
    if args.stdev:  # guidellm refuses a zero spread or prefix: leave them out
        data += f",prompt_tokens_stdev={args.stdev},output_tokens_stdev={args.stdev}"
    if args.prefix_tokens:
        data += f",prefix_tokens={args.prefix_tokens}"
    exe = Path(sys.executable).with_name("guidellm")
    return [
        str(exe), "run",
        # plain completions: the prompt's tokens are the ones sent (no chat template around them)
        "--backend", f"kind=openai_http,target={args.target},model={args.model},"
        "request_format=/v1/completions",
        "--profile", profile,
        "--constraint", f"kind=max_requests,count={args.requests}",
        "--data", data,
        "--tokenizer", f"kind=hf_auto,model={tokenizer}",
        "--seed", f"kind=static,value={args.seed + level}",
        "--output", f"kind=json,path={out}",
    ]  # fmt: skip


def _local(args: argparse.Namespace):  # -> (PlanModel, Workload at rate 1, LocalCluster)
    from cluster.plan.local import LocalCluster
    from cluster.plan.models import load_model
    from cluster.plan.workload import Workload

    prefill, decode = (int(x) for x in args.plan.split(","))
    hit = args.prefix_tokens / (args.prefix_tokens + args.prompt_tokens)
    prompt = args.prompt_tokens + args.prefix_tokens
    work = Workload("bench", 1.0, prompt, args.output_tokens, hit)
    cluster = LocalCluster(
        prefill, decode, background_busy=args.background_busy,
        cpu_s_per_request=args.cpu_per_request, cpu_s_per_step=args.cpu_per_step,
        request_latency_s=args.request_latency or 0.0,
    )  # fmt: skip
    return load_model(args.model), work, cluster


def serving_constants(args: argparse.Namespace) -> None:
    """--background-busy, --cpu-per-request, --cpu-per-step: given, else --serving-cpu's fit,
    else 0."""
    fit = json.loads(Path(args.serving_cpu).read_text())["fit"] if args.serving_cpu else {}
    names = {"background_busy": "background_busy", "cpu_per_request": "cpu_s_per_request",
             "cpu_per_step": "cpu_s_per_step"}  # fmt: skip
    for arg, key in names.items():
        if getattr(args, arg) is None:
            setattr(args, arg, fit.get(key, 0.0))


def level_requests(args: argparse.Namespace, load: float) -> int:
    """`--requests`, or more to fill `--duration` seconds at this rate."""
    return max(args.requests, round(load * (args.duration or 0)))


def predict(args: argparse.Namespace, load: float, requests: int) -> dict:
    """The plan's prediction for the same deployment (prefill,decode ranks on this CPU, sharing
    its cores: cluster/plan/local.py) at an open-loop rate (closed loop: the rate the measured
    run reached is not known beforehand)."""
    from cluster.plan.local import predict_local

    model, work, cluster = _local(args)
    return predict_local(model, work.scaled(load), cluster, args.slo_ttft, args.slo_tpot, requests)


def request_latency(args: argparse.Namespace, tries: int = 10) -> float:
    """The router's own part of a TTFT, on the idle cluster: the median TTFT of one-token prompts
    sent one at a time, less the plan's prefill step of one token (what the ranks compute)."""
    import asyncio

    from bench.openloop import OpenLoop, run
    from cluster.plan.local import LocalCluster

    cfg = OpenLoop(args.target, args.model, 1.0, 1, 1, 0, 2, 1000, args.seed)
    ttfts = []
    for _ in range(tries):
        ttfts += [r.first_s - r.sent_s for r in asyncio.run(run(cfg))]
    model, _, cluster = _local(args)
    prefill = LocalCluster(cluster.prefill_ranks, cluster.decode_ranks).costs(
        model, cluster.prefill_ranks + cluster.background_busy
    )
    step = prefill.prefill_s(cluster.prefill_ranks, 1, 1, 0.0)
    return max(0.0, statistics.median(ttfts) - step)


def capacity(args: argparse.Namespace) -> float:
    from cluster.plan.local import capacity_rps

    return capacity_rps(*_local(args))


def cpu_seconds(server_pid: int | None) -> dict[str, float]:
    """CPU seconds so far of the router (the serve process), its ranks' engine threads (named
    engine.loop.OS_THREAD_NAME) and their other threads (serving: Ray calls, streaming, the KV
    transport), the rest of its process tree (Ray's daemons) and this load generator: who used
    the cores during a load."""
    import psutil

    from engine.loop import OS_THREAD_NAME

    def used(proc: psutil.Process) -> float:
        try:
            t = proc.cpu_times()
            return t.user + t.system
        except psutil.Error:
            return 0.0

    def engine_threads(proc: psutil.Process) -> float:
        total = 0.0
        try:
            for t in proc.threads():
                comm = Path(f"/proc/{proc.pid}/task/{t.id}/comm")
                if comm.read_bytes().strip() == OS_THREAD_NAME:
                    total += t.user_time + t.system_time
        except (psutil.Error, OSError):  # gone, or a thread ended meanwhile
            pass
        return total

    out = {"client": used(psutil.Process()), "router": 0.0, "rank_engines": 0.0,
           "rank_serving": 0.0, "ray_other": 0.0}  # fmt: skip
    if server_pid is None:
        return out
    root = psutil.Process(server_pid)
    out["router"] = used(root)
    for child in root.children(recursive=True):
        try:
            name = " ".join(child.cmdline()[:1])
        except psutil.Error:
            continue
        if name.startswith(("ray::Prefill", "ray::Decode")):
            engine = engine_threads(child)
            out["rank_engines"] += engine
            out["rank_serving"] += used(child) - engine
        else:
            out["ray_other"] += used(child)
    return out


def measure_openloop(args: argparse.Namespace, load: float, level: int) -> dict:
    import asyncio

    from bench.openloop import OpenLoop, run
    from moe.presets import ensure_preset

    vocab = json.loads((ensure_preset(args.model) / "config.json").read_text())["vocab_size"]
    cfg = OpenLoop(args.target, args.model, load, level_requests(args, load), args.prompt_tokens,
                   args.prefix_tokens, args.output_tokens, vocab, args.seed, level)  # fmt: skip
    before, start = cpu_seconds(args.server_pid), time.perf_counter()
    records = asyncio.run(run(cfg))
    after, wall = cpu_seconds(args.server_pid), time.perf_counter() - start
    row = summarise_records(records, args.slo_ttft, args.slo_tpot)
    # cores each part kept busy on average over the load
    row["cpu_cores"] = {k: (after[k] - before[k]) / wall for k in after}
    print(f"offered {load} req/s: delivered {row['delivered_rps']:.3f}, done {row['requests']}, "
          f"TTFT p50 {row['ttft_p50_s']:.3f} s, TPOT p50 {row['tpot_p50_s']:.4f} s",
          file=sys.stderr)  # fmt: skip
    return row


def plan_inputs(args: argparse.Namespace, capacity_rps: float | None) -> dict:
    from cluster.plan.probe import probe

    return {
        "capacity_rps": capacity_rps,
        "request_latency_s": args.request_latency,
        "background_busy": args.background_busy,
        "cpu_s_per_request": args.cpu_per_request,
        "cpu_s_per_step": args.cpu_per_step,
        "serving_cpu": args.serving_cpu,
        "probe": probe(),
    }


def replan(args: argparse.Namespace) -> None:
    """The plan's predictions beside an earlier measurement, at the rates it delivered."""
    old = json.loads(Path(args.replan).read_text())
    if args.request_latency is None:  # the one measured with the loads
        args.request_latency = old.get("plan_inputs", {}).get("request_latency_s")
    for row in old["loads"]:
        rate = row.get("delivered_rps") or row["throughput_rps"]
        row["plan"] = predict(args, rate, row["requests"] + row["failed"])
    old["plan_inputs"] = plan_inputs(args, capacity(args))
    keep = ("command", "date", "commit", "load_average")
    measured = {k: old[k] for k in keep if k in old}
    result = {k: v for k, v in old.items() if k not in (*keep, "machine", "cpu", "cpu_flags",
              "cores", "measured")} | {"measured": old.get("measured", measured)}  # fmt: skip
    name = Path(args.replan).stem
    Path(args.replan).unlink()  # NOTE: replaced on purpose (git keeps the measured one)
    path = record(name, result)
    write_md(name, path)
    print(f"recorded {path}")
    if args.plot:
        plot(result["loads"], result["mode"], RESULTS / f"{name}.png")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="small", help="the served model (and its tokenizer)")
    parser.add_argument("--tokenizer", help="tokenizer dir (default: the preset's checkpoint)")
    parser.add_argument("--mode", choices=["open", "closed"], default="open")
    parser.add_argument(
        "--tool",
        choices=["openloop", "guidellm"],
        default="openloop",
        help="load side: bench/openloop.py's seeded Poisson arrivals (open mode), or guidellm",
    )
    parser.add_argument("--loads", default="0.5,1,2", help="rates (open) or streams (closed)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--stdev", type=int, default=0, help="of both lengths (normal)")
    parser.add_argument("--prefix-tokens", type=int, default=0, help="shared by every prompt")
    parser.add_argument("--requests", type=int, default=100, help="per load (at least)")
    parser.add_argument("--duration", type=float, help="openloop: more requests to fill it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft", type=float, default=2.0)
    parser.add_argument("--slo-tpot", type=float, default=0.2)
    parser.add_argument("--plan", help="PREFILL,DECODE ranks: add the plan's prediction")
    parser.add_argument(
        "--capacity-fractions", help="with --plan: loads as these shares of the plan's capacity"
    )
    parser.add_argument(
        "--serving-cpu",
        metavar="RESULT",
        help="with --plan: the serving work's constants measured by bench/serving_cpu.py "
        "(its result file; the three options below override)",
    )
    parser.add_argument(
        "--background-busy",
        type=float,
        help="with --plan: cores busy besides the engine threads whatever the load",
    )
    parser.add_argument(
        "--cpu-per-request",
        type=float,
        help="with --plan: serving CPU seconds per request (router, client, ranks' serving)",
    )
    parser.add_argument(
        "--cpu-per-step",
        type=float,
        help="with --plan: serving CPU seconds per decode step of a rank",
    )
    parser.add_argument(
        "--request-latency",
        type=float,
        help="with --plan: the router's part of a TTFT (default: measured first, idle cluster)",
    )
    parser.add_argument("--server-pid", type=int, help="epcluster serve's pid: CPU accounting")
    parser.add_argument("--name", default="goodput")
    parser.add_argument("--plot", action="store_true", help=f"also {RESULTS}/<name>.png")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    parser.add_argument(
        "--replan",
        metavar="RESULT",
        help="recompute --plan's column of a recorded result "
        "(its measurements kept, at their delivered rates) instead of measuring",
    )
    args = parser.parse_args()
    serving_constants(args)
    if args.replan:
        replan(args)
        return
    tokenizer = args.tokenizer
    if tokenizer is None:
        from moe.presets import ensure_preset

        tokenizer = str(ensure_preset(args.model))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        loads = [float(x) for x in args.loads.split(",")]
        if args.plan and args.request_latency is None and args.tool == "openloop":
            args.request_latency = request_latency(args)
            print(f"router request latency {args.request_latency:.4f} s", file=sys.stderr)
        if args.capacity_fractions:
            # the loads as shares of the plan's predicted capacity of this deployment
            cap = args.capacity_rps = capacity(args)
            print(f"plan: capacity {cap:.3f} req/s", file=sys.stderr)
            loads = [round(cap * float(f), 3) for f in args.capacity_fractions.split(",")]
        for level, load in enumerate(loads):
            if args.tool == "openloop" and args.mode == "open":
                row = {"load": load, **measure_openloop(args, load, level)}
            else:
                out = Path(tmp) / f"{load}.json"
                # guidellm's progress and tables go to stderr: stdout stays this script's
                subprocess.run(
                    guidellm_command(args, load, level, out, tokenizer),
                    check=True,
                    stdout=sys.stderr,
                )
                report = json.loads(out.read_text())
                row = {"load": load, **summarise(report, args.slo_ttft, args.slo_tpot)}
            if args.plan and args.mode == "open":
                # NOTE: the prediction is for the rate that was delivered, not the one offered
                rate = row.get("delivered_rps") or row["throughput_rps"]
                row["plan"] = predict(args, rate, row["requests"] + row["failed"])
            rows.append(row)
    result = {"mode": args.mode, "slo_ttft_s": args.slo_ttft, "slo_tpot_s": args.slo_tpot,
              "tool": args.tool, "loads": rows}  # fmt: skip
    if args.plan:
        result["plan_inputs"] = plan_inputs(args, getattr(args, "capacity_rps", None))
    path = record(args.name, result)
    if args.plan:
        write_md(path.stem, path)  # beside its json (record() may add a suffix)
    if args.plot:
        plot(rows, args.mode, RESULTS / f"{path.stem}.png")
    print(json.dumps(result, indent=1) if args.json else f"recorded {path}")


if __name__ == "__main__":
    main()
