"""The step cost model on hand-computed cases: `small` against its own module tree (parameters
counted by name on the meta device), DeepSeek-V3 against its config's numbers written out."""

import math

import pytest
import torch

from cluster.plan.cost import Unit, decode_step, expected_touched, prefill_step
from cluster.plan.hardware import CATALOG
from cluster.plan.models import load_model
from moe.model import DeepseekForCausalLM


def _meta_counts(name: str) -> dict[str, int]:
    """Parameters of the real module tree by role (the oracle for models.py's counts)."""
    model = load_model(name)
    with torch.device("meta"):
        net = DeepseekForCausalLM(model.config)
    out = {"attention": 0, "routed": 0, "dense_mlp": 0, "moe_rest": 0, "head": 0, "other": 0}
    for pname, p in net.named_parameters():
        if ".self_attn." in pname or "layernorm" in pname:
            out["attention"] += p.numel()
        elif ".experts." in pname:
            out["routed"] += p.numel()
        elif ".mlp.gate." in pname or "shared_experts" in pname:
            out["moe_rest"] += p.numel()
        elif ".mlp." in pname:
            out["dense_mlp"] += p.numel()
        elif "lm_head" in pname:
            out["head"] += p.numel()
        else:
            out["other"] += p.numel()  # embedding, final norm
    return out


def test_small_counts_match_the_module_tree():
    m, meta = load_model("small"), _meta_counts("small")
    assert m.total_params == sum(meta.values()) == 273_967_072
    assert m.config.num_hidden_layers * m.attention_params == meta["attention"]
    assert m.routed_params == meta["routed"]
    assert m.num_dense_layers * m.dense_mlp_params == meta["dense_mlp"]


def test_small_decode_step_bytes_and_flops():
    """EP1, fp32, batch 4 at context 100: every weight but the embedding is read once; the
    routed experts touched are 32 (1 - (31/32)^16) of 32; FLOPs are 2 x the multiplied weights."""
    m, meta, hw = load_model("small"), _meta_counts("small"), CATALOG["H100"]
    unit = Unit(1, 1, 0, "fp32", "fp32", "fp32", "fp32", imbalance=1.0, step_overhead_s=0.0)
    step = decode_step(m, hw, unit, batch=4, context=100)
    kv = 4 * 100 * (256 + 32) * 8 * 4  # latent + rope, 8 layers, fp32
    assert step.phases["attention"].bytes == pytest.approx(meta["attention"] * 4 + kv)
    touched = 32 * (1 - (31 / 32) ** 16)  # 4 tokens x top-4 rows over 32 experts
    expert = 3 * 768 * 384
    moe_bytes = (meta["moe_rest"] + 7 * touched * expert) * 4
    assert step.phases["experts"].bytes == pytest.approx(moe_bytes)
    assert step.phases["lm_head"].bytes == meta["head"] * 4
    # FLOPs: 2 per multiply-add; the attention core: per head per position 288 + 256
    core = 2 * 4 * 100 * 8 * 12 * (288 + 256)
    assert step.phases["attention"].flops == pytest.approx(2 * 4 * meta["attention"] + core)
    routed = 2 * 7 * 4 * 4 * expert
    assert step.phases["experts"].flops == pytest.approx(2 * 4 * meta["moe_rest"] + routed)
    assert step.comm_s == 0  # one rank: no all-to-all
    # the roofline per phase
    for p in step.phases.values():
        assert p.time_s == max(p.bytes / hw.read_bw, p.compute_s)
    assert step.time_s == pytest.approx(sum(p.time_s for p in step.phases.values()))


V3_ATTN = (
    7168 * 1536 + 1536 + 1536 * 128 * 192  # q_a, its norm, q_b
    + 7168 * 576 + 512 + 512 * 128 * 256  # kv_a (latent + rope), its norm, kv_b
    + 128 * 128 * 7168 + 2 * 7168  # o_proj, the layer's two norms
)  # fmt: skip
V3_EXPERT = 3 * 7168 * 2048


def test_deepseek_v3_decode_step_ep144():
    """DeepSeek's decode unit: EP144 (2 routed slots per GPU with 32 redundant), fp8 weights,
    bf16 latent cache, batch 128 at 4,989 positions; dispatch fp8 + scales, combine bf16."""
    m, hw = load_model("deepseek-v3"), CATALOG["H800"]
    assert m.total_params == pytest.approx(671.0e9, rel=1e-3)
    unit = Unit(144, 8, 32, imbalance=1.0, step_overhead_s=0.0)
    step = decode_step(m, hw, unit, batch=128, context=4989)
    kv = 128 * 4989 * 576 * 61 * 2
    assert step.phases["attention"].bytes == pytest.approx(61 * V3_ATTN + kv)
    assert step.phases["attention"].flops == pytest.approx(
        2 * 128 * 61 * V3_ATTN + 2 * 128 * 4989 * 61 * 128 * (576 + 512)
    )
    touched = 2 * (1 - 0.5**1024)  # 128 x 8 rows over 2 slots: both
    moe = 58 * (7168 * 256 + 256 + V3_EXPERT + touched * V3_EXPERT)
    assert step.phases["experts"].bytes == pytest.approx(moe)
    assert step.phases["experts"].flops == pytest.approx(
        2 * 58 * (128 * (7168 * 256 + 256 + V3_EXPERT) + 128 * 8 * V3_EXPERT)
    )
    assert step.phases["dense_mlp"].bytes == 3 * 3 * 7168 * 18432
    assert step.phases["lm_head"].bytes == 129280 * 7168 * 2  # bf16 under fp8 weights
    # all-to-all: of 1,024 rows, 7/144 stay in the node (NVLink), 136/144 leave it (RDMA)
    row = 7168 * (1 + 4 / 128) + 7168 * 2
    intra = 128 * 8 * 7 / 144 * row / (160e9 * 0.9)
    inter = 128 * 8 * 136 / 144 * row / (50e9 * 0.9)
    assert step.comm_s == pytest.approx(58 * max(intra, inter))
    assert step.time_s == pytest.approx(max(step.compute_s, step.comm_s))  # overlap hides


