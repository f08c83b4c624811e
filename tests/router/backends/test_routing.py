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


def test_prefill_affinity_is_stable_and_spreads_prefixes():
    loads = [0, 0, 0, 0]
    keys = [prefix_key([i] * 16, 16) for i in range(200)]
    choices = [prefill_choice(k, loads, 100) for k in keys]
    assert choices == [prefill_choice(k, loads, 100) for k in keys]  # same prefix, same rank
    counts = [choices.count(r) for r in range(4)]
    assert min(counts) > 25  # rendezvous hashing spreads prefixes over all ranks


def test_prefill_affinity_gives_way_to_load():
    key = prefix_key(list(range(16)), 16)
    home = prefill_choice(key, [0, 0, 0], 100)
    loads = [0, 0, 0]
    loads[home] = 101
    second = prefill_choice(key, loads, 100)
    assert second != home
    loads[home] = 100  # within the bound: affinity wins
    assert prefill_choice(key, loads, 100) == home
