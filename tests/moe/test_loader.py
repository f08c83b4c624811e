"""Loader: FP8 block-quantized checkpoints, expert subsets, sharded files, clear errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from kernels.fp8 import dequantize_block_fp8, quantize_block_fp8
from moe import load_model
from moe.config import ConfigError
from moe.loader import LoadError
from tests.hf_oracle import make_hf_model

# Wide enough that some weights span several 128 x 128 blocks, with ragged edges.
WIDE = dict(
    hidden_size=192,
    intermediate_size=320,
    moe_intermediate_size=136,
    kv_lora_rank=160,
    q_lora_rank=144,
    num_hidden_layers=2,
    n_routed_experts=8,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=2,
)


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("v3")
    make_hf_model("v3", path, n_group=4, topk_group=2)
    return path


def test_fp8_checkpoint_matches_within_quantization_error(tmp_path):
    ref_dir, fp8_dir = tmp_path / "ref", tmp_path / "fp8"
    make_hf_model("v3", ref_dir, **WIDE)
    tensors = load_file(str(ref_dir / "model.safetensors"))
    quantized, dequantized = {}, {}
    for name, w in tensors.items():
        if w.dim() == 2 and "proj" in name:  # linear weights, as DeepSeek-V3 ships them
            q, scale_inv = quantize_block_fp8(w)
            quantized[name], quantized[name + "_scale_inv"] = q, scale_inv
            dequantized[name] = dequantize_block_fp8(q, scale_inv)
        else:
            quantized[name] = dequantized[name] = w
    fp8_dir.mkdir()
    save_file(quantized, str(fp8_dir / "model.safetensors"))
    (fp8_dir / "config.json").write_text((ref_dir / "config.json").read_text())
    assert any(t.dtype == torch.float8_e4m3fn for t in quantized.values())

    fp8_model = load_model(fp8_dir)
    # The loaded weights are exactly the dequantized ones...
    attn = fp8_model.model.layers[0].self_attn
    assert torch.equal(
        attn.q_a_proj.weight, dequantized["model.layers.0.self_attn.q_a_proj.weight"]
    )
    experts = fp8_model.model.layers[1].mlp.experts
    assert torch.equal(experts.w2[3], dequantized["model.layers.1.mlp.experts.3.down_proj.weight"])
    # ... and their error against the original is what e4m3 allows (3 mantissa bits: <= 2^-4
    # relative to each block's absmax).
    w = tensors["model.layers.0.mlp.down_proj.weight"]
    err = (dequantized["model.layers.0.mlp.down_proj.weight"] - w).abs().max()
    assert 0 < err <= w.abs().max() * 2**-4

    # Every quantized tensor is within its computed e4m3 error of the original; and the model
    # computes exactly what the dequantized weights give.
    for name, deq in dequantized.items():
        if name in tensors and quantized[name].dtype == torch.float8_e4m3fn:
            bound = tensors[name].abs().max() * 2**-4
            assert (deq - tensors[name]).abs().max() <= bound, name
    deq_dir = tmp_path / "deq"
    deq_dir.mkdir()
    save_file(dequantized, str(deq_dir / "model.safetensors"))
    (deq_dir / "config.json").write_text((ref_dir / "config.json").read_text())
    ids = torch.randint(0, 160, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(fp8_model(ids), load_model(deq_dir)(ids), atol=1e-5)


def test_expert_subset_holds_only_those_experts(v3_dir):
    full = load_model(v3_dir)
    subset = [1, 5, 6, 12]
    part = load_model(v3_dir, experts=subset)
    for layer_full, layer_part in zip(full.moe_layers(), part.moe_layers()):
        e = layer_part.experts
        assert e.expert_ids == subset
        assert e.w13.shape[0] == e.w2.shape[0] == len(subset)
        for slot, expert in enumerate(subset):
            assert torch.equal(e.w13[slot], layer_full.experts.w13[expert])
            assert torch.equal(e.w2[slot], layer_full.experts.w2[expert])
    n_full = sum(p.numel() for p in full.parameters())
    n_part = sum(p.numel() for p in part.parameters())
    per_expert = (
        full.moe_layers()[0].experts.w13[0].numel() + full.moe_layers()[0].experts.w2[0].numel()
    )
    assert n_full - n_part == per_expert * (16 - len(subset)) * len(full.moe_layers())


def test_expert_subset_never_reads_other_experts(v3_dir, monkeypatch):
    from moe import loader

    read = []
    original = loader.CheckpointReader.get
    monkeypatch.setattr(
        loader.CheckpointReader, "get", lambda self, key: read.append(key) or original(self, key)
    )
    load_model(v3_dir, experts={1: [0, 3], 2: [3, 3, 7]})  # per layer, with a replica
    experts_read = {k.split(".mlp.experts.")[1].split(".")[0] for k in read if ".experts." in k}
    assert experts_read == {"0", "3", "7"}
    assert not [k for k in read if ".layers.1.mlp.experts.7." in k]


def test_sharded_checkpoint(v3_dir, tmp_path):
    tensors = load_file(str(v3_dir / "model.safetensors"))
    names = sorted(tensors)
    shards = {"a.safetensors": names[::2], "b.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / file))
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text((v3_dir / "config.json").read_text())
    ids = torch.arange(10)[None]
    assert torch.equal(load_model(tmp_path)(ids), load_model(v3_dir)(ids))


def test_bad_configs_name_the_field(v3_dir, tmp_path):
    raw = json.loads((v3_dir / "config.json").read_text())
    for field, value in [
        ("n_group", 3),
        ("scoring_func", "relu"),
        ("topk_method", "best"),
        ("kv_lora_rank", 0),
        ("hidden_act", "gelu"),
        ("topk_group", 9),
    ]:
        (tmp_path / "config.json").write_text(json.dumps(dict(raw, **{field: value})))
        with pytest.raises(ConfigError, match=field):
            load_model(tmp_path)
    (tmp_path / "config.json").write_text(
        json.dumps({k: v for k, v in raw.items() if k != "hidden_size"})
    )
    with pytest.raises(ConfigError, match="hidden_size"):
        load_model(tmp_path)


def test_missing_tensor_is_named(v3_dir, tmp_path):
    tensors = load_file(str(v3_dir / "model.safetensors"))
    del tensors["model.layers.2.mlp.experts.4.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((v3_dir / "config.json").read_text())
    with pytest.raises(LoadError, match=r"experts\.4\.up_proj"):
        load_model(tmp_path)
