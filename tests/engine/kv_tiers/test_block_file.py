import os
import threading
from dataclasses import replace

import pytest
import torch

from engine.kv_tiers import block_file
from engine.kv_tiers.key import KeySpace
from tests.engine.kv_tiers.blocks import SPACE, block, key


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_round_trip_is_bit_for_bit(tmp_path, dtype: str) -> None:
    space = KeySpace(b"m" * 16, dtype, block_size=4, num_layers=2)
    kv = torch.randn(2, 4, 3, generator=torch.Generator().manual_seed(0)).to(getattr(torch, dtype))
    kv[0, 0, 0] = float("nan")  # NaN payloads must survive too (compared as bits)
    path = str(tmp_path / "b")
    written = block_file.write(path, key(1, space), kv)
    assert written == os.path.getsize(path) == block_file.file_size(key(1, space), kv)
    back = block_file.read(path, key(1, space))
    assert back is not None and back.dtype == kv.dtype and back.shape == kv.shape
    assert torch.equal(back.view(torch.uint8), kv.view(torch.uint8))
    assert os.listdir(tmp_path) == ["b"]  # no temporary file left behind


def _damage_cases(data: bytes) -> dict[str, bytes]:
    flipped = bytearray(data)
    flipped[-5] ^= 0x01  # one bit of the payload
    other_model = replace(SPACE, model=b"x" * 16)
    return {
        "truncated": data[: len(data) - 7],
        "header only": data[:20],
        "flipped payload byte": bytes(flipped),
        "foreign": block_file.encode(key(2), block(1)),  # another block's whole, valid file
        "other model": block_file.encode(key(1, other_model), block(1)),
        "garbage": b"\x00\xff" * 300,
        "empty": b"",
    }


@pytest.mark.parametrize(
    "case",
    [
        "truncated",
        "header only",
        "flipped payload byte",
        "foreign",
        "other model",
        "garbage",
        "empty",
    ],
)
def test_bad_file_is_a_miss_and_removed(tmp_path, case: str) -> None:
    good = block_file.encode(key(1), block(1))
    path = tmp_path / "b"
    path.write_bytes(_damage_cases(good)[case])
    assert block_file.read(str(path), key(1)) is None
    assert not path.exists()


def test_missing_file_is_a_miss(tmp_path) -> None:
    assert block_file.read(str(tmp_path / "none"), key(1)) is None


def test_concurrent_writers_of_one_block_leave_one_valid_file(tmp_path) -> None:
    path = str(tmp_path / "b")
    start = threading.Barrier(8)
    errors: list[BaseException] = []

    def writer() -> None:
        start.wait()
        try:
            for _ in range(20):
                block_file.write(path, key(1), block(1))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=writer) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert os.listdir(tmp_path) == ["b"]
    back = block_file.read(path, key(1))
    assert back is not None and torch.equal(back, block(1))
