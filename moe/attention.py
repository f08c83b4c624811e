"""Multi-head latent attention (MLA) over either no cache or a paged latent cache.

Legend (kernels/__init__.py): T tokens of the flat batch, B sequences, D hidden, NH heads,
Dn / Dr / Dv nope, rope and value head dims, Dc kv_lora_rank, C = Dc + Dr cached numbers per
token, NB cache blocks, BS block size, M blocks per table, J context positions, Ta tokens of the
absorbed path (decode tokens and short chunks).
"""

from dataclasses import dataclass, field

import torch
from torch import nn

from kernels.linear import Linear, fuse_rows, linear
from kernels.mla_attention import causal_attention, gather_latent, mla_decode, write_cache
from kernels.rotary import apply_rotary
from moe.config import ModelConfig
from moe.norm import RMSNorm

# Queries of a sequence up to this many take the absorbed path (q_nope W_UK against the latent
# cache, read in place), longer chunks the expanded one (keys and values from kv_b_proj). Per
# query and key the absorbed path costs NH (2 Dc + Dr) multiply-adds, the expanded NH (Dn + Dr +
# Dv) plus, once per key, the expansion NH Dc (Dn + Dv): absorbed is cheaper while
# q NH (2 Dc - Dn - Dv) < NH Dc (Dn + Dv), i.e. q < 85 on DeepSeek-V3's and the presets' shapes.
ABSORB_MAX_QUERY = 64


@dataclass(slots=True)
class PagedKV:
    """Where a step's new tokens go in the paged latent cache, and what each sequence sees.

    The flat batch holds B sequences back to back: sequence i contributes query_lens[i] new tokens
    and has context_lens[i] tokens once they are written (cached prefix + new).
    """

    kv_caches: list[torch.Tensor]  # per layer [NB, BS, C]
    slot_mapping: torch.Tensor  # [T] int64: block * BS + offset for each new token
    block_tables: torch.Tensor  # [B, M] int64, padded with a valid block id
    query_lens: list[int]
    context_lens: list[int]
    absorb: bool = True  # short queries use the latent (absorbed) path
    absorbed_tokens: torch.Tensor = field(init=False)  # [Ta] tokens of the absorbed path
    absorbed_lens: torch.Tensor = field(init=False)  # [Ta] int64 keys each of them sees
    absorbed_tables: torch.Tensor = field(init=False)  # [Ta, M] int64 its sequence's table
    all_absorbed: bool = field(init=False)  # every token: then absorbed_tokens is 0 .. T-1
    prefill_seqs: list[tuple[int, int, int, int]] = field(init=False)  # (seq, start, end, ctx)

    def __post_init__(self) -> None:
        assert len(self.query_lens) == len(self.context_lens) == self.block_tables.shape[0]
        assert sum(self.query_lens) == self.slot_mapping.shape[0]
        tokens, lens, seqs, prefill, start = [], [], [], [], 0
        for i, (q, ctx) in enumerate(zip(self.query_lens, self.context_lens)):
            assert 1 <= q <= ctx, (i, q, ctx)
            if q <= ABSORB_MAX_QUERY and self.absorb:  # decode, or a short chunk
                tokens.extend(range(start, start + q))
                lens.extend(range(ctx - q + 1, ctx + 1))  # each query sees up to itself
                seqs.extend([i] * q)
            else:
                prefill.append((i, start, start + q, ctx))
            start += q
        self.absorbed_tokens = torch.tensor(tokens, dtype=torch.long)
        self.absorbed_lens = torch.tensor(lens, dtype=torch.long)
        # NOTE: once per step here, not once per layer in the attention
        self.absorbed_tables = self.block_tables[torch.tensor(seqs, dtype=torch.long)].long()
        self.all_absorbed = not prefill
        self.prefill_seqs = prefill

    @classmethod
    def decode(
        cls,
        kv_caches: list[torch.Tensor],
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
    ) -> "PagedKV":
        """A decode-only batch (one new token per sequence) whose absorbed-path tensors are the
        given ones, not copies: block_tables [B, M] and context_lens [B] int64, on the model's
        device. For static buffers that a CUDA graph reads (engine/decode_graphs.py): writing
        new values into them changes what the next replay computes."""
        kv = cls.__new__(cls)
        num = block_tables.shape[0]
        kv.kv_caches, kv.slot_mapping, kv.block_tables = kv_caches, slot_mapping, block_tables
        kv.query_lens, kv.context_lens, kv.absorb = [1] * num, [], True
        kv.absorbed_tokens = torch.arange(num, device=block_tables.device)
        kv.absorbed_lens, kv.absorbed_tables = context_lens, block_tables
        kv.all_absorbed, kv.prefill_seqs = True, []
        return kv


class MLAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__()
        c = config
        self.config, self.layer = c, layer
        self.num_heads = c.num_attention_heads
        q_out = c.num_attention_heads * c.qk_head_dim
        if c.q_lora_rank is None:
            self.q_proj = Linear(c.hidden_size, q_out, bias=False)
        else:
            self.q_a_proj = Linear(c.hidden_size, c.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
            self.q_b_proj = Linear(c.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = Linear(c.hidden_size, c.kv_cache_width, bias=False)
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, c.rms_norm_eps)
        self.kv_b_proj = Linear(
            c.kv_lora_rank, c.num_attention_heads * (c.qk_nope_head_dim + c.v_head_dim), bias=False
        )
        self.o_proj = Linear(c.num_attention_heads * c.v_head_dim, c.hidden_size, bias=False)
        self.scale = c.softmax_scale
        self.w_uk: torch.Tensor | None = None  # [NH, Dn, Dc]
        self.w_uv_t: torch.Tensor | None = None  # [NH, Dc, Dv]
        self.w_uv: torch.Tensor | None = None  # [NH, Dv, Dc]
        self.w_in: torch.Tensor | None = None  # [q_lora_rank or NH * (Dn + Dr), + C] (fuse())

    def fuse(self) -> None:
        """After loading: the two projections of the input (q_a_proj or q_proj, and
        kv_a_proj_with_mqa) in one weight, so one call computes both."""
        first = self.q_proj if self.config.q_lora_rank is None else self.q_a_proj
        self.w_in = fuse_rows(first, self.kv_a_proj_with_mqa)

    def absorb_weights(self) -> None:
        """Split kv_b_proj into W_UK and W_UV for the latent decode path (after loading)."""
        c = self.config
        w = self.kv_b_proj.weight.detach().view(self.num_heads, -1, c.kv_lora_rank)
        self.w_uk = w[:, : c.qk_nope_head_dim].contiguous()
        self.w_uv = w[:, c.qk_nope_head_dim :].contiguous()
        self.w_uv_t = self.w_uv.transpose(1, 2).contiguous()

    def _project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D] -> q_nope [T, NH, Dn], q_pe [T, NH, Dr], latent [T, C] (normed kv_c, then
        roped k_pe)"""
        c = self.config
        if self.w_in is not None:
            q_width = self.w_in.shape[0] - c.kv_cache_width
            q, kv_a = linear(x, self.w_in, packed=True).split([q_width, c.kv_cache_width], dim=-1)
        else:
            q = (self.q_proj if c.q_lora_rank is None else self.q_a_proj)(x)
            kv_a = self.kv_a_proj_with_mqa(x)
        if c.q_lora_rank is not None:
            q = self.q_b_proj(self.q_a_layernorm(q))
        q = q.view(x.shape[0], self.num_heads, c.qk_head_dim)
        q_nope, q_pe = q.split([c.qk_nope_head_dim, c.qk_rope_head_dim], dim=-1)
        kv_c, k_pe = kv_a.split([c.kv_lora_rank, c.qk_rope_head_dim], dim=-1)
        q_pe = apply_rotary(q_pe, cos, sin, c.rope_interleave)
        k_pe = apply_rotary(k_pe, cos, sin, c.rope_interleave)
        latent = torch.cat([self.kv_a_layernorm(kv_c), k_pe], dim=-1)  # [T, C]
        return q_nope, q_pe, latent

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """latent [J, C] -> keys [J, NH, Dn + Dr], values [J, NH, Dv] (the naive MLA path)."""
        c = self.config
        kv = self.kv_b_proj(latent[:, : c.kv_lora_rank]).view(latent.shape[0], self.num_heads, -1)
        k_nope, v = kv.split([c.qk_nope_head_dim, c.v_head_dim], dim=-1)
        k_pe = latent[:, None, c.kv_lora_rank :].expand(-1, self.num_heads, -1)
        return torch.cat([k_nope, k_pe], dim=-1), v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        seq_lens: list[int] | None = None,
        kv: PagedKV | None = None,
    ) -> torch.Tensor:
        """x [T, D] -> [T, D]. Without kv, the flat batch is whole sequences of seq_lens tokens."""
        c = self.config
        q_nope, q_pe, latent = self._project(x, cos, sin)
        if kv is None:
            assert seq_lens is not None and sum(seq_lens) == x.shape[0]
            q = torch.cat([q_nope, q_pe], dim=-1)  # [T, NH, Dn + Dr]
            out = x.new_empty(x.shape[0], self.num_heads, c.v_head_dim)  # [T, NH, Dv]
            start = 0
            for n in seq_lens:
                k, v = self._expand(latent[start : start + n])
                out[start : start + n] = causal_attention(q[start : start + n], k, v, self.scale)
                start += n
            return self.o_proj(out.flatten(1))

        cache = kv.kv_caches[self.layer]  # [NB, BS, C]
        write_cache(cache, kv.slot_mapping, latent)
        if kv.all_absorbed:  # decode and short chunks only: no gathers
            out = self._absorbed(q_nope, q_pe, cache, kv).to(x.dtype)
            return self.o_proj(out.flatten(1))
        out = x.new_empty(x.shape[0], self.num_heads, c.v_head_dim)  # [T, NH, Dv]
        if kv.absorbed_tokens.numel():
            tok = kv.absorbed_tokens
            out[tok] = self._absorbed(q_nope[tok], q_pe[tok], cache, kv).to(out.dtype)
        q = torch.cat([q_nope, q_pe], dim=-1)  # [T, NH, Dn + Dr]
        for seq, start, end, ctx in kv.prefill_seqs:
            k, v = self._expand(gather_latent(cache, kv.block_tables[seq], ctx).to(x.dtype))
            out[start:end] = causal_attention(q[start:end], k, v, self.scale)
        return self.o_proj(out.flatten(1))

    def _absorbed(
        self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, kv: PagedKV
    ) -> torch.Tensor:
        """The absorbed path's queries [Ta, NH, *] -> [Ta, NH, Dv]: the same kernel for decode
        and for a short chunk over a cached prefix (each query with its own length)."""
        return mla_decode(
            q_nope, q_pe, cache, kv.absorbed_tables, kv.absorbed_lens, self.w_uk, self.w_uv,
            self.scale, self.w_uv_t,
        )  # fmt: skip
