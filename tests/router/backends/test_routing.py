"""Routing policies: hand-computed cases and properties."""

from engine.messages import RankStatus
from router.backends.routing import decode_preference, prefill_choice, prefix_key


def rank(i, used, total=100, running=0, ready=True):
    return RankStatus("decode", i, ready, running, 0, used, total)


def test_decode_prefers_free_blocks_then_fewer_requests():
    ranks = [rank(0, 50), rank(1, 10), rank(2, 10, running=3), rank(3, 0, ready=False)]
    assert decode_preference(ranks, [0, 0, 0, 0], 5) == [1, 2, 0]
    # blocks this router just reserved count against a rank until the next status
    assert decode_preference(ranks, [0, 45, 0, 0], 5) == [2, 0, 1]
    # a rank that cannot hold the prompt is not a candidate
    assert decode_preference(ranks, [0, 0, 0, 0], 60) == [1, 2]
    assert decode_preference(ranks, [0, 0, 0, 0], 95) == []


def test_prefix_key_depends_on_the_first_blocks_only():
    a = list(range(40))
    assert prefix_key(a, 16) == prefix_key(a[:16] + [999] * 30, 16)
    assert prefix_key(a, 16) != prefix_key([7] + a[1:], 16)
    assert prefix_key(a, 16, 2) != prefix_key(a[:16] + [999] * 30, 16, 2)
    assert prefix_key([1, 2, 3], 16) != prefix_key([1, 2, 4], 16)  # shorter than a block


def test_prefill_ties_are_stable_and_spread_prefixes():
    loads, hits = [0, 0, 0, 0], [0, 0, 0, 0]
    keys = [prefix_key([i] * 16, 16) for i in range(200)]
    choices = [prefill_choice(k, loads, hits, 40, 100) for k in keys]
    assert choices == [prefill_choice(k, loads, hits, 40, 100) for k in keys]  # same prefix
    counts = [choices.count(r) for r in range(4)]
    assert min(counts) > 25  # rendezvous hashing spreads prefixes over all ranks


def test_prefill_weighs_expected_hits_against_queued_tokens():
    key = prefix_key(list(range(16)), 16)
    # a 100-token prompt, 64 of them expected to hit rank 1: costs 0+100, 30+36, 10+100
    assert prefill_choice(key, [0, 30, 10], [0, 64, 0], 100, 4096) == 1
    # rank 1 busier: 70 + 36 = 106 > 0 + 100
    assert prefill_choice(key, [0, 70, 10], [0, 64, 0], 100, 4096) == 0
    # the shared disk's hits count for every rank: load decides (costs 50, 66, 46)
    assert prefill_choice(key, [14, 30, 10], [64, 64, 64], 100, 4096) == 2
    # no hits anywhere: the least busy rank
    assert prefill_choice(key, [5, 3, 9], [0, 0, 0], 100, 4096) == 1


def test_prefill_hits_are_bounded_by_max_imbalance():
    key = prefix_key(list(range(16)), 16)
    # rank 0 holds the whole prompt: cost 150 + 0 beats 0 + 1000, but it is 150 tokens busier
    # than the least busy: out for a bound of 100, in for 150
    assert prefill_choice(key, [150, 0], [1000, 0], 1000, 100) == 1
    assert prefill_choice(key, [150, 0], [1000, 0], 1000, 150) == 0
