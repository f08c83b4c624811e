"""tools/small_mtp.py at a few steps on tiny-random (the same path as small's build, in seconds):
the directory loads as a checkpoint with one MTP layer over the preset's own main weights, the
training lowers the loss, and a rebuild writes the same bytes (seeded)."""

from pathlib import Path

import torch

from moe import load_model
from moe.presets import ensure_preset
from tools.small_mtp import SmallMtpConfig, build

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

    build(tmp_path / "b", CFG)
    first = (tmp_path / "a" / "mtp.safetensors").read_bytes()
    assert first == (tmp_path / "b" / "mtp.safetensors").read_bytes()
