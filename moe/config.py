"""ModelConfig: the DeepSeek-V2/V3 architecture, read from a checkpoint's config.json.

Accepts the original DeepSeek names and transformers' (rope_scaling or rope_parameters, with or
without scoring_func / topk_method, which transformers 5 leaves out and derives from model_type).
"""

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from kernels.gate import SCORING_FUNCS, TOPK_METHODS

MODEL_TYPES = ("deepseek_v2", "deepseek_v3")


class ConfigError(ValueError):
    """A checkpoint config that is invalid or not supported; the message names the field."""


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """YaRN scaling (the only kind DeepSeek uses); factor 1 means plain RoPE."""

    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None

    @property
    def attention_factor(self) -> float:
        """The cos/sin scale. Follows transformers (the oracle): the mscale ratio only when both
        are set, else the plain YaRN factor."""
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(
                self.factor, self.mscale_all_dim
            )
        return yarn_mscale(self.factor)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    n_group: int = 1
    topk_group: int = 1
    topk_method: str = "greedy"
    scoring_func: str = "softmax"
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    first_k_dense_replace: int = 0
    moe_layer_freq: int = 1
    rope_theta: float = 10000.0
    rope_interleave: bool = True
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    hidden_act: str = "silu"
    attention_bias: bool = False
    mlp_bias: bool = False
    num_nextn_predict_layers: int = 0  # DeepSeek-V3's MTP layers (moe/mtp.py)

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ConfigError(f"config field {name!r}: {why} (got {getattr(self, name)!r})")

        need(self.model_type in MODEL_TYPES, "model_type", f"must be one of {MODEL_TYPES}")
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "moe_intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "n_routed_experts",
            "num_experts_per_tok",
            "n_group",
            "topk_group",
            "moe_layer_freq",
            "max_position_embeddings",
        ):
            value = getattr(self, name)
            need(
                isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                name,
                "must be a positive integer",
            )
        need(
            self.q_lora_rank is None or self.q_lora_rank >= 1, "q_lora_rank", "must be null or >= 1"
        )
        need(self.num_nextn_predict_layers >= 0, "num_nextn_predict_layers", "must be >= 0")
        need(self.n_shared_experts >= 0, "n_shared_experts", "must be >= 0")
        need(self.qk_rope_head_dim % 2 == 0, "qk_rope_head_dim", "must be even")
        need(self.topk_method in TOPK_METHODS, "topk_method", f"must be one of {TOPK_METHODS}")
        need(self.scoring_func in SCORING_FUNCS, "scoring_func", f"must be one of {SCORING_FUNCS}")
        need(self.n_routed_experts % self.n_group == 0, "n_group", "must divide n_routed_experts")
        need(self.topk_group <= self.n_group, "topk_group", "must be <= n_group")
        need(
            self.num_experts_per_tok <= self.n_routed_experts,
            "num_experts_per_tok",
            "must be <= n_routed_experts",
        )
        if self.topk_method != "greedy":
            per_group = self.n_routed_experts // self.n_group
            need(
                self.num_experts_per_tok <= self.topk_group * per_group,
                "num_experts_per_tok",
                "must be <= topk_group * experts per group",
            )
        if self.topk_method == "noaux_tc":
            need(
                self.n_routed_experts // self.n_group >= 2,
                "n_group",
                "noaux_tc ranks groups by their top-2 experts: each group needs >= 2 experts",
            )
        need(
            0 <= self.first_k_dense_replace <= self.num_hidden_layers,
            "first_k_dense_replace",
            "must be in [0, num_hidden_layers]",
        )
        need(self.hidden_act == "silu", "hidden_act", "only silu is supported")
        need(not self.attention_bias, "attention_bias", "biased attention is not supported")
        need(not self.mlp_bias, "mlp_bias", "biased MLPs are not supported")
        need(
            math.isfinite(self.routed_scaling_factor) and self.routed_scaling_factor > 0,
            "routed_scaling_factor",
            "must be a positive number",
        )
        need(self.rope_theta > 0, "rope_theta", "must be > 0")
        need(self.rms_norm_eps > 0, "rms_norm_eps", "must be > 0")
        need(
            self.rope_scaling is None or self.rope_scaling.factor >= 1,
            "rope_scaling",
            "YaRN factor must be >= 1",
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_width(self) -> int:
        """Numbers cached per token per layer: the latent plus the shared RoPE key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace and layer % self.moe_layer_freq == 0

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.num_hidden_layers) if self.is_moe_layer(i)]

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        rs = self.rope_scaling
        if rs is not None and rs.mscale_all_dim:
            scale *= yarn_mscale(rs.factor, rs.mscale_all_dim) ** 2
        return scale

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        data = dict(raw)
        model_type = data.get("model_type")
        if model_type not in MODEL_TYPES:
            raise ConfigError(
                f"config field 'model_type': must be one of {MODEL_TYPES} (got {model_type!r})"
            )
        v3 = model_type == "deepseek_v3"
        # transformers 5 drops these and hard-codes them by model type: a V3 checkpoint without
        # them is a sigmoid + bias gate, never softmax.
        data.setdefault("scoring_func", "sigmoid" if v3 else "softmax")
        data.setdefault("topk_method", "noaux_tc" if v3 else "greedy")
        data.setdefault("norm_topk_prob", v3)
        data.setdefault("rope_interleave", True)
        if data.get("n_group") is None:
            data["n_group"] = 1
        if data.get("topk_group") is None:
            data["topk_group"] = 1
        if data.get("n_shared_experts") is None:
            data["n_shared_experts"] = 0
        rope = data.get("rope_parameters") or data.get("rope_scaling") or {}
        if "rope_theta" in rope:
            data["rope_theta"] = rope["rope_theta"]
        data["rope_scaling"] = _parse_rope_scaling(rope, data)
        for key in ("bos_token_id", "eos_token_id"):
            if isinstance(data.get(key), list):
                data[key] = data[key][0] if data[key] else None
        known = {f.name for f in fields(cls)}
        missing = [name for name in known if name not in data and _required(cls, name)]
        if missing:
            raise ConfigError(f"config is missing required fields: {sorted(missing)}")
        try:
            return cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as e:
            raise ConfigError(f"config: {e}") from e

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_dict(json.loads(path.read_text()))


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _required(cls: type, name: str) -> bool:
    from dataclasses import MISSING

    f = next(f for f in fields(cls) if f.name == name)
    return f.default is MISSING and f.default_factory is MISSING


def _parse_rope_scaling(rope: dict[str, Any], data: dict[str, Any]) -> RopeScaling | None:
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", None):
        return None
    if kind != "yarn":
        raise ConfigError(
            f"config field 'rope_scaling': only YaRN is supported (got type {kind!r})"
        )
    factor = rope.get("factor")
    original = rope.get("original_max_position_embeddings")
    if original is None:
        raise ConfigError(
            "config field 'rope_scaling': YaRN needs original_max_position_embeddings"
        )
    if factor is None:
        factor = data.get("max_position_embeddings", original) / original
    return RopeScaling(
        factor=float(factor),
        original_max_position_embeddings=int(original),
        beta_fast=float(rope.get("beta_fast") or 32),
        beta_slow=float(rope.get("beta_slow") or 1),
        mscale=rope.get("mscale"),
        mscale_all_dim=rope.get("mscale_all_dim"),
    )
