"""A decode step's decoder layers in one call each on CPU (kernels/cpu/decode_layer.cpp
DecodeLayer): the kernels of the Python layer code (moe/model.py DecoderLayer.stages), in its
order, on the same tensors, so the numbers are bit for bit the same, without the ~2 ms of Python
and torch glue a batch-1 step of `small` spent between its ~134 kernel calls.

ModelRunner chooses it, beside the CUDA graphs (engine/decode_graphs.py) and the Python layers:
CpuDecode.layers gives the fused layers for a step when the compiled CPU kernels run it (fp32 CPU
tensors, EPCLUSTER_KERNELS auto) and every query takes the absorbed path (decode, short chunks
over a cached prefix), else None; the runner passes what it got to `model.stages(fused=...)`.
A dense layer, and an MoE layer whose dispatcher is a LocalDispatcher holding every expert, run
whole; an expert-parallel MoE layer runs its attention half in one call and its MoE block in
Python (the stages yield while its rows travel, as the Python layers do). The layers are built on
first use and again when an MoE layer's dispatcher or expert weights change (the balancer swaps
in new storage).
"""

from dataclasses import dataclass
from typing import Any

import torch

from kernels.backend import use_cpu_kernel
from kernels.cpu.build import cpu_kernels
from kernels.gate import SCORING_FUNCS, TOPK_METHODS
from kernels.linear import panels
from moe.attention import MLAttention, PagedKV
from moe.dispatch import LocalDispatcher
from moe.layers import MLP, Experts, MoE
from moe.model import DecoderLayer, DeepseekForCausalLM
from moe.overlap import Stages


@dataclass(frozen=True, slots=True)
class FusedLayer:
    """One decoder layer's compiled form: `decode` (a DecodeLayer), the layer's MoE block or
    None (dense), and whether the whole layer runs compiled (else its MoE block runs in Python)."""

    decode: Any  # cpu_kernels().DecodeLayer
    moe: MoE | None
    whole: bool


@dataclass(frozen=True, slots=True)
class DecodeLayers:
    """Every decoder layer of a model, compiled: what ModelRunner passes as model.stages(fused=)."""

    layers: tuple[FusedLayer, ...]

    def stages(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: PagedKV
    ) -> Stages[torch.Tensor]:
        """x [T, D] through every layer -> [T, D] (before the final norm), yielding while an
        expert-parallel MoE layer's rows travel; the local MoE layers' load and row counts as
        their dispatchers would count them."""
        slots, tables, lens = kv.slot_mapping, kv.absorbed_tables, kv.absorbed_lens
        cos, sin = cos.contiguous(), sin.contiguous()
        for layer, cache in zip(self.layers, kv.kv_caches):
            fused, moe = layer.decode, layer.moe
            if layer.whole:
                x, counts = fused.forward(x, cos, sin, cache, slots, tables, lens)
                if moe is not None:
                    moe.dispatcher.load.add(counts)
                    moe.dispatcher.stats.rows += x.shape[0] * moe.gate.config.num_experts_per_tok
            else:
                h1, h = fused.attention(x, cos, sin, cache, slots, tables, lens)
                x = h1 + (yield from moe.stages(h))
        return x


class CpuDecode:
    """The fused layers of one model, built on first use and rebuilt when what they read
    changes."""

    def __init__(self, model: DeepseekForCausalLM) -> None:
        self.model = model
        self.built: DecodeLayers | None = None  # the layers last built (None: some cannot be)
        self._key: tuple | None = None

    def _state(self) -> tuple:
        """What the built layers depend on that can change after loading."""
        key = []
        for moe in self.model.moe_layers():
            experts = moe.experts
            key += [id(moe.dispatcher), id(experts), experts.w13.data_ptr()]
            key.append(experts.w2.data_ptr())
        return tuple(key)

    def layers(self, x: torch.Tensor, kv: PagedKV | None) -> DecodeLayers | None:
        """The fused layers for a step whose hidden states have x's dtype and device over kv, or
        None (the Python layers run it)."""
        if kv is None or not kv.all_absorbed or not use_cpu_kernel(x):
            return None
        key = self._state()
        if key != self._key:
            self.built = _build(self.model)
            self._key = key
        return self.built


def _build(model: DeepseekForCausalLM) -> DecodeLayers | None:
    built = []
    for layer in model.model.layers:
        fused = _decode_layer(layer)
        if fused is None:
            return None
        moe = layer.mlp if isinstance(layer.mlp, MoE) else None
        built.append(FusedLayer(fused, moe, moe is None or fused.moe))
    return DecodeLayers(tuple(built))


