"""The kernels compile for an H100 (sm_90) ahead of time, on a machine without a GPU.

This catches what the interpreter lets through: a global that is not a constexpr, a type or a
tile shape that the lowering or tl.dot rejects. The compiler runs in a subprocess without
TRITON_INTERPRET (in the test process the kernels are interpreted functions). The tiles are
the wrappers' defaults for DeepSeek-V3's shapes, in bf16 (and FP8 weights).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

triton = pytest.importorskip("triton", reason="the Triton kernels need the triton package")

REPO = Path(__file__).resolve().parents[2]
MOE_PTRS = dict(block_slot_ptr="*i32", block_start_ptr="*i32", block_end_ptr="*i32")
MOE_TILES = dict(FP32_DOT=False, BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SCALE_BLOCK=128)


def specs() -> list[tuple[object, dict[str, str], dict[str, object]]]:
    """(kernel, pointer and float argument types, constexprs); other arguments are i32."""
    from kernels.gate import _grouped_topk_kernel
    from kernels.mla_attention import _mla_decode_reduce_kernel, _mla_decode_split_kernel
    from kernels.moe_mlp import _grouped_gemm_kernel

    out = []
    for fp8 in (False, True):
        w = "*fp8e4nv" if fp8 else "*bf16"
        types = dict(MOE_PTRS, a_ptr="*bf16", b_ptr=w, scale_ptr="*fp32", c_ptr="*bf16")
        for gated in (True, False):
            out.append((_grouped_gemm_kernel, types, dict(MOE_TILES, GATED=gated, FP8=fp8)))
    split_types = dict(
        q_ptr="*bf16", cache_ptr="*bf16", table_ptr="*i64", lens_ptr="*i32",
        part_out_ptr="*fp32", part_lse_ptr="*fp32", scale_log2="fp32",
    )  # fmt: skip
    split_tiles = dict(PAGE=64, FP32_DOT=False, BLOCK_H=16, BLOCK_T=16, BLOCK_R=512, BLOCK_P=64)
    out.append((_mla_decode_split_kernel, split_types, split_tiles))
    reduce_types = dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr="*bf16")
    out.append((_mla_decode_reduce_kernel, reduce_types, dict(BLOCK_K=16, BLOCK_R=512)))
    gate_types = dict(
        logits_ptr="*fp32", bias_ptr="*fp32", weights_ptr="*fp32", idx_ptr="*i64", scaling="fp32"
    )
    for softmax in (False, True):  # V3 (sigmoid, noaux_tc) and V2 (softmax, group max)
        flags = dict(SOFTMAX=softmax, BIAS=not softmax, GROUPED=True, TOP2=not softmax, NORM=True)
        out.append(
            (_grouped_topk_kernel, gate_types, dict(flags, BLOCK_E=256, BLOCK_G=8, BLOCK_K=8))
        )
    return out


def compile_all() -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    for kernel, types, constexprs in specs():
        signature = {
            name: "constexpr" if name in constexprs else types.get(name, "i32")
            for name in kernel.arg_names
        }
        source = ASTSource(kernel, signature, constexprs)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={})
        assert compiled.asm.get("cubin"), kernel.__name__
        print("compiled", kernel.__name__, constexprs, flush=True)


@pytest.mark.slow
def test_kernels_compile_for_sm90():
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton has no NVIDIA backend")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.test_compile"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.count("compiled") == len(specs())


if __name__ == "__main__":
    compile_all()
