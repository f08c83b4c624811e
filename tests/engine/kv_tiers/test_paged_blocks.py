"""The paged cache -> tiers -> another paged cache path, checked against kv_transfer.export_kv
(the rows a request's KV handoff reads)."""

import torch

from engine.block_manager import BlockManager
from engine.kv_tiers.disk import DiskTier
from engine.kv_tiers.host import HostTier
from engine.kv_tiers.key import KeySpace
from engine.kv_tiers.paged import blocks_in, blocks_out
from engine.kv_tiers.store import TieredStore
from engine.kv_transfer import export_kv

L, NB, BS, C = 3, 8, 4, 5


def _caches(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(NB, BS, C, generator=g) for _ in range(L)]


def test_a_prefix_moved_through_the_tiers_lands_with_the_same_rows(tmp_path) -> None:
    tokens = list(range(100, 111))  # two full blocks and a partial one
    space = KeySpace(b"m" * 16, "float32", BS, L)
    # Rank A computed the prompt into blocks [5, 2, 7] of its cache.
    src = _caches(0)
    table_a = [5, 2, 7]
    keys = space.keys(tokens)
    store = TieredStore(HostTier(0), DiskTier(str(tmp_path), 1 << 20))  # disk only: shared
    for k, kv in zip(keys, blocks_out(src, table_a[: len(keys)]), strict=True):
        store.offer(k, kv)
    assert store.close()
    # Rank B (its own paged cache, another store on the same directory) misses in its paged
    # cache, hits both full blocks below, loads them into fresh blocks.
    dst = _caches(1)
    manager = BlockManager(NB, BS)
    table_b, paged_hits = manager.allocate(tokens)
    assert paged_hits == 0
    other = TieredStore(HostTier(1 << 20), DiskTier(str(tmp_path), 1 << 20))
    num_hits = other.lookup(keys)
    assert num_hits == 2
    blocks_in(dst, table_b[:num_hits], other.load(keys[:num_hits]))
    expected = export_kv(src, table_a, num_hits * BS)  # [L, 8, C]
    assert torch.equal(export_kv(dst, table_b, num_hits * BS), expected)
    # Blocks outside the loaded ones are untouched.
    untouched = [b for b in range(NB) if b not in table_b[:num_hits]]
    assert all(torch.equal(d[untouched], s[untouched]) for d, s in zip(dst, _caches(1)))
    other.close()


def test_blocks_out_are_copies() -> None:
    caches = _caches(0)
    (out,) = blocks_out(caches, [3])
    before = out.clone()
    caches[0][3] += 1  # the paged block is reused
    assert torch.equal(out, before)
    assert blocks_out(caches, []) == []


def test_blocks_out_hold_only_their_own_bytes() -> None:
    blocks = blocks_out(_caches(0), [1, 2, 3])
    assert all(kv.untyped_storage().nbytes() == L * BS * C * 4 for kv in blocks)
