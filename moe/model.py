"""The DeepSeek-V2/V3 causal LM. Parameter names follow the HF checkpoints (model.layers.{i}...).

Legend (kernels/__init__.py): B sequences, T tokens, D hidden, V vocab.
One forward path: `stages(input_ids, positions, ...)` is a generator over a flat batch that yields
while an MoE layer's rows travel (moe.overlap drives two of them interleaved: two-batch overlap).
`forward_tokens` runs it to the end; `compute_logits` turns hidden states into logits; and
`forward(input_ids [B, Q])` is both for whole sequences without a cache (every position's logits).
With a PagedKV the flat batch runs over the paged latent cache (chunked prefill and decode in one
call), as the engine drives it.
"""

import logging
from collections.abc import Mapping, Sequence
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from kernels import hugepages
from kernels.backend import use_cpu_kernel
from kernels.linear import Linear, panel_copy, panels
from kernels.rotary import rope_cos_sin
from moe.attention import MLAttention, PagedKV
from moe.config import ModelConfig
from moe.dispatch import AllToAllDispatcher, CommStats
from moe.layers import MLP, MoE
from moe.mtp import eh_input, make_mtp_layer, mtp_experts
from moe.norm import RMSNorm
from moe.overlap import Stages, run_to_end
from moe.placement import Placement
from moe.rope import rope_inv_freq

log = logging.getLogger(__name__)

ExpertSubset = Sequence[int] | Mapping[int, Sequence[int]] | None


class FusedLayers(Protocol):
    """Every decoder layer of a step in a compiled form (engine/cpu_decode.py builds them for the
    CPU): what the caller of `stages` may pass to run instead of the Python layers."""

    def stages(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: PagedKV
    ) -> Stages[torch.Tensor]:
        """x [T, D] through every layer -> [T, D] (before the final norm)."""
        ...


