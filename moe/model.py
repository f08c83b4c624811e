"""The DeepSeek-V2/V3 causal LM. Parameter names follow the HF checkpoints (model.layers.{i}...).

Legend: B batch, T tokens, H hidden, V vocab.
Two entry points: `forward(input_ids [B, T])` for whole sequences without a cache (logits for every
position), and `forward_tokens` + `compute_logits` for a flat batch over the paged latent cache,
which the engine drives (chunked prefill and decode in one call).
"""

from collections.abc import Mapping, Sequence

import torch
from torch import nn

from kernels.rotary import rope_cos_sin
from moe.attention import MLAttention, PagedKV
from moe.config import ModelConfig
from moe.layers import MLP, MoE, RMSNorm
from moe.rope import rope_inv_freq

ExpertSubset = Sequence[int] | Mapping[int, Sequence[int]] | None


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

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        seq_lens: list[int] | None,
        kv: PagedKV | None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, seq_lens, kv)
        return x + self.mlp(self.post_attention_layernorm(x))


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
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        inv_freq, self.rope_scaling = rope_inv_freq(config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def init_buffers(self) -> None:
        """Recompute the non-persistent buffers (after building on the meta device)."""
        device = self.lm_head.weight.device
        self.inv_freq = rope_inv_freq(self.config)[0].to(device)
        for moe in self.moe_layers():
            moe.experts.init_buffers()

    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def prepare(self) -> None:
        """Derive what the fast paths need from loaded weights (absorbed MLA matrices)."""
        for layer in self.model.layers:
            layer.self_attn.absorb_weights()

    def moe_layers(self) -> list[MoE]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

    def forward_tokens(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        seq_lens: list[int] | None = None,
        kv: PagedKV | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [T] (a flat batch of sequences) -> final hidden states [T, H].

        Without kv the batch is whole sequences of seq_lens tokens; with kv, see PagedKV.
        """
        x = self.model.embed_tokens(input_ids)
        cos, sin = rope_cos_sin(positions, self.inv_freq, self.rope_scaling)
        for layer in self.model.layers:
            x = layer(x, cos, sin, seq_lens, kv)
        return self.model.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] fp32."""
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [B, T] -> logits [B, T, V] fp32, every position, no cache."""
        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device).repeat(batch)
        hidden = self.forward_tokens(input_ids.reshape(-1), positions, [length] * batch)
        return self.compute_logits(hidden).view(batch, length, -1)
