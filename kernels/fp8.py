"""DeepSeek-V3's published FP8 format: e4m3 weights with one fp32 scale per 128 x 128 block
(`weight_scale_inv`, multiplied in to dequantize).

Legend (kernels/__init__.py): Fo out features, Fi in features, Bo = ceil(Fo / 128),
Bi = ceil(Fi / 128).
"""

import torch

BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def dequantize_block_fp8(
    w: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK
) -> torch.Tensor:
    """w [Fo, Fi] float8_e4m3fn, scale_inv [Bo, Bi] fp32 -> [Fo, Fi] fp32."""
    rows, cols = w.shape
    assert scale_inv.shape == ((rows + block - 1) // block, (cols + block - 1) // block), (
        w.shape,
        scale_inv.shape,
    )
    scale = scale_inv.float().repeat_interleave(block, 0).repeat_interleave(block, 1)[:rows, :cols]
    return w.float() * scale


def quantize_block_fp8(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [Fo, Fi] float -> (w_fp8 [Fo, Fi] float8_e4m3fn, scale_inv [Bo, Bi] fp32), one absmax
    scale per block (used to make test checkpoints and by tools; the loader only dequantizes)."""
    rows, cols = w.shape
    br, bc = (rows + block - 1) // block, (cols + block - 1) // block
    padded = w.float().new_zeros(br * block, bc * block)
    padded[:rows, :cols] = w.float()
    tiles = padded.view(br, block, bc, block)
    scale_inv = (tiles.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)  # [Bo, Bi]
    q = (tiles / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(br * block, bc * block)[:rows, :cols].contiguous(), scale_inv
