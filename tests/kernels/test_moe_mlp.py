"""The Triton grouped expert MLP against the torch references: every branch of its kernel (the
fp32/IEEE dot and the tensor-core dot, each over bf16/fp16/fp32 or FP8 weights, gated and not)."""

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from kernels.fp8 import quantize_block_fp8
from kernels.moe_mlp import (
    grouped_expert_mlp_fp8_ref,
    grouped_expert_mlp_ref,
    grouped_expert_mlp_triton,
)
from tests.kernels.branches import BRANCHES


def assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    """16-bit data: the reference rounds gate/up, silu(gate) * up and the output to the dtype
    (0.5 ulp each); the kernel rounds the intermediate and the output, and Triton's interpreter
    converts fp32 to bf16 by truncation (1 ulp). Both branches' products of the 16-bit inputs are
    exact, summed in fp32 (the tensor-core branch's bf16 dot by the tests' emulation,
    tests/kernels/branches.py: so this bounds rounding, not tensor-core arithmetic). So a few
    ulps of the largest output; a misplaced mask or index is off by about the output's size."""
    assert out.dtype == ref.dtype and out.shape == ref.shape
    if ref.dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    else:
        largest = ref.float().abs().max().item() if ref.numel() else 0.0
        atol = 4 * torch.finfo(ref.dtype).eps * max(largest, 1.0)
        torch.testing.assert_close(out.float(), ref.float(), rtol=0.0, atol=atol)


def make(counts: list[int], hidden: int, inter: int, dtype: torch.dtype, device: str, seed=0):
    gen = torch.Generator().manual_seed(seed)
    slots = len(counts)
    x = torch.randn(sum(counts), hidden, generator=gen)
    w13 = torch.randn(slots, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(slots, hidden, inter, generator=gen) / inter**0.5
    return [t.to(device, dtype) for t in (x, w13, w2)]


@pytest.mark.parametrize("dtype, fp32_dot, dot_kind", BRANCHES)
@pytest.mark.parametrize(
    "counts, hidden, inter",
    [
        ([3, 0, 17, 1], 40, 24),  # odd sizes, an empty slot, a slot over two row blocks
        ([0, 1, 0], 32, 16),  # one row (batch 1) between empty slots
        ([0, 0], 16, 16),  # no rows at all
    ],
)
def test_matches_reference(counts, hidden, inter, dtype, fp32_dot, dot_kind, device, dots):
    x, w13, w2 = make(counts, hidden, inter, dtype, device)
    # 16-wide tiles: small shapes still span several tiles in every dimension
    out = grouped_expert_mlp_triton(x, counts, w13, w2, block_n=16, block_k=16, fp32_dot=fp32_dot)
    assert_matches(out, grouped_expert_mlp_ref(x, counts, w13, w2))
    if sum(counts):
        dots.assert_only(dot_kind)


def test_default_tiles_and_device_counts(device, dots):
    """counts as a device tensor (no host sync); 21 rows per slot pick 32-row blocks; fp32 data
    takes the IEEE dot by default."""
    counts = [40, 2]
    x, w13, w2 = make(counts, 48, 40, torch.float32, device, seed=1)
    counts_t = torch.tensor(counts, device=device)
    out = grouped_expert_mlp_triton(x, counts_t, w13, w2, block_n=32, block_k=32)
    assert_matches(out, grouped_expert_mlp_ref(x, counts, w13, w2))
    dots.assert_only("fp32 x fp32 ieee")


def quantize_experts(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Per slot: gate and up quantized separately (as in a checkpoint), then stacked."""
    inter = w2.shape[2]
    halves = [[quantize_block_fp8(w[:inter]), quantize_block_fp8(w[inter:])] for w in w13]
    w13_q = torch.stack([torch.cat([g[0], u[0]]) for g, u in halves])
    w13_s = torch.stack([torch.cat([g[1], u[1]]) for g, u in halves])
    downs = [quantize_block_fp8(w) for w in w2]
    return w13_q, w13_s, torch.stack([q for q, _ in downs]), torch.stack([s for _, s in downs])


@pytest.mark.parametrize("dtype, fp32_dot, dot_kind", BRANCHES)
def test_fp8_matches_dequantized_reference(dtype, fp32_dot, dot_kind, device, dots):
    counts, hidden, inter = [2, 0, 5], 160, 136  # partial 128-blocks in both dims
    x, w13, w2 = make(counts, hidden, inter, torch.float32, device, seed=2)
    # Blocks of very different magnitude: a kernel that applies the wrong block's scale (say the
    # gate's to the up half, or block 0's to row 130) is off by far more than the tolerance.
    w13[:, inter:] *= 8.0
    w13[:, 128:inter] *= 0.125
    w2[:, :, 128:] *= 4.0
    w13_q, w13_s, w2_q, w2_s = quantize_experts(w13.cpu(), w2.cpu())
    w13_q, w13_s, w2_q, w2_s = (t.to(device) for t in (w13_q, w13_s, w2_q, w2_s))
    assert w13_s.shape == (3, 4, 2) and w2_s.shape == (3, 2, 2)
    x = x.to(dtype)
    out = grouped_expert_mlp_triton(
        x, counts, w13_q, w2_q, w13_s, w2_s, block_n=32, block_k=32, fp32_dot=fp32_dot
    )
    assert_matches(out, grouped_expert_mlp_fp8_ref(x, counts, w13_q, w13_s, w2_q, w2_s))
    dots.assert_only(dot_kind)  # the e4m3 tiles widened to x's dtype, or to fp32
