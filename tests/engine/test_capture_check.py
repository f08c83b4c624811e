"""engine/capture_check.py: what it reports on hand-made steps (each kind at its line, and none
of the ops a CUDA graph holds), then over the decode step of every batch bucket that cuda_graph
captures (fails on any finding), and over the expert-parallel all-to-all step (a report: the
list docs/kernels.md gives of what a GPU port of the all-to-all must remove)."""

import os
from pathlib import Path

import pytest
import torch

from engine import LLM
from engine.capture_check import CaptureCheck, Finding
from kernels import backend
from kernels.backend import ENV_VAR
from kernels.moe_mlp import dense_mlp
from moe import load_model
from moe.placement import Placement
from moe.presets import ensure_preset
from tests.procs import run_ranks

HERE = "tests/engine/test_capture_check.py"
DOCS = Path(__file__).resolve().parents[2] / "docs" / "kernels.md"


def findings_of(fn) -> list[Finding]:
    with CaptureCheck("cpu") as check:
        fn()
    return check.findings


X = torch.arange(6.0)  # [6]
MASK = X > 2
# (the call, the op reported, its kind): one line each, the line the finding must name
REPORTED = [
    (lambda: X.sum().item(), "Tensor.item", "host read"),
    (lambda: X.tolist(), "Tensor.tolist", "host read"),
    (lambda: X.cpu(), "Tensor.cpu", "host read"),
    (lambda: X.numpy(), "Tensor.numpy", "host read"),
    (lambda: bool(X.sum() > 0), "Tensor.__bool__", "host read"),
    (lambda: int(X[1]), "Tensor.__int__", "host read"),
    (lambda: float(X[1]), "Tensor.__float__", "host read"),
    (lambda: [1, 2, 3][X.long()[1]], "Tensor.__index__", "host read"),
    (lambda: torch.equal(X, X), "aten.equal", "host read"),
    (lambda: torch.tensor([1, 2]), "torch.tensor", "host data"),
    (lambda: torch.as_tensor([3], device="cpu"), "torch.as_tensor", "host data"),
    (lambda: X.new_tensor([1.0]), "Tensor.new_tensor", "host data"),
    (lambda: torch.nonzero(X), "aten.nonzero", "data-dependent shape"),
    (lambda: X.masked_select(MASK), "aten.masked_select", "data-dependent shape"),
    (lambda: torch.bincount(X.long()), "aten.bincount", "data-dependent shape"),
    (lambda: X.repeat_interleave(X.long()), "aten.repeat_interleave", "data-dependent shape"),
    (lambda: X[MASK], "aten.index", "boolean mask"),
]
# what a graph holds: device-side factories, sorts, searches, gathers, scatters, fills
SILENT = [
    lambda: torch.arange(4),
    lambda: torch.full((3,), 7, dtype=torch.long),
    lambda: torch.zeros(4, dtype=torch.long).index_add_(0, X.long()[:3], X.long()[:3]),
    lambda: torch.searchsorted(X, X),
    lambda: torch.argsort(X, stable=True),
    lambda: torch.repeat_interleave(X, X.long(), output_size=15),
    lambda: torch.repeat_interleave(X, 2),
    lambda: X[X.long()[:3]],
    lambda: X.masked_fill(MASK, 0.0),
    lambda: torch.where(MASK, X, 0.0),
    lambda: torch.as_tensor(X, dtype=torch.float64),
    lambda: X.to(torch.int32),
]


@pytest.mark.parametrize("case", range(len(REPORTED)))
def test_reports_each_kind_at_its_line(case):
    fn, op, kind = REPORTED[case]
    (found,) = findings_of(fn)
    assert (found.kind, found.op) == (kind, op)
    assert found.where == f"{HERE}:{fn.__code__.co_firstlineno} (<lambda>)"
    assert found.stack[0] == found.where and len(found.stack) <= 3


def test_unique_is_data_dependent():
    (found,) = findings_of(lambda: torch.unique(X))
    assert found.kind == "data-dependent shape" and "unique" in found.op


@pytest.mark.parametrize("case", range(len(SILENT)))
def test_reports_nothing_a_graph_can_hold(case):
    assert findings_of(SILENT[case]) == []


def test_leaves_torch_as_it_found_it():
    saved = torch.Tensor.tolist, torch.as_tensor, torch.Tensor.__bool__
    with pytest.raises(RuntimeError, match="inside"):
        with CaptureCheck("cpu"):
            raise RuntimeError("inside")
    assert (torch.Tensor.tolist, torch.as_tensor, torch.Tensor.__bool__) == saved
    assert findings_of(lambda: None) == []
    X.tolist()  # outside any check: nothing recorded anywhere, nothing raised


