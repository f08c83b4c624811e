"""FP8 experts served in FP8 (moe.loader's keep_fp8_experts): the experts hold the checkpoint's
e4m3 weights and 128 x 128 block scales; the model through the Triton FP8 grouped GEMM (in the
interpreter) equals the dequantized model within the FP8 GEMM's tolerance, and the CPU's per-use
dequantization equals dequantizing on load bit for bit. Fused expert tensors (audit M10) and
live expert moves carry the scales too."""

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.config import EngineConfig, EngineConfigError
from kernels import moe_mlp
from kernels.fp8 import dequantize_block_fp8, quantize_block_fp8
from moe import load_model
from moe.loader import LoadError, read_expert
from moe.placement import Placement
from moe.presets import PRESETS, write_random_checkpoint
from moe.replacement import LayerMove
from tests.procs import run_ranks

# Experts of whole 128 x 128 blocks, and of partial ones (the last block of each dim cut short).
FULL = dict(hidden_size=128, moe_intermediate_size=128)
PARTIAL = dict(hidden_size=160, moe_intermediate_size=72)
MOE_LAYERS = (1, 2)
# fp32 model, FP8 experts through the Triton kernel vs the same weights dequantized on load:
# the kernel does not round activations to FP8 (they stay fp32); it widens e4m3 to fp32 (exact)
# and multiplies each K tile's fp32 partial product by its block's scale, where the dequantized
# path rounds w * scale to fp32 once per weight and sums in another order. So the two differ by
# fp32 rounding only (~1e-7 relative per GEMM); 1e-5 of the largest logit bounds that after two
# MoE layers and the head (a wrong block's scale, or raw e4m3 values, is off by >10%).
FP8_GEMM_RTOL = 1e-5


def fp8_checkpoint(path: Path, shapes: dict) -> dict[str, torch.Tensor]:
    """A tiny random V3 checkpoint with every linear weight block-quantized to e4m3, as
    DeepSeek-V3 ships; -> the saved tensors."""
    raw = dict(PRESETS["tiny-random"], **shapes)
    write_random_checkpoint(raw, path)
    tensors = load_file(str(path / "model.safetensors"))
    quantized = {}
    for name, w in tensors.items():
        if w.dim() == 2 and name.endswith("proj.weight"):
            quantized[name], quantized[name + "_scale_inv"] = quantize_block_fp8(w)
        else:
            quantized[name] = w
    save_file(quantized, str(path / "model.safetensors"))
    return quantized


