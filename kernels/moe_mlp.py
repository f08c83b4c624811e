"""SiLU-and-mul MLPs: one dense MLP, and a grouped MLP over expert-sorted rows.

Legend (kernels/__init__.py): N rows, D hidden, I intermediate, S_r expert slots on a rank.
"""

import torch
import torch.nn.functional as F


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [..., 2I] -> [..., I]: silu(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def grouped_expert_mlp(
    x: torch.Tensor, counts: list[int], w13: torch.Tensor, w2: torch.Tensor
) -> torch.Tensor:
    """Run expert MLPs over rows sorted by expert slot.

    x [N, D] rows grouped by slot (counts[s] rows for slot s, in slot order, sum(counts) == N);
    w13 [S_r, 2I, D] (gate rows then up rows), w2 [S_r, D, I] -> [N, D] in x's dtype.
    """
    assert x.dim() == 2 and w13.dim() == 3 and w2.dim() == 3, (x.shape, w13.shape, w2.shape)
    assert len(counts) == w13.shape[0] == w2.shape[0], (len(counts), w13.shape, w2.shape)
    assert sum(counts) == x.shape[0], (sum(counts), x.shape)
    out = torch.empty_like(x)
    start = 0
    for slot, n in enumerate(counts):
        if n == 0:
            continue
        rows = x[start : start + n]  # [n, D]
        # NOTE: F.linear, not `rows @ w.t()`: on CPU the latter is up to 10x slower for few rows.
        out[start : start + n] = F.linear(silu_and_mul(F.linear(rows, w13[slot])), w2[slot])
        start += n
    return out
