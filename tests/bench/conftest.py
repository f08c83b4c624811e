from pathlib import Path

import pytest

from tests.mtp_checkpoint import write_mtp_random


@pytest.fixture(scope="session")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tiny-random with one random MTP layer (tests/mtp_checkpoint.py): the speculating
    benchmarks' engine side."""
    return write_mtp_random(tmp_path_factory.mktemp("mtp-random"))