def fused_block(layer: DecoderLayer) -> FusedLayer | None:
    """One decoder layer compiled alone (the MTP layer's block: engine/speculative.py), or None
    when it cannot be (see _decode_layer; an MoE block that does not hold every expert here).
    Its weights never move (the balancer moves the main layers' only): built once."""
    fused = _decode_layer(layer)
    if fused is None:
        return None
    moe = layer.mlp if isinstance(layer.mlp, MoE) else None
    if moe is not None and not fused.moe:
        return None
    return FusedLayer(fused, moe, True)


def _fp32(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.is_contiguous() for t in tensors)


def _local(moe: MoE) -> bool:
    """Whether the MoE block can run in the compiled layer: this rank holds every expert (a
    LocalDispatcher), as plain Experts, its weights fp32, and the compiled gate takes the
    expert count."""
    d = moe.dispatcher
    if type(d) is not LocalDispatcher or type(moe.experts) is not Experts:
        return False
    weights = [moe.gate.weight, moe.experts.w13, moe.experts.w2]
    if moe.shared_experts is not None:
        if moe.shared_experts.w13 is None:
            return False
        weights += [moe.shared_experts.w13, moe.shared_experts.down_proj.weight]
    if not _fp32(*weights):
        return False
    if d.log2slot.device.type != "cpu" or bool((d.log2slot < 0).any()):
        return False  # a subset of the experts: the Python path raises, naming them
    return moe.gate.config.n_routed_experts <= 256


def _decode_layer(layer: DecoderLayer) -> Any | None:
    """A DecodeLayer for a DecoderLayer, or None when one of its weights cannot take it (not
    fp32 and contiguous, not prepared: see DeepseekForCausalLM.prepare)."""
    attn: MLAttention = layer.self_attn
    c = attn.config
    if attn.w_in is None or attn.w_uk is None or attn.w_uv_t is None:
        return None
    d = cpu_kernels().DecodeLayer()
    d.input_norm = layer.input_layernorm.weight.detach()
    d.post_norm = layer.post_attention_layernorm.weight.detach()
    d.kv_norm = attn.kv_a_layernorm.weight.detach()
    weights = [d.input_norm, d.post_norm, d.kv_norm, attn.w_in, attn.w_uk, attn.w_uv_t]
    weights.append(attn.o_proj.weight)
    d.w_in, d.w_in_rows = panels(attn.w_in), attn.w_in.shape[0]
    if c.q_lora_rank is not None:
        d.q_norm = attn.q_a_layernorm.weight.detach()
        d.q_b, d.q_b_rows = panels(attn.q_b_proj.weight), attn.q_b_proj.weight.shape[0]
        weights += [d.q_norm, attn.q_b_proj.weight]
    d.w_uk, d.w_uv_t = attn.w_uk, attn.w_uv_t
    d.o_proj = panels(attn.o_proj.weight)
    d.heads, d.nope, d.rope = attn.num_heads, c.qk_nope_head_dim, c.qk_rope_head_dim
    d.rank = c.kv_lora_rank
    d.interleave, d.scale, d.eps = c.rope_interleave, attn.scale, c.rms_norm_eps
    mlp = layer.mlp
    dense = mlp.shared_experts if isinstance(mlp, MoE) else mlp
    if dense is not None and (not isinstance(mlp, MoE) or _local(mlp)):
        assert isinstance(dense, MLP)
        if dense.w13 is None:
            return None
        d.mlp_w13, d.mlp_w2 = panels(dense.w13), panels(dense.down_proj.weight)
        d.mlp_inter = dense.down_proj.weight.shape[1]
        weights += [dense.w13, dense.down_proj.weight]
    if isinstance(mlp, MoE) and _local(mlp):  # else the MoE block runs in Python
        gate, experts, dispatcher = mlp.gate, mlp.experts, mlp.dispatcher
        d.moe = True
        d.gate = gate.weight.detach()
        bias = gate.e_score_correction_bias
        d.gate_bias = None if bias is None else bias.detach()
        d.top_k, d.n_group, d.topk_group = c.num_experts_per_tok, c.n_group, c.topk_group
        d.scoring = SCORING_FUNCS.index(c.scoring_func)
        d.method = TOPK_METHODS.index(c.topk_method)
        d.norm_topk, d.routed_scale = c.norm_topk_prob, c.routed_scaling_factor
        d.w13, d.w2 = experts.w13.detach(), experts.w2.detach()
        d.log2slot, d.slots = dispatcher.log2slot, len(dispatcher.expert_ids)
        weights += [d.gate, d.w13, d.w2]
    if not _fp32(*weights):
        return None
    return d
