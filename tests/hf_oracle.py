"""Tiny random transformers DeepSeek models saved as safetensors: the oracle for the model."""

from pathlib import Path
from typing import Any

import torch

BASE: dict[str, Any] = dict(
    vocab_size=160,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=24,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_shared_experts=1,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=16,
    first_k_dense_replace=1,
    max_position_embeddings=512,
    initializer_range=0.15,
    tie_word_embeddings=False,
)


def make_hf_model(kind: str, path: Path, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """Build a random DeepseekV{2,3}ForCausalLM, randomise the V3 gate bias (zeros by default),
    save it to `path` and return it (fp32, eval)."""
    import transformers

    cfg = dict(BASE, **overrides)
    torch.manual_seed(seed)
    if kind == "v3":
        model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**cfg))
        with torch.no_grad():
            for layer in model.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None:
                    gate.e_score_correction_bias.normal_(0, 0.2)
    else:
        model = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**cfg))
    model.eval()
    model.save_pretrained(path)
    return model


def hf_greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy generate on one prompt; returns only the new tokens."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(  # an explicit mask: token 0 in a prompt is not padding
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            min_new_tokens=max_new_tokens,
            pad_token_id=0,
            eos_token_id=None,
        )
    return out[0, len(prompt) :].tolist()


def hf_v3_main_model(path: Path) -> torch.nn.Module:
    """transformers' DeepseekV3ForCausalLM from a checkpoint (fp32, eval). transformers does not
    model the MTP layers (model.layers.{num_hidden_layers + k}.*) and ignores only layer 61's
    keys by name: this subclass declares the checkpoint's own MTP keys ignorable, so loading a
    checkpoint with MTP layers reports nothing unexpected and the comparison stays clean."""
    import json

    import transformers

    config = json.loads((path / "config.json").read_text())
    first = config["num_hidden_layers"]
    mtp = [rf"model\.layers\.{first + k}\..*" for k in range(config["num_nextn_predict_layers"])]

    class MainOnly(transformers.DeepseekV3ForCausalLM):
        _keys_to_ignore_on_load_unexpected = mtp

    return MainOnly.from_pretrained(path, dtype=torch.float32).eval()
