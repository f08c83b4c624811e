"""SiLU-and-mul MLPs: one dense MLP, and a grouped MLP over expert-sorted rows (torch reference,
the compiled CPU kernel, and a Triton grouped GEMM, also over FP8 block-scaled weights).

Legend (kernels/__init__.py): N rows, D hidden, I intermediate, S_r expert slots on a rank,
RB row blocks (each within one slot).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels.backend import dot_in_fp32, jit, tl, triton, use_cpu_kernel, use_triton
from kernels.cpu.build import cpu_kernels
from kernels.fp8 import BLOCK as FP8_BLOCK
from kernels.fp8 import dequantize_block_fp8
from kernels.linear import linear, panels


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] -> [..., I]: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def dense_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One SiLU-gated MLP over every row (the dense layers, the shared experts): x [N, D],
    w13 [2I, D] (gate rows then up rows), w2 [D, I] -> [N, D]. On fp32 CPU tensors one call of
    the compiled kernel over panel copies of the weights (kernels.linear.panels), else one slot
    of grouped_expert_mlp."""
    if (
        use_cpu_kernel(x)
        and w13.dtype == w2.dtype == torch.float32
        and w13.is_contiguous()
        and w2.is_contiguous()
    ):
        return cpu_kernels().mlp_panels(x.contiguous(), panels(w13), panels(w2), w2.shape[1])
    if use_triton(x):
        # NOTE: the one count filled on the device, not copied from a host list: a CUDA graph
        # of the decode step cannot hold a host-to-device copy (engine/capture_check.py)
        counts = torch.full((1,), x.shape[0], dtype=torch.int64, device=x.device)  # [1]
        return grouped_expert_mlp_triton(x, counts, w13[None], w2[None])
    return grouped_expert_mlp(x, [x.shape[0]], w13[None], w2[None])


