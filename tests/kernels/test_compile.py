"""Every branch of every Triton kernel compiles for an H100 (sm_90) ahead of time, on a machine
without a GPU.

This catches what the interpreter lets through: a global that is not a constexpr, a type or a
tile shape that the lowering or tl.dot rejects. One test per branch: each combination of
constexprs a wrapper can launch (the grouped GEMM: gated or not x 16-bit or FP8 weights x the
dot branches of tests/kernels/branches.py over bf16, fp16 and fp32 data; the MLA split kernel:
those dot branches; the reduce: each output dtype; the gate: all 16 of grouped_topk_flags), at
the wrappers' default tiles for DeepSeek-V3's shapes. The compiler runs in one subprocess
without TRITON_INTERPRET (in the test process the kernels are interpreted functions).
"""

import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernels.gate import SCORING_FUNCS, TOPK_METHODS, grouped_topk_flags
from tests.kernels.branches import BRANCHES

triton = pytest.importorskip("triton", reason="the Triton kernels need the triton package")

REPO = Path(__file__).resolve().parents[2]
TRITON_TYPES = {"torch.float32": "fp32", "torch.bfloat16": "bf16", "torch.float16": "fp16"}
# (data type, FP32_DOT, the branch's name) per entry of BRANCHES
DOT_BRANCHES = [(TRITON_TYPES[str(p.values[0])], p.values[1], p.id) for p in BRANCHES]
MOE_PTRS = dict(block_slot_ptr="*i32", block_start_ptr="*i32", block_end_ptr="*i32")
MOE_TILES = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=64, SCALE_BLOCK=128)
MLA_TILES = dict(PAGE=64, BLOCK_H=16, BLOCK_T=16, BLOCK_R=512, BLOCK_P=64)
# A tensor-core instruction in the PTX (mma.sync, or wgmma on sm_90), with its input type
TENSOR_CORE_OP = re.compile(r"\b(?:wg)?mma\.[\w.]*?\.f32\.(bf16|f16|tf32|e4m3)\.")


def tensor_cores(data: str, fp32_dot: bool) -> str:
    """The input type of the tensor-core dots a branch compiles to (PTX's name), or none."""
    return "none" if fp32_dot else {"bf16": "bf16", "fp16": "f16"}[data]


def specs() -> dict[str, tuple[object, dict[str, str], dict[str, object], str]]:
    """id -> (kernel, pointer and float argument types, constexprs, tensor_cores()); other
    arguments are i32."""
    from kernels.gate import _grouped_topk_kernel
    from kernels.mla_attention import _mla_decode_reduce_kernel, _mla_decode_split_kernel
    from kernels.moe_mlp import _grouped_gemm_kernel

    out = {}
    for gated, fp8, (data, fp32_dot, branch) in itertools.product(
        (True, False), (False, True), DOT_BRANCHES
    ):
        # not FP8: the wrapper passes the weights as the (unread) scale pointer
        w = "*fp8e4nv" if fp8 else f"*{data}"
        types = dict(MOE_PTRS, a_ptr=f"*{data}", b_ptr=w, c_ptr=f"*{data}")
        types["scale_ptr"] = "*fp32" if fp8 else w
        flags = dict(MOE_TILES, GATED=gated, FP8=fp8, FP32_DOT=fp32_dot)
        name = f"grouped_gemm-{'gate_up' if gated else 'down'}-{'fp8' if fp8 else data}w-{branch}"
        out[name] = (_grouped_gemm_kernel, types, flags, tensor_cores(data, fp32_dot))
    for data, fp32_dot, branch in DOT_BRANCHES:
        types = dict(
            q_ptr=f"*{data}", cache_ptr=f"*{data}", table_ptr="*i64", lens_ptr="*i32",
            part_out_ptr="*fp32", part_lse_ptr="*fp32", scale_log2="fp32",
        )  # fmt: skip
        out[f"mla_split-{branch}"] = (
            _mla_decode_split_kernel, types, dict(MLA_TILES, FP32_DOT=fp32_dot),
            tensor_cores(data, fp32_dot),
        )  # fmt: skip
    for data in ("fp32", "bf16", "fp16"):
        types = dict(part_out_ptr="*fp32", part_lse_ptr="*fp32", out_ptr=f"*{data}")
        out[f"mla_reduce-{data}"] = (
            _mla_decode_reduce_kernel, types, dict(BLOCK_K=16, BLOCK_R=512), "none"
        )  # fmt: skip
    gate_types = dict(
        logits_ptr="*fp32", bias_ptr="*fp32", weights_ptr="*fp32", idx_ptr="*i64", scaling="fp32"
    )
    for scoring, method, n_group, norm in itertools.product(
        SCORING_FUNCS, TOPK_METHODS, (8, 1), (True, False)
    ):
        flags = grouped_topk_flags(scoring, method, n_group, norm)
        name = "grouped_topk-" + ("softmax" if flags["SOFTMAX"] else "sigmoid")
        name += "-noaux" * flags["BIAS"] + "-grouped" * flags["GROUPED"] + "-norm" * flags["NORM"]
        out[name] = (  # V3's 256 experts in 8 groups, top 8
            _grouped_topk_kernel, gate_types, dict(flags, BLOCK_E=256, BLOCK_G=8, BLOCK_K=8), "none"
        )  # fmt: skip
    return out


