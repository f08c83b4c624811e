"""RMSNorm. Shapes: [..., D] -> [..., D]."""

import torch

from kernels.backend import use_cpu_kernel
from kernels.cpu.build import cpu_kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] any float dtype, weight [D] -> [..., D] in x's dtype.

    Statistics in fp32, the weight applied after casting back (as DeepSeek and transformers do).
    """
    assert x.shape[-1] == weight.shape[0], (x.shape, weight.shape)
    if use_cpu_kernel(x) and x.dim() == 2 and x.stride(1) == 1 and weight.dtype == torch.float32:
        return cpu_kernels().rms_norm(x, weight.contiguous(), eps)  # one op, not eight
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)
