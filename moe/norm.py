"""RMSNorm as a module (a leaf: attention and the decoder layers use it without the MoE layers).

Legend (kernels/__init__.py): D the normalised size.
"""

import torch
from torch import nn

from kernels.rmsnorm import rms_norm


class RMSNorm(nn.Module):
    """[..., D] -> [..., D] in x's dtype (kernels.rmsnorm.rms_norm with a learned weight)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)
