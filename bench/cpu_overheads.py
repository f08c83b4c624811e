"""What a CPU rank's decode step costs beyond the roofline of the probed machine: the engine's
per-step and per-sequence overheads, measured, for the plan's CPU entry (cluster/plan/probe.py).

One engine (one torch thread, as a cluster rank runs) decodes `--batches` requests of 128 prompt
tokens with the fused decode layers; the mean step at each batch minus the plan's roofline of
that step (cluster/plan/cost.py, EP1, fp32, this machine's one-thread bandwidth and peak from
the probe, no overheads) is the overhead; a line through the two batches gives
step_overhead_s + sequence_overhead_s x batch, written into the probe's cache beside the
bandwidth and peak (and recorded in bench/results/cpu_overheads_<model>.json). Nothing here
comes from a cluster or a goodput run.

    .venv/bin/python -m bench.cpu_overheads [--model small] [--batches 1,32] [--steps 40]
"""

import argparse
import time

import torch

from bench.common import record, workload
from cluster.plan.cost import Unit, decode_step
from cluster.plan.models import load_model
from cluster.plan.probe import cpu_hardware, probe, save
from engine import EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine

PROMPT = 128


def step_seconds(model: str, batch: int, steps: int) -> float:
    """Mean seconds of a decode step of `batch` requests (after the prefill and a warm-up)."""
    config = EngineConfig(model=model, max_num_seqs=max(64, batch), max_num_batched_tokens=4096,
                          enable_prefix_caching=False)  # fmt: skip
    engine = LLMEngine(config)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=steps + 10, temperature=0.0, ignore_eos=True)
    for i, (prompt, _) in enumerate(workload(batch, (PROMPT, PROMPT), (1, 1), vocab, 0)):
        engine.add_request(str(i), prompt, params)
    for _ in range(3):
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    return (time.perf_counter() - start) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()
    torch.set_num_threads(1)  # a cluster rank's torch_threads
    lo, hi = (int(b) for b in args.batches.split(","))
    probe()  # bandwidth and peak first (measured now if not cached)
    hw = cpu_hardware(busy_threads=1.0)
    unit = Unit(1, 1, 0, "fp32", "fp32", "fp32", "fp32", imbalance=1.0, step_overhead_s=0.0)
    plan_model = load_model(args.model)
    rows = {}
    for batch in (lo, hi):
        measured = step_seconds(args.model, batch, args.steps)
        context = PROMPT + 3 + args.steps / 2
        roofline = decode_step(plan_model, hw, unit, batch, context).time_s
        rows[batch] = {"step_ms": measured * 1e3, "roofline_ms": roofline * 1e3,
                       "overhead_ms": (measured - roofline) * 1e3}  # fmt: skip
        print(batch, rows[batch])
    per_seq = max(0.0, (rows[hi]["overhead_ms"] - rows[lo]["overhead_ms"]) / (hi - lo) / 1e3)
    per_step = max(0.0, rows[lo]["overhead_ms"] / 1e3 - per_seq * lo)
    cache = probe() | {"step_overhead_s": per_step, "sequence_overhead_s": per_seq,
                       "overheads": f"bench/cpu_overheads.py --batches {args.batches}"}  # fmt: skip
    save(cache)
    result = {
        "model": args.model,
        "threads": 1,
        "batches": rows,
        "step_overhead_ms": per_step * 1e3,
        "sequence_overhead_ms": per_seq * 1e3,
        "probe": {k: v for k, v in cache.items() if k != "overheads"},
    }
    print(record(f"cpu_overheads_{args.model}", result))


if __name__ == "__main__":
    main()
