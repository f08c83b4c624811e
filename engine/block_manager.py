"""Block ids of the paged KV cache: allocation, reference counts, prefix caching, LRU eviction.

The cache tensors live elsewhere; this class only decides which block ids a request holds.
Every block is in exactly one of three states:
  free    - no reference, no hash: handed out first.
  cached  - no reference, holds a registered hash: reusable by a request with the same prefix,
            else evicted least recently freed first.
  used    - reference count > 0 (shared when several requests reuse one prefix block).
"""

import hashlib
import sys
from array import array
from collections import OrderedDict, deque
from collections.abc import Sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    """The KV blocks that hold num_tokens tokens (the last one partly filled)."""
    return -(-num_tokens // block_size)


def _hash_block(prev: bytes, token_ids: Sequence[int]) -> bytes:
    tokens = array("q", token_ids)
    if sys.byteorder != "little":  # the router on another host must compute the same bytes
        tokens.byteswap()
    return hashlib.blake2b(prev + tokens.tobytes(), digest_size=16).digest()


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Chained hashes of the full blocks of token_ids (a trailing partial block gets none).

    Block i's hash covers its own tokens and block i-1's hash, so equal hashes mean equal whole
    prefixes. Stable across processes and hosts (blake2b over int64 little-endian token ids).
    """
    assert block_size >= 1, block_size
    hashes: list[bytes] = []
    prev = b""
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = _hash_block(prev, token_ids[start : start + block_size])
        hashes.append(prev)
    return hashes


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        assert num_blocks >= 1 and block_size >= 1, (num_blocks, block_size)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.hash_to_block: dict[bytes, int] = {}
        self.free_ids: deque[int] = deque(range(num_blocks))
        # Unreferenced blocks with a hash, least recently freed first (values unused).
        self.cached_ids: OrderedDict[int, None] = OrderedDict()

    # ---- counters ----

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation can take now: free ones plus evictable cached ones."""
        return len(self.free_ids) + len(self.cached_ids)

    @property
    def num_cached_blocks(self) -> int:
        return len(self.cached_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    # ---- allocation ----

    def _num_blocks_for(self, num_tokens: int) -> int:
        return blocks_for(num_tokens, self.block_size)

    def _plan(self, token_ids: Sequence[int]) -> tuple[list[int], int] | None:
        """(reused block ids, number of fresh blocks) for token_ids, or None if they do not fit."""
        assert len(token_ids) >= 1, "a request needs at least one token"
        reused: list[int] = []
        if self.enable_prefix_caching:
            # The last token is always recomputed so the model yields logits for it.
            max_reuse = (len(token_ids) - 1) // self.block_size
            prev = b""
            for start in range(0, max_reuse * self.block_size, self.block_size):
                # Hash lazily: a long prompt whose first block misses costs one hash, not all.
                prev = _hash_block(prev, token_ids[start : start + self.block_size])
                block_id = self.hash_to_block.get(prev)
                if block_id is None:
                    break
                reused.append(block_id)
        num_fresh = self._num_blocks_for(len(token_ids)) - len(reused)
        # Reused blocks that sit in the cached pool stop being available for fresh allocation.
        reused_from_pool = sum(1 for b in reused if self.ref_counts[b] == 0)
        if num_fresh > self.num_free_blocks - reused_from_pool:
            return None
        return reused, num_fresh

    def can_allocate(self, token_ids: Sequence[int]) -> bool:
        return self._plan(token_ids) is not None

    def allocate(self, token_ids: Sequence[int]) -> tuple[list[int], int] | None:
        """Reserve blocks for a request whose known tokens are token_ids.

        Returns (block_table, num_cached_tokens): the first num_cached_tokens tokens are already
        in the cache (reused blocks) and need no compute. None, with nothing changed, if the
        blocks do not fit.
        """
        plan = self._plan(token_ids)
        if plan is None:
            return None
        reused, num_fresh = plan
        for block_id in reused:
            if self.ref_counts[block_id] == 0:
                del self.cached_ids[block_id]
            self.ref_counts[block_id] += 1
        # Reused blocks leave the pool before any eviction, so none of them can be evicted here.
        block_table = reused + [self._take_fresh() for _ in range(num_fresh)]
        return block_table, len(reused) * self.block_size

    def append_slots(self, block_table: list[int], num_tokens: int) -> bool:
        """Grow block_table in place to hold num_tokens tokens; False (nothing changed) if full."""
        num_new = self._num_blocks_for(num_tokens) - len(block_table)
        if num_new <= 0:
            return True
        if num_new > self.num_free_blocks:
            return False
        block_table.extend(self._take_fresh() for _ in range(num_new))
        return True

    def truncate(self, block_table: list[int], num_tokens: int) -> None:
        """Free the blocks of block_table past those that hold num_tokens tokens (a verify's
        rejected drafts), in place."""
        keep = self._num_blocks_for(num_tokens)
        if keep < len(block_table):
            tail = block_table[keep:]
            del block_table[keep:]
            self.free(tail)

    def _take_fresh(self) -> int:
        if self.free_ids:
            block_id = self.free_ids.popleft()
        else:
            block_id, _ = self.cached_ids.popitem(last=False)  # evict the least recently freed
            del self.hash_to_block[self.block_hash[block_id]]
            self.block_hash[block_id] = None
        self.ref_counts[block_id] = 1
        return block_id

    # ---- prefix caching ----

    def commit(
        self, block_table: list[int], token_ids: Sequence[int], num_computed_tokens: int
    ) -> list[int]:
        """Register the hashes of the full blocks whose tokens are all computed; -> the block ids
        hashed by this call (the KV tiers' write-back offers them).

        Idempotent. A hash already held by another block keeps that mapping: this block then stays
        unhashed and goes to the free list when released.
        """
        hashed: list[int] = []
        if not self.enable_prefix_caching:
            return hashed
        num_full = min(num_computed_tokens, len(token_ids)) // self.block_size
        assert num_full <= len(block_table), (num_full, len(block_table))
        prev = b""
        for i in range(num_full):
            block_id = block_table[i]
            known = self.block_hash[block_id]
            if known is not None:  # hashed by an earlier commit or reused: skip the rehash
                prev = known
                continue
            start = i * self.block_size
            prev = _hash_block(prev, token_ids[start : start + self.block_size])
            if prev not in self.hash_to_block:
                self.hash_to_block[prev] = block_id
                self.block_hash[block_id] = prev
                hashed.append(block_id)
        return hashed

    def free(self, block_table: list[int]) -> None:
        """Release a request's blocks and clear block_table.

        Released in reverse so that, in the LRU pool, a sequence's tail is evicted before its head
        (the head is the prefix other requests are likelier to share).
        """
        for block_id in reversed(block_table):
            assert self.ref_counts[block_id] > 0, f"double free of block {block_id}"
            self.ref_counts[block_id] -= 1
            if self.ref_counts[block_id] == 0:
                if self.block_hash[block_id] is not None:
                    self.cached_ids[block_id] = None
                else:
                    self.free_ids.append(block_id)
        block_table.clear()

    def reset_prefix_cache(self) -> None:
        """Forget every hash (e.g. after new weights): cached blocks become plain free blocks."""
        for block_id in self.hash_to_block.values():
            self.block_hash[block_id] = None
        self.hash_to_block.clear()
        self.free_ids.extend(self.cached_ids)
        self.cached_ids.clear()

    # ---- invariants ----

    def assert_consistent(self) -> None:
        """free, cached and used partition all blocks; hashes and ref counts agree with them."""
        free, cached = list(self.free_ids), list(self.cached_ids)
        used = [b for b in range(self.num_blocks) if self.ref_counts[b] > 0]
        seen = free + cached + used
        assert sorted(seen) == list(range(self.num_blocks)), (
            f"free {sorted(free)}, cached {sorted(cached)} and used {used} do not partition "
            f"{self.num_blocks} blocks"
        )
        assert all(self.ref_counts[b] == 0 for b in free + cached), "pooled block with references"
        assert all(self.ref_counts[b] >= 0 for b in range(self.num_blocks)), self.ref_counts
        assert all(self.block_hash[b] is None for b in free), "free block holding a hash"
        assert all(self.block_hash[b] is not None for b in cached), "cached block without hash"
        for h, b in self.hash_to_block.items():
            assert self.block_hash[b] == h, f"hash map points to block {b} holding another hash"
        num_hashed = sum(h is not None for h in self.block_hash)
        assert num_hashed == len(self.hash_to_block), (num_hashed, len(self.hash_to_block))

    def assert_idle(self) -> None:
        """With no request alive, every block must be free or cached-and-unreferenced."""
        self.assert_consistent()
        used = {b: c for b, c in enumerate(self.ref_counts) if c != 0}
        assert not used, f"blocks still referenced with no request alive: {used}"
