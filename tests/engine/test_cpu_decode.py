"""The fused decode layers (engine/cpu_decode.py, one compiled call per layer) against the
model's Python layers: the same hidden states, cache rows and expert loads, bit for bit, step by
step; and the steps it must leave to the Python layers."""

import pytest
import torch

from engine.cpu_decode import CpuDecode
from kernels.cpu.build import cpu_kernels
from moe import load_model
from moe.attention import PagedKV
from moe.dispatch import CommStats, LocalDispatcher
from moe.dispatch_handles import SlotLoad
from tests.hf_oracle import make_hf_model

pytestmark = pytest.mark.skipif(cpu_kernels() is None, reason="the CPU kernels did not build")

BLOCK = 4
MODELS = {
    "v3-groups": ("v3", dict(n_group=4, topk_group=2)),
    "v2-no-q-lora-softmax": ("v2", dict(q_lora_rank=None, topk_method="greedy")),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory):
    kind, overrides = MODELS[request.param]
    path = tmp_path_factory.mktemp(request.param)
    make_hf_model(kind, path, **overrides)
    return load_model(str(path))


class Run:
    """A batch of sequences decoded over their own paged cache, fused or not."""

    def __init__(self, model, prompts: list[list[int]], fused: bool) -> None:
        c = model.config
        self.model, self.fused = model, fused
        self.seqs = [list(p) for p in prompts]
        per_seq = 24  # blocks: room for 96 tokens
        self.tables = [[s * per_seq + b for b in range(per_seq)] for s in range(len(prompts))]
        self.caches = [
            torch.zeros(len(prompts) * per_seq, BLOCK, c.kv_cache_width)
            for _ in range(c.num_hidden_layers)
        ]
        # the runner's choice, made here per run: the fused layers where they serve, or none
        self.cpu_decode = CpuDecode(model) if fused else None
        self.loads = {moe: SlotLoad() for moe in model.moe_layers()}
        self.stats = CommStats()
        self.fused_steps = 0

    def step(self, new: list[int]) -> torch.Tensor:
        """Feed each sequence's last new[i] tokens -> hidden [T, D] (final norm applied)."""
        ids, pos, slots = [], [], []
        for i, (seq, n) in enumerate(zip(self.seqs, new)):
            for p in range(len(seq) - n, len(seq)):
                ids.append(seq[p])
                pos.append(p)
                slots.append(self.tables[i][p // BLOCK] * BLOCK + p % BLOCK)
        kv = PagedKV(
            self.caches, torch.tensor(slots), torch.tensor(self.tables), list(new),
            [len(s) for s in self.seqs],
        )  # fmt: skip
        m = self.model
        for moe in m.moe_layers():
            moe.dispatcher.load = self.loads[moe]
            moe.dispatcher.stats = self.stats
        fused = None
        if self.cpu_decode is not None:
            fused = self.cpu_decode.layers(torch.empty(0, m.config.hidden_size), kv)
        if fused is not None:
            self.fused_steps += 1
        with torch.inference_mode():
            hidden = m.forward_tokens(torch.tensor(ids), torch.tensor(pos), kv=kv, fused=fused)
        return hidden


class PythonMoE(LocalDispatcher):
    """A dispatcher the fused layers do not take as local (as an expert-parallel one): its MoE
    blocks run in Python between the compiled attention halves."""


@pytest.fixture(params=["whole layers", "MoE blocks in Python"])
def dispatch(request, model):
    if request.param == "whole layers":
        yield request.param
        return
    saved = [moe.dispatcher for moe in model.moe_layers()]
    for moe in model.moe_layers():
        moe.dispatcher = PythonMoE(moe.experts.expert_ids, model.config.n_routed_experts)
    yield request.param
    for moe, dispatcher in zip(model.moe_layers(), saved):
        moe.dispatcher = dispatcher


def test_fused_layers_equal_the_python_layers_bit_for_bit(model, dispatch):
    c = model.config
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, c.vocab_size, (n,), generator=gen).tolist() for n in (6, 1, 70)]
    runs = {fused: Run(model, prompts, fused) for fused in (True, False)}
    # the prompts whole (a 70-token prefill: the Python layers), then a 3-token chunk beside
    # decode tokens (every query absorbed: fused), then decode steps
    new = [len(p) for p in prompts]
    for step in range(9):
        hidden = {fused: run.step(new) for fused, run in runs.items()}
        assert torch.equal(hidden[True], hidden[False]), step
        for a, b in zip(runs[True].caches, runs[False].caches):
            assert torch.equal(a, b), step
        for moe in model.moe_layers():
            assert torch.equal(runs[True].loads[moe].peek(), runs[False].loads[moe].peek()), step
        assert runs[True].stats.rows == runs[False].stats.rows
        last = torch.tensor(new).cumsum(0) - 1
        nxt = model.compute_logits(hidden[True][last]).argmax(-1).tolist()
        new = [3, 1, 1] if step == 0 else [1, 1, 1]
        for run in runs.values():
            for seq, token in zip(run.seqs, nxt):
                seq.append(token)
            if step == 0:
                run.seqs[0] += [7, 8]
    assert runs[True].fused_steps == 8 and runs[False].fused_steps == 0
    whole = [layer.whole for layer in runs[True].cpu_decode.built.layers]
    num_dense = c.num_hidden_layers - len(model.moe_layers())
    assert whole == [True] * num_dense + [dispatch == "whole layers"] * len(model.moe_layers())
    assert runs[True].stats.rows == runs[False].stats.rows > 0
    total = sum(int(load.peek().sum()) for load in runs[True].loads.values())
    # every token of every step routed top-k times in each MoE layer
    tokens = sum(len(p) for p in prompts) + 5 + 3 * 7
    assert total == tokens * c.num_experts_per_tok * len(model.moe_layers())


def test_steps_the_fused_layers_leave_to_the_python_layers(model, monkeypatch):
    fused = CpuDecode(model)
    x = torch.empty(1, model.config.hidden_size)
    tables = torch.arange(16).view(2, 8)
    decode = PagedKV([], torch.tensor([3, 40]), tables, [1, 1], [4, 9])
    long_chunk = PagedKV([], torch.arange(65), tables[:1], [65], [65])
    assert fused.layers(x, decode) is not None
    assert fused.layers(x, long_chunk) is None  # a 65-token chunk takes the expanded path
    assert fused.layers(x, None) is None  # no cache: whole sequences
    assert fused.layers(x.double(), decode) is None
    monkeypatch.setenv("EPCLUSTER_KERNELS", "reference")
    assert fused.layers(x, decode) is None
    monkeypatch.delenv("EPCLUSTER_KERNELS")
    assert fused.layers(x, decode) is not None


def test_new_expert_weights_are_picked_up(model):
    """The balancer swaps in new expert storage (moe/replacement.py): the fused layers are
    built again, and decode with the new weights as the Python layers do."""
    c = model.config
    prompts = [[3, 9, 27, 81 % c.vocab_size]]
    runs = {fused: Run(model, prompts, fused) for fused in (True, False)}
    for run in runs.values():
        run.step([4])
    before = runs[True].cpu_decode.built
    experts = model.moe_layers()[0].experts
    old = experts.w13.data
    experts.w13.data = old.flip(0).contiguous()  # other experts' weights in every slot
    try:
        for run in runs.values():
            run.seqs[0].append(5)
        hidden = {fused: run.step([1]) for fused, run in runs.items()}
        assert runs[True].cpu_decode.built is not before
        assert torch.equal(hidden[True], hidden[False])
    finally:
        experts.w13.data = old
