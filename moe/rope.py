"""RoPE frequencies with DeepSeek's YaRN scaling (as transformers' _compute_yarn_parameters)."""

import math

import torch

from moe.config import ModelConfig


def rope_inv_freq(config: ModelConfig) -> tuple[torch.Tensor, float]:
    """-> (inv_freq [D/2] fp32, attention_scaling) for D = qk_rope_head_dim."""
    dim, base = config.qk_rope_head_dim, config.rope_theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim)
    rs = config.rope_scaling
    if rs is None:
        return 1.0 / pos_freqs, 1.0

    def correction_dim(num_rotations: float) -> float:
        return (
            dim
            * math.log(rs.original_max_position_embeddings / (num_rotations * 2 * math.pi))
            / (2 * math.log(base))
        )

    low = max(math.floor(correction_dim(rs.beta_fast)), 0)
    high = min(math.ceil(correction_dim(rs.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(
        0, 1
    )
    extrapolation = 1 - ramp  # 1 where the original frequency is kept
    inv_freq = (1.0 / (rs.factor * pos_freqs)) * ramp + (1.0 / pos_freqs) * extrapolation
    return inv_freq, rs.attention_factor
