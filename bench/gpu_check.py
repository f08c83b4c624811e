"""The GPU acceptance check: the first thing to run on a GPU (nothing of the GPU path has run on
one yet). On one GPU, within 10 minutes, it checks the GPU path end to end and writes one JSON,
bench/results/gpu_check_<gpu>.json, with every result and the GPU's name.

    .venv/bin/python -m bench.gpu_check            # make gpu-check
    .venv/bin/python -m bench.gpu_check --dry-run  # make gpu-check DRY_RUN=1; also without a GPU

The steps, in order:
- kernel_tests: tests/kernels' Triton tests compiled (TRITON_INTERPRET unset) against the torch
  references; the dry run runs a few in the interpreter instead.
- engine_cpu: the in-process engine on CPU, greedy tokens on tiny and small (the dry run: tiny):
  the oracle of the next two.
- engine_cuda: the engine on CUDA: the same greedy tokens.
- decode_graphs: the decode step captured as CUDA graphs and replayed (EngineConfig.cuda_graph,
  engine/decode_graphs.py): the same tokens as the eager CUDA engine, replays counted.
- fp8: the FP8 tests (the Triton FP8 grouped GEMM against its dequantized reference, and the
  FP8 experts where the loader has `fp8_experts`), compiled.
- kernel_bench: bench/kernels.py's timings (batch 32, context 4096, the small and V3 shapes).
- decode_speed: bench/decode_speed.py's batches 1, 8, 32 on the CUDA engine, graphs on and off.
A step that fails is recorded with its error and the next one runs; the JSON is rewritten after
every step, so a step that kills the process (a failed capture) leaves the others' results. In a
dry run (or without a GPU) every GPU step is recorded "skipped: no GPU" (or "skipped: --dry-run").
The exit status is 1 if any step failed.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from bench.common import REPO, record, workload

if TYPE_CHECKING:
    from engine import LLM

BUDGET_S = 600.0  # the acceptance check's promise: one GPU, 10 minutes
# tests/kernels' files that test no Triton kernel (the CPU kernels, huge pages, the install) or
# that compile ahead of time for a GPU that is here anyway
NOT_TRITON = ("test_compile.py", "test_cpu_kernels.py", "test_hugepages.py", "test_prebuilt.py")
DRY_RUN_KERNEL_TESTS = ["tests/kernels/test_gate.py"]  # the interpreter is slow: a sample


@dataclass(frozen=True, slots=True)
class Step:
    name: str
    what: str
    needs_gpu: bool
    run: Callable[["Check"], dict]  # -> the step's result; result["ok"] says passed or failed


@dataclass(slots=True)
class Check:
    """What the steps share: the GPU (None in a dry run), the models and the results so far."""

    gpu: str | None
    models: tuple[str, ...]
    results: dict[str, dict]


def run_pytest(args: list[str], interpret: bool, timeout_s: float) -> dict:
    """pytest in a subprocess (the interpreter switch is read when triton is first imported) ->
    counts and the failed tests' names, from its JUnit XML."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
        proc = subprocess.run(
            [*command, f"--junitxml={xml}"],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout_s,
        )  # fmt: skip
        cases = ET.parse(xml).getroot().iter("testcase") if xml.exists() else []
        outcomes = {"passed": [], "failed": [], "skipped": []}
        for case in cases:
            bad = case.find("failure") is not None or case.find("error") is not None
            kind = "failed" if bad else "skipped" if case.find("skipped") is not None else "passed"
            outcomes[kind].append(f"{case.get('classname')}::{case.get('name')}")
    return {
        "command": " ".join(["pytest", *args]) + (" (TRITON_INTERPRET=1)" if interpret else ""),
        "exit_status": proc.returncode,
        **{kind: len(names) for kind, names in outcomes.items()},
        "failures": outcomes["failed"],
        "output_tail": proc.stdout[-2000:] if proc.returncode else "",
        "ok": proc.returncode == 0 and bool(outcomes["passed"]),
    }


