"""Load an HF-format DeepSeek checkpoint: config.json plus model.safetensors, or shards listed in
model.safetensors.index.json. Only the routed experts a rank holds are read. FP8 block-quantized
weights are dequantized on load, except the routed experts' when asked to keep them (fp8_experts):
then the experts hold e4m3 weights and their block scales, as the checkpoint stores them.
"""

import dataclasses
import json
import logging
import re
from pathlib import Path

import torch
from safetensors import safe_open

from kernels import hugepages
from kernels.fp8 import BLOCK as FP8_BLOCK
from kernels.fp8 import dequantize_block_fp8
from moe.config import ModelConfig
from moe.layers import Experts, MoE
from moe.model import DeepseekForCausalLM, ExpertSubset
from moe.mtp import has_mtp_weights, share_or_keep

log = logging.getLogger(__name__)

_EXPERT = re.compile(
    r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight"
)
_FUSED = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# an MTP layer's copies of the main model's embedding and head (shared when equal)
_MTP_SHARED = ("embed_tokens.weight", "shared_head.head.weight")


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

    def get(self, key: str, row: int | None = None) -> torch.Tensor:
        """The tensor, or its row `row` read without the rest (fused expert tensors),
        dequantized if it is FP8 with a block scale."""
        tensor = self._read(key, row)
        if tensor.dtype != torch.float8_e4m3fn:
            return tensor
        return dequantize_block_fp8(tensor, self._scale(key, row))

    def get_fp8(self, key: str, row: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """An FP8 tensor (or its row) as stored: (e4m3 [Fo, Fi], scale_inv [Bo, Bi] fp32)."""
        tensor = self._read(key, row)
        if tensor.dtype != torch.float8_e4m3fn:
            raise LoadError(f"{key} is {tensor.dtype}, not FP8: it cannot be kept in FP8")
        return tensor, self._scale(key, row).float()

    def is_fp8(self, key: str) -> bool:
        return self._handles[self.weight_map[key]].get_slice(key).get_dtype() == "F8_E4M3"

    def _read(self, key: str, row: int | None) -> torch.Tensor:
        handle = self._handles[self.weight_map[key]]
        return handle.get_tensor(key) if row is None else handle.get_slice(key)[row]

    def _scale(self, key: str, row: int | None) -> torch.Tensor:
        scale_key = key + "_scale_inv"
        if scale_key not in self.weight_map:
            raise LoadError(f"{key} is FP8 but {scale_key} is missing")
        return self._read(scale_key, row)


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
    keep_fp8_experts: bool = False,
) -> DeepseekForCausalLM:
    """Build the model from a checkpoint directory or preset name.

    experts: the logical routed experts to hold (all by default): one list for every MoE layer or
    a mapping layer -> list (slot order; an expert may repeat). Other experts are never read.
    keep_fp8_experts: when the checkpoint's routed experts are FP8 block-quantized, hold them so
    (Experts.keep_fp8) instead of dequantizing them to `dtype`; other checkpoints load as usual.
    """
    path = resolve_model_path(path)
    config = ModelConfig.from_file(path)
    reader = CheckpointReader(path)
    if config.num_nextn_predict_layers and not has_mtp_weights(reader.keys(), config):
        # quantized re-uploads often drop the MTP layers but keep the config's count
        log.warning("%s: config lists MTP layers, the checkpoint has none: loaded without", path)
        config = dataclasses.replace(config, num_nextn_predict_layers=0)
    keep = keep_fp8_experts and experts_are_fp8(reader)
    # NOTE: dtypes are set on the meta device, so every tensor is allocated once, in its dtype.
    with torch.device("meta"):
        model = DeepseekForCausalLM(config, experts).to(dtype)
    for moe in [*model.moe_layers(), *(m.mlp for m in model.mtp if isinstance(m.mlp, MoE))]:
        if moe.gate.e_score_correction_bias is not None:  # kept fp32, as DeepSeek does
            moe.gate.e_score_correction_bias.data = moe.gate.e_score_correction_bias.data.float()
        if keep:
            moe.experts.keep_fp8()
    model = model.to_empty(device=device)
    # before the weights are written (model.prepare collapses what this missed)
    hugepages.advise(p for p in model.parameters() if p.nbytes >= 1 << 20)
    model.init_buffers()
    _load_weights(model, reader)
    model.tie_weights()
    model.prepare()
    return model.eval()


def experts_are_fp8(reader: CheckpointReader) -> bool:
    """Whether the checkpoint's routed experts are FP8 (judged by the first expert tensor)."""
    key = next((k for k in reader.keys() if _EXPERT.fullmatch(k) or _FUSED.fullmatch(k)), None)
    return key is not None and reader.is_fp8(key)