def grouped_expert_mlp(
    x: torch.Tensor, counts: list[int] | torch.Tensor, w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Run expert MLPs over rows sorted by expert slot.

    x [N, D] rows grouped by slot (counts[s] rows for slot s, in slot order, sum(counts) == N);
    w13 [S_r, 2I, D] (gate rows then up rows), w2 [S_r, D, I] -> [N, D] in x's dtype.
    Triton on CUDA tensors, the compiled kernel on fp32 CPU tensors (kernels/backend.py: one
    call per layer, each used expert's weights read once), else the torch reference.
    """
    if use_triton(x):
        return grouped_expert_mlp_triton(x, counts, w13, w2)
    if isinstance(counts, torch.Tensor):  # the host paths walk the slots (a read back)
        counts = counts.tolist()
    if use_cpu_kernel(x) and w13.dtype == w2.dtype == torch.float32:
        return cpu_kernels().grouped_mlp(x.contiguous(), counts, w13.contiguous(), w2.contiguous())
    return grouped_expert_mlp_ref(x, counts, w13, w2)


def grouped_expert_mlp_fp8(
    x: torch.Tensor,
    counts: list[int] | torch.Tensor,
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
) -> torch.Tensor:
    """grouped_expert_mlp over float8_e4m3fn weights with one fp32 scale per 128 x 128 block.

    w13 [S_r, 2I, D], w13_scale_inv [S_r, 2 * ceil(I/128), ceil(D/128)] (gate and up quantized
    separately, as in the checkpoint: gate blocks, then up blocks); w2 [S_r, D, I],
    w2_scale_inv [S_r, ceil(D/128), ceil(I/128)] -> [N, D] in x's dtype.
    Triton where use_triton(x); elsewhere the weights are dequantized to x's dtype for this call
    and run by grouped_expert_mlp: bit for bit what weights dequantized on load compute.
    """
    if use_triton(x):
        return grouped_expert_mlp_triton(x, counts, w13, w2, w13_scale_inv, w2_scale_inv)
    # NOTE: every slot, every call: a CPU serves FP8 checkpoints dequantized on load by default
    # (EngineConfig.fp8_experts), this path trades that memory for time.
    w13_deq, w2_deq = dequantize_experts(w13, w13_scale_inv, w2, w2_scale_inv, x.dtype)
    return grouped_expert_mlp(x, counts, w13_deq, w2_deq)


def dequantize_experts(
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 expert weights in grouped_expert_mlp_fp8's layout -> (w13 [S_r, 2I, D],
    w2 [S_r, D, I]) in dtype, each block times its scale in fp32 and then rounded to dtype."""
    deq = lambda w, scale_inv: dequantize_block_fp8(w, scale_inv).to(dtype)
    inter, half = w2.shape[2], w13_scale_inv.shape[1] // 2  # gate and up were quantized apart
    w13_deq = torch.stack(
        [
            torch.cat([deq(w[:inter], s[:half]), deq(w[inter:], s[half:])])
            for w, s in zip(w13, w13_scale_inv)
        ]
    )  # [S_r, 2I, D]
    w2_deq = torch.stack([deq(w, s) for w, s in zip(w2, w2_scale_inv)])  # [S_r, D, I]
    return w13_deq, w2_deq


def grouped_expert_mlp_ref(
    x: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """The torch reference of grouped_expert_mlp (same shapes)."""
    assert x.dim() == 2 and w13.dim() == 3 and w2.dim() == 3, (x.shape, w13.shape, w2.shape)
    assert len(counts) == w13.shape[0] == w2.shape[0], (len(counts), w13.shape, w2.shape)
    assert sum(counts) == x.shape[0], (sum(counts), x.shape)
    out = torch.empty_like(x)
    start = 0
    for slot, n in enumerate(counts):
        if n == 0:
            continue
        rows = x[start : start + n]  # [n, H]
        # NOTE: kernels.linear: for few rows on CPU, W @ rows.T reads the weights 1.2-1.8x faster
        # than F.linear (and `rows @ w.t()` is up to 10x slower).
        out[start : start + n] = linear(silu_and_mul(linear(rows, w13[slot])), w2[slot])
        start += n
    return out


def grouped_expert_mlp_fp8_ref(
    x: torch.Tensor,
    counts: list[int],
    w13: torch.Tensor,
    w13_scale_inv: torch.Tensor,
    w2: torch.Tensor,
    w2_scale_inv: torch.Tensor,
) -> torch.Tensor:
    """The torch reference of grouped_expert_mlp_fp8: dequantize to x's dtype, then the MLP."""
    w13_deq, w2_deq = dequantize_experts(w13, w13_scale_inv, w2, w2_scale_inv, x.dtype)
    return grouped_expert_mlp_ref(x, counts, w13_deq, w2_deq)


# ---- Triton ----------------------------------------------------------------------------------


@jit
def _tile_dot(a, b_ptrs, b_mask, s_ptrs, s_mask, FP8: tl.constexpr, FP32_DOT: tl.constexpr):
    """a [BM, BK] @ the B tile at b_ptrs [BK, BN] -> [BM, BN] fp32, times the FP8 block scales."""
    b = tl.load(b_ptrs, mask=b_mask, other=0.0)
    if FP32_DOT:
        part = tl.dot(a, b.to(tl.float32), input_precision="ieee")
    else:
        part = tl.dot(a, b.to(a.dtype))  # e4m3 -> bf16 is exact
    if FP8:
        part = part * tl.load(s_ptrs, mask=s_mask, other=0.0)[None, :]
    return part


@jit
def _grouped_gemm_kernel(
    a_ptr,
    b_ptr,
    scale_ptr,
    c_ptr,
    block_slot_ptr,
    block_start_ptr,
    block_end_ptr,
    n_out,
    k_dim,
    up_offset,
    up_scale_offset,
    stride_am,
    stride_ak,
    stride_bs,
    stride_bn,
    stride_bk,
    stride_ss,
    stride_sn,
    stride_sk,
    stride_cm,
    stride_cn,
    GATED: tl.constexpr,
    FP8: tl.constexpr,
    FP32_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr,
):
    """C[rows, cols] = A[rows] @ B[slot, cols].T for one block of rows that share a slot.

    GATED: C = silu(A @ B[slot, cols].T) * (A @ B[slot, up_offset + cols].T).
    FP8: B is e4m3 with one scale per SCALE_BLOCK x SCALE_BLOCK block (BLOCK_K divides it, so a
    K tile has one scale per column: applied to the tile's partial product).
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    slot = tl.load(block_slot_ptr + pid_m)
    if slot < 0:  # past the last row block: the grid is an upper bound, sized without a sync
        return
    row_end = tl.load(block_end_ptr + pid_m)
    offs_m = tl.load(block_start_ptr + pid_m) + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < row_end
    mask_n = offs_n < n_out
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak  # [BM, BK]
    b_ptrs = (
        b_ptr
        + slot.to(tl.int64) * stride_bs
        + offs_n[None, :] * stride_bn
        + offs_k[:, None] * stride_bk
    )  # [BK, BN]
    s_ptrs = scale_ptr + slot.to(tl.int64) * stride_ss + (offs_n // SCALE_BLOCK) * stride_sn
    s_up_ptrs = s_ptrs + up_scale_offset * stride_sn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        mask_k = offs_k < k_dim - k0
        a = tl.load(a_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        if FP32_DOT:
            a = a.to(tl.float32)
        b_mask = mask_k[:, None] & mask_n[None, :]
        scale_col = (k0 // SCALE_BLOCK) * stride_sk
        acc += _tile_dot(a, b_ptrs, b_mask, s_ptrs + scale_col, mask_n, FP8, FP32_DOT)
        if GATED:
            acc_up += _tile_dot(
                a, b_ptrs + up_offset * stride_bn, b_mask, s_up_ptrs + scale_col, mask_n, FP8,
                FP32_DOT,
            )  # fmt: skip
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    if GATED:
        acc = acc * tl.sigmoid(acc) * acc_up
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _row_blocks(
    counts: torch.Tensor, num_rows: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """counts [S_r] int64 -> per row block: slot (-1 past the last block), first row, the slot's
    end row.

    The G = ceil(N / block_m) + S entries bound sum(ceil(counts / block_m)) without reading
    counts on the host (no device sync); extra blocks get slot -1 and exit at once.
    """
    num_slots = counts.shape[0]
    num_blocks = triton.cdiv(num_rows, block_m) + num_slots
    blocks = (counts + block_m - 1) // block_m  # [S_r]
    block_ends = blocks.cumsum(0)  # [S_r]
    row_ends = counts.cumsum(0)  # [S_r]
    b = torch.arange(num_blocks, device=counts.device)  # [RB]
    slot = torch.searchsorted(block_ends, b, right=True)  # [RB]: S_r past the last block
    valid = slot < num_slots
    slot = slot.clamp(max=num_slots - 1)
    first_block = block_ends[slot] - blocks[slot]
    start = row_ends[slot] - counts[slot] + (b - first_block) * block_m
    slot = torch.where(valid, slot, -1)
    return slot.to(torch.int32), start.to(torch.int32), row_ends[slot.clamp(min=0)].to(torch.int32)


def _grouped_gemm(
    a: torch.Tensor,
    w: torch.Tensor,
    scale_inv: torch.Tensor | None,
    out: torch.Tensor,
    blocks: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    gated: bool,
    block_m: int,
    block_n: int,
    block_k: int,
    num_warps: int,
    fp32_dot: bool,
) -> None:
    """out [N, n_out] = a [N, n_in] @ w[slot] [*, n_in].T per row block (gated: silu(gate) * up)."""
    n_out, k_dim = out.shape[1], a.shape[1]
    fp8 = scale_inv is not None
    scale = scale_inv if fp8 else w  # a placeholder pointer when not FP8: never read
    scale_strides = scale_inv.stride() if fp8 else (0, 0, 0)
    grid = (blocks[0].shape[0], triton.cdiv(n_out, block_n))
    _grouped_gemm_kernel[grid](
        a, w, scale, out, *blocks,
        n_out, k_dim, n_out if gated else 0, scale_inv.shape[1] // 2 if fp8 and gated else 0,
        *a.stride(), *w.stride(), *scale_strides, *out.stride(),
        GATED=gated, FP8=fp8, FP32_DOT=fp32_dot,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, SCALE_BLOCK=FP8_BLOCK,
        num_warps=num_warps,
    )  # fmt: skip


def grouped_expert_mlp_triton(
    x: torch.Tensor,
    counts: list[int] | torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    w13_scale_inv: torch.Tensor | None = None,
    w2_scale_inv: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int = 64,
    block_k: int = 64,
    num_warps: int = 4,
    fp32_dot: bool | None = None,
) -> torch.Tensor:
    """The Triton path of grouped_expert_mlp (and, with the scales, of grouped_expert_mlp_fp8).

    Two grouped GEMMs over row blocks that each lie within one slot: [N, D] -> [N, I] with
    gate/up and silu(gate) * up fused, then [N, I] -> [N, D]. counts may be a device tensor [S_r].
    The intermediate [N, I] is stored in x's dtype, as the reference rounds it.
    fp32_dot: the kernel's branch (kernels.backend.dot_in_fp32; None: by x's dtype and device).
    """
    num_rows, hidden = x.shape
    num_slots, inter = w2.shape[0], w2.shape[2]
    assert x.dim() == 2 and w13.shape == (num_slots, 2 * inter, hidden), (x.shape, w13.shape)
    assert w2.shape == (num_slots, hidden, inter), (w2.shape, w13.shape)
    assert x.dtype in (torch.float32, torch.bfloat16, torch.float16), x.dtype
    assert w13.device == w2.device == x.device, (x.device, w13.device, w2.device)
    if isinstance(counts, torch.Tensor):
        assert counts.shape == (num_slots,), (counts.shape, num_slots)
    else:
        assert len(counts) == num_slots and sum(counts) == num_rows, (counts, x.shape)
    fp8 = w13_scale_inv is not None
    assert fp8 == (w2_scale_inv is not None), "both scales or neither"
    if fp8:
        assert w13.dtype == w2.dtype == torch.float8_e4m3fn, (w13.dtype, w2.dtype)
        bi, bh = triton.cdiv(inter, FP8_BLOCK), triton.cdiv(hidden, FP8_BLOCK)
        assert w13_scale_inv.shape == (num_slots, 2 * bi, bh), w13_scale_inv.shape
        assert w2_scale_inv.shape == (num_slots, bh, bi), w2_scale_inv.shape
        assert FP8_BLOCK % block_k == 0, ("a K tile must lie in one scale block", block_k)
        w13_scale_inv, w2_scale_inv = w13_scale_inv.float(), w2_scale_inv.float()
    else:
        assert w13.dtype == w2.dtype == x.dtype, (x.dtype, w13.dtype, w2.dtype)
    out = torch.empty_like(x)
    if num_rows == 0:
        return out
    if block_m is None:  # about the rows per slot: decode has few, so small blocks waste less
        block_m = min(64, max(16, triton.next_power_of_2(triton.cdiv(num_rows, num_slots))))
    counts = torch.as_tensor(counts, dtype=torch.int64, device=x.device)
    blocks = _row_blocks(counts, num_rows, block_m)
    h = x.new_empty(num_rows, inter)  # [N, I]
    launch = (block_m, block_n, block_k, num_warps, dot_in_fp32(x, fp32_dot))
    _grouped_gemm(x, w13, w13_scale_inv, h, blocks, True, *launch)
    _grouped_gemm(h, w2, w2_scale_inv, out, blocks, False, *launch)
    return out
