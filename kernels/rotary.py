"""Rotary position embedding for the decoupled RoPE part of MLA.

Legend (kernels/__init__.py): T tokens, NH heads, Dr rope dims (even).
"""

import torch

from kernels.backend import use_cpu_kernel
from kernels.cpu.build import cpu_kernels


def rope_cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions [T] int -> cos, sin [T, Dr/2] fp32, scaled by attention_scaling (YaRN mscale)."""
    freqs = positions.float()[:, None] * inv_freq[None, :]  # [T, Dr/2]
    return freqs.cos() * attention_scaling, freqs.sin() * attention_scaling


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool
) -> torch.Tensor:
    """x [T, NH, Dr] or [T, Dr]; cos, sin [T, Dr/2] -> same shape and dtype as x.

    interleaved: pairs are (x0, x1), (x2, x3), ... as in DeepSeek's released weights; the output is
    laid out de-interleaved (all first elements, then all second elements). Queries and keys get the
    same layout, so dot products are unchanged. Otherwise pairs are (x_i, x_{i+D/2}).
    """
    assert x.shape[-1] == 2 * cos.shape[-1], (x.shape, cos.shape)
    if use_cpu_kernel(x) and x.stride(-1) == 1 and cos.dtype == torch.float32:
        return cpu_kernels().rotary(x, cos.contiguous(), sin.contiguous(), interleaved)
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    if interleaved:
        x1, x2 = x[..., 0::2], x[..., 1::2]
    else:
        x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
