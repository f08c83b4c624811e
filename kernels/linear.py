"""Dense projections y = x @ W.T, with the fastest CPU path for the number of rows.

Measured on this class of machine (2 cores, AVX2; `python -m bench.linear`): MKL's F.linear reads
W at 7-16 GB/s for a few rows (it packs W on every call, and its matrix-vector product tops out
near 16 GB/s); W @ x.T (W as the left operand, in place) at 20-37 GB/s for 2-8 rows; a small
AVX2 kernel (kernels/cpu_gemm.cpp, compiled on first use by torch's cpp_extension) at 25-35 GB/s
for one row and about 1.5x W @ x.T for 9-12 rows; for many rows (prefill) F.linear is fastest.
Results agree with F.linear up to float rounding (the order of the sums differs).

Legend (kernels/__init__.py): N rows, K in features, M out features.
"""

import functools
import hashlib
import logging
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger(__name__)

KERNEL_ROWS = (1, 9, 10, 11, 12)  # these row counts: the AVX2 kernel (bench.linear)
SMALL_ROWS = 32  # up to this many rows: W @ x.T


@functools.cache
def cpu_kernel():
    """The compiled AVX2 kernel module, or None (no AVX2, EPCLUSTER_CPU_KERNEL=0, or it failed to
    build: the torch paths then serve, with a warning)."""
    if os.environ.get("EPCLUSTER_CPU_KERNEL", "1") == "0":
        return None
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        return None
    from torch.utils import cpp_extension

    # NOTE: the venv's bin first: a pip-installed ninja lives there, and torch looks on PATH.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    source = Path(__file__).with_name("cpu_gemm.cpp")
    # NOTE: the source's path and text in the name: each checkout gets a build of its own (torch
    # rebuilds a name whose source path changed, so two checkouts would rebuild over each other).
    digest = hashlib.sha256(str(source).encode() + source.read_bytes()).hexdigest()[:10]
    try:
        return cpp_extension.load(
            f"epcluster_cpu_gemm_{digest}",
            [str(source)],
            extra_cflags=["-O3", "-mavx2", "-mfma", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as e:  # no compiler, no headers: slower, still correct
        log.warning("the AVX2 CPU kernel did not build (%s): using torch's paths", e)
        return None


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [N, K] (or [..., K]), weight [M, K] -> [..., M]."""
    if x.device.type == "cpu" and x.dim() == 2 and 0 < x.shape[0] <= SMALL_ROWS:
        if (
            x.shape[0] in KERNEL_ROWS
            and x.dtype == weight.dtype == torch.float32
            and x.shape[1] % 8 == 0
            and weight.is_contiguous()
            and cpu_kernel() is not None
        ):
            return cpu_kernel().few_rows_linear(x.contiguous(), weight)
        return (weight @ x.T).T.contiguous()
    return F.linear(x, weight)


class Linear(nn.Linear):
    """nn.Linear (same parameters and state dict) whose forward uses `linear` (no bias)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.bias is None
        return linear(x, self.weight)
