"""Models as data for planning: every preset, DeepSeek-V3 (671B) and V2-Lite from their public
config.json values, or any checkpoint's config.json; and the parameter counts a step reads.

Counts follow the module layout of moe/model.py (MLA with or without q_lora, dense MLP in the
first `first_k_dense_replace` layers, routed + shared experts after), so `small` counts 273.97M
like its checkpoint. Shape legend: H hidden, I dense intermediate, M moe intermediate,
E routed experts, N heads, V vocab, L layers.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moe.config import ModelConfig
from moe.presets import PRESETS, TRAINED, V3_DEFAULTS

# deepseek-ai/DeepSeek-V3 config.json (huggingface.co/deepseek-ai/DeepSeek-V3, Dec 2024).
DEEPSEEK_V3 = dict(
    V3_DEFAULTS,
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    first_k_dense_replace=3,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=256,
    num_experts_per_tok=8,
    n_shared_experts=1,
    n_group=8,
    topk_group=4,
    routed_scaling_factor=2.5,
    max_position_embeddings=163840,
    num_nextn_predict_layers=1,
    rope_scaling={
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
)
# deepseek-ai/DeepSeek-V2-Lite config.json (huggingface.co/deepseek-ai/DeepSeek-V2-Lite).
DEEPSEEK_V2_LITE = dict(
    model_type="deepseek_v2",
    vocab_size=102400,
    hidden_size=2048,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    first_k_dense_replace=1,
    num_attention_heads=16,
    num_key_value_heads=16,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=64,
    num_experts_per_tok=6,
    n_shared_experts=2,
    n_group=1,
    topk_group=1,
    topk_method="greedy",
    scoring_func="softmax",
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    max_position_embeddings=163840,
    rope_scaling={
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
)
PUBLISHED: dict[str, dict[str, Any]] = {
    "deepseek-v3": DEEPSEEK_V3,
    "deepseek-v2-lite": DEEPSEEK_V2_LITE,
}


@dataclass(frozen=True, slots=True)
class PlanModel:
    """A model's architecture plus what planning needs beyond ModelConfig (MTP layers)."""

    name: str
    config: ModelConfig
    mtp_layers: int = 0

    def __post_init__(self) -> None:
        if self.mtp_layers < 0:
            raise ValueError(f"mtp_layers must be >= 0 (got {self.mtp_layers})")

    @property
    def attention_params(self) -> int:
        """One layer's MLA projections and norms."""
        c = self.config
        n = c.num_attention_heads
        if c.q_lora_rank is None:
            q = c.hidden_size * n * c.qk_head_dim
        else:
            q = c.hidden_size * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * n * c.qk_head_dim
        kv = c.hidden_size * c.kv_cache_width + c.kv_lora_rank
        kv += c.kv_lora_rank * n * (c.qk_nope_head_dim + c.v_head_dim)
        return q + kv + n * c.v_head_dim * c.hidden_size + 2 * c.hidden_size

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.config.hidden_size * self.config.intermediate_size

    @property
    def expert_params(self) -> int:
        """One routed expert (gate, up, down); a shared expert is the same size."""
        return 3 * self.config.hidden_size * self.config.moe_intermediate_size

    @property
    def gate_params(self) -> int:
        c = self.config
        bias = c.n_routed_experts if c.topk_method == "noaux_tc" else 0
        return c.hidden_size * c.n_routed_experts + bias

    @property
    def num_moe_layers(self) -> int:
        return len(self.config.moe_layers)

    @property
    def num_dense_layers(self) -> int:
        return self.config.num_hidden_layers - self.num_moe_layers

    @property
    def embed_params(self) -> int:
        return self.config.vocab_size * self.config.hidden_size

    @property
    def replicated_params(self) -> int:
        """What every rank of an EP pool holds: attention, dense MLPs, gates, shared experts,
        norms, embedding and lm_head (the routed experts are the sharded part)."""
        c = self.config
        shared = c.n_shared_experts * self.expert_params
        head = 0 if c.tie_word_embeddings else self.embed_params
        return (
            c.num_hidden_layers * self.attention_params
            + self.num_dense_layers * self.dense_mlp_params
            + self.num_moe_layers * (self.gate_params + shared)
            + self.embed_params
            + head
            + c.hidden_size
        )

    @property
    def routed_params(self) -> int:
        return self.num_moe_layers * self.config.n_routed_experts * self.expert_params

    @property
    def total_params(self) -> int:
        return self.replicated_params + self.routed_params

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies (the embedding is a row lookup, not counted)."""
        k = self.config.num_experts_per_tok
        return (
            self.total_params
            - self.embed_params
            - self.routed_params
            + (self.num_moe_layers * k * self.expert_params)
        )

    def kv_bytes_per_token(self, dtype_bytes: float) -> float:
        """MLA's latent cache: (kv_lora_rank + rope dim) numbers per layer per token."""
        return self.config.kv_cache_width * self.config.num_hidden_layers * dtype_bytes


def load_model(name_or_path: str) -> PlanModel:
    """A preset name, a published model name (deepseek-v3, deepseek-v2-lite), or a checkpoint
    directory / config.json path."""
    if name_or_path in PUBLISHED:
        raw = PUBLISHED[name_or_path]
    elif name_or_path in PRESETS:
        raw = PRESETS[name_or_path]
    elif name_or_path in TRAINED:
        raw = _read(TRAINED[name_or_path])
    else:
        path = Path(name_or_path)
        if not path.exists():
            known = sorted([*PUBLISHED, *PRESETS, *TRAINED])
            raise ValueError(f"model {name_or_path!r}: not one of {known} and no such path")
        raw = _read(path)
    mtp = int(raw.get("num_nextn_predict_layers") or 0)
    return PlanModel(name_or_path, ModelConfig.from_dict(raw), mtp)


def _read(path: Path) -> dict[str, Any]:
    import json

    if path.is_dir():
        path = path / "config.json"
    return json.loads(path.read_text())


def model_names() -> list[str]:
    return sorted([*PUBLISHED, *PRESETS, *TRAINED])
