import os
from types import ModuleType

import pytest
import torch

from kernels.cpu.build import cpu_kernels
from tests.kernels.branches import DotRecorder


@pytest.fixture
def device() -> str:
    """Where the kernels run: compiled on a GPU, else on the CPU in Triton's interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def dots(monkeypatch: pytest.MonkeyPatch) -> DotRecorder:
    """The interpreter's tl.dot counted by kind, with bf16 dots made exact (tests/kernels/
    branches.py)."""
    return DotRecorder(monkeypatch)


@pytest.fixture(scope="module")
def kernels() -> ModuleType:
    """The compiled CPU kernels (built here where the install built none: make test has a
    compiler); skips where they cannot serve."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no AVX2 on this CPU: the torch paths serve")
    if os.environ.get("EPCLUSTER_CPU_KERNEL") == "0":
        pytest.skip("EPCLUSTER_CPU_KERNEL=0")
    module = cpu_kernels()
    assert module is not None, "the CPU kernels did not build (see the warning)"
    return module
