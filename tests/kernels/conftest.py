import pytest
import torch


@pytest.fixture
def device() -> str:
    """Where the kernels run: compiled on a GPU, else on the CPU in Triton's interpreter."""
    return "cuda" if torch.cuda.is_available() else "cpu"
