import errno
import logging
import os

import pytest
import torch

from engine.kv_tiers import block_file
from engine.kv_tiers.disk import DiskTier
from tests.engine.kv_tiers.blocks import block, key

FILE_BYTES = block_file.file_size(key(1), block(1))


def _names(disk: DiskTier) -> set[str]:
    return {name for _, _, names in os.walk(disk.path) for name in names}


def test_lru_evicts_least_recently_used_files_within_budget(tmp_path) -> None:
    disk = DiskTier(str(tmp_path), budget_bytes=3 * FILE_BYTES)
    for i in (1, 2, 3):
        assert disk.put(key(i), block(i))
    assert torch.equal(disk.get(key(1)), block(1))  # 2 is now the oldest
    disk.put(key(4), block(4))  # evicts 2
    disk.put(key(5), block(5))  # evicts 3
    assert _names(disk) == {key(i).name for i in (1, 4, 5)}
    assert [disk.contains(key(i)) for i in (1, 2, 3, 4, 5)] == [True, False, False, True, True]
    s = disk.stats
    assert (s.evictions, s.blocks, s.bytes_held) == (2, 3, 3 * FILE_BYTES)
    assert disk.file_path(key(1)).startswith(os.path.join(str(tmp_path), key(1).name[:2], ""))


def test_a_second_tier_on_the_directory_is_warm_and_shared(tmp_path) -> None:
    first = DiskTier(str(tmp_path), budget_bytes=10 * FILE_BYTES)
    for i in (1, 2):
        first.put(key(i), block(i))
    # A restart (or another rank starting): the scan finds both.
    second = DiskTier(str(tmp_path), budget_bytes=10 * FILE_BYTES)
    assert len(second) == 2 and second.stats.bytes_held == 2 * FILE_BYTES
    assert torch.equal(second.get(key(2)), block(2))
    # A block the first writes after the second's scan: found on the second's next lookup.
    first.put(key(3), block(3))
    assert second.contains(key(3)) and torch.equal(second.get(key(3)), block(3))
    assert len(second) == 3


def test_restart_scan_orders_by_last_use_and_applies_a_smaller_budget(tmp_path) -> None:
    first = DiskTier(str(tmp_path), budget_bytes=10 * FILE_BYTES)
    for i in (1, 2, 3):
        first.put(key(i), block(i))
        os.utime(first.file_path(key(i)), (1000 + i, 1000 + i))  # 1 oldest
    os.utime(first.file_path(key(1)), (2000, 2000))  # 1 used last: 2 is now the oldest
    second = DiskTier(str(tmp_path), budget_bytes=2 * FILE_BYTES)
    assert second.stats.evictions == 1 and _names(second) == {key(1).name, key(3).name}


def test_a_corrupt_file_is_a_miss_removed_and_forgotten(tmp_path) -> None:
    disk = DiskTier(str(tmp_path), budget_bytes=10 * FILE_BYTES)
    disk.put(key(1), block(1))
    path = disk.file_path(key(1))
    with open(path, "r+b") as f:
        f.truncate(FILE_BYTES - 3)
    assert disk.get(key(1)) is None
    assert not os.path.exists(path) and not disk.contains(key(1))
    assert (disk.stats.misses, disk.stats.blocks, disk.stats.bytes_held) == (1, 0, 0)


def test_an_unwritable_directory_is_no_tier_with_one_warning(tmp_path, caplog) -> None:
    (tmp_path / "file").write_bytes(b"x")  # a directory under a file: makedirs fails (even root)
    with caplog.at_level(logging.WARNING, logger="engine.kv_tiers.disk"):
        disk = DiskTier(str(tmp_path / "file" / "kv"), budget_bytes=10 * FILE_BYTES)
        assert not disk.put(key(1), block(1)) and not disk.put(key(2), block(2))
        assert not disk.contains(key(1)) and disk.get(key(1)) is None
    assert not disk.enabled and disk.stats.disabled == 1
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1


@pytest.mark.parametrize("failing", ["write", "replace", "open"])
def test_a_full_disk_turns_the_tier_off_with_one_warning(tmp_path, monkeypatch, caplog, failing):
    disk = DiskTier(str(tmp_path), budget_bytes=10 * FILE_BYTES)
    assert disk.put(key(1), block(1))
    code = errno.EACCES if failing == "open" else errno.ENOSPC

    def fail(*args: object, **kwargs: object) -> None:
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr(os, failing, fail)
    with caplog.at_level(logging.WARNING, logger="engine.kv_tiers.disk"):
        assert not disk.put(key(2), block(2))
        assert not disk.put(key(3), block(3))
    monkeypatch.undo()
    assert disk.stats.disabled == 1 and disk.stats.errors == 1
    assert len([r for r in caplog.records if r.levelno == logging.WARNING]) == 1
    assert disk.get(key(1)) is None and not disk.contains(key(1))  # off: every lookup misses
    leftovers = {n for n in _names(disk) if n.endswith(block_file.TMP_SUFFIX)}
    assert not leftovers  # the failed writer removed its temporary file


def test_rewriting_a_block_another_rank_wrote_counts_it_once(tmp_path) -> None:
    first = DiskTier(str(tmp_path), budget_bytes=10 * FILE_BYTES)
    second = DiskTier(str(tmp_path), budget_bytes=10 * FILE_BYTES)
    first.put(key(1), block(1))
    assert second.contains(key(1))  # indexed from the shared directory
    assert second.put(key(1), block(1)) and second.put(key(1), block(1))
    assert (second.stats.blocks, second.stats.bytes_held) == (1, FILE_BYTES)
    assert _names(second) == {key(1).name}
