"""RMSNorm. Shapes: [..., D] -> [..., D]."""

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., D] any float dtype, weight [D] -> [..., D] in x's dtype.

    Statistics in fp32, the weight applied after casting back (as DeepSeek and transformers do).
    """
    assert x.shape[-1] == weight.shape[0], (x.shape, weight.shape)
    dtype = x.dtype
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(dtype)
