"""What the served model is, and what a prompt must fit: one check that the router and the engine
both run, so a prompt gets the same answer in-process and in the cluster."""

from dataclasses import dataclass

import torch

from engine.block_manager import blocks_for
from engine.kv_transfer import kv_bytes_per_token
from engine.messages import ModelInfo
from moe.config import ModelConfig


def build_model_info(
    name: str, config: ModelConfig, max_model_len: int, dtype: torch.dtype, kernels: str = ""
) -> ModelInfo:
    """ModelInfo from a model config, without loading weights (the router on Ray calls this
    with the pools' config, and fills `kernels` from what the ranks report)."""
    return ModelInfo(
        model=name,
        model_type=config.model_type,
        vocab_size=config.vocab_size,
        max_model_len=max_model_len,
        num_layers=config.num_hidden_layers,
        num_routed_experts=config.n_routed_experts,
        experts_per_token=config.num_experts_per_tok,
        eos_token_id=config.eos_token_id,
        kv_bytes_per_token=kv_bytes_per_token(
            config.num_hidden_layers, config.kv_cache_width, dtype
        ),
        kernels=kernels,
    )


@dataclass(frozen=True, slots=True)
class PromptLimits:
    vocab_size: int
    max_model_len: int  # prompt + output tokens
    block_size: int
    max_blocks: int  # the smallest KV cache, in blocks, that must hold the prompt

    @property
    def max_prompt_tokens(self) -> int:
        """The longest prompt that fits the context and the cache, with room for one token."""
        return min(self.max_model_len, self.max_blocks * self.block_size) - 1


def check_stop_token_ids(stop_token_ids: list[int], limits: PromptLimits) -> None:
    """ValueError naming the first stop token id outside the vocabulary (every front end)."""
    for t in stop_token_ids:
        if t >= limits.vocab_size:
            raise ValueError(f"stop_token_ids holds {t}: ids must be in [0, {limits.vocab_size})")


def check_prompt(token_ids: list[int], limits: PromptLimits) -> list[int]:
    """-> token_ids, or ValueError saying what to fix."""
    if not token_ids:
        raise ValueError("prompt is empty: give at least one token")
    for i, t in enumerate(token_ids):
        if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < limits.vocab_size:
            raise ValueError(
                f"prompt token {i} is {t!r}, out of range: ids must be in [0, {limits.vocab_size})"
            )
    n = len(token_ids)
    if n >= limits.max_model_len:
        raise ValueError(
            f"prompt has {n} tokens but the model's context is {limits.max_model_len}: "
            f"shorten it to at most {limits.max_model_len - 1} tokens"
        )
    blocks = blocks_for(n + 1, limits.block_size)  # the prompt and the token it yields
    if blocks > limits.max_blocks:
        raise ValueError(
            f"prompt has {n} tokens and needs {blocks} KV blocks, but a KV cache here holds "
            f"{limits.max_blocks}: shorten it to at most {limits.max_prompt_tokens} tokens"
        )
    return token_ids
