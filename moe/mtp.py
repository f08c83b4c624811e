"""DeepSeek-V3's multi-token-prediction (MTP) module: the extra layer(s) a checkpoint with
num_nextn_predict_layers > 0 stores at model.layers.{num_hidden_layers + k}.

Legend (kernels/__init__.py): T tokens, D hidden, V vocab.
Depth k predicts the token after next (tech report, section 2.2): from the main model's hidden
state h_i (its last layer, before the final norm) and the next token t_{i+1},
x = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)]) (the embedding first, as the checkpoints' eh_proj
is laid out), then a decoder block (attention + MoE or dense MLP, as its layer index says), then
shared_head.norm and the output head. The embedding and the head are the main model's (DeepSeek's
checkpoints store copies per MTP layer; the loader shares them when equal, else keeps the copy).

KV: the block has its own attention, so it reads and writes its own paged cache layer, index
num_hidden_layers + k of PagedKV.kv_caches (MLAttention indexes the caches by its layer): an
engine that drafts allocates num_hidden_layers + num_nextn_predict_layers cache layers.
"""

import logging
from collections.abc import Mapping

import torch
from torch import nn

from kernels.linear import Linear
from moe.config import ModelConfig
from moe.norm import RMSNorm

log = logging.getLogger(__name__)


class SharedHead(nn.Module):
    """The final norm of an MTP layer; `head` is None while the main lm_head serves."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head: Linear | None = None


def mtp_experts(layer: int, experts: object) -> object:
    """The experts an MTP MoE layer holds: a per-layer mapping without this layer (a placement
    covers the main model's MoE layers) means all of them, served locally on every rank."""
    if isinstance(experts, Mapping) and layer not in experts:
        return None
    return experts


def make_mtp_layer(config: ModelConfig, block: nn.Module) -> nn.Module:
    """An MTP layer: `block`, a DecoderLayer built for its index with `mtp_experts` (its
    attention and feed-forward, HF names), plus enorm, hnorm, eh_proj and shared_head, and an
    optional own copy of the embedding (embed_tokens) and the head."""
    size = config.hidden_size
    block.enorm = RMSNorm(size, config.rms_norm_eps)
    block.hnorm = RMSNorm(size, config.rms_norm_eps)
    block.eh_proj = Linear(2 * size, size, bias=False)
    block.shared_head = SharedHead(config)
    block.embed_tokens = None  # the main model's unless the checkpoint's copy differs
    return block


def eh_input(
    layer: nn.Module, embed: nn.Embedding, hidden: torch.Tensor, next_ids: torch.Tensor
) -> torch.Tensor:
    """hidden [T, D], next_ids [T] -> the block's input [T, D]:
    eh_proj(cat(enorm(embed(next_ids)), hnorm(hidden)))."""
    own = layer.embed_tokens
    e = layer.enorm((own if own is not None else embed)(next_ids))
    return layer.eh_proj(torch.cat([e, layer.hnorm(hidden)], dim=-1))


def has_mtp_weights(keys: list[str], config: ModelConfig) -> bool:
    """Whether a checkpoint's tensor names include its first MTP layer."""
    prefix = f"model.layers.{config.num_hidden_layers}."
    return any(k.startswith(prefix) for k in keys)


def share_or_keep(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """An MTP layer's copy of the embedding or head (name: mtp.{k}.embed_tokens.weight or
    mtp.{k}.shared_head.head.weight): shared with the main model's when equal (DeepSeek's
    checkpoints store equal copies), else held as the layer's own. ValueError on a wrong shape."""
    layer = model.mtp[int(name.split(".")[1])]
    embed = name.endswith("embed_tokens.weight")
    main = model.model.embed_tokens.weight if embed else model.lm_head.weight
    if tensor.shape != main.shape:
        raise ValueError(f"shape {tuple(tensor.shape)} != the main model's {tuple(main.shape)}")
    tensor = tensor.to(device=main.device, dtype=main.dtype)
    if torch.equal(tensor, main):
        return
    log.info("%s differs from the main model's: the MTP layer keeps its own", name)
    if embed:
        layer.embed_tokens = nn.Embedding(*tensor.shape, _weight=tensor)
    else:
        head = Linear(tensor.shape[1], tensor.shape[0], bias=False, device="meta")
        head.weight = nn.Parameter(tensor, requires_grad=False)
        layer.shared_head.head = head