def compile_all(names: list[str]) -> None:
    """Prints `compiled NAME: TYPES` (the input types of its tensor-core instructions, or none)
    or `failed NAME: error` for each spec named, past any failure."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    all_specs = specs()
    for name in names:
        kernel, types, constexprs, _ = all_specs[name]
        signature = {
            arg: "constexpr" if arg in constexprs else types.get(arg, "i32")
            for arg in kernel.arg_names
        }
        try:
            source = ASTSource(kernel, signature, constexprs)
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={})
            assert compiled.asm.get("cubin"), "no cubin"
            found = sorted(set(TENSOR_CORE_OP.findall(compiled.asm["ptx"])))
        except Exception as error:  # reported per spec; the next one still compiles
            print(f"failed {name}: {type(error).__name__}: {error}".replace("\n", " "), flush=True)
        else:
            print(f"compiled {name}: {','.join(found) or 'none'}", flush=True)


@pytest.fixture(scope="module")
def compiled(request: pytest.FixtureRequest) -> tuple[dict[str, str], str]:
    """Compiles, in one subprocess, every spec that this session's tests ask for: (name ->
    "compiled: TYPES" or "failed: error", the subprocess's stderr)."""
    if "nvidia" not in triton.backends.backends:
        pytest.skip("this triton has no NVIDIA backend")
    names = [
        item.callspec.params["name"]
        for item in request.session.items
        if item.originalname == "test_compiles_for_sm90"
    ]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "tests.kernels.test_compile", *names],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=540,
    )
    results = {}
    for line in proc.stdout.splitlines():
        status, _, rest = line.partition(" ")
        name, _, detail = rest.partition(": ")
        results[name] = f"{status}: {detail}"
    return results, proc.stderr


@pytest.mark.slow
@pytest.mark.parametrize("name", list(specs()))
def test_compiles_for_sm90(name: str, compiled: tuple[dict[str, str], str]) -> None:
    """It compiles, and to the branch named: tensor-core instructions of the 16-bit type in a
    tensor-core branch, none in an IEEE one (a dot that fell back to TF32 or to FMAs shows)."""
    results, stderr = compiled
    assert name in results, stderr[-4000:]  # the subprocess died before this spec
    assert results[name] == f"compiled: {specs()[name][3]}", results[name]


def test_specs_cover_every_branch() -> None:
    """The grid holds every combination of branch constexprs that the wrappers can launch."""
    flags = lambda prefix, keys: {
        tuple(spec[2][k] for k in keys) for name, spec in specs().items() if name.startswith(prefix)
    }
    assert flags("grouped_gemm", ("GATED", "FP8", "FP32_DOT")) == set(
        itertools.product((True, False), repeat=3)
    )
    assert flags("mla_split", ("FP32_DOT",)) == {(True,), (False,)}
    gate_keys = ("SOFTMAX", "BIAS", "GROUPED", "TOP2", "NORM")
    # BIAS and TOP2 go together (noaux_tc): 2^4 combinations
    assert len(flags("grouped_topk", gate_keys)) == 16


if __name__ == "__main__":
    compile_all(sys.argv[1:])
