"""Dense projections y = x @ W.T, by the fastest path for the device and the number of rows.

fp32 on CPU: the compiled kernel (kernels/cpu.py), which reads W in place with 512-bit vectors
where MKL packs W on every call and multiplies with 256-bit ones (on this machine: 345-385
GFLOP/s for 32-96 rows against MKL's 204 on a large sgemm; `python -m bench.linear` per row
count). Without it, W @ x.T for a few rows (W as the left operand, in place: 1.2-1.8x F.linear),
F.linear beyond. The results agree with F.linear up to float rounding (the order of the sums
differs).

Legend (kernels/__init__.py): N rows, Fi in features, Fo out features.
"""

import torch
import torch.nn.functional as F
from torch import nn

from kernels.backend import kernel_mode, use_cpu_kernel
from kernels.cpu import cpu_kernels

SMALL_ROWS = 32  # up to this many rows, without the compiled kernel: W @ x.T


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [N, Fi] (or [..., Fi]), weight [Fo, Fi] -> [..., Fo]."""
    if use_cpu_kernel(x) and weight.dtype == torch.float32 and weight.is_contiguous():
        flat = x.reshape(-1, x.shape[-1])  # [N, Fi]
        return cpu_kernels().linear(flat.contiguous(), weight).view(*x.shape[:-1], weight.shape[0])
    if (
        x.device.type == "cpu"
        and x.dim() == 2
        and 0 < x.shape[0] <= SMALL_ROWS
        and kernel_mode() != "reference"
    ):
        return (weight @ x.T).T.contiguous()
    return F.linear(x, weight)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) whose forward uses `linear` (no bias)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.bias is None
        return linear(x, self.weight)


def fuse_rows(*layers: nn.Linear) -> torch.Tensor:
    """One [sum of out features, in] weight for layers that take the same input, so one call
    computes all of them; each layer's weight becomes a view of its rows (no copy kept, the state
    dict unchanged). -> the fused weight."""
    fused = torch.cat([layer.weight.detach() for layer in layers])
    start = 0
    for layer in layers:
        rows = layer.weight.shape[0]
        layer.weight.data = fused[start : start + rows]
        start += rows
    return fused
