"""The Triton group-limited top-k gate against the torch reference."""

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from kernels.gate import grouped_topk_ref, grouped_topk_triton


def by_expert(weights: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by expert id: the chosen set per row, whatever order a path returns it in."""
    idx, order = idx.sort(dim=1)
    return weights.gather(1, order), idx


@pytest.mark.parametrize("num_tokens", [1, 9])
@pytest.mark.parametrize(
    "num_experts, n_group, topk_group, top_k, scoring, method, norm",
    [
        (32, 4, 2, 4, "sigmoid", "noaux_tc", True),  # DeepSeek-V3-like
        (24, 4, 2, 3, "softmax", "group_limited_greedy", False),  # V2-like, groups of 6
        (20, 4, 3, 5, "sigmoid", "noaux_tc", False),  # groups of 5, not a power of two
        (10, 1, 1, 3, "softmax", "greedy", False),  # V2-Lite-like
        (16, 4, 2, 3, "softmax", "greedy", True),  # greedy ignores the groups
    ],
)
def test_matches_reference(
    num_tokens, num_experts, n_group, topk_group, top_k, scoring, method, norm, device
):
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