def local_expert_ids(config: ModelConfig, layer: int, experts: ExpertSubset) -> list[int]:
    """Logical routed experts a rank holds in `layer`: all of them, one list for every layer, or a
    per-layer mapping (a placement with replicas may list an expert more than once)."""
    if experts is None:
        return list(range(config.n_routed_experts))
    if isinstance(experts, Mapping):
        return list(experts[layer])
    return list(experts)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer: int, experts: ExpertSubset) -> None:
        super().__init__()
        self.self_attn = MLAttention(config, layer)
        if config.is_moe_layer(layer):
            self.mlp: nn.Module = MoE(config, local_expert_ids(config, layer, experts))
        else:
            self.mlp = MLP(config.hidden_size, config.intermediate_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def stages(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        seq_lens: list[int] | None,
        kv: PagedKV | None,
        topk_out: list[torch.Tensor] | None = None,
    ) -> Stages[torch.Tensor]:
        """x [T, D] -> [T, D], yielding while an MoE layer's rows travel (topk_out: MoE.stages)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, seq_lens, kv)
        h = self.post_attention_layernorm(x)
        if isinstance(self.mlp, MoE):
            return x + (yield from self.mlp.stages(h, topk_out))
        return x + self.mlp(h)


class DeepseekModel(nn.Module):
    def __init__(self, config: ModelConfig, experts: ExpertSubset = None) -> None:
        super().__init__()
        # _weight skips the random init (uninitialised storage: the loader fills it).
        weight = torch.empty(config.vocab_size, config.hidden_size)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, experts) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, experts: ExpertSubset = None) -> None:
        super().__init__()
        self.config = config
        self.model = DeepseekModel(config, experts)
        # DeepSeek-V3's multi-token-prediction layers (moe/mtp.py), none without them
        n = config.num_hidden_layers
        self.mtp = nn.ModuleList(
            make_mtp_layer(config, DecoderLayer(config, n + k, mtp_experts(n + k, experts)))
            for k in range(config.num_nextn_predict_layers)
        )
        self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
        inv_freq, self.rope_scaling = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def init_buffers(self) -> None:
        """Recompute the non-persistent buffers (after building on the meta device)."""
        device = self.lm_head.weight.device
        self.inv_freq = rope_inv_freq(self.config)[0].to(device)

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def prepare(self) -> None:
        """Derive what the fast paths need from loaded weights (absorbed MLA matrices, fused
        projections, and on the CPU kernels the panel copies of the weights every decode step
        multiplies by: made here, not on the first request, ~0.15 s for `small`)."""
        step_weights = [self.lm_head.weight]
        for layer in [*self.model.layers, *self.mtp]:
            attn = layer.self_attn
            attn.absorb_weights()
            attn.fuse()
            step_weights += [attn.w_in, attn.o_proj.weight]
            if self.config.q_lora_rank is not None:
                step_weights.append(attn.q_b_proj.weight)
            for mlp in (layer.mlp, getattr(layer.mlp, "shared_experts", None)):
                if isinstance(mlp, MLP):
                    mlp.fuse()
                    step_weights += [mlp.w13, mlp.down_proj.weight]
        for weight in step_weights:
            if use_cpu_kernel(weight) and weight.is_contiguous():
                panels(weight)
        moved = hugepages.collapse(self.read_weights())
        if moved:
            log.info("%.0f MiB of weights on huge pages", moved / 2**20)

    def read_weights(self, min_bytes: int = 1 << 20) -> list[torch.Tensor]:
        """The weight tensors of at least min_bytes that steps read: parameters, buffers and
        derived weights (absorbed, fused), a weight with a panel copy (kernels.linear.panels) by
        its copy alone; not the embedding table, of which a step reads a row per token."""
        found: dict[int, torch.Tensor] = {}
        for module in self.modules():
            if isinstance(module, nn.Embedding):
                continue
            own = [*module._parameters.values(), *module._buffers.values()]
            for value in [*own, *vars(module).values()]:
                if not isinstance(value, torch.Tensor):
                    continue
                copy = panel_copy(value)
                tensor = value if copy is None else copy
                if tensor.untyped_storage().nbytes() >= min_bytes:
                    found[id(tensor)] = tensor
        return list(found.values())

    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

    def install_expert_parallel(
        self, group: dist.ProcessGroup | None, placement: Placement, rank: int
    ) -> dict[int, AllToAllDispatcher]:
        """Give every MoE layer (loaded with experts=placement.rank_experts(rank)) an
        AllToAllDispatcher over `group`. Returns model layer -> dispatcher."""
        moe_layers = dict(zip(self.config.moe_layers, self.moe_layers(), strict=True))
        if tuple(moe_layers) != placement.layers:
            raise ValueError(
                f"placement layers {placement.layers} != the model's MoE layers {tuple(moe_layers)}"
            )
        expected = placement.rank_experts(rank)
        counts_group = None
        if dist.is_initialized():  # every rank of the pool gets here once, in the same order
            counts_group = dist.new_group(dist.get_process_group_ranks(group or dist.group.WORLD))
        dispatchers = {}
        for pos, (layer, moe) in enumerate(moe_layers.items()):
            if moe.experts.expert_ids != expected[layer]:
                raise ValueError(
                    f"layer {layer}: rank {rank} holds experts {moe.experts.expert_ids}, "
                    f"the placement puts {expected[layer]} there"
                )
            moe.dispatcher = AllToAllDispatcher(group, placement, pos, rank, counts_group)
            dispatchers[layer] = moe.dispatcher
        return dispatchers

    def share_comm_stats(self) -> CommStats:
        """One CommStats for every MoE layer's dispatcher (call after the dispatchers are
        final: install_expert_parallel replaces them); -> it."""
        stats = CommStats()
        for moe in self.moe_layers():
            moe.dispatcher.stats = stats
        return stats

    def stages(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: list[int] | None = None,
        kv: PagedKV | None = None,
        fused: FusedLayers | None = None,
        topk_out: list[torch.Tensor] | None = None,
        pre_norm_out: list[torch.Tensor] | None = None,
    ) -> Stages[torch.Tensor]:
        """input_ids, positions [T] (a flat batch of sequences) -> final hidden states [T, D],
        yielding while an MoE layer's rows travel.

        Without kv the batch is whole sequences of seq_lens tokens; with kv, see PagedKV.
        fused: the layers in a compiled form, the caller's choice for this step (ModelRunner:
        engine/cpu_decode.py), run over kv instead of the Python layers; the same numbers.
        topk_out: each MoE layer appends its topk_idx [T, K] there and its dispatcher counts no
        load (the caller counts it: the decode graphs leave their padding rows out).
        pre_norm_out: the last layer's output [T, D] before the final norm is appended there
        (the MTP layer's input: speculative decoding).
        """
        x = self.model.embed_tokens(input_ids)  # [T, D]
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_scaling)
        if fused is not None:
            assert kv is not None and topk_out is None, "the fused layers run over a paged cache"
            x = yield from fused.stages(x, cos, sin, kv)
        else:
            for layer in self.model.layers:
                x = yield from layer.stages(x, cos, sin, seq_lens, kv, topk_out)
        if pre_norm_out is not None:
            pre_norm_out.append(x)
        return self.model.norm(x)

    def forward_tokens(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: list[int] | None = None,
        kv: PagedKV | None = None,
        fused: FusedLayers | None = None,
        topk_out: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`stages` run to the end: input_ids, positions [T] -> hidden [T, D]."""
        return run_to_end(self.stages(input_ids, positions, seq_lens, kv, fused, topk_out))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [T, D] -> logits [T, V] fp32."""
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, Q] -> logits [B, Q, V] fp32, every position, no cache."""
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device).repeat(batch)
        hidden = self.forward_tokens(input_ids.reshape(-1), positions, [length] * batch)
        return self.compute_logits(hidden).view(batch, length, -1)

    def mtp_hidden(
        self,
        hidden: torch.Tensor,
        next_token_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: list[int] | None = None,
        kv: PagedKV | None = None,
        depth: int = 0,
    ) -> torch.Tensor:
        """MTP layer `depth` (moe/mtp.py): hidden [T, D] (the main model's last layer, or depth
        - 1's output, before any final norm), next_token_ids [T] (token i + 1 of each row),
        positions [T] (of the rows of hidden) -> its block's output [T, D], before
        shared_head.norm. seq_lens / kv as in `stages` (its cache layer: num_hidden_layers +
        depth)."""
        layer = self.mtp[depth]
        x = eh_input(layer, self.model.embed_tokens, hidden, next_token_ids)
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_scaling)
        return run_to_end(layer.stages(x, cos, sin, seq_lens, kv))

    def mtp_logits(
        self,
        hidden: torch.Tensor,
        next_token_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: list[int] | None = None,
        kv: PagedKV | None = None,
        depth: int = 0,
    ) -> torch.Tensor:
        """`mtp_hidden` through shared_head: -> logits [T, V] fp32 for the token after next."""
        return self.mtp_head(
            self.mtp_hidden(hidden, next_token_ids, positions, seq_lens, kv, depth), depth
        )

    def mtp_head(self, hidden: torch.Tensor, depth: int = 0) -> torch.Tensor:
        """MTP layer `depth`'s block output [T, D] -> logits [T, V] fp32 (shared_head's norm,
        then its own head or the main model's)."""
        layer = self.mtp[depth]
        head = layer.shared_head.head
        return (head if head is not None else self.lm_head)(layer.shared_head.norm(hidden)).float()