def _load_weights(model: DeepseekForCausalLM, reader: CheckpointReader) -> None:
    config = model.config
    params = dict(model.named_parameters())
    if config.tie_word_embeddings:
        params.pop("lm_head.weight", None)
    layers = [*model.model.layers, *model.mtp]  # by checkpoint layer index
    slots = {  # layer -> logical expert -> local slots holding it
        i: _slots_by_expert(layer.mlp.experts.expert_ids)
        for i, layer in enumerate(layers)
        if config.is_moe_layer(i)
    }
    last = config.num_hidden_layers + config.num_nextn_predict_layers
    shared: list[tuple[str, str]] = []  # (checkpoint key, MTP layer's key) of embedding / head
    inter = config.moe_intermediate_size
    loaded: set[str] = set()
    unexpected: list[str] = []
    for key in reader.keys():
        if key.endswith("_scale_inv") or key.endswith("rotary_emb.inv_freq"):
            continue
        layer_match = _LAYER.match(key)
        name = key
        if layer_match and int(layer_match.group(1)) >= config.num_hidden_layers:
            index = int(layer_match.group(1))
            if index >= last:
                continue  # MTP layers the config does not ask for: not served
            name = f"mtp.{index - config.num_hidden_layers}.{key[layer_match.end() :]}"
            if name.endswith(_MTP_SHARED):
                shared.append((key, name))
                continue
        if m := _EXPERT.fullmatch(key):
            layer, expert, proj = int(m.group(1)), int(m.group(2)), m.group(3)
            targets = slots.get(layer, {}).get(expert, [])
            if layer not in slots or expert >= config.n_routed_experts:
                unexpected.append(key)
            if not targets:
                continue  # another rank's expert: never read
            experts = layers[layer].mlp.experts
            weight, scale = reader.get_fp8(key) if experts.fp8 else (reader.get(key), None)
            for slot in targets:
                _copy_expert(experts, slot, proj, weight, scale, inter)
                loaded.add(f"{layer}.{slot}.{proj}")
        elif m := _FUSED.fullmatch(key):
            layer, which = int(m.group(1)), m.group(2)
            experts = layers[layer].mlp.experts
            for expert, targets in slots[layer].items():
                row, scale = _read_row(reader, key, expert, experts.fp8, inter)
                for slot in targets:
                    if which == "gate_up_proj":
                        experts.w13.data[slot].copy_(row)
                        loaded.update({f"{layer}.{slot}.gate_proj", f"{layer}.{slot}.up_proj"})
                    else:
                        experts.w2.data[slot].copy_(row)
                        loaded.add(f"{layer}.{slot}.down_proj")
                    if scale is not None:
                        name = "w13_scale_inv" if which == "gate_up_proj" else "w2_scale_inv"
                        getattr(experts, name)[slot].copy_(scale)
        elif name in params:
            tensor = reader.get(key)
            if tensor.shape != params[name].shape:
                raise LoadError(
                    f"{key}: checkpoint shape {tuple(tensor.shape)} != model "
                    f"{tuple(params[name].shape)}"
                )
            params[name].data.copy_(tensor)
            loaded.add(name)
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
    for key, name in shared:  # after the main model's embedding and head
        try:
            share_or_keep(model, name, reader.get(key))
        except ValueError as e:
            raise LoadError(f"{key}: {e}") from e


def _slots_by_expert(expert_ids: list[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for slot, expert in enumerate(expert_ids):
        out.setdefault(expert, []).append(slot)
    return out


def _read_row(
    reader: CheckpointReader, key: str, expert: int, fp8: bool, inter: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One expert's row of a fused tensor: (weights, None) dequantized, or (e4m3, scale_inv)."""
    if not fp8:
        return reader.get(key, expert), None
    row, scale = reader.get_fp8(key, expert)
    if key.endswith("gate_up_proj") and inter % FP8_BLOCK:
        # a 128-row block then spans gate and up rows: Experts' layout scales them apart
        raise LoadError(
            f"{key}: gate and up share scale blocks (moe_intermediate_size {inter} is not a "
            f"multiple of {FP8_BLOCK}); load it with fp8_experts 'dequantize'"
        )
    return row, scale


def _copy_expert(
    experts: Experts,
    slot: int,
    proj: str,
    weight: torch.Tensor,
    scale_inv: torch.Tensor | None,
    inter: int,
) -> None:
    """One projection of one expert into a slot (and its block scales when kept in FP8)."""
    if proj == "down_proj":
        experts.w2.data[slot].copy_(weight)
        if scale_inv is not None:
            experts.w2_scale_inv[slot].copy_(scale_inv)
        return
    gate = proj == "gate_proj"
    experts.w13.data[slot, slice(0, inter) if gate else slice(inter, 2 * inter)].copy_(weight)
    if scale_inv is not None:
        half = experts.w13_scale_inv.shape[1] // 2  # gate blocks, then up blocks
        blocks = slice(0, half) if gate else slice(half, 2 * half)
        experts.w13_scale_inv[slot, blocks].copy_(scale_inv)


def read_expert(
    path: str | Path,
    layer: int,
    expert: int,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    fp8: bool = False,
) -> tuple[torch.Tensor, ...]:
    """One routed expert from the checkpoint, as Experts stores it (Experts.slot_tensors' order):
    (w13 [2I, D]: gate rows then up rows, w2 [D, I]) in dtype; with fp8, as stored:
    (w13, w2 e4m3, w13_scale_inv [2 * ceil(I/128), ceil(D/128)], w2_scale_inv) (a
    re-placement's fallback when a transfer fails)."""
    reader = CheckpointReader(resolve_model_path(path))
    prefix = f"model.layers.{layer}.mlp.experts"
    inter = ModelConfig.from_file(resolve_model_path(path)).moe_intermediate_size
    if f"{prefix}.gate_up_proj" in reader.weight_map:
        (w13, s13), (w2, s2) = (
            _read_row(reader, f"{prefix}.{which}", expert, fp8, inter)
            for which in ("gate_up_proj", "down_proj")
        )
    else:
        (gate, s_gate), (up, s_up), (w2, s2) = (
            reader.get_fp8(key) if fp8 else (reader.get(key), None)
            for key in (
                f"{prefix}.{expert}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")
            )
        )
        w13 = torch.cat([gate, up])
        s13 = torch.cat([s_gate, s_up]) if fp8 else None
    if fp8:
        return tuple(t.to(device) for t in (w13, w2, s13, s2))
    return w13.to(device=device, dtype=dtype), w2.to(device=device, dtype=dtype)
