"""The reference/Triton switch and the public ops' dispatch through it."""

from types import SimpleNamespace

import pytest
import torch

from kernels import backend, gate, mla_attention, moe_mlp
from kernels.backend import ENV_VAR, dot_in_fp32, use_triton
from kernels.fp8 import quantize_block_fp8


def test_modes(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.setenv(ENV_VAR, "reference")
    assert not use_triton(cpu)
    monkeypatch.setenv(ENV_VAR, "auto")
    assert not use_triton(cpu)  # auto takes Triton on CUDA tensors only
    monkeypatch.delenv(ENV_VAR)
    assert not use_triton(cpu)  # auto is the default
    monkeypatch.setenv(ENV_VAR, "fast")
    with pytest.raises(ValueError, match="fast"):
        use_triton(cpu)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
@pytest.mark.skipif(backend.triton is None, reason="the Triton kernels need the triton package")
def test_forced_triton_runs_cpu_tensors_in_the_interpreter(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "triton")
    assert backend.interpreting()  # tests/conftest.py turned it on before triton was imported
    assert use_triton(torch.zeros(1))


def test_dot_branch():
    """The Triton kernels' FP32_DOT: by default fp32 data always, bf16/fp16 data on the tensor
    cores on CUDA and in fp32 elsewhere (the interpreter); a caller's choice wins, but fp32 data
    never takes the tensor-core dot (TF32)."""
    cuda = lambda dtype: SimpleNamespace(dtype=dtype, is_cuda=True)  # no CUDA tensors here
    assert dot_in_fp32(cuda(torch.float32))
    assert not dot_in_fp32(cuda(torch.bfloat16)) and not dot_in_fp32(cuda(torch.float16))
    assert dot_in_fp32(cuda(torch.bfloat16), True)
    cpu_bf16 = torch.zeros(1, dtype=torch.bfloat16)
    assert dot_in_fp32(cpu_bf16) and not dot_in_fp32(cpu_bf16, False)
    assert dot_in_fp32(torch.zeros(1), True)
    with pytest.raises(AssertionError, match="IEEE"):
        dot_in_fp32(torch.zeros(1), False)


def ops():
    """(module, name of the reference, name of the Triton wrapper, a call of the public op)."""
    gen = torch.Generator().manual_seed(0)
    x, w13, w2 = torch.randn(3, 16, generator=gen), torch.randn(2, 32, 16), torch.randn(2, 16, 16)
    q, cache = torch.randn(2, 2, 24, generator=gen), torch.randn(4, 4, 24, generator=gen)
    tables, lens = torch.tensor([[1, 2], [3, 0]]), torch.tensor([6, 2])
    logits = torch.randn(3, 8, generator=gen)
    w13_q, w13_s = zip(*(quantize_block_fp8(w) for w in w13.view(4, 16, 16)))
    w13_q, w13_s = torch.stack(w13_q).view(2, 32, 16), torch.stack(w13_s).view(2, 2, 1)
    w2_q, w2_s = (torch.stack(t) for t in zip(*(quantize_block_fp8(w) for w in w2)))
    return [
        (
            moe_mlp,
            "grouped_expert_mlp_ref",
            "grouped_expert_mlp_triton",
            lambda: moe_mlp.grouped_expert_mlp(x, [1, 2], w13, w2),
        ),
        (
            moe_mlp,
            "dequantize_experts",  # off Triton: dequantized per call, then the MLP
            "grouped_expert_mlp_triton",
            lambda: moe_mlp.grouped_expert_mlp_fp8(x, [1, 2], w13_q, w13_s, w2_q, w2_s),
        ),
        (
            mla_attention,
            "paged_latent_attention_ref",
            "paged_latent_attention_triton",
            lambda: mla_attention.paged_latent_attention(q, cache, tables, lens, 0.2, 16),
        ),
        (
            gate,
            "grouped_topk_ref",
            "grouped_topk_triton",
            lambda: gate.grouped_topk(
                logits, 2, "softmax", "group_limited_greedy", 4, 2, True, 1.0
            ),
        ),
    ]


def spy(fn, name: str, calls: list[str]):
    def wrapped(*args):
        calls.append(name)
        return fn(*args)

    return wrapped


@pytest.mark.parametrize("op", range(4))
@pytest.mark.parametrize("mode", ["reference", "triton", "auto"])
def test_dispatch(op, mode, monkeypatch):
    """Each public op calls exactly the implementation the switch names (auto on CPU tensors: the
    compiled CPU kernel for the fp32 ops (all but the FP8 expert MLP) when it built, else the
    reference), and returns what the reference returns."""
    if mode == "triton" and not backend.interpreting():
        pytest.skip("forcing Triton on these CPU tensors needs triton's interpreter")
    module, ref_name, triton_name, call = ops()[op]
    monkeypatch.setenv(ENV_VAR, "reference")
    expected = call()
    calls = []
    for name in (ref_name, triton_name):
        monkeypatch.setattr(module, name, spy(getattr(module, name), name, calls))
    monkeypatch.setenv(ENV_VAR, mode)
    out = call()
    compiled = mode == "auto" and op != 1 and backend.use_cpu_kernel(torch.zeros(1))
    assert calls == ([] if compiled else [triton_name if mode == "triton" else ref_name])
    if isinstance(out, tuple):  # the gate: same experts per row, in whichever order
        (w, i), (ref_w, ref_i) = out, expected
        i, order = i.sort(1)
        ref_i, ref_order = ref_i.sort(1)
        out, expected = w.gather(1, order), ref_w.gather(1, ref_order)
        assert torch.equal(i, ref_i)
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