@pytest.fixture(scope="module", params=[FULL, PARTIAL], ids=["full-blocks", "partial-blocks"])
def ckpt(request, tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("fp8")
    return path, fp8_checkpoint(path, request.param)


def raw(t: torch.Tensor) -> torch.Tensor:
    """e4m3 values as their bytes (torch.equal has no float8 kernel)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def test_keep_holds_the_checkpoint_bytes_and_scales(ckpt):
    path, tensors = ckpt
    kept, deq = load_model(path, keep_fp8_experts=True), load_model(path)
    inter = kept.config.moe_intermediate_size
    for layer in MOE_LAYERS:
        e = kept.model.layers[layer].mlp.experts
        assert e.fp8 and e.w13.dtype == e.w2.dtype == torch.float8_e4m3fn
        half = e.w13_scale_inv.shape[1] // 2
        for expert in (0, 9):
            key = f"model.layers.{layer}.mlp.experts.{expert}"
            gate, up = tensors[f"{key}.gate_proj.weight"], tensors[f"{key}.up_proj.weight"]
            assert torch.equal(raw(e.w13[expert, :inter]), raw(gate))
            assert torch.equal(raw(e.w13[expert, inter:]), raw(up))
            assert torch.equal(
                e.w13_scale_inv[expert, :half], tensors[f"{key}.gate_proj.weight_scale_inv"]
            )
            assert torch.equal(
                e.w13_scale_inv[expert, half:], tensors[f"{key}.up_proj.weight_scale_inv"]
            )
            assert torch.equal(raw(e.w2[expert]), raw(tensors[f"{key}.down_proj.weight"]))
            assert torch.equal(e.w2_scale_inv[expert], tensors[f"{key}.down_proj.weight_scale_inv"])
        # a quarter of the fp32 weights' bytes (the scales add 4 B per block); the rest fp32
        d = deq.model.layers[layer].mlp.experts
        assert e.w13.nbytes + e.w2.nbytes == (d.w13.nbytes + d.w2.nbytes) // 4
    attn = kept.model.layers[0].self_attn.q_a_proj.weight
    assert attn.dtype == torch.float32 and torch.equal(
        attn, deq.model.layers[0].self_attn.q_a_proj.weight
    )
    assert not deq.model.layers[1].mlp.experts.fp8


def test_cpu_dequantizes_per_use_to_what_loading_dequantized(ckpt):
    path, _ = ckpt
    ids = torch.randint(2, 512, (2, 12), generator=torch.Generator().manual_seed(0))
    kept, deq = load_model(path, keep_fp8_experts=True), load_model(path)
    assert torch.equal(kept(ids), deq(ids))


def greedy(model: torch.nn.Module, prompt: torch.Tensor, steps: int) -> list[int]:
    ids = prompt[None]
    for _ in range(steps):
        nxt = model(ids)[0, -1].argmax()
        ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, prompt.shape[0] :].tolist()


def test_triton_fp8_gemm_equals_the_dequantized_model(ckpt, monkeypatch):
    path, _ = ckpt
    kept, deq = load_model(path, keep_fp8_experts=True), load_model(path)
    prompt = torch.randint(2, 512, (10,), generator=torch.Generator().manual_seed(1))
    expected = greedy(deq, prompt, 4)  # the default CPU path, weights dequantized on load
    fp8_calls = []
    triton_mlp = moe_mlp.grouped_expert_mlp_triton

    def spy(x, counts, w13, w2, w13_scale_inv=None, w2_scale_inv=None, **tiles):
        fp8_calls.append(w13_scale_inv is not None)
        return triton_mlp(x, counts, w13, w2, w13_scale_inv, w2_scale_inv, **tiles)

    monkeypatch.setattr(moe_mlp, "grouped_expert_mlp_triton", spy)
    monkeypatch.setenv("EPCLUSTER_KERNELS", "triton")  # CPU tensors: Triton's interpreter
    ids = torch.cat([prompt, torch.tensor(expected)])[None]
    logits = kept(ids)
    assert fp8_calls.count(True) == len(MOE_LAYERS)  # every MoE layer's experts, in FP8
    fp8_calls.clear()
    reference = deq(ids)  # the same kernels over the dequantized weights
    assert fp8_calls and not any(fp8_calls)
    scale = reference.abs().max().item()
    torch.testing.assert_close(logits, reference, rtol=0, atol=FP8_GEMM_RTOL * scale)
    assert greedy(kept, prompt, 4) == expected


def fused(tensors: dict[str, torch.Tensor], num_experts: int) -> dict[str, torch.Tensor]:
    """The per-expert FP8 tensors as fused [E, ...] ones (transformers' layout), scales too."""
    out = {k: v for k, v in tensors.items() if ".mlp.experts." not in k}
    for layer in MOE_LAYERS:
        p = f"model.layers.{layer}.mlp.experts"
        for name, parts in [
            ("gate_up_proj", ("gate_proj", "up_proj")),
            ("down_proj", ("down_proj",)),
        ]:
            for suffix in ("weight", "weight_scale_inv"):
                rows = [
                    torch.cat([raw(tensors[f"{p}.{e}.{part}.{suffix}"]) for part in parts])
                    for e in range(num_experts)
                ]
                key = f"{p}.{name}" + ("_scale_inv" if suffix.endswith("inv") else "")
                out[key] = torch.stack(rows)
                if suffix == "weight":
                    out[key] = out[key].view(torch.float8_e4m3fn)
    return out


def test_fused_fp8_experts_are_dequantized_or_kept(tmp_path):
    """Audit M10: fused FP8 expert rows were read raw (unscaled e4m3) by the loader and by the
    balancer's checkpoint fallback."""
    per_expert = tmp_path / "per_expert"
    tensors = fp8_checkpoint(per_expert, FULL)
    fused_dir = tmp_path / "fused"
    fused_dir.mkdir()
    save_file(fused(tensors, 16), str(fused_dir / "model.safetensors"))
    (fused_dir / "config.json").write_text((per_expert / "config.json").read_text())
    for keep in (False, True):
        a = load_model(per_expert, keep_fp8_experts=keep).model.layers[2].mlp.experts
        b = load_model(fused_dir, keep_fp8_experts=keep).model.layers[2].mlp.experts
        for name, t in a.slot_tensors().items():
            assert torch.equal(raw(getattr(b, name)), raw(t)), (keep, name)
        read = read_expert(fused_dir, 2, 5, fp8=keep)  # the balancer's fallback
        for t, slot in zip(read, a.slot_tensors().values(), strict=True):
            assert torch.equal(raw(t), raw(slot[5]))
    down = tensors["model.layers.2.mlp.experts.5.down_proj.weight"]
    scale = tensors["model.layers.2.mlp.experts.5.down_proj.weight_scale_inv"]
    assert torch.equal(read_expert(fused_dir, 2, 5)[1], dequantize_block_fp8(down, scale))


def test_fused_gate_up_sharing_a_block_cannot_be_kept(tmp_path):
    per_expert, fused_dir = tmp_path / "per_expert", tmp_path / "fused"
    tensors = fp8_checkpoint(per_expert, PARTIAL)  # 72 gate rows: block 0 spans gate and up
    fused_dir.mkdir()
    save_file(fused(tensors, 16), str(fused_dir / "model.safetensors"))
    (fused_dir / "config.json").write_text((per_expert / "config.json").read_text())
    with pytest.raises(LoadError, match="gate and up share scale blocks"):
        load_model(fused_dir, keep_fp8_experts=True)


def test_read_expert_gives_what_a_slot_holds(ckpt):
    path, _ = ckpt
    for keep in (False, True):
        experts = load_model(path, keep_fp8_experts=keep).model.layers[1].mlp.experts
        read = read_expert(path, 1, 11, fp8=keep)
        assert len(read) == len(experts.slot_tensors())
        for t, slot in zip(read, experts.slot_tensors().values()):
            assert t.dtype == slot.dtype and torch.equal(raw(t), raw(slot[11]))


def moving_rank(rank: int, num_ranks: int, path: Path, fail: bool) -> dict:
    """Layer 1's experts reversed over 2 ranks (every slot changes rank), moved in FP8; with
    `fail`, each rank's receives are replaced by the checkpoint fallback."""
    placement = Placement.contiguous(MOE_LAYERS, 16, num_ranks)
    model = load_model(path, experts=placement.rank_experts(rank), keep_fp8_experts=True)
    old = placement.phy2log[0].tolist()
    new = old[::-1]
    moe = model.moe_layers()[0]
    with torch.inference_mode():
        move = LayerMove(
            moe, 0, old, new, rank, num_ranks, None, lambda e: read_expert(path, 1, e, fp8=True)
        )
        move._done.wait()
        if fail:  # as if every receive had failed: the fallback reads the checkpoint
            move._failed = [(i, e) for i, e, _ in move._recvs]
        from_checkpoint = move.finish()
        move.apply()
    tensors = {name: raw(t).clone() for name, t in moe.experts.slot_tensors().items()}
    return {"ids": moe.experts.expert_ids, "tensors": tensors, "from_checkpoint": from_checkpoint}


@pytest.mark.parametrize("fail", [False, True], ids=["transfer", "checkpoint-fallback"])
def test_live_moves_carry_the_scales(tmp_path, fail):
    fp8_checkpoint(tmp_path, PARTIAL)
    full = load_model(tmp_path, keep_fp8_experts=True).model.layers[1].mlp.experts
    results = run_ranks(moving_rank, 2, tmp_path, fail)
    for rank, result in enumerate(results):
        ids = list(range(16))[::-1][rank * 8 : (rank + 1) * 8]
        assert result["ids"] == ids
        assert result["from_checkpoint"] == (8 if fail else 0)
        assert set(result["tensors"]) == {"w13", "w2", "w13_scale_inv", "w2_scale_inv"}
        for name, t in full.slot_tensors().items():
            assert torch.equal(result["tensors"][name], raw(t)[ids]), (rank, name)


def test_the_engine_option():
    assert EngineConfig().fp8_experts == "auto"
    assert not EngineConfig().keep_fp8_experts  # a CPU dequantizes on load
    assert EngineConfig(device="cuda").keep_fp8_experts
    assert EngineConfig(fp8_experts="keep").keep_fp8_experts
    assert not EngineConfig(device="cuda", fp8_experts="dequantize").keep_fp8_experts
    with pytest.raises(EngineConfigError, match="fp8_experts: must be keep, dequantize or auto"):
        EngineConfig(fp8_experts="fp8")
