"""Dense projections y = x @ W.T, by the fastest path for the device and the number of rows.

fp32 on CPU: the compiled kernel (kernels/cpu/build.py), with 512-bit vectors where MKL packs W on
every call and multiplies with 256-bit ones: a layer's own weights (`Linear`, packed=True) as a
copy laid out in panels once (outer-product tiles, ~400 GFLOP/s at 32 rows in cache), other
weights read in place (dot-product tiles; 345-385 GFLOP/s for 32-96 rows against MKL's 204 on
a large sgemm; `python -m bench.linear` per row count). Without it, W @ x.T for a few rows (W
as the left operand, in place: 1.2-1.8x F.linear), F.linear beyond. The results agree with
F.linear up to float rounding (the order of the sums differs).

Legend (kernels/__init__.py): N rows, Fi in features, Fo out features.
"""

import torch
import torch.nn.functional as F
from torch import nn

from kernels.backend import kernel_mode, use_cpu_kernel
from kernels.cpu.build import cpu_kernels

SMALL_ROWS = 32  # up to this many rows, without the compiled kernel: W @ x.T


def panels(weight: torch.Tensor) -> torch.Tensor:
    """weight [Fo, Fi] (fp32, contiguous) laid out for the compiled kernel's panel tiles
    (kernels/cpu/gemm.cpp: pack_panels), kept on the tensor and packed again when it gets new
    storage (fuse_rows) or, for a tensor that tracks versions, changes in place. The copy doubles
    the weight's memory.
    NOTE: the loaded weights are inference tensors (moe.loader), which count no versions: a
    weight written in place after its first packed use (nothing does: loading comes first, and
    the balancer moves only routed experts, which take the grouped kernel) needs
    `del weight._epc_panels`."""
    version = None if weight.is_inference() else weight._version
    key = (weight.data_ptr(), version, tuple(weight.shape))
    cached = getattr(weight, "_epc_panels", None)
    if cached is None or cached[0] != key:
        cached = (key, cpu_kernels().pack_panels(weight.detach()))
        weight._epc_panels = cached
    return cached[1]


def panel_copy(weight: torch.Tensor) -> torch.Tensor | None:
    """The copy of `weight` in panels that `panels` made, if any (what a step reads instead of
    the weight itself)."""
    cached = getattr(weight, "_epc_panels", None)
    return None if cached is None else cached[1]


def linear(x: torch.Tensor, weight: torch.Tensor, packed: bool = False) -> torch.Tensor:
    """x [N, Fi] (or [..., Fi]), weight [Fo, Fi] -> [..., Fo].

    packed: for a weight used on every step (a layer's own): on the compiled CPU kernel, a copy
    of it in panels (`panels`) and the outer-product tiles, ~1.3x faster for more than a few
    rows. A given weight must always take the same path: each path sums in its own order, and
    a row's result must not depend on the rows beside it (the cluster batches differently from
    the engine and gives the same tokens)."""
    if use_cpu_kernel(x) and weight.dtype == torch.float32 and weight.is_contiguous():
        flat = x.reshape(-1, x.shape[-1]).contiguous()  # [N, Fi]
        if packed:
            y = cpu_kernels().linear_panels(flat, panels(weight), weight.shape[0])
        else:
            y = cpu_kernels().linear(flat, weight)
        return y.view(*x.shape[:-1], weight.shape[0])
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
        return linear(x, self.weight, packed=True)


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
