"""Placement: index maps, validation, per-rank experts and replica selection."""

import dataclasses

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe.placement import Placement

LAYERS = (1, 2)


def test_contiguous_without_replicas():
    p = Placement.contiguous(LAYERS, 16, 4)
    assert p.num_slots == 16 and p.slots_per_rank == 4
    assert p.rank_experts(2) == {1: [8, 9, 10, 11], 2: [8, 9, 10, 11]}
    assert p.logcnt.tolist() == [[1] * 16] * 2
    assert p.log2phy.tolist() == [[[e] for e in range(16)]] * 2
    assert [p.rank_of_slot(s) for s in (0, 3, 4, 15)] == [0, 0, 1, 3]


def test_contiguous_with_replicas():
    p = Placement.contiguous(LAYERS, 16, 2, num_slots=20)
    assert p.rank_experts(0)[1] == list(range(10))
    assert p.rank_experts(1)[2] == [10, 11, 12, 13, 14, 15, 0, 1, 2, 3]
    assert p.logcnt[0].tolist() == [2] * 4 + [1] * 12
    assert p.log2phy[0, 0].tolist() == [0, 16]
    assert p.log2phy[0, 5].tolist() == [5, -1]


def test_from_phy2log_hand_case():
    phy2log = torch.tensor([[2, 0, 1, 0], [1, 1, 0, 2]])
    p = Placement.from_phy2log((3, 5), phy2log, num_ranks=2)
    assert p.num_experts == 3
    assert p.logcnt.tolist() == [[2, 1, 1], [1, 2, 1]]
    assert p.log2phy.tolist() == [[[1, 3], [2, -1], [0, -1]], [[2, -1], [0, 1], [3, -1]]]
    assert p.rank_experts(1) == {3: [1, 0], 5: [0, 2]}


@pytest.mark.parametrize(
    "phy2log, num_ranks, num_experts, message",
    [
        ([[0, 1, 1, 0]], 2, 3, "expert 2 of layer 1 has no slot"),
        ([[0, 1, 3, 2]], 2, 3, "outside"),
        ([[0, 1, -1, 2]], 2, 3, "outside"),
        ([[0, 1, 2]], 2, 3, "do not divide"),
    ],
)
def test_invalid_placements(phy2log, num_ranks, num_experts, message):
    with pytest.raises(ValueError, match=message):
        Placement.from_phy2log((1,), torch.tensor(phy2log), num_ranks, num_experts)


def test_invalid_shapes_and_frozen():
    with pytest.raises(ValueError, match="2 layers"):
        Placement.from_phy2log((1, 2), torch.tensor([[0, 1]]), 1)
    with pytest.raises(ValueError, match="cannot hold"):
        Placement.contiguous(LAYERS, 16, 2, num_slots=8)
    p = Placement.contiguous(LAYERS, 4, 2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.num_ranks = 4


@st.composite
def placements(draw):
    num_experts = draw(st.integers(1, 8))
    num_ranks = draw(st.integers(1, 4))
    min_per_rank = -(-num_experts // num_ranks)
    per_rank = draw(st.integers(min_per_rank, min_per_rank + 3))
    num_slots = num_ranks * per_rank
    rows = []
    for _ in range(draw(st.integers(1, 3))):
        extra = draw(
            st.lists(
                st.integers(0, num_experts - 1),
                min_size=num_slots - num_experts,
                max_size=num_slots - num_experts,
            )
        )
        rows.append(draw(st.permutations(list(range(num_experts)) + extra)))
    layers = tuple(range(len(rows)))
    return Placement.from_phy2log(layers, torch.tensor(rows), num_ranks, num_experts)


@settings(max_examples=100, deadline=None)
@given(placements())
def test_log2phy_inverts_phy2log(p):
    for pos in range(p.num_layers):
        for expert in range(p.num_experts):
            cnt = int(p.logcnt[pos, expert])
            slots = p.phy2log[pos].eq(expert).nonzero().flatten().tolist()
            assert p.log2phy[pos, expert, :cnt].tolist() == slots
            assert (p.log2phy[pos, expert, cnt:] == -1).all()
        for rank in range(p.num_ranks):
            ids = p.rank_experts(rank)[p.layers[pos]]
            assert ids == [p.phy2log[pos, s].item() for s in p.rank_slots(rank)]


@settings(max_examples=100, deadline=None)
@given(placements(), st.data())
def test_select_slots_picks_a_slot_of_the_expert(p, data):
    num_tokens = data.draw(st.integers(0, 20))
    top_k = data.draw(st.integers(1, p.num_experts))
    pos = data.draw(st.integers(0, p.num_layers - 1))
    topk_idx = (
        torch.stack(
            [
                torch.tensor(data.draw(st.permutations(range(p.num_experts)))[:top_k])
                for _ in range(num_tokens)
            ]
        )
        if num_tokens
        else torch.empty(0, top_k, dtype=torch.int64)
    )
    phy = p.select_slots(pos, topk_idx, offset=data.draw(st.integers(0, 7)))
    assert phy.shape == topk_idx.shape and phy.dtype == torch.int64
    assert torch.equal(p.phy2log[pos][phy], topk_idx)
    assert torch.equal(p.select_slots(pos, topk_idx), p.select_slots(pos, topk_idx))


def test_select_slots_spreads_over_replicas():
    phy2log = torch.tensor([[0, 1, 2, 3, 0, 0]])  # expert 0 in slots 0, 4, 5
    p = Placement.from_phy2log((1,), phy2log, num_ranks=2)
    # Expert 0 always at k = 0 (the hot expert of a sorted top-k): still round-robin.
    topk_idx = torch.stack([torch.zeros(30, dtype=torch.int64), torch.full((30,), 2)], dim=1)
    phy = p.select_slots(0, topk_idx)
    assert torch.bincount(phy[:, 0], minlength=6).tolist() == [10, 0, 0, 0, 10, 10]
    assert (phy[:, 1] == 2).all()
    # One token per rank (decode): the offset sends each rank's token to another replica.
    one = torch.tensor([[0]])
    assert [p.select_slots(0, one, offset=r).item() for r in range(3)] == [0, 4, 5]