def kernel_tests(check: Check) -> dict:
    if check.gpu is None:
        return run_pytest(DRY_RUN_KERNEL_TESTS, interpret=True, timeout_s=300)
    ignore = [f"--ignore=tests/kernels/{name}" for name in NOT_TRITON]
    return run_pytest(["tests/kernels", *ignore], interpret=False, timeout_s=300)


def fp8(check: Check) -> dict:
    from engine.config import EngineConfig

    paths = ["tests/kernels", "tests/moe", "tests/engine"]
    result = run_pytest([*paths, "-k", "fp8"], interpret=False, timeout_s=240)
    return dict(result, fp8_experts_option="fp8_experts" in EngineConfig.__dataclass_fields__)


def greedy(llm: "LLM") -> list[list[int]]:
    """Greedy tokens (24 each, EOS ignored) for 4 seeded prompts of 5-40 tokens, in one batch."""
    from engine import SamplingParams

    requests = workload(4, (5, 40), (24, 24), llm.engine.model.config.vocab_size, seed=0)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    outs = llm.generate([prompt for prompt, _ in requests], params)
    return [out.token_ids for out in outs]


def same_tokens(expected: list[list[int]], got: list[list[int]]) -> dict:
    """Whether two runs agree, and where each request first differs (None: nowhere)."""
    first = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), None) for x, y in
             zip(expected, got)]  # fmt: skip
    return {"same": expected == got, "first_difference": first}


def engine_cpu(check: Check) -> dict:
    from engine import LLM

    tokens = {model: greedy(LLM(model)) for model in check.models}
    return {"tokens": tokens, "ok": all(len(t) == 24 for ts in tokens.values() for t in ts)}


def engine_cuda(check: Check) -> dict:
    from engine import LLM

    cpu = check.results["engine_cpu"].get("result", {}).get("tokens", {})
    out = {m: same_tokens(cpu.get(m, []), greedy(LLM(m, device="cuda"))) for m in check.models}
    return dict(out, ok=all(r["same"] for r in out.values()))


def decode_graphs(check: Check) -> dict:
    """Per model: eager CUDA tokens, then an engine that captures a graph per bucket (1, 2, 4,
    8) when it starts and replays them for its decode steps."""
    from engine import LLM

    out = {}
    for model in check.models:
        eager = greedy(LLM(model, device="cuda"))
        llm = LLM(model, device="cuda", cuda_graph=True, cuda_graph_max_batch=8)
        replayed = greedy(llm)
        graphs = llm.engine.runner.graphs
        out[model] = dict(
            same_tokens(eager, replayed), buckets=graphs.buckets, replays=graphs.num_replays
        )
    return dict(out, ok=all(r["same"] and r["replays"] > 0 for r in out.values()))


def kernel_bench(check: Check) -> dict:
    from bench import kernels

    out = {}
    for name, shape in kernels.SHAPES.items():
        out[f"{name}/moe/32"] = kernels.bench_moe(shape, 32, fp8=False)
        out[f"{name}/moe_fp8/32"] = kernels.bench_moe(shape, 32, fp8=True)
        out[f"{name}/gate/32"] = kernels.bench_gate(shape, 32)
        out[f"{name}/mla/32x4096"] = kernels.bench_mla(shape, 32, 4096)
        torch.cuda.empty_cache()
    return dict(out, ok=True)


def decode_speed(check: Check) -> dict:
    from bench.decode_speed import run_batch
    from engine import EngineConfig
    from engine.llm_engine import LLMEngine

    out = {}
    for graphs in (True, False):
        engine = LLMEngine(
            EngineConfig(model=check.models[-1], device="cuda", cuda_graph=graphs,
                         max_num_seqs=64, max_num_batched_tokens=4096,
                         enable_prefix_caching=False)
        )  # fmt: skip
        vocab = engine.model.config.vocab_size
        run_batch(engine, 2, vocab, seed=999)  # warm-up
        for batch in (1, 8, 32):
            run = run_batch(engine, batch, vocab, seed=batch)
            out[f"graphs={graphs}/B={batch}"] = {
                "decode_tok_s": round(batch * 127 / run["decode_s"], 1),
                "decode_step_ms_median": round(run["decode_step_ms_median"], 3),
            }
    return dict(out, ok=True)


