"""Embedded models, all DeepSeek-V3 layout, each a real HF-format checkpoint directory (config.json,
model.safetensors, tokenizer.json) that loads through the same loader as any checkpoint.

tiny: the default, trained on Python's language reference (tools/tiny/train.py); its checkpoint is
  committed under moe/weights/tiny and installs with the package (1.9M parameters).
tiny-random: deterministic random weights, for tests that need its shapes (0.36M parameters).
small: deterministic random weights, for benchmarks (273.97M, 100.6M active per token).
The random ones are written once into a cache folder.
"""

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from moe.config import ModelConfig
from moe.model import DeepseekForCausalLM

V3_DEFAULTS = dict(
    model_type="deepseek_v3",
    architectures=["DeepseekV3ForCausalLM"],
    hidden_act="silu",
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    norm_topk_prob=True,
    rope_interleave=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    attention_bias=False,
    num_nextn_predict_layers=0,
    torch_dtype="float32",
)

TRAINED: dict[str, Path] = {"tiny": Path(__file__).parent / "weights" / "tiny"}

PRESETS: dict[str, dict[str, Any]] = {  # random weights
    "tiny-random": dict(
        V3_DEFAULTS,
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=48,
        kv_lora_rank=32,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        max_position_embeddings=2048,
        initializer_range=0.1,
    ),
    "small": dict(
        V3_DEFAULTS,
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        moe_intermediate_size=384,
        num_hidden_layers=8,
        first_k_dense_replace=1,
        num_attention_heads=12,
        num_key_value_heads=12,
        q_lora_rank=384,
        kv_lora_rank=256,
        qk_nope_head_dim=64,
        qk_rope_head_dim=32,
        v_head_dim=64,
        n_routed_experts=32,
        num_experts_per_tok=4,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        routed_scaling_factor=2.5,
        max_position_embeddings=4096,
        initializer_range=0.02,
    ),
}
_VERSION = "v1"  # bump when a preset's weights or config change


def cache_root() -> Path:
    return Path(os.environ.get("EPCLUSTER_CACHE", Path.home() / ".cache" / "epcluster"))


def preset_names() -> list[str]:
    return [*TRAINED, *PRESETS]


def ensure_preset(name: str) -> Path:
    """The preset's checkpoint directory: the packaged one of a trained preset, or the cached one
    of a random preset, written on first use (atomically: a rename)."""
    if name in TRAINED:
        return TRAINED[name]
    target = cache_root() / f"{name}-{_VERSION}"
    if (target / "config.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        write_random_checkpoint(PRESETS[name], tmp, seed=0)
        write_tokenizer(tmp / "tokenizer.json", PRESETS[name]["vocab_size"])
        try:
            tmp.rename(target)
        except OSError:  # another process won the race
            if not (target / "config.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def write_random_checkpoint(raw_config: dict[str, Any], path: Path, seed: int = 0) -> None:
    """Deterministic random weights for `raw_config`, saved with per-expert HF keys."""
    config = ModelConfig.from_dict(raw_config)
    std = float(raw_config.get("initializer_range", 0.02))
    with torch.device("meta"):
        skeleton = DeepseekForCausalLM(config)
    tensors: dict[str, torch.Tensor] = {}
    inter = config.moe_intermediate_size
    for name, param in skeleton.named_parameters():
        shape = tuple(param.shape)
        if name.endswith(("layernorm.weight", "norm.weight")):
            tensors[name] = torch.ones(shape)
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = _randn(name, shape, seed) * 0.1
        elif name.endswith((".w13", ".w2")):
            prefix = name.rsplit(".", 1)[0]
            for e in range(shape[0]):
                w = _randn(f"{name}.{e}", shape[1:], seed) * std
                if name.endswith(".w13"):
                    tensors[f"{prefix}.{e}.gate_proj.weight"] = w[:inter].contiguous()
                    tensors[f"{prefix}.{e}.up_proj.weight"] = w[inter:].contiguous()
                else:
                    tensors[f"{prefix}.{e}.down_proj.weight"] = w
        else:
            tensors[name] = _randn(name, shape, seed) * std
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps(raw_config, indent=2))


def _randn(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return torch.randn(shape, generator=gen)


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE trained on a fixed corpus (Python's own docstrings), ids 0/1 = bos/eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|bos|>", "<|eos|>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.save(str(path))


def _corpus() -> list[str]:
    import builtins

    docs = [getattr(builtins, n).__doc__ or "" for n in sorted(dir(builtins))]
    return [d for d in docs if d] + [__doc__ or "", ModelConfig.__doc__ or ""]
