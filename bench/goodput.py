"""Goodput of a running cluster over its OpenAI HTTP API, with guidellm (vLLM project's load tool,
`pip install -e '.[load]'`) generating the load: open loop (Poisson arrivals at each rate) or
closed loop (N concurrent streams), synthetic prompts of the given lengths (normal spread) with
a shared prefix, seeded, with guidellm's progress bar. This script only wraps it: per load it
reads guidellm's per-request records and reports TTFT / TPOT (inter-token latency) / e2e
percentiles, throughput and goodput (requests/s that met both SLOs), writes
bench/results/<name>.json (with the command) and a plot; `--plan` sets the prediction of
`epcluster plan` for the same deployment beside each load (cluster/plan/planner.py, predict).

The calibration of issue 27 (a cluster of 2 prefill + 2 decode ranks of `small`, then 1 + 1):
    .venv/bin/epcluster serve --model small --prefill-ranks 2 --decode-ranks 2 --http-port 8000 &
    .venv/bin/python -m bench.goodput --model small --mode open --loads 0.5,1,2 \
        --prompt-tokens 128 --output-tokens 128 --prefix-tokens 32 --requests 100 \
        --slo-ttft 2 --slo-tpot 0.2 --plan 2,2 --name goodput_small_2p2d --plot
No hub is reached: the tokenizer is the checkpoint's own (HF_HUB_OFFLINE=1).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import RESULTS, record


def guidellm_command(args: argparse.Namespace, load: float, out: Path, tokenizer: str) -> list[str]:
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
        "--seed", f"kind=static,value={args.seed}",
        "--output", f"kind=json,path={out}",
    ]  # fmt: skip


def summarise(report: dict, slo_ttft: float, slo_tpot: float) -> dict:
    """Percentiles, throughput and goodput of one guidellm benchmark (its per-request records).
    TPOT is the inter-token latency (the first token excluded), as the plan defines it."""
    bench = report["benchmarks"][0]
    done = bench["requests"]["successful"]
    failed = len(bench["requests"]["errored"]) + len(bench["requests"]["incomplete"])
    seconds = bench["duration"]
    ttft = [r["time_to_first_token_ms"] / 1000 for r in done]
    tpot = [(r["inter_token_latency_ms"] or 0.0) / 1000 for r in done]
    e2e = [r["request_latency"] for r in done]
    good = sum(1 for a, b in zip(ttft, tpot) if a <= slo_ttft and b <= slo_tpot)

    def pct(xs: list[float], q: int) -> float | None:
        return statistics.quantiles(xs, n=100, method="inclusive")[q - 1] if len(xs) > 1 else None

    return {
        "requests": len(done),
        "failed": failed,
        "duration_s": seconds,
        "throughput_rps": len(done) / seconds,
        "input_tokens_per_s": sum(r["prompt_tokens"] for r in done) / seconds,
        "output_tokens_per_s": sum(r["output_tokens"] for r in done) / seconds,
        "goodput_rps": good / seconds,
        **{f"ttft_p{q}_s": pct(ttft, q) for q in (50, 90, 99)},
        **{f"tpot_p{q}_s": pct(tpot, q) for q in (50, 90, 99)},
        **{f"e2e_p{q}_s": pct(e2e, q) for q in (50, 90, 99)},
    }


def predict(args: argparse.Namespace, load: float) -> dict:
    """The plan's prediction for the same deployment (prefill,decode ranks on this CPU) and an
    open-loop load (closed loop: the rate the measured run reached is not known beforehand)."""
    from cluster.plan.models import load_model
    from cluster.plan.planner import ModelCosts, predict_fixed
    from cluster.plan.probe import cpu_hardware
    from cluster.plan.workload import Workload

    prefill, decode = (int(x) for x in args.plan.split(","))
    # assumption: every rank busy at once, the machine's cores and bandwidth shared evenly
    share = min(1.0, (os.cpu_count() or 1) / (prefill + decode))
    costs = ModelCosts(load_model(args.model), cpu_hardware(share=share), 1, "fp32", "fp32")
    hit = args.prefix_tokens / (args.prefix_tokens + args.prompt_tokens)
    work = Workload("bench", load, args.prompt_tokens + args.prefix_tokens, args.output_tokens, hit)
    plan = predict_fixed(costs, work, prefill, decode, args.slo_ttft, args.slo_tpot)
    s = plan.summary()
    keys = ("ttft_s", "ttft_p90_s", "tpot_s", "tpot_p90_s", "e2e_s", "goodput_rps")
    return {k: s[k] for k in keys}


def plot(rows: list[dict], mode: str, path: Path) -> None:
    """Throughput and goodput, and TTFT / TPOT medians (measured; the plan's dashed), by load."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    loads = [r["load"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(loads, [r["throughput_rps"] for r in rows], "o-", label="throughput")
    a.plot(loads, [r["goodput_rps"] for r in rows], "s-", label="goodput")
    b.plot(loads, [r["ttft_p50_s"] for r in rows], "o-", label="TTFT p50")
    b.plot(loads, [r["tpot_p50_s"] for r in rows], "s-", label="TPOT p50")
    if all("plan" in r for r in rows):
        a.plot(loads, [r["plan"]["goodput_rps"] for r in rows], "s--", label="goodput (plan)")
        b.plot(loads, [r["plan"]["ttft_s"] for r in rows], "o--", label="TTFT p50 (plan)")
        b.plot(loads, [r["plan"]["tpot_s"] for r in rows], "s--", label="TPOT p50 (plan)")
    xlabel = "offered requests/s" if mode == "open" else "concurrent streams"
    a.set(xlabel=xlabel, ylabel="requests/s")
    b.set(xlabel=xlabel, ylabel="seconds", yscale="log")
    a.legend(), b.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--target", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="small", help="the served model (and its tokenizer)")
    parser.add_argument("--tokenizer", help="tokenizer dir (default: the preset's checkpoint)")
    parser.add_argument("--mode", choices=["open", "closed"], default="open")
    parser.add_argument("--loads", default="0.5,1,2", help="rates (open) or streams (closed)")
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--output-tokens", type=int, default=128)
    parser.add_argument("--stdev", type=int, default=0, help="of both lengths (normal)")
    parser.add_argument("--prefix-tokens", type=int, default=0, help="shared by every prompt")
    parser.add_argument("--requests", type=int, default=100, help="per load")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft", type=float, default=2.0)
    parser.add_argument("--slo-tpot", type=float, default=0.2)
    parser.add_argument("--plan", help="PREFILL,DECODE ranks: add the plan's prediction")
    parser.add_argument("--name", default="goodput")
    parser.add_argument("--plot", action="store_true", help=f"also {RESULTS}/<name>.png")
    parser.add_argument("--json", action="store_true", help="print the result as JSON")
    args = parser.parse_args()
    tokenizer = args.tokenizer
    if tokenizer is None:
        from moe.presets import ensure_preset

        tokenizer = str(ensure_preset(args.model))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for load in (float(x) for x in args.loads.split(",")):
            out = Path(tmp) / f"{load}.json"
            # guidellm's progress and tables go to stderr: stdout stays this script's
            subprocess.run(
                guidellm_command(args, load, out, tokenizer), check=True, stdout=sys.stderr
            )
            row = {
                "load": load,
                **summarise(json.loads(out.read_text()), args.slo_ttft, args.slo_tpot),
            }
            if args.plan and args.mode == "open":
                row["plan"] = predict(args, load)
            rows.append(row)
    result = {"mode": args.mode, "slo_ttft_s": args.slo_ttft, "slo_tpot_s": args.slo_tpot,
              "tool": "guidellm", "loads": rows}  # fmt: skip
    path = record(args.name, result)
    if args.plot:
        plot(rows, args.mode, RESULTS / f"{args.name}.png")
    print(json.dumps(result, indent=1) if args.json else f"recorded {path}")


if __name__ == "__main__":
    main()
