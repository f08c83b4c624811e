"""The memory plan per GPU: refuses what cannot fit, with the numbers; accepts what can."""

from pathlib import Path

import pytest
import yaml

from cluster.plan.memory import GIB, MemoryPlan, MemoryPlanError, plan_memory, rank_memory
from cluster.plan.models import load_model

V3_EXPERT = 3 * 7168 * 2048


def test_v3_bf16_ep16_does_not_fit_80_gb():
    """16 routed experts x 58 layers in bf16 alone are 16 x 58 x 44.04M x 2 B = 81.7 GB."""
    m = load_model("deepseek-v3")
    with pytest.raises(MemoryPlanError, match=r"does not fit a 74\.5 GiB GPU.*experts 76\.1"):
        plan_memory(m, 80e9, ep_size=16, weight_dtype="bf16")


def test_v3_fp8_ep144_fits_80_gb_with_its_numbers():
    """DeepSeek's decode unit: 2 slots per GPU (256 + 32 redundant over 144 ranks)."""
    m = load_model("deepseek-v3")
    plan = plan_memory(m, 80e9, ep_size=144, redundant_experts=32, step_tokens=128)
    assert plan.expert_weights == 2 * 58 * V3_EXPERT
    embed = 2 * 129280 * 7168  # embedding + lm_head stay bf16
    assert plan.replicated_weights == (m.replicated_params - embed) + embed * 2
    assert plan.reserve == 0.05 * 80e9
    assert plan.headroom == pytest.approx(0.0, abs=1)  # the rest is KV cache
    assert plan.kv_tokens == int(plan.kv_cache // (576 * 61 * 2))
    assert 40 * GIB < plan.kv_cache < 50 * GIB


def test_a_kv_budget_or_a_minimum_context_that_does_not_fit_is_refused():
    m = load_model("deepseek-v3")
    with pytest.raises(MemoryPlanError, match="needs"):
        plan_memory(m, 80e9, 144, redundant_experts=32, kv_budget_bytes=60e9)
    with pytest.raises(MemoryPlanError):
        plan_memory(m, 80e9, 144, redundant_experts=32, min_kv_tokens=10**7)
    ok = plan_memory(m, 80e9, 144, redundant_experts=32, kv_budget_bytes=20e9)
    assert ok.kv_cache == 20e9 and ok.headroom > 20 * GIB


def test_small_fits_a_laptop():
    plan = plan_memory(load_model("small"), 8 * GIB, 1, "fp32", "fp32", step_tokens=512)
    assert plan.weights == 273_967_072 * 4


GPU8X = Path(__file__).resolve().parents[3] / "deploy/kubernetes/overlays/gpu-8x/config.yaml"
# What the 8-GPU overlay keeps free on every 80 GB GPU beyond the 5% reserve (docs/operations.md,
# "Memory per GPU"): room for what the arithmetic leaves out (allocator slack, CUDA graphs).
GPU8X_HEADROOM = 6 * GIB


def overlay_rank(pool: str, fp8_experts: bool, ep_size: int | None = None) -> MemoryPlan:
    """One rank of the overlay's pool, as its config gives it, on an 80 GB GPU."""
    config = yaml.safe_load(GPU8X.read_text())
    engine = {**config["engine"], **config[pool].get("engine", {})}
    assert config["ray"]["gpu_memory_bytes"] == 80e9 and config["dtype"] == "bfloat16"
    return rank_memory(
        load_model("deepseek-v3"),
        80e9,
        ep_size or config[pool]["num_ranks"],
        config["dtype"],
        fp8_experts,
        engine["kv_cache_bytes"],
        engine.get("max_num_batched_tokens", 2048),
    )


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_the_gpu8x_overlay_fits_80_gb_with_fp8_experts(pool):
    config = yaml.safe_load(GPU8X.read_text())
    assert config["engine"]["fp8_experts"] == "keep" and config[pool]["num_ranks"] == 32
    plan = overlay_rank(pool, fp8_experts=True)
    m = load_model("deepseek-v3")
    # bf16 everywhere but the experts: 8 slots of FP8 experts (256 / 32) in each of 58 layers
    assert plan.replicated_weights == m.replicated_params * 2
    assert plan.expert_weights == 8 * 58 * V3_EXPERT
    assert 31 * GIB < plan.replicated_weights < 32 * GIB
    assert 18.9 * GIB < plan.expert_weights < 19.1 * GIB
    assert plan.headroom >= GPU8X_HEADROOM, plan.describe()
    # its experts in bf16 (fp8_experts dequantize) it cannot start
    with pytest.raises(MemoryPlanError, match=r"does not fit a 74\.5 GiB GPU.*experts 38\.1"):
        overlay_rank(pool, fp8_experts=False)


def test_v3_ep16_does_not_fit_80_gb_with_bf16_or_fp8_experts():
    """The overlay as it shipped (EP16, bf16, 16 GiB of KV) needs 128.5 GiB (138 GB) a GPU; FP8
    experts alone do not save it: the bf16 attention, dense and shared weights stay."""
    m = load_model("deepseek-v3")
    with pytest.raises(MemoryPlanError, match=r"experts 76\.1.*needs 128\.5 GiB"):
        rank_memory(m, 80e9, 16, "bfloat16", False, 16 * GIB, 2048)
    with pytest.raises(MemoryPlanError, match=r"bf16 \(experts fp8\) EP16 .*experts 38\.1"):
        overlay_rank("decode", fp8_experts=True, ep_size=16)


def test_rank_memory_is_plan_memory_with_the_engines_dtypes():
    m = load_model("small")
    plan = rank_memory(m, 8 * GIB, 2, "float32", False, 1 * GIB, 512, num_slots=40)
    assert plan == plan_memory(m, 8 * GIB, 2, "fp32", "fp32", 8, 512, 1 * GIB)
    assert plan.expert_weights == 20 * 7 * m.expert_params * 4  # (32 + 8) / 2 slots, 7 layers
    fp8 = rank_memory(m, 8 * GIB, 2, "float32", True, 1 * GIB, 512, num_slots=40)
    assert fp8.expert_weights == plan.expert_weights / 4
    assert fp8.replicated_weights == plan.replicated_weights
