"""torch.compile on the CPU decode step, beside the torch paths it would compile and the compiled
CPU kernels (issue 12: "try torch.compile on CPU and keep it only where it measurably wins and
stays exact").

Three engines on one checkpoint in one process, taking turns batch by batch: the torch paths
(EPCLUSTER_KERNELS=reference, the Python decoder layers) eager; the same with torch.compile
(inductor, dynamic shapes) on every dense part of the step: the attention's projections, its
absorbed paged attention and o_proj, the norms, the dense MLP and shared experts, the gate and
lm_head (the routed experts stay eager: their loop over the rows each expert got makes dynamo
recompile for every new count, and hits its recompile limit); and the default path (the compiled
CPU kernels and the fused decode layers). Each decodes B requests of 128 random prompt tokens
for --steps greedy tokens; the median decode step is compared, and the greedy tokens of
torch.compile and of the CPU kernels with the eager torch path's.

    .venv/bin/python -m bench.torch_compile [--model small] [--batches 1 8 32] [--repeats 3]
"""

import argparse
import os
import statistics
import time

import torch

import moe.attention
import moe.layers
import moe.norm
from bench.common import record, workload
from bench.decode_speed import decode_engine, read_bandwidth
from engine import SamplingParams
from engine.llm_engine import LLMEngine
from kernels.backend import ENV_VAR as KERNELS_VAR


def compile_dense_parts(model) -> int:
    """torch.compile (dynamic shapes) on the dense parts of each layer -> functions wrapped."""
    wrapped = 0

    def wrap(owner, name: str) -> None:
        nonlocal wrapped
        setattr(owner, name, torch.compile(getattr(owner, name), dynamic=True))
        wrapped += 1

    for module in model.modules():
        if isinstance(module, moe.attention.MLAttention):
            wrap(module, "_project")
            wrap(module, "_absorbed")
            wrap(module.o_proj, "forward")
        elif isinstance(module, (moe.norm.RMSNorm, moe.layers.MLP, moe.layers.Gate)):
            wrap(module, "forward")
    wrap(model, "compute_logits")
    return wrapped


def decode(engine: LLMEngine, batch: int, seed: int, steps: int) -> tuple[float, list]:
    """-> (median decode step ms, each request's greedy tokens)."""
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True)
    for i, (prompt, _) in enumerate(workload(batch, (128, 128), (1, 1), vocab, seed)):
        engine.add_request(f"{seed}-{i}", prompt, params)
    tokens: dict[str, list[int]] = {}
    step_s = []
    while engine.has_unfinished():
        prefill = not tokens
        start = time.perf_counter()
        out = engine.step().outputs
        if not prefill:
            step_s.append(time.perf_counter() - start)
        for delta in out:
            tokens.setdefault(delta.request_id, []).extend(delta.token_ids)
    assert all(len(t) == steps + 1 for t in tokens.values()), tokens
    return statistics.median(step_s) * 1e3, [tokens[k] for k in sorted(tokens)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    bandwidths = [read_bandwidth()]
    kernels = decode_engine(args.model)
    os.environ[KERNELS_VAR] = "reference"  # read at every call
    eager = decode_engine(args.model, python_layers=True)
    compiled = decode_engine(args.model, python_layers=True)
    wrapped = compile_dense_parts(compiled.model)
    start = time.perf_counter()
    for batch in args.batches:  # the first compiles, then a recompile or two for the shapes
        decode(compiled, batch, seed=999, steps=3)
    compile_s = time.perf_counter() - start
    print(f"compiled {wrapped} functions: {compile_s:.0f} s of warm-up", flush=True)

    engines = {"torch eager": eager, "torch.compile": compiled, "compiled CPU kernels": kernels}
    runs: dict[int, list[dict]] = {}
    for batch in args.batches:
        for r in range(args.repeats):
            row, outputs = {}, {}
            for label, engine in engines.items():
                os.environ[KERNELS_VAR] = "auto" if engine is kernels else "reference"
                row[label], outputs[label] = decode(engine, batch, batch * 10 + r, args.steps)
            # NOTE: the CPU kernels sum in another order than torch (logits within 1e-4): on a
            # random model a greedy token can flip between them; torch.compile is asked for
            # the eager path's tokens.
            for label in ("torch.compile", "compiled CPU kernels"):
                row[f"{label} tokens = eager's"] = outputs[label] == outputs["torch eager"]
            runs.setdefault(batch, []).append(row)
            print(batch, {k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()},
                  flush=True)  # fmt: skip
    summary = {}
    for batch, rows in runs.items():
        summary[batch] = {
            "eager / compiled step time": [
                round(x["torch eager"] / x["torch.compile"], 3) for x in rows
            ],
            "torch.compile / CPU kernels step time": [
                round(x["torch.compile"] / x["compiled CPU kernels"], 3) for x in rows
            ],
            "torch.compile tokens = eager's, repeats": sum(
                x["torch.compile tokens = eager's"] for x in rows
            ),
            "CPU kernels tokens = eager's, repeats": sum(
                x["compiled CPU kernels tokens = eager's"] for x in rows
            ),
        }
        print(batch, summary[batch])
    bandwidths.append(read_bandwidth())
    name = args.name or f"torch_compile_{args.model}"
    result = {
        "model": args.model,
        "steps": args.steps,
        "functions_compiled": wrapped,
        "compile_warmup_s": compile_s,
        "torch": torch.__version__,
        "read_bandwidth_gb_s_before_after": [round(b / 1e9, 1) for b in bandwidths],
        "median_step_ms": runs,
        "summary": summary,
    }
    print(record(name, result))


if __name__ == "__main__":
    main()
