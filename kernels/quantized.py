"""int8 projections y = x @ W.T: the MTP drafts' copy of the vocabulary head
(engine/speculative.py). W is quantized once, symmetric per output row (scale = max|W[row]| /
127, round half to even). The compiled CPU kernels (kernels/cpu/quantized.cpp) read a quarter
of the fp32 weight's bytes per call: on AVX512-VNNI x is quantized per row too and the sums are
integer (`int8_linear_vnni_ref` gives the same numbers), elsewhere the int8 weights are widened
to fp32 against fp32 x (`int8_linear_ref`: the same up to fp32 rounding). Where neither serves,
the weight-only reference dequantizes and multiplies in torch (slower than the fp32 weight
itself: only tests and `draft_head: int8` forced off the CPU kernels take it).

Legend (kernels/__init__.py): N rows, Fi in features, Fo out features, Fq = Fi rounded up to
ROW_ALIGN.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.backend import use_cpu_kernel
from kernels.cpu.build import cpu_kernels

ROW_ALIGN = 64  # an int8 row is whole 64-byte cache lines (the kernel's kRowAlign)
QMAX = 127  # symmetric: -127 .. 127 (-128 unused, so q and -q are both representable)


@dataclass(frozen=True, slots=True)
class Int8Weight:
    """W [Fo, Fi] as int8 rows: q [Fo, Fq] (zeros past Fi), scale [Fo] fp32 (W ~ q * scale),
    sums [Fo] int32 (q's row sums: the VNNI kernel's offset correction)."""

    q: torch.Tensor  # [Fo, Fq] int8
    scale: torch.Tensor  # [Fo] fp32
    sums: torch.Tensor  # [Fo] int32
    in_features: int

    def __post_init__(self) -> None:
        fo, fq = self.q.shape
        assert self.q.dtype == torch.int8 and self.scale.dtype == torch.float32
        assert self.scale.shape == self.sums.shape == (fo,), (self.scale.shape, fo)
        assert self.sums.dtype == torch.int32
        assert fq == -(-self.in_features // ROW_ALIGN) * ROW_ALIGN, (fq, self.in_features)

    @property
    def nbytes(self) -> int:
        """Bytes held (q, the scales and the sums)."""
        return self.q.nbytes + self.scale.nbytes + self.sums.nbytes

    def dequantize(self) -> torch.Tensor:
        """-> [Fo, Fi] fp32: q * scale, the weight the kernels multiply by."""
        return self.q[:, : self.in_features].float() * self.scale[:, None]


def quantize_rows(weight: torch.Tensor) -> Int8Weight:
    """weight [Fo, Fi] (any float dtype) -> its int8 rows: scale[o] = max|weight[o]| / 127,
    q = round(weight / scale) (half to even), a row of zeros has scale 0 and q 0."""
    assert weight.dim() == 2 and weight.is_floating_point(), (weight.shape, weight.dtype)
    w = weight.detach().float()  # [Fo, Fi]
    fo, fi = w.shape
    scale = w.abs().amax(dim=1) / QMAX  # [Fo]
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))  # a zero row stays zero
    q = torch.zeros(fo, -(-fi // ROW_ALIGN) * ROW_ALIGN, dtype=torch.int8, device=w.device)
    # NOTE: clamped: max|w| / (max|w| / 127) may round to 127.00001, never past 127.5
    q[:, :fi] = torch.round(w / divisor[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return Int8Weight(q, scale.contiguous(), q.sum(dim=1, dtype=torch.int32), fi)


def int8_linear(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """x [..., Fi] -> [..., Fo] ~ x @ weight.dequantize().T: the compiled kernel for fp32 CPU
    tensors (weight on the CPU; VNNI where the CPU has it), else `int8_linear_ref`."""
    assert x.shape[-1] == weight.in_features, (x.shape, weight.in_features)
    if use_cpu_kernel(x) and weight.q.is_cpu:
        kernels = cpu_kernels()
        flat = x.reshape(-1, x.shape[-1]).contiguous()  # [N, Fi]
        if kernels.int8_vnni:
            y = kernels.linear_int8_vnni(flat, weight.q, weight.scale, weight.sums)  # [N, Fo]
        else:
            y = kernels.linear_int8(flat, weight.q, weight.scale)  # [N, Fo]
        return y.view(*x.shape[:-1], weight.q.shape[0])
    return int8_linear_ref(x, weight)


def int8_linear_ref(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """The weight-only reference: x [..., Fi] @ (q * scale).T in torch, in x's dtype."""
    return F.linear(x, weight.dequantize().to(device=x.device, dtype=x.dtype))


def quantize_x(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [N, Fi] fp32 -> (xq [N, Fi] int64 in -127 .. 127, xs [N] fp32), symmetric per row as
    the VNNI kernel does it: xq = round(x * (127 / max|x[row]|)) (half to even), xs = max / 127."""
    amax = x.abs().amax(dim=1)  # [N]
    inv = torch.where(amax > 0, QMAX / amax, torch.zeros_like(amax))
    xq = torch.round(x * inv[:, None]).clamp_(-QMAX, QMAX).long()
    return xq, amax / QMAX


def int8_linear_vnni_ref(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """The VNNI kernel's numbers: x [N, Fi] fp32 quantized per row (`quantize_x`), the integer
    sums exact, then (float(sum) * (xs * scale)) in fp32 -> [N, Fo]."""
    xq, xs = quantize_x(x)
    sums = xq @ weight.q[:, : weight.in_features].long().T  # [N, Fo] exact
    return sums.float() * (xs[:, None] * weight.scale[None, :])