@pytest.mark.skipif(not backend.interpreting(), reason="Triton on CPU tensors: the interpreter")
def test_the_dense_mlp_on_triton_builds_its_count_on_the_device(monkeypatch):
    """The dense layers' and shared experts' MLP (one slot of the grouped GEMM): no host list
    copied to the device, and the reference's numbers."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 64, generator=gen)  # [N, D]
    w13, w2 = torch.randn(64, 64, generator=gen) / 8, torch.randn(64, 32, generator=gen) / 8
    monkeypatch.setenv(ENV_VAR, "reference")
    expected = dense_mlp(x, w13, w2)
    monkeypatch.setenv(ENV_VAR, "triton")
    with CaptureCheck("cpu") as check:
        out = dense_mlp(x, w13, w2)
    assert check.findings == [], "\n".join(map(str, check.findings))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)  # fp32 in the interpreter


# ---- the decode step of every path cuda_graph captures ----------------------------------------


def decode_graphs(kernels: str, monkeypatch, capture: bool = False):
    """A tiny-random engine's DecodeGraphs (buckets 1 .. 32) with EPCLUSTER_KERNELS=kernels:
    triton runs on the GPU where there is one, else in Triton's interpreter."""
    monkeypatch.setenv(ENV_VAR, kernels)
    device = "cuda" if kernels == "triton" and torch.cuda.is_available() else "cpu"
    llm = LLM("tiny-random", block_size=4, max_model_len=96, device=device)
    llm.engine.runner.enable_graphs(llm.engine.max_model_len, capture=capture)
    return llm.engine.runner.graphs, device


def bucket_findings(graphs, device: str, bucket: int) -> list[Finding]:
    """The step of one bucket over the static buffers (padding rows: token 0 at position 0),
    after a warm-up step as DecodeGraphs._capture runs (lazy moves to the device happen there)."""
    with torch.inference_mode():
        graphs._forward(bucket)
        with CaptureCheck(device) as check:
            graphs._forward(bucket)
    return check.findings


@pytest.mark.slow
def test_every_bucket_of_the_triton_decode_step_is_capture_safe(monkeypatch):
    """The dense layer, the shared experts, the gate, the local dispatch, the routed experts and
    the attention of the Triton path: nothing a graph cannot hold, at any batch size."""
    graphs, device = decode_graphs("triton", monkeypatch)
    assert graphs.buckets == [1, 2, 4, 8, 16, 32]
    for bucket in graphs.buckets:
        found = bucket_findings(graphs, device, bucket)
        assert found == [], f"bucket {bucket}:\n" + "\n".join(map(str, found))


def test_the_reference_path_reads_expert_counts_so_its_steps_run_eagerly(monkeypatch, caplog):
    """The references read the routed experts' counts on the host (one .tolist() per MoE layer,
    and nothing else): DecodeGraphs runs them eagerly, with a warning, instead of capturing."""
    caplog.set_level("WARNING", logger="engine.decode_graphs")
    graphs, device = decode_graphs("reference", monkeypatch, capture=True)
    assert not graphs.capture and graphs.graphs == {}
    (warning,) = [r.getMessage() for r in caplog.records if r.name == "engine.decode_graphs"]
    assert "EPCLUSTER_KERNELS=reference" in warning and "eagerly" in warning
    for bucket in graphs.buckets:
        found = bucket_findings(graphs, device, bucket)
        keys = [f.key for f in found]
        assert keys == ["Tensor.tolist at moe/dispatch.py (_handle)"] * len(graphs.moes), keys


# ---- the expert-parallel all-to-all step: reported, not failed --------------------------------

MOE_LAYER, NUM_EXPERTS = 1, 16  # the tiny preset: layer 0 is dense


def _all_to_all_findings(rank: int, num_ranks: int) -> list[Finding]:
    """One MoE layer of a 2-rank pool (gloo) under the check, on the kernels a GPU would take
    (Triton, interpreted) where the interpreter is on."""
    os.environ[ENV_VAR] = "triton" if backend.interpreting() else "reference"
    placement = Placement.contiguous((1, 2), NUM_EXPERTS, num_ranks)
    model = load_model("tiny-random", experts=placement.rank_experts(rank))
    model.install_expert_parallel(None, placement, rank)
    x = torch.randn(3 + 2 * rank, 64, generator=torch.Generator().manual_seed(rank))  # [T, D]
    with torch.inference_mode(), CaptureCheck("cpu") as check:
        model.model.layers[MOE_LAYER].mlp(x)
    return check.findings


@pytest.mark.timeout(120)
def test_the_all_to_all_step_report_names_its_host_reads_and_docs_list_them():
    ensure_preset("tiny-random")  # before spawning: the ranks would race to write it
    reports = run_ranks(_all_to_all_findings, 2, timeout=110)
    docs = DOCS.read_text()
    for found in reports:
        keys = {f.key for f in found}
        # the split sizes of the uneven all-to-alls, read back on the host
        assert "Tensor.tolist at moe/dispatch_handles.py (launch_rows)" in keys, keys
        assert "aten.bincount at moe/dispatch.py (dispatch)" in keys, keys
        missing = sorted(k for k in keys if f"`{k}`" not in docs)
        assert missing == [], f"docs/kernels.md does not list {missing}"
