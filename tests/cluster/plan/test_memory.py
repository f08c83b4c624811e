"""The memory plan per GPU: refuses what cannot fit, with the numbers; accepts what can."""

import pytest

from cluster.plan.memory import GIB, MemoryPlanError, plan_memory
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
