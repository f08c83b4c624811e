"""bench/gpu_check.py's dry run (what CI can check of the GPU acceptance command): the plan of
steps, the CPU engine's tokens and the interpreter's kernel tests recorded, every GPU step
marked skipped, a failing step recorded without stopping the others."""

import json
import sys
from pathlib import Path

import pytest
import torch

from bench import common, gpu_check
from engine import LLM

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU dry run")


@pytest.fixture
def results(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(sys, "argv", [str(common.REPO / "bench" / "gpu_check.py"), "--dry-run"])
    return tmp_path


def test_the_dry_run_records_the_plan_and_the_cpu_parts(results: Path) -> None:
    assert gpu_check.main(["--dry-run"]) == 0
    out = json.loads((results / "gpu_check_no_gpu.json").read_text())
    assert out["gpu"] is None and out["dry_run"] is True
    assert out["command"] == ".venv/bin/python -m bench.gpu_check --dry-run"
    names = ["kernel_tests", "engine_cpu", "engine_cuda", "decode_graphs", "fp8", "kernel_bench"]
    assert [s["step"] for s in out["plan"]] == [*names, "decode_speed"]
    steps = out["steps"]
    for step in out["plan"]:
        assert step["needs_gpu"] == (step["step"] not in ("kernel_tests", "engine_cpu"))
        if step["needs_gpu"]:
            assert steps[step["step"]] == {"status": "skipped: no GPU"}
    kernels = steps["kernel_tests"]
    assert kernels["status"] == "passed", kernels
    assert kernels["result"]["passed"] >= 10 and kernels["result"]["failed"] == 0
    assert kernels["result"]["command"].endswith("(TRITON_INTERPRET=1)")
    # the tokens recorded are the engine's for the same prompts (24 greedy each)
    tokens = steps["engine_cpu"]["result"]["tokens"]
    assert list(tokens) == ["tiny"] and steps["engine_cpu"]["status"] == "passed"
    assert tokens["tiny"] == gpu_check.greedy(LLM("tiny"))
    assert [len(t) for t in tokens["tiny"]] == [24] * 4


def test_a_failing_step_is_recorded_and_the_others_still_run(
    results: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(check: gpu_check.Check) -> dict:
        raise RuntimeError("operation not permitted when stream is capturing")

    steps = list(gpu_check.STEPS)
    steps[0] = gpu_check.Step("kernel_tests", "broken on purpose", False, broken)
    monkeypatch.setattr(gpu_check, "STEPS", tuple(steps))
    assert gpu_check.main(["--dry-run"]) == 1
    out = json.loads((results / "gpu_check_no_gpu.json").read_text())
    assert out["steps"]["kernel_tests"]["status"] == "failed"
    assert "stream is capturing" in out["steps"]["kernel_tests"]["error"]
    assert out["steps"]["engine_cpu"]["status"] == "passed"


def test_the_plan_on_a_gpu_runs_every_step_and_the_budget_skips_late_ones() -> None:
    assert all(s["skip"] is None for s in gpu_check.plan("NVIDIA H100 80GB HBM3", False))
    dry = gpu_check.plan("NVIDIA H100 80GB HBM3", True)
    assert {s["skip"] for s in dry if s["needs_gpu"]} == {"skipped: --dry-run"}
    assert gpu_check.gpu_slug("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
    check = gpu_check.Check(gpu="x", models=("tiny",), results={})
    late = gpu_check.run_step(gpu_check.STEPS[0], check, None, deadline=0.0)
    assert late == {"status": "skipped: past the 600 s budget"}
