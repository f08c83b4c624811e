"""tiny-random's shapes with one random MTP layer (num_nextn_predict_layers 1), saved as
safetensors with the layer at model.layers.3, as a DeepSeek-V3 checkpoint stores it: the model
of the speculative-decoding tests (its drafts mostly wrong: random weights)."""

from pathlib import Path

from safetensors.torch import load_file, save_file

from moe.presets import PRESETS, write_random_checkpoint

LAYERS = PRESETS["tiny-random"]["num_hidden_layers"]


def write_mtp_random(path: Path) -> Path:
    """-> path, now holding the checkpoint (config.json, model.safetensors; byte tokenizer)."""
    write_random_checkpoint(dict(PRESETS["tiny-random"], num_nextn_predict_layers=1), path, 0)
    file = path / "model.safetensors"
    tensors = load_file(str(file))  # the model's names (mtp.0.*) -> the checkpoint's
    renamed = {
        f"model.layers.{LAYERS}.{k.removeprefix('mtp.0.')}" if k.startswith("mtp.0.") else k: v
        for k, v in tensors.items()
    }
    assert any(k.startswith(f"model.layers.{LAYERS}.eh_proj") for k in renamed)
    save_file(renamed, str(file), metadata={"format": "pt"})
    return path
