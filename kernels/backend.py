"""Which implementation a kernel call runs: the plain-torch reference, the Triton kernel, or the
compiled CPU kernel (kernels/cpu/build.py).

EPCLUSTER_KERNELS chooses, read at every call:
  auto (default)  Triton for CUDA tensors when triton imports; the compiled CPU kernel for fp32
                  CPU tensors when it built (EPCLUSTER_CPU_KERNEL=0 turns it off); else the
                  reference;
  reference       always the reference;
  triton          always Triton. CPU tensors then run in Triton's interpreter, which must be on
                  (TRITON_INTERPRET=1) before triton is first imported: tests/conftest.py does that
                  on machines without CUDA.

triton is optional: without it (macOS, minimal installs) `jit` leaves the kernels as plain
functions that nothing calls, and only the references run. Kernel modules use
`from __future__ import annotations` so that `tl.constexpr` annotations need no triton. A CUDA
machine whose triton does not import logs one warning saying so (the references serve its GPUs,
eagerly), and `serving_kernels` names what serves an engine: GetModelInfo.kernels and the ranks'
epcluster_kernels_info metric report it.
"""

import functools
import logging
import os
from collections.abc import Callable

import torch

from kernels.cpu.build import cpu_kernels, cpu_kernels_name

log = logging.getLogger(__name__)

try:
    import triton
    import triton.language as tl

    TRITON_ERROR = ""
except Exception as e:  # not installed, or broken (a missing driver library): the references
    triton = None
    tl = None
    TRITON_ERROR = f"{type(e).__name__}: {e}"

MODES = ("auto", "reference", "triton")
ENV_VAR = "EPCLUSTER_KERNELS"


def jit(fn: Callable) -> Callable:
    """triton.jit where triton imports; otherwise the function itself (never launched)."""
    return fn if triton is None else triton.jit(fn)


# NOTE: the mode is read at every kernel call (~100 a decode step), and os.environ.get costs
# ~0.7 us: its mapping's own dict, which every change to os.environ updates, takes ~0.05.
_ENVIRON = getattr(os.environ, "_data", None)
_KEY = os.environ.encodekey(ENV_VAR) if _ENVIRON is not None else None


def kernel_mode() -> str:
    if _ENVIRON is not None:
        raw = _ENVIRON.get(_KEY)
        mode = "auto" if raw is None else os.environ.decodevalue(raw)
    else:
        mode = os.environ.get(ENV_VAR, "auto")
    if mode not in MODES:
        raise ValueError(f"{ENV_VAR}={mode!r}: must be one of {MODES}")
    return mode


def interpreting() -> bool:
    """Whether triton was imported with its interpreter on (so kernels run on CPU tensors)."""
    if triton is None:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    # NOTE: the interpreter is chosen when triton's own library (tl.max ...) is decorated, at
    # import; reading TRITON_INTERPRET now could disagree with what happened then.
    return isinstance(tl.max, InterpretedFunction)


def use_triton(x: torch.Tensor) -> bool:
    """Whether an op on `x` (the tensor that decides its device) takes the Triton kernel."""
    mode = kernel_mode()
    if mode == "reference":
        return False
    if mode == "auto":
        if not x.is_cuda:
            return False
        if triton is None:
            warn_no_triton()
            return False
        return True
    if triton is None:
        raise RuntimeError(f"{ENV_VAR}=triton, but triton does not import")
    if not x.is_cuda and not interpreting():
        raise RuntimeError(
            f"{ENV_VAR}=triton on {x.device} tensors needs TRITON_INTERPRET=1 set before triton "
            "is imported"
        )
    return True


def use_cpu_kernel(x: torch.Tensor) -> bool:
    """Whether an op on `x` takes the compiled CPU kernel: fp32 on the CPU, in auto mode."""
    return (
        x.dtype == torch.float32
        and x.is_cpu
        and kernel_mode() == "auto"
        and cpu_kernels() is not None
    )


def dot_in_fp32(x: torch.Tensor, choice: bool | None = None) -> bool:
    """The FP32_DOT constexpr of a Triton kernel over `x`: the caller's choice (each wrapper's
    `fp32_dot` argument, which the tests set to run every branch), else the production default:
    fp32 data casts its tiles to fp32 and multiplies in IEEE precision (not TF32), bf16/fp16 data
    multiplies its tiles on the tensor cores, and in the interpreter (non-CUDA tensors) every
    dtype takes fp32, since the interpreter's tl.dot multiplies bf16 tiles' raw bits."""
    if choice is None:
        return x.dtype == torch.float32 or not x.is_cuda
    # NOTE: fp32 tiles into the tensor-core dot would run in TF32, a branch nothing wants or tests.
    assert choice or x.dtype != torch.float32, "fp32 data takes the fp32 (IEEE) dot"
    return choice


@functools.cache
def warn_no_triton() -> None:
    """Once per process: CUDA tensors take the torch references, not the Triton kernels."""
    log.warning(
        "triton does not import (%s): CUDA tensors take the torch reference kernels instead of "
        "Triton (slower; and decode steps run eagerly, without CUDA graphs)",
        TRITON_ERROR or "not installed",
    )


def serving_kernels(device: torch.device | str, dtype: torch.dtype) -> str:
    """Which kernels serve a model on `device` in `dtype`: "triton" (CUDA tensors, or forced),
    "triton-interpreter" (forced on CPU tensors), "cpu-avx512" / "cpu-avx2" (the compiled CPU
    kernels: fp32 on the CPU) or "reference" (the torch references). Where a fallback serves,
    its one warning is logged (warn_no_triton, or kernels/cpu/build.py's)."""
    device = torch.device(device)
    mode = kernel_mode()
    if mode == "reference":
        return "reference"
    if mode == "triton":
        if triton is None:
            raise RuntimeError(f"{ENV_VAR}=triton, but triton does not import ({TRITON_ERROR})")
        return "triton" if device.type == "cuda" else "triton-interpreter"
    if device.type == "cuda":
        if triton is None:
            warn_no_triton()
            return "reference"
        return "triton"
    if device.type == "cpu" and dtype == torch.float32:
        return cpu_kernels_name()
    return "reference"
