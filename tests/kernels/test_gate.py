"""The Triton group-limited top-k gate against the torch reference, in every branch."""

import itertools

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from kernels.gate import (
    SCORING_FUNCS,
    TOPK_METHODS,
    grouped_topk_flags,
    grouped_topk_ref,
    grouped_topk_triton,
)


def by_expert(weights: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by expert id: the chosen set per row, whatever order a path returns it in."""
    idx, order = idx.sort(dim=1)
    return weights.gather(1, order), idx


# (num_experts, n_group, topk_group, top_k): the group loops over 5 and 8 experts (a power of
# two or not), and one group
SHAPES = {"groups-of-5": (20, 4, 3, 5), "groups-of-8": (32, 4, 2, 4), "one-group": (10, 1, 1, 3)}


@pytest.mark.parametrize("num_tokens", [1, 9])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("norm", [True, False], ids=["norm", "raw"])
@pytest.mark.parametrize("method", TOPK_METHODS)
@pytest.mark.parametrize("scoring", SCORING_FUNCS)
def test_matches_reference(num_tokens, shape, norm, method, scoring, device):
    """Every branch of the kernel (grouped_topk_flags: each scoring x method x grouped or not x
    norm, 16 combinations of its constexprs) against the reference."""
    num_experts, n_group, topk_group, top_k = SHAPES[shape]
    gen = torch.Generator().manual_seed(num_experts + num_tokens)
    # continuous random logits and bias: no ties, so the chosen sets are unique
    logits = torch.randn(num_tokens, num_experts, generator=gen).to(device)
    bias = (0.3 * torch.randn(num_experts, generator=gen)).to(device)
    args = (logits, top_k, scoring, method, n_group, topk_group, norm, 2.5, bias)
    weights, idx = grouped_topk_triton(*args)
    assert weights.dtype == torch.float32 and idx.dtype == torch.int64
    assert weights.shape == idx.shape == (num_tokens, top_k)
    ref_weights, ref_idx = by_expert(*grouped_topk_ref(*args))
    weights, idx = by_expert(weights, idx)
    assert torch.equal(idx, ref_idx)
    torch.testing.assert_close(weights, ref_weights, rtol=1e-5, atol=1e-6)


def test_the_grid_reaches_every_branch():
    """test_matches_reference's grid launches all 16 combinations of the kernel's constexprs
    (BIAS and TOP2 go together: noaux_tc)."""
    groups = {shape[1] for shape in SHAPES.values()}
    combos = {
        tuple(grouped_topk_flags(scoring, method, n_group, norm).values())
        for scoring, method, n_group, norm in itertools.product(
            SCORING_FUNCS, TOPK_METHODS, groups, (True, False)
        )
    }
    assert len(combos) == 16


@pytest.mark.parametrize(
    "scoring, method, chosen",
    [
        ("softmax", "group_limited_greedy", [0, 1]),  # group maxima 5, 4, 4.5, 0.2: group 0
        ("sigmoid", "noaux_tc", [2, 3]),  # sums of the top two: group 1 (sig 4 + sig 3.9)
        ("softmax", "greedy", [0, 4]),  # no groups: the two best
    ],
)
def test_group_ranking_decides(scoring, method, chosen, device):
    """Hand-made: each way of ranking groups picks a different pair of experts."""
    logits = torch.tensor([[5.0, -1.0, 4.0, 3.9, 4.5, 0.0, 0.1, 0.2]], device=device)
    args = (logits, 2, scoring, method, 4, 1, False, 1.0, torch.zeros(8, device=device))
    assert sorted(grouped_topk_triton(*args)[1][0].tolist()) == chosen
    assert sorted(grouped_topk_ref(*args)[1][0].tolist()) == chosen
