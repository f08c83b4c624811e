"""Attention for MLA: causal attention over expanded keys (prefill) and paged latent attention
with absorbed weights (decode).

Legend (kernels/__init__.py): B sequences, Q query tokens, J context positions, NH heads, Dk key
dims, Dv value dims, C latent width (kv_lora_rank + qk_rope_head_dim), Dc kv_lora_rank, NB cache
blocks, BS block size, M blocks per table.
"""

import torch


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


def gather_latent(kv_cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """kv_cache [NB, BS, C], block_table [M] int -> the first `length` cached rows [length, C]."""
    block_size = kv_cache.shape[1]
    pos = torch.arange(length, device=kv_cache.device)
    slots = block_table[pos // block_size].long() * block_size + pos % block_size  # [length]
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
    """
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
    kv = kv_cache.view(-1, width)[slots].float().masked_fill_(beyond[..., None], 0.0)  # [B, J, C]
    scores = torch.einsum("nhc,nlc->nhl", q.float(), kv) * scale  # [B, NH, J]
    scores.masked_fill_(beyond[:, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    return torch.einsum("nhl,nlr->nhr", probs, kv[..., :kv_lora_rank]).to(q.dtype)
