import threading

import torch

from engine.kv_tiers import block_file
from engine.kv_tiers.disk import DiskTier
from engine.kv_tiers.host import HostTier
from engine.kv_tiers.store import TieredStore
from tests.engine.kv_tiers.blocks import BLOCK_BYTES, block, key

FILE_BYTES = block_file.file_size(key(1), block(1))


def _store(tmp_path, host_blocks: int = 10, disk_blocks: int = 10) -> TieredStore:
    return TieredStore(
        HostTier(host_blocks * BLOCK_BYTES), DiskTier(str(tmp_path), disk_blocks * FILE_BYTES)
    )


def test_offered_blocks_reach_both_tiers_and_load_back(tmp_path) -> None:
    store = _store(tmp_path)
    for i in (1, 2, 3):
        assert store.offer(key(i), block(i))
    assert store.close()
    assert all(store.host.contains(key(i)) and store.disk.contains(key(i)) for i in (1, 2, 3))
    loaded = store.load([key(1), key(2), key(3)])
    assert all(torch.equal(kv, block(i)) for kv, i in zip(loaded, (1, 2, 3), strict=True))
    assert store.stats()["host"].hits == 3 and store.stats()["disk"].hits == 0


def test_lookup_stops_at_the_first_missing_key(tmp_path) -> None:
    store = _store(tmp_path)
    for i in (1, 2, 4):
        store.offer(key(i), block(i))
    assert store.close()
    assert store.lookup([key(1), key(2), key(3), key(4)]) == 2
    assert store.lookup([key(3), key(1)]) == 0
    assert store.lookup([key(1), key(2)]) == 2
    assert len(store.load([key(1), key(2), key(3), key(4)])) == 2


def test_disk_hits_are_promoted_to_host(tmp_path) -> None:
    store = _store(tmp_path, host_blocks=1)  # host keeps only the last block offered
    for i in (1, 2):
        store.offer(key(i), block(i))
    assert store.close()
    assert not store.host.contains(key(1)) and store.lookup([key(1), key(2)]) == 2
    loaded = store.load([key(1)])
    assert torch.equal(loaded[0], block(1)) and store.host.contains(key(1))
    assert store.stats()["disk"].hits == 1 and store.stats()["host"].misses == 1


def test_a_restarted_store_is_warm_from_disk(tmp_path) -> None:
    first = _store(tmp_path)
    first.offer(key(1), block(1))
    assert first.close()
    second = _store(tmp_path)
    assert second.lookup([key(1)]) == 1 and torch.equal(second.load([key(1)])[0], block(1))
    second.close()


def test_offer_never_blocks_and_counts_drops_when_the_queue_is_full() -> None:
    host = HostTier(10 * BLOCK_BYTES)
    entered, release = threading.Event(), threading.Event()
    put = host.put

    def slow_put(k, kv):  # the writer holds block 1 until released
        entered.set()
        release.wait()
        return put(k, kv)

    host.put = slow_put  # type: ignore[method-assign]
    store = TieredStore(host, None, max_queued=1)
    assert store.offer(key(1), block(1))
    assert entered.wait(timeout=60)  # the writer took block 1: the queue is empty
    assert store.offer(key(2), block(2))  # fills the queue
    assert not store.offer(key(3), block(3))  # full: dropped, not waited for
    assert store.dropped_writes == 1
    release.set()
    assert store.close()
    assert [host.contains(key(i)) for i in (1, 2, 3)] == [True, True, False]
    assert not store.offer(key(4), block(4)) and store.dropped_writes == 2  # closed


def test_a_disk_that_fails_leaves_the_store_serving_from_host(tmp_path) -> None:
    (tmp_path / "file").write_bytes(b"x")
    store = TieredStore(
        HostTier(10 * BLOCK_BYTES), DiskTier(str(tmp_path / "file" / "kv"), 1 << 20)
    )
    store.offer(key(1), block(1))
    assert store.close() and store.writer_errors == 0
    assert store.lookup([key(1)]) == 1 and torch.equal(store.load([key(1)])[0], block(1))
    assert store.stats()["disk"].disabled == 1
