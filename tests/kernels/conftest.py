import pytest
import torch

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
