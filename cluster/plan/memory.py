"""The memory plan of one GPU of an EP pool: weights, KV cache, activations, headroom.

A pure function of the model, dtypes, EP size, redundant experts, KV budget, the step's tokens
and the GPU's memory, so the cluster config can call it before launch: a deployment that
cannot fit is refused with the numbers, never discovered by an out-of-memory error.
"""

import math
from dataclasses import dataclass

from cluster.plan.hardware import DTYPE_BYTES
from cluster.plan.models import PlanModel

GIB = 2**30
# assumption: CUDA context, NCCL/DeepEP buffers and allocator fragmentation take 5% of a GPU
RESERVE_FRACTION = 0.05


class MemoryPlanError(ValueError):
    """The deployment does not fit; the message has the plan's numbers."""


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    """Bytes per GPU."""

    gpu_bytes: float
    replicated_weights: float  # attention, dense MLPs, shared experts, embedding, lm_head
    expert_weights: float  # this rank's routed slots, redundant ones included
    activations: float
    reserve: float
    kv_cache: float
    kv_bytes_per_token: float

    @property
    def weights(self) -> float:
        return self.replicated_weights + self.expert_weights

    @property
    def used(self) -> float:
        return self.weights + self.activations + self.reserve + self.kv_cache

    @property
    def headroom(self) -> float:
        return self.gpu_bytes - self.used

    @property
    def kv_tokens(self) -> int:
        """Positions of latent cache this GPU holds (all layers)."""
        return int(self.kv_cache // self.kv_bytes_per_token)

    def describe(self) -> str:
        return (
            f"weights {self.weights / GIB:.1f} GiB (replicated {self.replicated_weights / GIB:.1f}"
            f" + experts {self.expert_weights / GIB:.1f}), activations "
            f"{self.activations / GIB:.1f} GiB, reserve {self.reserve / GIB:.1f} GiB, KV "
            f"{self.kv_cache / GIB:.1f} GiB ({self.kv_tokens} tokens), headroom "
            f"{self.headroom / GIB:.1f} GiB of {self.gpu_bytes / GIB:.1f} GiB"
        )


def activation_bytes(model: PlanModel, tokens: int, head_rows: int, dtype_bytes: float) -> float:
    """Peak live activations of a step of `tokens` positions: per position the residual and its
    norm (2H), q and the expanded k/v of MHA-form attention (N x (2 qk + v)), the MLP's gate/up
    (2I), the K dispatched rows received (K H); and the logits of `head_rows` rows in fp32."""
    c = model.config
    per_token = 2 * c.hidden_size + c.num_attention_heads * (2 * c.qk_head_dim + c.v_head_dim)
    per_token += 2 * c.intermediate_size + c.num_experts_per_tok * c.hidden_size
    return tokens * per_token * dtype_bytes + head_rows * c.vocab_size * 4


def plan_memory(
    model: PlanModel,
    gpu_bytes: float,
    ep_size: int,
    weight_dtype: str = "fp8",
    kv_dtype: str = "bf16",
    redundant_experts: int = 0,
    step_tokens: int = 8192,
    kv_budget_bytes: float | None = None,
    min_kv_tokens: int = 0,
    expert_dtype: str | None = None,
) -> MemoryPlan:
    """The plan of one GPU; raises MemoryPlanError when it cannot fit.

    kv_budget_bytes: the KV cache asked for (None: all that is left after the rest).
    min_kv_tokens: the cache must hold at least this many positions (e.g. one full context).
    expert_dtype: the routed experts' (None: weight_dtype's), e.g. FP8 experts beside bf16
    attention, as moe.loader serves an FP8 checkpoint with fp8_experts kept. FP8's block scales
    (4 B per 128 x 128 block, 0.02%) are left to the reserve.
    """
    if ep_size < 1 or redundant_experts < 0:
        raise ValueError("ep_size >= 1 and redundant_experts >= 0")
    expert_dtype = expert_dtype or weight_dtype
    w = DTYPE_BYTES[weight_dtype]
    head_w = DTYPE_BYTES["bf16"] if weight_dtype == "fp8" else w  # embedding, lm_head
    c = model.config
    embed = model.embed_params * (1 if c.tie_word_embeddings else 2)
    replicated = (model.replicated_params - embed) * w + embed * head_w
    slots = math.ceil((c.n_routed_experts + redundant_experts) / ep_size)
    experts = slots * model.num_moe_layers * model.expert_params * DTYPE_BYTES[expert_dtype]
    act_dtype = DTYPE_BYTES["fp32" if weight_dtype == "fp32" else "bf16"]
    acts = activation_bytes(model, step_tokens, min(step_tokens, 256), act_dtype)
    reserve = RESERVE_FRACTION * gpu_bytes
    per_token = model.kv_bytes_per_token(DTYPE_BYTES[kv_dtype])
    free = gpu_bytes - replicated - experts - acts - reserve
    kv = free if kv_budget_bytes is None else kv_budget_bytes
    plan = MemoryPlan(gpu_bytes, replicated, experts, acts, reserve, max(kv, 0.0), per_token)
    if free < kv or kv < min_kv_tokens * per_token or kv <= 0:
        raise MemoryPlanError(
            f"{model.name} {weight_dtype}"
            f"{'' if expert_dtype == weight_dtype else f' (experts {expert_dtype})'} "
            f"EP{ep_size} (+{redundant_experts} redundant) does not "
            f"fit a {gpu_bytes / GIB:.1f} GiB GPU: {plan.describe()}; needs "
            f"{(gpu_bytes - free + max(kv, min_kv_tokens * per_token)) / GIB:.1f} GiB"
        )
    return plan


# EngineConfig.dtype -> the planner's dtype names (float16 weighs what bf16 does)
ENGINE_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "bf16"}


def rank_memory(
    model: PlanModel,
    gpu_bytes: float,
    ep_size: int,
    dtype: str,
    fp8_experts: bool,
    kv_cache_bytes: float,
    step_tokens: int,
    num_slots: int | None = None,
) -> MemoryPlan:
    """What one rank of an engine pool holds, as moe.loader and the engine serve it: every
    weight but the routed experts in the engine's `dtype` (an FP8 checkpoint's too: dequantized
    on load), the rank's expert slots in FP8 when fp8_experts (kept) else in `dtype`, the KV cache
    of kv_cache_bytes (its latents in `dtype`), and the activations of a step of step_tokens
    (max_num_batched_tokens); raises MemoryPlanError when it cannot fit.

    num_slots: the pool's physical expert slots (a placement's; None: one per expert).
    """
    plan_dtype = ENGINE_DTYPES[dtype]
    experts = model.config.n_routed_experts
    return plan_memory(
        model,
        gpu_bytes,
        ep_size,
        weight_dtype=plan_dtype,
        kv_dtype=plan_dtype,
        redundant_experts=max((num_slots or experts) - experts, 0),
        step_tokens=step_tokens,
        kv_budget_bytes=kv_cache_bytes,
        expert_dtype="fp8" if fp8_experts else plan_dtype,
    )
