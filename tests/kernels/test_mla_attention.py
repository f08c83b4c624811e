"""The Triton split-K paged MLA decode attention against the torch reference: both branches of
the split kernel (the fp32/IEEE dot and the tensor-core dot) and the reduce kernel, per dtype."""

import pytest
import torch

pytest.importorskip("triton", reason="the Triton kernels need the triton package")

from kernels.mla_attention import (
    paged_latent_attention_ref,
    paged_latent_attention_triton,
)
from tests.kernels.branches import BRANCHES

PAD_BLOCK = 0  # padding entries of a table point here; it holds only NaN


def paged_case(
    context_lens: list[int], num_heads: int, rank: int, rope: int, page: int, dtype, device, seed
):
    """A NaN-filled cache in which only each sequence's context rows are written, in shuffled
    blocks; tables padded with PAD_BLOCK. NaN anywhere the kernel must not read would show."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(context_lens)
    max_blocks = max(-(-n // page) for n in context_lens) + 1  # at least one padding entry
    num_blocks = num_seqs * max_blocks + 3  # spare blocks stay NaN too
    cache = torch.full((num_blocks, page, rank + rope), float("nan"))
    tables = torch.full((num_seqs, max_blocks), PAD_BLOCK, dtype=torch.long)
    free = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    for i, n in enumerate(context_lens):
        for b in range(-(-n // page)):
            tables[i, b] = free.pop()
            rows = min(page, n - b * page)  # the last block's tail stays NaN
            cache[tables[i, b], :rows] = torch.randn(rows, rank + rope, generator=gen)
    q = torch.randn(num_seqs, num_heads, rank + rope, generator=gen)
    lens = torch.tensor(context_lens)
    return q.to(device, dtype), cache.to(device, dtype), tables.to(device), lens.to(device)


@pytest.mark.parametrize("dtype, fp32_dot, dot_kind", BRANCHES)
@pytest.mark.parametrize(
    "context_lens, num_heads, rank, rope, page, num_splits",
    [
        # lengths off the page size and a 1-token context; 3 splits leave the short ones empty
        ([5, 33, 1], 3, 24, 8, 4, 3),
        ([5, 33, 1], 20, 24, 8, 4, 1),  # two head groups (16 + 4), no split
        ([50], 4, 32, 16, 16, 8),  # batch 1, more splits asked than blocks: one per block
        ([7, 16], 2, 16, 16, 8, None),  # the default split count
    ],
)
def test_matches_reference(
    context_lens, num_heads, rank, rope, page, num_splits, dtype, fp32_dot, dot_kind, device, dots
):
    q, cache, tables, lens = paged_case(
        context_lens, num_heads, rank, rope, page, dtype, device, seed=len(context_lens)
    )
    scale = (rank + rope) ** -0.5
    out = paged_latent_attention_triton(
        q, cache, tables, lens, scale, rank, num_splits=num_splits, block_t=16, fp32_dot=fp32_dot
    )
    dots.assert_only(dot_kind)
    ref = paged_latent_attention_ref(q, cache, tables, lens, scale, rank)
    assert out.shape == (len(context_lens), num_heads, rank) and out.dtype == dtype
    assert not out.isnan().any()
    if dtype == torch.float32:
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5)
    else:
        # The reference computes in fp32 from the 16-bit inputs and rounds once (0.5 ulp). The
        # kernel's products of 16-bit inputs are exact, summed in fp32 (the bf16 tensor-core
        # branch's dots by the tests' emulation, tests/kernels/branches.py: this bounds rounding,
        # not tensor-core arithmetic); that branch also rounds the probabilities to the dtype
        # before multiplying the values, and Triton's interpreter converts fp32 to bf16 by
        # truncation (1 ulp). Outputs are averages of values of size <= ~4: 2 ulps of 1 bound
        # the rounding. A row read past a context is NaN (so is all the cache nothing wrote),
        # and a wrong operand or a missing rescale in a branch's dots is off by a value's size.
        tol = 2 * torch.finfo(dtype).eps
        torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)
