import hashlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.block_manager import BlockManager, block_hashes

BS = 4


def test_block_hashes_chain_and_stability():
    tokens = list(range(10))
    hashes = block_hashes(tokens, BS)
    assert len(hashes) == 2  # the partial third block gets no hash
    packed = b"".join(t.to_bytes(8, "little", signed=True) for t in range(4))
    assert hashes[0] == hashlib.blake2b(packed, digest_size=16).digest()
    packed = b"".join(t.to_bytes(8, "little", signed=True) for t in range(4, 8))
    assert hashes[1] == hashlib.blake2b(hashes[0] + packed, digest_size=16).digest()
    # Same second block after a different first block: the chain makes the hashes differ.
    other = block_hashes([9, 9, 9, 9, 4, 5, 6, 7], BS)
    assert other[1] != hashes[1] and block_hashes(tokens[:8], BS) == hashes
    assert block_hashes([1, 2, 3], BS) == []


def test_allocate_fresh_then_reuse_after_commit_and_free():
    bm = BlockManager(num_blocks=8, block_size=BS)
    tokens = list(range(10))  # 3 blocks: 2 full + 2 tokens
    table, cached = bm.allocate(tokens)
    assert (table, cached) == ([0, 1, 2], 0)
    assert (bm.num_used_blocks, bm.num_free_blocks, bm.usage) == (3, 5, 3 / 8)
    assert bm.commit(table, tokens, num_computed_tokens=5) == [0]  # the blocks it hashed
    assert bm.commit(table, tokens, num_computed_tokens=10) == [1]
    assert bm.commit(table, tokens, num_computed_tokens=10) == []  # idempotent
    bm.free(table)
    assert table == [] and bm.num_cached_blocks == 2 and bm.num_free_blocks == 8
    bm.assert_idle()

    table2, cached2 = bm.allocate(tokens + [99])
    assert table2[:2] == [0, 1] and cached2 == 8 and len(table2) == 3
    assert bm.num_cached_blocks == 0  # the reused blocks left the LRU pool


def test_last_token_is_never_cached():
    bm = BlockManager(num_blocks=8, block_size=BS)
    tokens = list(range(8))  # exactly 2 full blocks
    table, _ = bm.allocate(tokens)
    bm.commit(table, tokens, 8)
    bm.free(table)
    table, cached = bm.allocate(tokens)
    assert cached == 4 and table[0] == 0 and table[1] not in (0, 1)
    # The recomputed last block duplicates block 1's hash: the existing mapping is kept.
    bm.commit(table, tokens, 8)
    assert bm.hash_to_block[block_hashes(tokens, BS)[1]] == 1
    bm.free(table)
    bm.assert_idle()


def test_shared_prefix_ref_counts():
    bm = BlockManager(num_blocks=8, block_size=BS)
    a = list(range(9))
    ta, _ = bm.allocate(a)
    bm.commit(ta, a, 9)
    tb, cached = bm.allocate(a[:8] + [50, 51])
    assert cached == 8 and tb[:2] == ta[:2] and bm.ref_counts[ta[0]] == 2
    assert bm.num_used_blocks == 4
    bm.free(ta)
    assert bm.num_used_blocks == 3 and bm.num_cached_blocks == 0
    bm.free(tb)
    assert bm.num_cached_blocks == 2
    bm.assert_idle()


def test_not_enough_blocks_changes_nothing():
    bm = BlockManager(num_blocks=3, block_size=BS)
    assert not bm.can_allocate(list(range(13)))
    assert bm.allocate(list(range(13))) is None
    assert bm.num_free_blocks == 3
    table, _ = bm.allocate(list(range(8)))
    assert not bm.append_slots(table, 13) and table == [0, 1]
    assert bm.append_slots(table, 12) and table == [0, 1, 2]
    assert bm.append_slots(table, 12) and bm.num_free_blocks == 0
    assert not bm.can_allocate([1])


def test_reused_cached_blocks_are_not_counted_as_free():
    bm = BlockManager(num_blocks=3, block_size=BS)
    tokens = list(range(9))
    table, _ = bm.allocate(tokens)
    bm.commit(table, tokens, 9)
    bm.free(table)  # 2 cached + 1 free
    # 12 tokens = 3 blocks, 2 reusable (cached) + 1 fresh: fits exactly.
    table, cached = bm.allocate(tokens[:8] + [7, 7, 7, 7])
    assert cached == 8 and bm.num_free_blocks == 0
    bm.free(table)
    # 16 tokens = 4 blocks: 2 reused + 2 fresh, but only 1 block is left outside the reused ones.
    assert bm.allocate(tokens[:8] + [1] * 8) is None
    bm.assert_idle()


