"""Two-batch overlap: run two micro-batches through the model interleaved, so that while one
waits for its all-to-all (dispatch or combine), the other computes.

Each micro-batch's forward is a generator that yields right after it starts an async
all-to-all (the dispatch rows, then the combine); `run_interleaved` advances the generators in
turn, so one micro-batch's attention and experts run while the other's rows travel. Per MoE layer
the collectives go out in the same order on every rank (counts 0, rows 0, counts 1, rows 1,
combine 0, combine 1), so ranks never deadlock, whatever their batch sizes (an empty micro-batch
still joins every collective). The counts travel on a group of their own, so they do not queue
behind the other micro-batch's rows.

Legend: T tokens of a micro-batch, H hidden.
"""

from collections.abc import Generator

import torch

from kernels.rotary import rope_cos_sin
from moe.attention import PagedKV
from moe.layers import MoE
from moe.model import DecoderLayer, DeepseekForCausalLM

Stages = Generator[None, None, torch.Tensor]


def layer_stages(
    layer: DecoderLayer,
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    kv: PagedKV | None,
    seq_lens: list[int] | None,
) -> Stages:
    """One decoder layer on x [T, H], yielding while its all-to-alls are in flight."""
    x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, seq_lens, kv)
    h = layer.post_attention_layernorm(x)
    mlp = layer.mlp
    dispatcher = getattr(mlp, "dispatcher", None)
    if not isinstance(mlp, MoE) or dispatcher is None:
        return x + mlp(h)
    topk_weights, topk_idx = mlp.gate(h)  # [T, K]
    handle = dispatcher.dispatch(h, topk_idx, topk_weights, async_op=True)  # counts in flight
    handle.launch_rows()  # the other micro-batch's attention runs while the rows travel
    shared = mlp.shared_experts(h) if mlp.shared_experts is not None else None  # rows in flight
    yield
    handle.wait()
    y = mlp.experts.forward_sorted(handle.recv_x, handle.recv_counts)
    combine = dispatcher.combine(y, handle, async_op=True)
    yield
    out = combine.output()  # waits
    return x + (out if shared is None else out + shared)


def model_stages(
    model: DeepseekForCausalLM,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    kv: PagedKV | None = None,
    seq_lens: list[int] | None = None,
) -> Stages:
    """model.forward_tokens as a generator: input_ids, positions [T] -> hidden [T, H]."""
    x = model.model.embed_tokens(input_ids)
    cos, sin = rope_cos_sin(positions, model.inv_freq, model.rope_scaling)
    for layer in model.model.layers:
        x = yield from layer_stages(layer, x, cos, sin, kv, seq_lens)
    return model.model.norm(x)


def run_interleaved(stages: list[Stages]) -> list[torch.Tensor]:
    """Advance each generator to its next yield in turn until all return; -> their results."""
    results: list[torch.Tensor | None] = [None] * len(stages)
    live = list(range(len(stages)))
    while live:
        for i in list(live):
            try:
                next(stages[i])
            except StopIteration as stop:
                results[i] = stop.value
                live.remove(i)
    return results  # type: ignore[return-value]
