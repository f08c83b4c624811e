"""PoolLoad arithmetic, by hand: per-rank sums, balancedness and the counts between two dumps."""

import pytest

from engine.messages import PoolLoad


def test_balancedness_and_counts_since_by_hand():
    # 2 ranks, 4 slots: slots 0-1 on rank 0, 2-3 on rank 1
    before = PoolLoad(
        "decode", 2, 3, {1: ([1, 1, 0, 2], [0, 1, 2, 0]), 2: ([0, 0, 0, 0], [0, 1, 2, 0])}
    )
    after = PoolLoad(
        "decode", 2, 3, {1: ([7, 1, 0, 4], [0, 1, 2, 0]), 2: ([3, 1, 2, 2], [0, 1, 2, 0])}
    )
    added = after.since(before)
    assert added.layers == {1: ([6, 0, 0, 2], [0, 1, 2, 0]), 2: ([3, 1, 2, 2], [0, 1, 2, 0])}
    assert added.rank_tokens() == {1: [6, 2], 2: [4, 4]}
    assert added.expert_tokens() == {1: [8, 0, 0], 2: [5, 1, 2]}
    # layer 1: mean 4 / max 6; layer 2: 4 / 4
    assert added.balancedness() == pytest.approx((4 / 6 + 1.0) / 2)
    assert before.since(before).balancedness() == 1.0  # no load counts as even


def test_counts_since_a_different_placement_are_refused():
    before = PoolLoad("prefill", 2, 2, {1: ([1, 1], [0, 1])})
    after = PoolLoad("prefill", 2, 2, {1: ([1, 1], [1, 0])})
    with pytest.raises(ValueError, match="layer 1: the placement changed"):
        after.since(before)