def test_lru_eviction_tail_first():
    bm = BlockManager(num_blocks=4, block_size=BS)
    tokens = list(range(13))  # 4 blocks, 3 full
    table, _ = bm.allocate(tokens)
    assert table == [0, 1, 2, 3]
    bm.commit(table, tokens, 13)
    bm.free(table)  # freed in reverse: cached 2, 1, 0 (tail first); block 3 holds no hash
    assert list(bm.cached_ids) == [2, 1, 0] and list(bm.free_ids) == [3]
    other, _ = bm.allocate([100] * 8)  # takes free block 3, then evicts block 2 (the tail)
    assert other == [3, 2]
    assert block_hashes(tokens, BS)[2] not in bm.hash_to_block and bm.block_hash[2] is None
    bm.free(other)
    table, cached = bm.allocate(tokens)  # the head (blocks 0, 1) survived
    assert cached == 8 and table[:2] == [0, 1]
    # A reused block freed again becomes the most recently used one.
    bm.free(table)
    assert list(bm.cached_ids) == [1, 0]
    bm.assert_idle()


def test_prefix_caching_off():
    bm = BlockManager(num_blocks=4, block_size=BS, enable_prefix_caching=False)
    tokens = list(range(9))
    table, _ = bm.allocate(tokens)
    bm.commit(table, tokens, 9)
    bm.free(table)
    assert bm.num_cached_blocks == 0
    assert bm.allocate(tokens)[1] == 0


def test_reset_prefix_cache():
    bm = BlockManager(num_blocks=4, block_size=BS)
    tokens = list(range(9))
    table, _ = bm.allocate(tokens)
    bm.commit(table, tokens, 9)
    bm.free(table)
    bm.reset_prefix_cache()
    assert bm.num_cached_blocks == 0 and bm.num_free_blocks == 4 and bm.hash_to_block == {}
    bm.assert_idle()
    assert bm.allocate(tokens)[1] == 0


def test_assert_idle_catches_leak_and_double_free():
    bm = BlockManager(num_blocks=4, block_size=BS)
    table, _ = bm.allocate([1, 2, 3])
    with pytest.raises(AssertionError, match="still referenced"):
        bm.assert_idle()
    leaked = list(table)
    bm.free(table)
    with pytest.raises(AssertionError, match="double free"):
        bm.free(leaked)
    bm.free_ids.append(0)  # corrupt: a duplicate in the free list
    with pytest.raises(AssertionError, match="partition"):
        bm.assert_idle()


# ---- random operation sequences ----

prompts = st.lists(st.integers(0, 2), min_size=1, max_size=14)  # tiny alphabet: shared prefixes
ops = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "append", "commit", "free", "refree"]),
        prompts,
        st.integers(0, 10),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_blocks=st.integers(1, 12), caching=st.booleans())
def test_random_operations_keep_invariants(ops, num_blocks: int, caching: bool):
    bm = BlockManager(num_blocks=num_blocks, block_size=BS, enable_prefix_caching=caching)
    live: list[tuple[list[int], list[int], int]] = []  # (tokens, block_table, num_computed)
    for op, tokens, k in ops:
        if op == "alloc":
            could = bm.can_allocate(tokens)
            free_before = bm.num_free_blocks
            result = bm.allocate(tokens)
            assert (result is not None) == could
            if result is None:
                assert bm.num_free_blocks == free_before
            else:
                table, cached = result
                assert len(table) == -(-len(tokens) // BS) and cached % BS == 0
                assert cached <= len(tokens) - 1 and len(set(table)) == len(table)
                live.append((tokens, table, cached))
        elif live and op == "append":  # decode k more tokens
            tokens, table, computed = live[k % len(live)]
            if bm.append_slots(table, len(tokens) + k):
                tokens.extend([k % 3] * k)
                assert len(table) == -(-len(tokens) // BS)
        elif live and op == "commit":
            i = k % len(live)
            tokens, table, _ = live[i]
            live[i] = (tokens, table, len(tokens))
            bm.commit(table, tokens, len(tokens))
        elif live and op in ("free", "refree"):
            tokens, table, computed = live.pop(k % len(live))
            bm.commit(table, tokens, computed)
            bm.free(table)
            if op == "refree":  # the same tokens come back at once: their prefix is reused
                # Other requests may have committed a longer run of the same prefix, so the
                # own commit is a lower bound and the hash map gives the exact count.
                cap = (len(tokens) - 1) // BS
                present = 0
                for h in block_hashes(tokens[: cap * BS], BS):
                    if h not in bm.hash_to_block:
                        break
                    present += 1
                result = bm.allocate(tokens)
                assert result is not None
                own = min(computed // BS, cap) if caching else 0
                assert result[1] == (present if caching else 0) * BS >= own * BS
                live.append((tokens, result[0], result[1]))
        bm.assert_consistent()
        assert bm.num_used_blocks == len({b for _, t, _ in live for b in t})
    for _, table, _ in live:
        bm.free(table)
    bm.assert_idle()


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 1000), min_size=1, max_size=30), data=st.data())
def test_commit_free_reallocate_reuses_computed_full_blocks(tokens: list[int], data):
    computed = data.draw(st.integers(0, len(tokens)))
    bm = BlockManager(num_blocks=8, block_size=BS)
    table, _ = bm.allocate(tokens)
    bm.commit(table, tokens, computed)
    bm.free(table)
    table, cached = bm.allocate(tokens)
    assert cached == min(computed // BS, (len(tokens) - 1) // BS) * BS
    bm.free(table)
    bm.assert_idle()