STEPS = (
    Step("kernel_tests", "tests/kernels' Triton tests against the references", False, kernel_tests),
    Step("engine_cpu", "the engine on CPU: greedy tokens (the oracle)", False, engine_cpu),
    Step("engine_cuda", "the engine on CUDA: the CPU's greedy tokens", True, engine_cuda),
    Step("decode_graphs", "CUDA-graph capture and replay: eager's tokens", True, decode_graphs),
    Step("fp8", "FP8 GEMM and FP8 experts against the dequantized path", True, fp8),
    Step("kernel_bench", "bench/kernels.py: the Triton kernels timed", True, kernel_bench),
    Step("decode_speed", "bench/decode_speed.py: decode tok/s at B=1, 8, 32", True, decode_speed),
)


def plan(gpu: str | None, dry_run: bool) -> list[dict]:
    """Each step, what it checks, and whether it runs here (or why not)."""
    skip = "skipped: no GPU" if gpu is None else "skipped: --dry-run" if dry_run else None
    return [
        {
            "step": s.name,
            "what": s.what,
            "needs_gpu": s.needs_gpu,
            "skip": skip if s.needs_gpu else None,
        }
        for s in STEPS
    ]


def run_step(step: Step, check: Check, skip: str | None, deadline: float) -> dict:
    """One step's record: its status (passed, failed, skipped: why), seconds, result or error."""
    if skip is None and time.monotonic() > deadline:
        skip = f"skipped: past the {BUDGET_S:.0f} s budget"
    if skip is not None:
        return {"status": skip}
    start = time.monotonic()
    try:
        result = step.run(check)
    except Exception as e:  # recorded; the next step still runs
        error = "".join(traceback.format_exception(e))[-3000:]
        return {"status": "failed", "seconds": round(time.monotonic() - start, 1), "error": error}
    status = "passed" if result.pop("ok") else "failed"
    return {"status": status, "seconds": round(time.monotonic() - start, 1), "result": result}


def gpu_slug(gpu: str | None) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'nvidia_h100_80gb_hbm3'; no GPU -> 'no_gpu'."""
    return re.sub(r"[^a-z0-9]+", "_", gpu.lower()).strip("_") if gpu else "no_gpu"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="only the CPU-checkable steps")
    args = ap.parse_args(argv)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    if gpu is not None and not args.dry_run:
        os.environ.pop("TRITON_INTERPRET", None)  # compiled kernels (read at triton's import)
    dry = args.dry_run or gpu is None
    steps = plan(gpu, args.dry_run)
    check = Check(gpu=None if dry else gpu, models=("tiny",) if dry else ("tiny", "small"),
                  results={})  # fmt: skip
    name = f"gpu_check_{gpu_slug(gpu)}" + ("_dry_run" if args.dry_run and gpu else "")
    doc = {
        "gpu": gpu,
        "dry_run": dry,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "plan": steps,
        "steps": check.results,
    }
    start = time.monotonic()
    for step, planned in zip(STEPS, steps):
        print(f"gpu_check: {step.name}: {step.what}", flush=True)
        check.results[step.name] = run_step(step, check, planned["skip"], start + BUDGET_S)
        print(f"gpu_check: {step.name}: {check.results[step.name]['status']}", flush=True)
        doc["total_s"] = round(time.monotonic() - start, 1)
        path = record(name, doc)  # after every step: a crash keeps what ran
    failed = [n for n, r in check.results.items() if r["status"] == "failed"]
    print(f"gpu_check: wrote {path}; failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
