"""DeepSeek MoE gate: scoring and (group-limited) top-k.

Legend (kernels/__init__.py): T tokens, E routed experts, G expert groups, K experts per token.
"""

from __future__ import annotations

import torch

from kernels.backend import jit, tl, triton, use_cpu_kernel, use_triton
from kernels.cpu.build import cpu_kernels

SCORING_FUNCS = ("softmax", "sigmoid")
TOPK_METHODS = ("greedy", "group_limited_greedy", "noaux_tc")


def grouped_topk(
    router_logits: torch.Tensor,
    top_k: int,
    scoring_func: str,
    topk_method: str,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    e_score_correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] fp32 -> (topk_weights [T, K] fp32, topk_idx [T, K] int64); see
    grouped_topk_ref. Triton on CUDA tensors, the compiled kernel on fp32 CPU tensors
    (kernels/backend.py), else the torch reference."""
    args = (router_logits, top_k, scoring_func, topk_method, n_group, topk_group, norm_topk_prob)
    if use_triton(router_logits):
        return grouped_topk_triton(*args, routed_scaling_factor, e_score_correction_bias)
    if use_cpu_kernel(router_logits) and router_logits.shape[1] <= 256:
        weights, ids = cpu_kernels().grouped_topk(
            router_logits.contiguous(), top_k, SCORING_FUNCS.index(scoring_func),
            TOPK_METHODS.index(topk_method), n_group, topk_group, norm_topk_prob,
            routed_scaling_factor, e_score_correction_bias,
        )  # fmt: skip
        return weights, ids
    return grouped_topk_ref(*args, routed_scaling_factor, e_score_correction_bias)


def grouped_topk_ref(
    router_logits: torch.Tensor,
    top_k: int,
    scoring_func: str,
    topk_method: str,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    e_score_correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] fp32 -> (topk_weights [T, K] fp32, topk_idx [T, K] int64).

    greedy: plain top-k of the scores (DeepSeek-V2-Lite).
    group_limited_greedy: keep the topk_group groups with the highest max score (DeepSeek-V2).
    noaux_tc: choose on scores + e_score_correction_bias, groups ranked by the sum of their top-2
      (DeepSeek-V3); the weights are the unbiased scores.
    """
    num_tokens, num_experts = router_logits.shape
    assert scoring_func in SCORING_FUNCS, scoring_func
    assert topk_method in TOPK_METHODS, topk_method
    assert num_experts % n_group == 0, (num_experts, n_group)
    logits = router_logits.float()
    scores = logits.softmax(dim=-1) if scoring_func == "softmax" else logits.sigmoid()  # [T, E]

    choice = scores
    if topk_method == "noaux_tc":
        assert e_score_correction_bias is not None, "noaux_tc needs e_score_correction_bias"
        choice = scores + e_score_correction_bias.float()[None, :]
    if topk_method != "greedy" and n_group > 1:
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)  # [T, G, E/G]
        if topk_method == "noaux_tc":
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [T, G]
        else:
            group_scores = grouped.max(dim=-1).values  # [T, G]
        group_idx = group_scores.topk(topk_group, dim=-1, sorted=False).indices  # [T, topk_group]
        group_mask = torch.zeros_like(group_scores, dtype=torch.bool)
        group_mask.scatter_(1, group_idx, True)
        expert_mask = group_mask[:, :, None].expand_as(grouped).reshape(num_tokens, num_experts)
        choice = choice.masked_fill(~expert_mask, float("-inf"))
    topk_idx = choice.topk(top_k, dim=-1, sorted=False).indices  # [T, K]
    topk_weights = scores.gather(1, topk_idx)  # [T, K]
    if norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)
    return topk_weights * routed_scaling_factor, topk_idx


# ---- Triton ----------------------------------------------------------------------------------


