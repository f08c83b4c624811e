"""The CPU kernels built at install time (setup.py, kernels/cpu/prebuilt.py): an engine starts on
the installed module without compiling anything; the module's name changes with every input of
the build; a build for another vector width is never imported; changed sources fall back to the
JIT build (kernels/cpu/build.py), which EPCLUSTER_CPU_KERNEL_JIT=0 turns into an error.

These need `make install` to have run (it builds the module); `make test` does that first."""

import importlib.util
import logging
import os
import shutil
import subprocess
import sys
from importlib.machinery import EXTENSION_SUFFIXES
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch.utils import cpp_extension

from kernels.cpu import build, prebuilt

REPO = Path(__file__).resolve().parents[2]
CAPABILITY = torch.backends.cpu.get_cpu_capability()
pytestmark = pytest.mark.skipif(
    CAPABILITY not in prebuilt.FLAGS, reason=f"no CPU kernels for {CAPABILITY} (no AVX2)"
)

ENGINE_START = """
import logging
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
from engine import LLM, SamplingParams
from kernels.cpu.build import cpu_kernels
out = LLM("tiny").generate([[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0.0))
print("served:", cpu_kernels().__file__, out[0].token_ids)
"""


def test_an_engine_starts_on_the_prebuilt_kernels_without_a_build(tmp_path: Path) -> None:
    """A fresh process, a JIT build made an error and an empty extension cache: the engine starts
    and generates on the installed module, and its log says so."""
    env = dict(os.environ, EPCLUSTER_CPU_KERNEL_JIT="0", TORCH_EXTENSIONS_DIR=str(tmp_path))
    env.pop("EPCLUSTER_CPU_KERNEL", None)
    proc = subprocess.run(
        [sys.executable, "-c", ENGINE_START], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    name = prebuilt.module_name(CAPABILITY, torch.__version__)
    served = Path(proc.stdout.split("served: ")[1].split()[0])
    assert served.parent == REPO / "kernels" / "cpu" and served.name.startswith(name + ".")
    assert f"CPU kernels ({CAPABILITY}): prebuilt {name}" in proc.stderr
    assert "building them now" not in proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing compiled, nothing cached


def test_the_install_builds_the_module_the_runtime_looks_for() -> None:
    spec = importlib.util.spec_from_file_location("epcluster_setup", REPO / "setup.py")
    setup = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(setup)  # defines cpu_kernel_build; setup() runs only as __main__
    path = os.environ["PATH"]
    try:
        (extension,) = setup.cpu_kernel_build()["ext_modules"]
    finally:
        os.environ["PATH"] = path
    name = prebuilt.module_name(CAPABILITY, torch.__version__)
    assert extension.name == f"kernels.cpu.{name}"
    assert extension.sources == [f"kernels/cpu/{s}" for s in prebuilt.SOURCES]
    assert prebuilt.FLAGS[CAPABILITY][1] in extension.extra_compile_args  # -mavx512f or -mavx2
    assert len(list((REPO / "kernels" / "cpu").glob(f"{name}.*"))) == 1  # built, in place


def test_the_name_changes_with_every_input_of_the_build(tmp_path: Path) -> None:
    for source in prebuilt.SOURCES + prebuilt.HEADERS:
        shutil.copy(prebuilt.HERE / source, tmp_path / source)
    base = prebuilt.module_name("AVX512", "2.13.0", tmp_path)
    assert base == prebuilt.module_name("AVX512", "2.13.0")  # the bytes count, not the folder
    assert base.startswith("_ext_avx512_") and len(base) == len("_ext_avx512_") + 16
    assert prebuilt.module_name("AVX2", "2.13.0", tmp_path).startswith("_ext_avx2_")
    assert prebuilt.sources_hash("AVX2", "2.13.0", tmp_path) != base[-16:]
    assert prebuilt.module_name("AVX512", "2.13.1", tmp_path) != base
    names = set()
    for source in prebuilt.SOURCES + prebuilt.HEADERS:
        text = (prebuilt.HERE / source).read_bytes()
        (tmp_path / source).write_bytes(text + b"\n")
        names.add(prebuilt.module_name("AVX512", "2.13.0", tmp_path))
        (tmp_path / source).write_bytes(text)
    assert len(names) == len(prebuilt.SOURCES + prebuilt.HEADERS) and base not in names


def test_the_prebuilt_module_serves_and_the_log_says_which(caplog) -> None:
    with caplog.at_level(logging.INFO, logger=build.__name__):
        module = build.cpu_kernels.__wrapped__()
    name = prebuilt.module_name(CAPABILITY, torch.__version__)
    assert module.__name__.split(".")[-1] == name
    assert f"prebuilt {name}" in caplog.text
    x, w = torch.randn(3, 40), torch.randn(24, 40)
    torch.testing.assert_close(module.linear(x, w), x @ w.T, rtol=1e-5, atol=1e-5)


def other_capability() -> str:
    return "AVX2" if CAPABILITY == "AVX512" else "AVX512"


def test_a_build_for_another_vector_width_is_never_imported(monkeypatch) -> None:
    """On this CPU's capability changed to the other one (what an AVX2 CPU reports next to an
    AVX-512 build), the installed module is not imported: the JIT build is asked for."""
    other = other_capability()
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: other)
    monkeypatch.setenv(build.JIT_ENV_VAR, "0")
    installed = prebuilt.module_name(CAPABILITY, torch.__version__)
    with pytest.raises(RuntimeError, match=f"the prebuilt {installed} is not _ext_{other.lower()}"):
        build.cpu_kernels.__wrapped__()
    assert not [m for m in sys.modules if m.startswith(f"kernels.cpu._ext_{other.lower()}")]


def test_changed_sources_fall_back_to_the_jit_build(monkeypatch, tmp_path: Path, caplog) -> None:
    """An editable checkout whose C++ changed after the install: the installed module is stale
    (its name is not the sources'), so the JIT build runs (stubbed here: it takes a minute),
    with a warning; with EPCLUSTER_CPU_KERNEL_JIT=0 that is an error instead."""
    for source in prebuilt.SOURCES + prebuilt.HEADERS:
        shutil.copy(prebuilt.HERE / source, tmp_path / source)
    with open(tmp_path / "ops.cpp", "a") as f:
        f.write("// changed\n")
    stale = prebuilt.module_name(CAPABILITY, torch.__version__)
    (tmp_path / f"{stale}{EXTENSION_SUFFIXES[0]}").write_bytes(b"")
    monkeypatch.setattr(prebuilt, "HERE", tmp_path)
    monkeypatch.setenv("PATH", os.environ["PATH"])  # the JIT path prepends the venv's bin
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setenv(build.JIT_ENV_VAR, "0")
    with pytest.raises(RuntimeError, match=f"the prebuilt {stale} is not _ext_"):
        build.cpu_kernels.__wrapped__()
    calls = []

    def jit_load(name: str, sources: list[str], **options: object) -> ModuleType:
        calls.append((name, options["extra_cflags"]))
        return ModuleType(name)

    monkeypatch.setattr(cpp_extension, "load", jit_load)
    monkeypatch.setenv(build.JIT_ENV_VAR, "1")
    with caplog.at_level(logging.INFO, logger=build.__name__):
        module = build.cpu_kernels.__wrapped__()
    assert calls == [(module.__name__, prebuilt.FLAGS[CAPABILITY])]
    assert module.__name__.startswith("epcluster_cpu_kernels_")
    assert "other sources" in caplog.text and "building them now" in caplog.text
