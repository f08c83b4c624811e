"""Loud fallbacks: a GPU without a working triton, and a CPU without AVX2 or a compiler, log one
warning naming the paths that serve instead, and serving_kernels reports what serves (what
GetModelInfo.kernels and epcluster_kernels_info carry)."""

import functools
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils import cpp_extension

from kernels import backend
from kernels.backend import ENV_VAR, serving_kernels, use_triton
from kernels.cpu import build

REPO = Path(__file__).resolve().parents[2]


def warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]


@pytest.fixture
def no_triton(monkeypatch):
    """This process as if `import triton` had failed on a CUDA machine, with a fresh one-warning
    cache (restored after)."""
    monkeypatch.setattr(backend, "triton", None)
    monkeypatch.setattr(backend, "TRITON_ERROR", "ImportError: libcuda.so.1: cannot open")
    monkeypatch.setenv(ENV_VAR, "auto")
    backend.warn_no_triton.cache_clear()
    yield
    backend.warn_no_triton.cache_clear()


def test_a_gpu_without_triton_warns_once_and_reports_the_references(no_triton, caplog):
    caplog.set_level("WARNING")
    assert serving_kernels("cuda", torch.bfloat16) == "reference"
    assert serving_kernels("cuda:1", torch.float32) == "reference"
    assert not use_triton(SimpleNamespace(is_cuda=True))  # a CUDA tensor's op: the reference
    (message,) = warnings(caplog)
    assert "libcuda.so.1: cannot open" in message
    assert "CUDA tensors take the torch reference kernels" in message
    assert "without CUDA graphs" in message


def test_forcing_triton_without_it_is_an_error_not_a_fallback(no_triton, monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")
    with pytest.raises(RuntimeError, match="libcuda.so.1"):
        serving_kernels("cuda", torch.bfloat16)


def test_a_broken_triton_import_counts_as_none(tmp_path):
    """A triton that raises something other than ImportError at import (a broken install)."""
    fake = tmp_path / "triton"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise RuntimeError('0 active drivers')\n")
    code = (
        f"import sys; sys.path.insert(0, {str(tmp_path)!r}); from kernels import backend; "
        "print(backend.triton is None, backend.TRITON_ERROR)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "True RuntimeError: 0 active drivers"


def test_a_cpu_without_avx2_warns_once_and_reports_the_references(monkeypatch, caplog):
    caplog.set_level("WARNING")
    monkeypatch.delenv(build.ENV_VAR, raising=False)
    monkeypatch.setenv(ENV_VAR, "auto")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    # a cache of its own, as the process has one: the warning comes with the first call only
    monkeypatch.setattr(build, "cpu_kernels", functools.cache(build.cpu_kernels.__wrapped__))
    assert serving_kernels("cpu", torch.float32) == "reference"
    assert serving_kernels("cpu", torch.float32) == "reference"
    (message,) = warnings(caplog)
    assert "vectors are DEFAULT" in message and "need AVX2 or AVX-512" in message
    assert "take torch's reference paths" in message


def test_a_cpu_without_a_compiler_warns_and_reports_the_references(monkeypatch, caplog, tmp_path):
    caplog.set_level("WARNING")
    monkeypatch.delenv(build.ENV_VAR, raising=False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    # a build folder of its own: nothing lands in torch's extension cache
    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path))

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Error building extension: c++: command not found")

    monkeypatch.setattr(cpp_extension, "load", no_compiler)
    assert build.cpu_kernels.__wrapped__() is None
    # (no prebuilt module here either: kernels/cpu/build.py first warns that it builds them)
    (message,) = [m for m in warnings(caplog) if "reference paths" in m]
    assert "did not build" in message and "c++: command not found" in message
    assert "take torch's reference paths" in message


def test_turning_the_cpu_kernels_off_is_quiet(monkeypatch, caplog):
    caplog.set_level("WARNING")
    monkeypatch.setenv(build.ENV_VAR, "0")
    assert build.cpu_kernels.__wrapped__() is None
    assert warnings(caplog) == []


def test_what_serves_this_machine(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "auto")
    built = build.cpu_kernels() is not None
    capability = torch.backends.cpu.get_cpu_capability().lower()
    assert serving_kernels("cpu", torch.float32) == (f"cpu-{capability}" if built else "reference")
    assert serving_kernels("cpu", torch.bfloat16) == "reference"  # the CPU kernels are fp32
    monkeypatch.setenv(ENV_VAR, "reference")
    assert serving_kernels("cpu", torch.float32) == "reference"
    if backend.interpreting():
        monkeypatch.setenv(ENV_VAR, "triton")
        assert serving_kernels("cpu", torch.float32) == "triton-interpreter"