@jit
def _grouped_topk_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    idx_ptr,
    num_experts,
    group_size,
    n_group,
    topk_group,
    top_k,
    scaling,
    stride_lt,
    stride_le,
    stride_wt,
    stride_it,
    SOFTMAX: tl.constexpr,
    BIAS: tl.constexpr,
    GROUPED: tl.constexpr,
    TOP2: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One token: scores, group choice, top-k (by repeated argmax), weights.

    GROUPED: keep the topk_group groups ranked by their best choice score, or with TOP2 by the
    sum of their best two.
    """
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    valid = offs < num_experts
    logits = tl.load(logits_ptr + token * stride_lt + offs * stride_le, valid, float("-inf"))
    logits = logits.to(tl.float32)
    if SOFTMAX:
        exp = tl.exp(logits - tl.max(logits, axis=0))
        scores = exp / tl.sum(exp, axis=0)
    else:
        scores = tl.sigmoid(logits)
    choice = scores
    if BIAS:
        choice += tl.load(bias_ptr + offs, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))  # [BE]
    if GROUPED:
        group = offs // group_size
        offs_g = tl.arange(0, BLOCK_G)
        group_scores = tl.full((BLOCK_G,), float("-inf"), dtype=tl.float32)
        for g in range(n_group):
            member = tl.where(group == g, choice, float("-inf"))
            best = tl.max(member, axis=0)
            if TOP2:  # drop the best once: a tie still counts twice
                best += tl.max(tl.where(offs == tl.argmax(member, axis=0), float("-inf"), member))
            group_scores = tl.where(offs_g == g, best, group_scores)
        keep = offs < 0  # [BE] all False
        for _ in range(topk_group):
            g = tl.argmax(group_scores, axis=0)
            keep = keep | (group == g)
            group_scores = tl.where(offs_g == g, float("-inf"), group_scores)
        choice = tl.where(keep, choice, float("-inf"))
    offs_k = tl.arange(0, BLOCK_K)
    topk_idx = tl.zeros((BLOCK_K,), dtype=tl.int64)
    topk_weights = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k in range(top_k):
        e = tl.argmax(choice, axis=0)
        weight = tl.sum(tl.where(offs == e, scores, 0.0), axis=0)
        topk_idx = tl.where(offs_k == k, e, topk_idx)
        topk_weights = tl.where(offs_k == k, weight, topk_weights)
        choice = tl.where(offs == e, float("-inf"), choice)
    if NORM:
        topk_weights = topk_weights / (tl.sum(topk_weights, axis=0) + 1e-20)
    mask_k = offs_k < top_k
    tl.store(weights_ptr + token * stride_wt + offs_k, topk_weights * scaling, mask=mask_k)
    tl.store(idx_ptr + token * stride_it + offs_k, topk_idx, mask=mask_k)


def grouped_topk_flags(
    scoring_func: str, topk_method: str, n_group: int, norm_topk_prob: bool
) -> dict[str, bool]:
    """The branch constexprs of _grouped_topk_kernel for a gate's configuration (the compile
    test enumerates every configuration through this, so it compiles what the wrapper launches).
    """
    noaux = topk_method == "noaux_tc"
    return dict(
        SOFTMAX=scoring_func == "softmax",
        BIAS=noaux,
        GROUPED=topk_method != "greedy" and n_group > 1,
        TOP2=noaux,
        NORM=norm_topk_prob,
    )


def grouped_topk_triton(
    router_logits: torch.Tensor,
    top_k: int,
    scoring_func: str,
    topk_method: str,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    e_score_correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton path of grouped_topk (same arguments and shapes), one program per token.

    topk_idx comes out in descending order of the choice score (the reference's is unordered).
    """
    num_tokens, num_experts = router_logits.shape
    assert scoring_func in SCORING_FUNCS, scoring_func
    assert topk_method in TOPK_METHODS, topk_method
    assert num_experts % n_group == 0 and 1 <= topk_group <= n_group, (num_experts, n_group)
    assert router_logits.is_floating_point(), router_logits.dtype
    flags = grouped_topk_flags(scoring_func, topk_method, n_group, norm_topk_prob)
    grouped = flags["GROUPED"]
    assert 1 <= top_k <= (topk_group * num_experts // n_group if grouped else num_experts), top_k
    bias = e_score_correction_bias
    if topk_method == "noaux_tc":
        assert bias is not None, "noaux_tc needs e_score_correction_bias"
        assert bias.shape == (num_experts,) and bias.device == router_logits.device, bias.shape
    else:
        bias = None
    weights = router_logits.new_empty(num_tokens, top_k, dtype=torch.float32)
    idx = router_logits.new_empty(num_tokens, top_k, dtype=torch.int64)
    if num_tokens == 0:
        return weights, idx
    bias = bias.detach().contiguous() if bias is not None else router_logits  # unread if no bias
    _grouped_topk_kernel[(num_tokens,)](
        router_logits, bias, weights, idx,
        num_experts, num_experts // n_group, n_group, topk_group, top_k, routed_scaling_factor,
        *router_logits.stride(), weights.stride(0), idx.stride(0),
        **flags, BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_G=triton.next_power_of_2(n_group), BLOCK_K=triton.next_power_of_2(top_k),
    )  # fmt: skip
    return weights, idx
