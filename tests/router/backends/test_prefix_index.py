"""The router's estimate of the prefill ranks' cached prefixes: hand-computed cases."""

from engine.block_manager import block_hashes
from engine.config import KVTiersConfig
from router.backends.prefix_index import IndexSize, PrefixIndex

BS = 4


def test_size_from_budgets():
    # 1000-byte blocks: 10 paged, 5 host, 20 disk
    tiers = KVTiersConfig(host_bytes=5000, disk_path="/x", disk_bytes=20_000)
    assert IndexSize.of(10_500, 1000, None) == IndexSize(10, 0)
    assert IndexSize.of(10_500, 1000, tiers) == IndexSize(15, 20)
    assert IndexSize.of(10_500, 1000, tiers, disk_shared=False) == IndexSize(35, 0)


def hits(index: PrefixIndex, prompt: list[int]) -> list[int]:
    return index.expected_hits(index.hashes(prompt), len(prompt))


def sent(index: PrefixIndex, rank: int, prompt: list[int]) -> None:
    index.sent(rank, index.hashes(prompt))


def test_the_last_token_is_left_to_compute():
    index = PrefixIndex(2, BS, IndexSize(100))
    assert index.hashes(list(range(9))) == block_hashes(list(range(9)), BS)
    sent(index, 0, list(range(8)))  # 2 full blocks held
    assert hits(index, list(range(8))) == [4, 0]  # 1 block reusable, not 2
    assert hits(index, list(range(9))) == [8, 0]
    assert hits(index, [0, 1, 2]) == [0, 0]


def test_expected_hits_are_the_leading_run_per_rank():
    index = PrefixIndex(3, BS, IndexSize(100))
    turn1 = list(range(10))  # blocks A B, 2 tokens over
    sent(index, 1, turn1)
    turn2 = turn1 + [50, 51, 52, 53, 54, 55, 56]  # 17 tokens: blocks A B C D reusable
    assert hits(index, turn2) == [0, 8, 0]
    sent(index, 1, turn2)
    turn3 = turn2 + [60] * 8  # 25 tokens: A..F reusable, A..D held by rank 1
    assert hits(index, turn3) == [0, 16, 0]
    # a prompt that differs in its first block hits nowhere (hashes are chained)
    assert hits(index, [99] + turn3[1:]) == [0, 0, 0]


def test_rank_lru_forgets_the_least_recently_sent():
    index = PrefixIndex(1, BS, IndexSize(3))
    a, b = list(range(8)), list(range(100, 108))  # 2 blocks each
    sent(index, 0, a)
    sent(index, 0, b)  # holds a's second block and both of b's: a's first is gone
    assert hits(index, a + [0]) == [0]  # a leading miss: no run
    assert hits(index, b + [0]) == [8]


def test_shared_disk_counts_for_every_rank_and_survives_a_reset():
    index = PrefixIndex(2, BS, IndexSize(2, shared_blocks=10))
    prompt = list(range(17))  # 4 reusable blocks
    sent(index, 0, prompt)
    # rank 0 remembers 2 blocks (its paged + host), the shared disk all 4: every rank 16
    assert hits(index, prompt) == [16, 16]
    index.reset(3)  # the pool re-formed with 3 ranks: only the disk is left
    assert hits(index, prompt) == [16, 16, 16]
    index = PrefixIndex(2, BS, IndexSize(10))  # no shared disk: a reset forgets rank 0's
    sent(index, 0, prompt)
    assert hits(index, prompt) == [16, 0]
    index.reset(2)
    assert hits(index, prompt) == [0, 0]
