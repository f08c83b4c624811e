import torch

from engine.kv_tiers.host import HostTier
from tests.engine.kv_tiers.blocks import BLOCK_BYTES, block, key


def test_lru_evicts_least_recently_used_within_budget() -> None:
    host = HostTier(budget_bytes=3 * BLOCK_BYTES + BLOCK_BYTES // 2)  # room for 3 blocks
    for i in (1, 2, 3):
        assert host.put(key(i), block(i))
    assert host.get(key(1)) is not None  # 1 is now the most recent: 2 is the oldest
    assert host.contains(key(2))  # a lookup does not refresh 2
    host.put(key(4), block(4))  # evicts 2
    host.put(key(5), block(5))  # evicts 3
    assert [host.contains(key(i)) for i in (1, 2, 3, 4, 5)] == [True, False, False, True, True]
    assert host.stats.evictions == 2
    assert host.stats.bytes_held == 3 * BLOCK_BYTES and host.stats.blocks == 3 == len(host)
    assert torch.equal(host.get(key(1)), block(1))
    assert host.get(key(2)) is None
    s = host.stats
    assert (s.hits, s.misses, s.read_count, s.bytes_read) == (2, 1, 2, 2 * BLOCK_BYTES)
    assert s.bytes_written == 5 * BLOCK_BYTES


def test_put_again_replaces_without_double_counting() -> None:
    host = HostTier(budget_bytes=2 * BLOCK_BYTES)
    host.put(key(1), block(1))
    host.put(key(1), block(7))
    assert host.stats.bytes_held == BLOCK_BYTES and host.stats.evictions == 0
    assert torch.equal(host.get(key(1)), block(7))


def test_block_larger_than_budget_is_refused() -> None:
    host = HostTier(budget_bytes=BLOCK_BYTES - 1)
    assert not host.put(key(1), block(1))
    assert len(host) == 0 and host.stats.bytes_held == 0