def test_deepseek_v3_prefill_sends_once_per_remote_node():
    """Prefill (DeepEP's normal kernels): a token crosses to each of the other 3 nodes it
    touches once: 3 (1 - (3/4)^8) rows per token over RDMA; no overlap when asked."""
    m, hw = load_model("deepseek-v3"), CATALOG["H800"]
    unit = Unit(32, 8, 32, imbalance=1.0, two_batch_overlap=False, step_overhead_s=1e-3)
    step = prefill_step(m, hw, unit, tokens=4096, sequences=2, cached=1000)
    row = 7168 * (1 + 4 / 128) + 7168 * 2
    inter = 4096 * 3 * (1 - 0.75**8) * row / (50e9 * 0.9)
    intra = 4096 * 8 * 7 / 32 * row / (160e9 * 0.9)
    assert step.comm_s == pytest.approx(58 * max(inter, intra))
    # causal attention over the cached 1000 + on average (2048 + 1) / 2 new positions
    core = 2 * 4096 * (1000 + 2049 / 2) * 61 * 128 * (192 + 128)
    assert step.phases["attention"].flops == pytest.approx(2 * 4096 * 61 * V3_ATTN + core)
    assert step.phases["lm_head"].flops == 2 * 2 * 129280 * 7168  # one row per prompt
    assert step.time_s == pytest.approx(step.compute_s + step.comm_s + 1e-3)


def test_expected_touched():
    assert expected_touched(4, 0) == 0
    assert expected_touched(1, 5) == 1
    assert expected_touched(4, 1) == pytest.approx(1)
    assert expected_touched(4, 2) == pytest.approx(4 * (1 - 0.75**2))
    assert math.isclose(expected_touched(8, 10_000), 8)


def test_unit_validates():
    with pytest.raises(ValueError, match="fill nodes"):
        Unit(12, 8)
    with pytest.raises(ValueError, match="dtype"):
        Unit(8, 8, weight_dtype="int4")


def test_cpu_overheads_per_step_sequence_and_exchange():
    """Beyond the roofline: a fixed step cost, one per sequence (the batch in decode), and one
    per exchange when the pool has 2 ranks: the split sizes, the rows and the combine of each of
    small's 7 MoE layers, and the step's all_reduce (moe/dispatch.py, engine/llm_engine.py)."""
    m, hw = load_model("small"), CATALOG["H100"]
    args = dict(imbalance=1.0, step_overhead_s=1e-3, sequence_overhead_s=1e-4,
                exchange_latency_s=2e-4)  # fmt: skip
    alone = decode_step(m, hw, Unit(1, 1, 0, "fp32", "fp32", "fp32", "fp32", **args), 4, 100)
    pair = decode_step(m, hw, Unit(2, 1, 0, "fp32", "fp32", "fp32", "fp32", **args), 4, 100)
    assert alone.overhead_s == pytest.approx(1e-3 + 4 * 1e-4)
    assert pair.overhead_s == pytest.approx(1e-3 + 4 * 1e-4 + (3 * 7 + 1) * 2e-4)
    prefill = prefill_step(m, hw, Unit(1, 1, 0, "fp32", "fp32", "fp32", "fp32", **args), 300, 3)
    assert prefill.overhead_s == pytest.approx(1e-3 + 3 * 1e-4)  # per prompt, not per token


def test_cpu_overheads_of_an_ep_rank_and_of_prefill_positions():
    """An EP rank adds its measured per-step and per-sequence overheads (a lone rank does not);
    a prefill adds its per-position overhead for every new position (a decode step none)."""
    m, hw = load_model("small"), CATALOG["H100"]
    args = dict(imbalance=1.0, step_overhead_s=1e-3, sequence_overhead_s=1e-4,
                exchange_latency_s=2e-4, ep_step_overhead_s=5e-3, ep_sequence_overhead_s=3e-4,
                prefill_token_overhead_s=1e-5)  # fmt: skip
    alone = Unit(1, 1, 0, "fp32", "fp32", "fp32", "fp32", **args)
    pair = Unit(2, 1, 0, "fp32", "fp32", "fp32", "fp32", **args)
    assert decode_step(m, hw, alone, 4, 100).overhead_s == pytest.approx(1e-3 + 4e-4)
    assert decode_step(m, hw, pair, 4, 100).overhead_s == pytest.approx(
        1e-3 + 4e-4 + 22 * 2e-4 + 5e-3 + 4 * 3e-4
    )
    assert prefill_step(m, hw, alone, 300, 3).overhead_s == pytest.approx(1e-3 + 3e-4 + 300e-5)
    assert prefill_step(m, hw, pair, 300, 3, cached=50).overhead_s == pytest.approx(
        1e-3 + 3e-4 + 300e-5 + 22 * 2e-4 + 5e-3 + 3 * 3e-4
    )
    with pytest.raises(ValueError, match="overheads"):
        Unit(2, 1, ep_step_overhead_s=-1e-3)
