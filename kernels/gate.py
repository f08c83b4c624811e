"""DeepSeek MoE gate: scoring and (group-limited) top-k.

Legend (kernels/__init__.py): T tokens, E routed experts, G expert groups, K experts per token.
"""

import torch

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
