"""tools/small_mtp.py at a few steps on tiny-random (the same path as small's build, in seconds):
the directory loads as a checkpoint with one MTP layer over the preset's own main weights, the
training lowers the loss, and a rebuild writes the same bytes (seeded)."""

from pathlib import Path

import torch

from bench.mtp_acceptance import prenorm_forward, random_prompts
from moe import load_model
from moe.presets import ensure_preset
from tools.small_mtp import FrozenShared, SmallMtpConfig, block_config, build
from tools.tiny.train_mtp import load_mtp_file, mtp_block

CFG = SmallMtpConfig(model="tiny-random", prompts=8, new=8, steps=4, batch_size=4, threads=1)


def test_build_loads_with_its_mtp_layer_and_is_reproducible(tmp_path: Path) -> None:
    record = build(tmp_path / "a", CFG)
    assert len(record["losses"]) == CFG.steps
    assert record["losses"][-1] < record["losses"][0]
    assert record["mtp_bytes"] == (tmp_path / "a" / "mtp.safetensors").stat().st_size

    built, preset = load_model(str(tmp_path / "a")), load_model("tiny-random")
    assert built.config.num_nextn_predict_layers == 1 and len(built.mtp) == 1
    assert preset.config.num_nextn_predict_layers == 0
    for (name, mine), (_, theirs) in zip(
        built.model.state_dict().items(), preset.model.state_dict().items(), strict=True
    ):
        assert torch.equal(mine, theirs), name  # the main model is the preset's
    assert (tmp_path / "a" / "main.safetensors").resolve() == (
        ensure_preset("tiny-random") / "model.safetensors"
    ).resolve()

    # moe/'s MTP path on the build equals the layer as trained (transformers' block)
    config = block_config(CFG.model)
    layer = load_mtp_file(tmp_path / "a" / "mtp.safetensors", config)
    embed, head = built.model.embed_tokens.weight, built.lm_head.weight
    shared = FrozenShared(config, embed.detach().float().clone(), head.detach().float().clone())
    ids = random_prompts(config.vocab_size, 1, 30, seed=3)  # [1, 30]
    hidden, _ = prenorm_forward(built, ids)  # [1, 30, D]
    with torch.no_grad():
        out = mtp_block(shared, layer, hidden[:, :-1], ids[:, 1:])
        expected = shared.lm_head(layer.shared_head.norm(out))[0]  # [29, V]
    with torch.inference_mode():
        got = built.mtp_logits(hidden[0, :-1], ids[0, 1:], torch.arange(1, 30), [29])
    assert (got - expected).abs().max().item() <= 1e-4

    build(tmp_path / "b", CFG)
    first = (tmp_path / "a" / "mtp.safetensors").read_bytes()
    assert first == (tmp_path / "b" / "mtp.safetensors").read_bytes()
