"""Attention for MLA: causal attention over expanded keys (prefill) and paged latent attention
with absorbed weights (decode).

Legend (kernels/__init__.py): B sequences, Q query tokens, J context positions, NH heads, Dk key
dims, Dv value dims, C latent width (kv_lora_rank + qk_rope_head_dim), Dc kv_lora_rank, Dr
qk_rope_head_dim, NB cache blocks, BS block size, M blocks per table, SP splits of a table.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

from kernels.backend import dot_in_fp32, jit, tl, triton, use_cpu_kernel, use_triton
from kernels.cpu.build import cpu_kernels


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [Q, NH, Dk], k [J, NH, Dk], v [J, NH, Dv] -> [Q, NH, Dv].

    The queries are the last Q of the L positions: query i sees keys 0 .. L - Q + i.
    """
    num_q, num_k = q.shape[0], k.shape[0]
    assert num_q <= num_k and k.shape[:2] == v.shape[:2], (q.shape, k.shape, v.shape)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale  # [NH, Q, J]
    allowed = torch.ones(num_q, num_k, dtype=torch.bool, device=q.device).tril(num_k - num_q)
    scores.masked_fill_(~allowed, float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


def cache_slot(
    table: Sequence[int] | torch.Tensor, pos: int | torch.Tensor, block_size: int
) -> int | torch.Tensor:
    """The flat row of the paged cache ([NB * BS, C]) that holds position `pos` of a sequence
    whose blocks are `table`: block table[pos // BS], offset pos % BS. Ints and lists (the
    engine's block tables, per position) or int64 tensors (pos [N], table [M]: -> [N]) alike."""
    return table[pos // block_size] * block_size + pos % block_size


def write_cache(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, latent: torch.Tensor) -> None:
    """kv_cache [NB, BS, C]: row slot_mapping[i] (block * BS + offset) = latent[i] ([T, C])."""
    if use_cpu_kernel(latent) and kv_cache.dtype == torch.float32 and slot_mapping.numel():
        cpu_kernels().write_rows(kv_cache, slot_mapping, latent)
        return
    kv_cache.view(-1, kv_cache.shape[-1])[slot_mapping] = latent.to(kv_cache.dtype)


def gather_latent(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """kv_cache [NB, BS, C], block_table [M] int -> the first `length` cached rows [length, C]."""
    block_size = kv_cache.shape[1]
    pos = torch.arange(length, device=kv_cache.device)
    slots = cache_slot(block_table.long(), pos, block_size)  # [length]
    return kv_cache.view(-1, kv_cache.shape[-1])[slots]


def paged_latent_attention(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """One query token per sequence against its paged latent cache (weight-absorbed MLA decode).

    q [B, NH, C]: q_nope already projected into the latent by W_UK, then q_pe;
    kv_cache [NB, BS, C]; block_tables [B, M] int (padding entries must be valid block ids);
    context_lens [B] int, >= 1 -> [B, NH, Dc]: attention output in the latent space (apply W_UV
    next).
    Triton on CUDA tensors, the compiled kernel on fp32 CPU tensors (kernels/backend.py: it
    reads the cache blocks in place), else the torch reference.
    """
    if use_triton(q):
        return paged_latent_attention_triton(
            q, kv_cache, block_tables, context_lens, scale, kv_lora_rank
        )
    if use_cpu_kernel(q) and kv_cache.dtype == torch.float32:
        return cpu_kernels().paged_mla_attention(
            q.contiguous(), kv_cache, block_tables.long(), context_lens.long().contiguous(),
            scale, kv_lora_rank,
        )  # fmt: skip
    return paged_latent_attention_ref(q, kv_cache, block_tables, context_lens, scale, kv_lora_rank)


def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    w_uk: torch.Tensor,
    w_uv: torch.Tensor,
    scale: float,
    w_uv_t: torch.Tensor | None = None,
) -> torch.Tensor:
    """Weight-absorbed MLA decode, one query per sequence: q_nope [B, NH, Dn], q_pe [B, NH, Dr]
    (roped), the paged cache as paged_latent_attention, w_uk [NH, Dn, Dc], w_uv [NH, Dv, Dc]
    (w_uv_t: w_uv transposed, contiguous, for the compiled kernel) -> [B, NH, Dv].
    q_lat = q_nope W_UK; latent attention; its output W_UV.T. One call of the compiled kernel
    on fp32 CPU tensors; else those three steps (Triton or the reference for the attention)."""
    if w_uv_t is not None and use_cpu_kernel(q_nope) and kv_cache.dtype == torch.float32:
        return cpu_kernels().mla_decode(
            q_nope, q_pe.contiguous(), kv_cache, block_tables, context_lens, w_uk, w_uv_t, scale
        )
    q_lat = torch.einsum("thd,hdr->thr", q_nope, w_uk)  # [B, NH, Dc]
    o_lat = paged_latent_attention(
        torch.cat([q_lat, q_pe], dim=-1), kv_cache, block_tables, context_lens, scale,
        w_uk.shape[-1],
    )  # fmt: skip
    return torch.einsum("thr,hvr->thv", o_lat, w_uv)


def paged_latent_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
) -> torch.Tensor:
    """The torch reference of paged_latent_attention (same shapes)."""
    num_seqs, _, width = q.shape
    assert kv_cache.shape[-1] == width and block_tables.shape[0] == num_seqs, (
        q.shape,
        kv_cache.shape,
        block_tables.shape,
    )
    block_size = kv_cache.shape[1]
    max_len = block_tables.shape[1] * block_size
    offsets = torch.arange(block_size, device=q.device)
    slots = (block_tables.long()[:, :, None] * block_size + offsets).view(num_seqs, max_len)
    beyond = torch.arange(max_len, device=q.device)[None, :] >= context_lens[:, None]  # [B, J]
    # NOTE: rows past a sequence's end are stale or uninitialised (maybe NaN): zero them, since
    # a zero probability times NaN is still NaN.
    # NOTE: index_select, not advanced indexing: on CPU it gathers the rows several times faster.
    flat = kv_cache.view(-1, width).index_select(0, slots.view(-1)).view(num_seqs, max_len, width)
    kv = flat.float().masked_fill_(beyond[..., None], 0.0)  # [B, J, C]
    scores = torch.einsum("nhc,nlc->nhl", q.float(), kv) * scale  # [B, NH, J]
    scores.masked_fill_(beyond[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("nhl,nlr->nhr", probs, kv[..., :kv_lora_rank]).to(q.dtype)


# ---- Triton: split-K paged decode ------------------------------------------------------------


@jit
def _mla_decode_split_kernel(
    q_ptr,
    cache_ptr,
    table_ptr,
    lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    num_heads,
    rank,
    rope,
    blocks_per_split,
    scale_log2,
    stride_qn,
    stride_qh,
    stride_qc,
    stride_cb,
    stride_cs,
    stride_cc,
    stride_tn,
    stride_tm,
    stride_on,
    stride_oh,
    stride_ok,
    stride_or,
    stride_ln,
    stride_lh,
    stride_lk,
    PAGE: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """One (sequence, head group, split): attention over the split's share of the context.

    Writes the split's normalised output [BLOCK_H, Dc] and its log2-sum-exp [BLOCK_H] (-inf for a
    split past the context's end). Keys are the whole latent row, values its first R numbers.
    """
    seq = tl.program_id(0)
    head_group = tl.program_id(1)
    split = tl.program_id(2)
    context_len = tl.load(lens_ptr + seq)
    start = split * blocks_per_split * PAGE
    end = tl.minimum(start + blocks_per_split * PAGE, context_len)
    offs_h = head_group * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_r = tl.arange(0, BLOCK_R)
    offs_p = tl.arange(0, BLOCK_P)
    mask_h = offs_h < num_heads
    mask_r = offs_r < rank
    mask_p = offs_p < rope
    q_rows = q_ptr + seq.to(tl.int64) * stride_qn + offs_h[:, None] * stride_qh  # [BH, 1]
    q_lat = tl.load(q_rows + offs_r[None, :] * stride_qc, mask_h[:, None] & mask_r[None, :], 0.0)
    pe_cols = (rank + offs_p[None, :]) * stride_qc
    q_pe = tl.load(q_rows + pe_cols, mask_h[:, None] & mask_p[None, :], 0.0)  # [BH, BP]
    if FP32_DOT:
        q_lat = q_lat.to(tl.float32)
        q_pe = q_pe.to(tl.float32)
    m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), dtype=tl.float32)
    table_row = table_ptr + seq.to(tl.int64) * stride_tn
    for t0 in range(start, end, BLOCK_T):
        pos = t0 + tl.arange(0, BLOCK_T)
        mask_t = pos < end
        # NOTE: masked loads only: table entries and cache rows past the context (padding,
        # stale or NaN rows) are never read, so they cannot leak in.
        block = tl.load(table_row + (pos // PAGE) * stride_tm, mask=mask_t, other=0)
        rows = cache_ptr + block.to(tl.int64) * stride_cb + (pos % PAGE) * stride_cs
        rows = rows[:, None]  # [BT, 1]
        kv = tl.load(rows + offs_r[None, :] * stride_cc, mask_t[:, None] & mask_r[None, :], 0.0)
        k_pe_ptrs = rows + (rank + offs_p[None, :]) * stride_cc
        k_pe = tl.load(k_pe_ptrs, mask_t[:, None] & mask_p[None, :], 0.0)  # [BT, BP]
        if FP32_DOT:
            kv = kv.to(tl.float32)
            k_pe = k_pe.to(tl.float32)
            s = tl.dot(q_lat, tl.trans(kv), input_precision="ieee")
            s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision="ieee")  # [BH, BT]
        else:
            s = tl.dot(q_lat, tl.trans(kv))
            s = tl.dot(q_pe, tl.trans(k_pe), s)  # [BH, BT]
        s = tl.where(mask_t[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: pos t0 < end is in the tile
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])  # [BH, BT]
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP32_DOT:
            acc = acc * alpha[:, None] + tl.dot(p, kv, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
        m_i = m_new
    nonempty = l_i > 0
    lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
    out = acc / tl.where(nonempty, l_i, 1.0)[:, None]
    part = seq.to(tl.int64) * stride_on + split * stride_ok
    o_ptrs = part_out_ptr + part + offs_h[:, None] * stride_oh + offs_r[None, :] * stride_or
    tl.store(o_ptrs, out, mask=mask_h[:, None] & mask_r[None, :])
    lse_ptrs = part_lse_ptr + seq.to(tl.int64) * stride_ln + offs_h * stride_lh + split * stride_lk
    tl.store(lse_ptrs, lse, mask=mask_h)


@jit
def _mla_decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    rank,
    stride_on,
    stride_oh,
    stride_ok,
    stride_or,
    stride_ln,
    stride_lh,
    stride_lk,
    stride_yn,
    stride_yh,
    stride_yr,
    BLOCK_K: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One (sequence, head): combine the splits' outputs, weighted by their sum-exp."""
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    mask_k = offs_k < num_splits
    mask_r = offs_r < rank
    lse_ptrs = part_lse_ptr + seq * stride_ln + head * stride_lh + offs_k * stride_lk
    lse = tl.load(lse_ptrs, mask=mask_k, other=float("-inf"))  # [BK]
    weight = tl.exp2(lse - tl.max(lse, axis=0))  # [BK]: 0 for empty splits; split 0 never is
    o_ptrs = (
        part_out_ptr
        + seq * stride_on
        + head * stride_oh
        + offs_k[:, None] * stride_ok
        + offs_r[None, :] * stride_or
    )
    part = tl.load(o_ptrs, mask=mask_k[:, None] & mask_r[None, :], other=0.0)  # [BK, BR]
    out = tl.sum(part * weight[:, None], axis=0) / tl.sum(weight, axis=0)
    y_ptrs = out_ptr + seq * stride_yn + head * stride_yh + offs_r * stride_yr
    tl.store(y_ptrs, out.to(out_ptr.dtype.element_ty), mask=mask_r)


@functools.cache
def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    return torch.cuda.get_device_properties(device).multi_processor_count


def paged_latent_attention_triton(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    kv_lora_rank: int,
    num_splits: int | None = None,
    block_h: int = 16,
    block_t: int | None = None,
    num_warps: int = 4,
    fp32_dot: bool | None = None,
) -> torch.Tensor:
    """The Triton path of paged_latent_attention (same shapes), split-K over each table's blocks.

    Programs (sequence, group of block_h heads, split) each cover blocks_per_split table entries
    and write a partial output and log-sum-exp [B, NH, SP]; a second kernel combines the SP splits.
    num_splits defaults to enough programs for about two per SM (capped at 16 and at M).
    fp32_dot: the split kernel's branch (kernels.backend.dot_in_fp32; None: by q's dtype and
    device).
    """
    num_seqs, num_heads, width = q.shape
    page = kv_cache.shape[1]
    max_blocks = block_tables.shape[1]
    rope = width - kv_lora_rank
    assert kv_cache.dim() == 3 and kv_cache.shape[2] == width, (q.shape, kv_cache.shape)
    assert block_tables.shape == (num_seqs, max_blocks), (block_tables.shape, num_seqs)
    assert context_lens.shape == (num_seqs,), (context_lens.shape, num_seqs)
    assert not block_tables.is_floating_point() and not context_lens.is_floating_point()
    assert 0 < kv_lora_rank < width, (kv_lora_rank, width)
    assert q.dtype == kv_cache.dtype, (q.dtype, kv_cache.dtype)
    assert q.device == kv_cache.device == block_tables.device, (q.device, kv_cache.device)
    out = q.new_empty(num_seqs, num_heads, kv_lora_rank)  # [B, NH, Dc]
    if num_seqs == 0:
        return out
    # NOTE: the engine keeps context_lens on the host; the kernel reads them on the device.
    context_lens = context_lens.to(q.device, torch.int32)
    head_groups = triton.cdiv(num_heads, block_h)
    if num_splits is None:
        want = triton.cdiv(2 * _num_sms(q.device), num_seqs * head_groups)
        num_splits = max(1, min(want, 16, max_blocks))
    blocks_per_split = triton.cdiv(max_blocks, num_splits)
    num_splits = triton.cdiv(max_blocks, blocks_per_split)  # none wholly past the table
    block_r = max(16, triton.next_power_of_2(kv_lora_rank))
    block_p = max(16, triton.next_power_of_2(rope))
    if block_t is None:  # smaller key tiles for the wide latent (512) to stay in registers
        block_t = 16 if block_r > 256 else 32
    part_out = q.new_empty(num_seqs, num_heads, num_splits, kv_lora_rank, dtype=torch.float32)
    part_lse = q.new_empty(num_seqs, num_heads, num_splits, dtype=torch.float32)
    _mla_decode_split_kernel[(num_seqs, head_groups, num_splits)](
        q, kv_cache, block_tables, context_lens, part_out, part_lse,
        num_heads, kv_lora_rank, rope, blocks_per_split, scale * math.log2(math.e),
        *q.stride(), *kv_cache.stride(), *block_tables.stride(), *part_out.stride(),
        *part_lse.stride(),
        PAGE=page, FP32_DOT=dot_in_fp32(q, fp32_dot), BLOCK_H=block_h, BLOCK_T=block_t,
        BLOCK_R=block_r, BLOCK_P=block_p, num_warps=num_warps,
    )  # fmt: skip
    _mla_decode_reduce_kernel[(num_seqs, num_heads)](
        part_out, part_lse, out, num_splits, kv_lora_rank,
        *part_out.stride(), *part_lse.stride(), *out.stride(),
        BLOCK_K=max(2, triton.next_power_of_2(num_splits)), BLOCK_R=block_r,
    )  # fmt: skip
    return out
