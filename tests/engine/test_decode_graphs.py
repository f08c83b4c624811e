"""The CUDA-graph decode path (engine/decode_graphs.py) without the capture, on CPU: the static
buffers, the batch-size buckets and their padding rows, and the load counted after each step,
against the plain engine, with engine/capture_check.py watching every step of the Triton path.
The capture itself needs a GPU (bench/kernels.py's machine)."""

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.capture_check import CaptureCheck, Finding
from engine.decode_graphs import batch_buckets
from moe.attention import PagedKV


def test_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 32]
    assert batch_buckets(40) == [1, 2, 4, 8, 16, 32, 40]


def test_the_option_needs_cuda():
    with pytest.raises(ValueError, match="cuda_graph: CUDA graphs need device cuda"):
        EngineConfig(model="tiny-random", cuda_graph=True)
    with pytest.raises(ValueError, match="cuda_graph_max_batch"):
        EngineConfig(model="tiny-random", cuda_graph_max_batch=0)


def test_decode_kv_reads_the_given_buffers():
    tables = torch.tensor([[3, 4], [5, 6], [7, 7]])
    lens = torch.tensor([5, 8, 1])
    slots = torch.tensor([12, 23, 28])
    kv = PagedKV.decode([], slots, tables, lens)
    plain = PagedKV([], slots, tables, [1, 1, 1], [5, 8, 1])
    assert kv.all_absorbed and plain.all_absorbed and kv.prefill_seqs == []
    assert torch.equal(kv.absorbed_tokens, plain.absorbed_tokens)
    assert torch.equal(kv.absorbed_lens, plain.absorbed_lens)
    assert torch.equal(kv.absorbed_tables, plain.absorbed_tables)
    lens[0] = 6  # a new value in the buffer is what the next step reads
    assert kv.absorbed_lens[0] == 6


def check_steps(graphs, device: str) -> list[Finding]:
    """Run every step of `graphs` under engine/capture_check.py's check -> the list its findings
    (what a CUDA graph of the step could not hold) go to."""
    findings, forward = [], graphs._forward

    def checked(bucket: int):
        with CaptureCheck(device) as check:
            out = forward(bucket)
        findings.extend(check.findings)
        return out

    graphs._forward = checked
    return findings


def loads(llm):
    return [m.dispatcher.load.peek().clone() for m in llm.engine.model.moe_layers()]


def rows(llm):
    return llm.engine.model.moe_layers()[0].dispatcher.stats.rows


@pytest.fixture(params=["auto", pytest.param("triton", marks=pytest.mark.slow)])
def kernels(request, monkeypatch):
    """auto: the compiled CPU kernels; triton: the Triton kernels, the path a GPU takes (the
    dispatch keeps its counts as a tensor, the grouped GEMM reads them): compiled on a GPU where
    there is one (forcing Triton on CPU tensors needs the interpreter, which tests/conftest.py
    turns on only without CUDA), else in Triton's interpreter."""
    monkeypatch.setenv("EPCLUSTER_KERNELS", request.param)
    return request.param


def test_static_decode_equals_the_plain_engine(kernels):
    gen = torch.Generator().manual_seed(4)
    # 5 requests with different output lengths: the decode batch shrinks 5 -> 1, through the
    # buckets 8, 4, 2, 1 (padding rows in most steps)
    prompts = [torch.randint(2, 500, (n,), generator=gen).tolist() for n in (9, 30, 4, 17, 50)]
    params = [
        SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (3, 14, 7, 10, 20)
    ]
    device = "cuda" if kernels == "triton" and torch.cuda.is_available() else "cpu"
    outs, engines = {}, {}
    for graphs in (True, False):
        llm = LLM(
            "tiny-random", block_size=4, max_num_batched_tokens=256, max_model_len=96, device=device
        )
        engine = llm.engine
        if graphs:
            engine.runner.enable_graphs(engine.max_model_len, capture=False)
            findings = check_steps(engine.runner.graphs, device)
        outs[graphs] = [o.token_ids for o in llm.generate(prompts, params)]
        engine.assert_no_leaks()
        engines[graphs] = llm
    assert outs[True] == outs[False]
    if kernels == "triton":  # the GPU's path: nothing in any step that a graph cannot hold
        assert findings == [], "\n".join(map(str, findings))
    g = engines[True].engine.runner.graphs
    # 19 decode steps (the longest output's 20 tokens, the first from the prefill step)
    assert g.num_replays == 19
    # decode steps 1-2 run 5 requests (bucket 8: 3 padding rows), 3-6 four, 7-9 three (bucket
    # 4: 1 row), 10-13 two, 14-19 one
    assert g.num_padding_rows == 2 * 3 + 3 * 1
    assert engines[False].engine.runner.graphs is None
    for a, b in zip(loads(engines[True]), loads(engines[False])):
        assert torch.equal(a, b)
    assert rows(engines[True]) == rows(engines[False])
    # the padding block is outside the block manager's and nobody's table
    cache = engines[True].engine.runner.kv_caches[0]
    assert cache.shape[0] == engines[True].engine.block_manager.num_blocks + 1
    assert g.pad_block == engines[True].engine.block_manager.num_blocks
