import pytest
import torch


@pytest.fixture
def one_torch_thread():
    """The eplb search runs many small tensor ops: extra intra-op threads only spin (4x the CPU
    time on the shared 2-core test machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
