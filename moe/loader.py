"""Load an HF-format DeepSeek checkpoint: config.json plus model.safetensors, or shards listed in
model.safetensors.index.json. Only the routed experts a rank holds are read; FP8 block-quantized
weights are dequantized on load.
"""

import json
import re
from pathlib import Path

import torch
from safetensors import safe_open

from kernels import hugepages
from kernels.fp8 import dequantize_block_fp8
from moe.config import ModelConfig
from moe.layers import Experts
from moe.model import DeepseekForCausalLM, ExpertSubset

_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight"
)
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


class LoadError(RuntimeError):
    """A checkpoint whose tensors do not fit its config."""


class CheckpointReader:
    """Lazy access to the tensors of a safetensors checkpoint (single file or sharded)."""

    def __init__(self, path: Path) -> None:
        index = path / "model.safetensors.index.json"
        if index.exists():
            weight_map = json.loads(index.read_text())["weight_map"]
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
            if not files:
                raise LoadError(f"{path}: no *.safetensors files")
            weight_map = {}
        self._handles = {f: safe_open(str(path / f), framework="pt") for f in files}
        for f, handle in self._handles.items():
            for key in handle.keys():
                weight_map.setdefault(key, f)
        self.weight_map: dict[str, str] = weight_map

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def get(self, key: str) -> torch.Tensor:
        """The tensor, dequantized if it is FP8 with a block scale."""
        tensor = self._handles[self.weight_map[key]].get_tensor(key)
        return self._dequantize(key, tensor)

    def get_row(self, key: str, row: int) -> torch.Tensor:
        """tensor[row] read without loading the rest (fused expert tensors)."""
        return self._handles[self.weight_map[key]].get_slice(key)[row]

    def _dequantize(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dtype != torch.float8_e4m3fn:
            return tensor
        scale_key = key + "_scale_inv"
        if scale_key not in self.weight_map:
            raise LoadError(f"{key} is FP8 but {scale_key} is missing")
        return dequantize_block_fp8(tensor, self.get(scale_key))


def resolve_model_path(model: str | Path) -> Path:
    """A preset name ('tiny', 'tiny-random', 'small') or a checkpoint directory -> the directory."""
    from moe.presets import ensure_preset, preset_names

    if isinstance(model, str) and model in preset_names():
        return ensure_preset(model)
    path = Path(model)
    if not (path / "config.json").exists():
        raise FileNotFoundError(
            f"{model!r} is neither a preset ({', '.join(preset_names())}) nor a directory with "
            "config.json"
        )
    return path


@torch.inference_mode()
def load_model(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    experts: ExpertSubset = None,
) -> DeepseekForCausalLM:
    """Build the model from a checkpoint directory or preset name.

    experts: the logical routed experts to hold (all by default): one list for every MoE layer or
    a mapping layer -> list (slot order; an expert may repeat). Other experts are never read.
    """
    path = resolve_model_path(path)
    config = ModelConfig.from_file(path)
    with torch.device("meta"):
        model = DeepseekForCausalLM(config, experts)
    model = model.to_empty(device=device).to(dtype)
    # before the weights are written (model.prepare collapses what this missed)
    hugepages.advise(p for p in model.parameters() if p.nbytes >= 1 << 20)
    model.init_buffers()
    for moe in model.moe_layers():
        if moe.gate.e_score_correction_bias is not None:  # kept fp32, as DeepSeek does
            moe.gate.e_score_correction_bias.data = moe.gate.e_score_correction_bias.data.float()
    _load_weights(model, CheckpointReader(path))
    model.tie_weights()
    model.prepare()
    return model.eval()


def _load_weights(model: DeepseekForCausalLM, reader: CheckpointReader) -> None:
    config = model.config
    params = dict(model.named_parameters())
    if config.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    slots = {  # layer -> logical expert -> local slots holding it
        i: _slots_by_expert(layer.mlp.experts.expert_ids)
        for i, layer in enumerate(model.model.layers)
        if config.is_moe_layer(i)
    }
    inter = config.moe_intermediate_size
    loaded: set[str] = set()
    unexpected: list[str] = []
    for key in reader.keys():
        if key.endswith("_scale_inv") or key.endswith("rotary_emb.inv_freq"):
            continue
        layer_match = _LAYER.match(key)
        if layer_match and int(layer_match.group(1)) >= config.num_hidden_layers:
            continue  # multi-token-prediction layers: not used for serving
        if m := _EXPERT.fullmatch(key):
            layer, expert, proj = int(m.group(1)), int(m.group(2)), m.group(3)
            targets = slots.get(layer, {}).get(expert, [])
            if layer not in slots or expert >= config.n_routed_experts:
                unexpected.append(key)
            if not targets:
                continue  # another rank's expert: never read
            weight = reader.get(key)
            experts = model.model.layers[layer].mlp.experts
            for slot in targets:
                _copy_expert(experts, slot, proj, weight, inter)
                loaded.add(f"{layer}.{slot}.{proj}")
        elif m := _FUSED.fullmatch(key):
            layer, which = int(m.group(1)), m.group(2)
            experts = model.model.layers[layer].mlp.experts
            for expert, targets in slots[layer].items():
                row = reader.get_row(key, expert)
                for slot in targets:
                    if which == "gate_up_proj":
                        experts.w13.data[slot].copy_(row)
                        loaded.update({f"{layer}.{slot}.gate_proj", f"{layer}.{slot}.up_proj"})
                    else:
                        experts.w2.data[slot].copy_(row)
                        loaded.add(f"{layer}.{slot}.down_proj")
        elif key in params:
            tensor = reader.get(key)
            if tensor.shape != params[key].shape:
                raise LoadError(
                    f"{key}: checkpoint shape {tuple(tensor.shape)} != model "
                    f"{tuple(params[key].shape)}"
                )
            params[key].data.copy_(tensor)
            loaded.add(key)
        else:
            unexpected.append(key)
    if unexpected:
        raise LoadError(f"checkpoint tensors the config does not describe: {unexpected[:8]}")
    missing = [k for k in params if not k.endswith((".w13", ".w2")) and k not in loaded]
    for layer, by_expert in slots.items():
        for expert, targets in by_expert.items():
            for slot in targets:
                for proj in ("gate_proj", "up_proj", "down_proj"):
                    if f"{layer}.{slot}.{proj}" not in loaded:
                        missing.append(f"model.layers.{layer}.mlp.experts.{expert}.{proj}.weight")
    if missing:
        raise LoadError(f"checkpoint lacks tensors the model needs: {missing[:8]}")


def _slots_by_expert(expert_ids: list[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for slot, expert in enumerate(expert_ids):
        out.setdefault(expert, []).append(slot)
    return out


def _copy_expert(experts: Experts, slot: int, proj: str, weight: torch.Tensor, inter: int) -> None:
    if proj == "gate_proj":
        experts.w13.data[slot, :inter].copy_(weight)
    elif proj == "up_proj":
        experts.w13.data[slot, inter:].copy_(weight)
    else:
        experts.w2.data[slot].copy_(weight)


def read_expert(
    path: str | Path,
    layer: int,
    expert: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One routed expert's weights from the checkpoint -> (w13 [2I, D]: gate rows then up rows,
    w2 [D, I]), as Experts stores them (a re-placement's fallback when a transfer fails)."""
    reader = CheckpointReader(resolve_model_path(path))
    prefix = f"model.layers.{layer}.mlp.experts"
    if f"{prefix}.gate_up_proj" in reader.weight_map:
        w13 = reader.get_row(f"{prefix}.gate_up_proj", expert)
        w2 = reader.get_row(f"{prefix}.down_proj", expert)
    else:
        gate, up, w2 = (
            reader.get(f"{prefix}.{expert}.{proj}.weight")
            for proj in ("gate_proj", "up_proj", "down_proj")
        )
        w13 = torch.cat([gate, up])
    return w13.to(device=device, dtype=dtype), w2.to(device=device, dtype=dtype)
