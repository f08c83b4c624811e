"""The compiled CPU kernels (the sources beside this file, kernels/cpu/__init__.py lists them):
fp32, for the widest vectors the CPU has. `pip install` builds them (setup.py; kernels/cpu/
prebuilt.py names and finds that module); where the install built none for this CPU and these
sources (an editable checkout whose C++ changed, another vector width), torch's cpp_extension
builds them on first use, one extension module per checkout and CPU kind, and a warning says so
(EPCLUSTER_CPU_KERNEL_JIT=0 makes that build an error: a start that must not compile).

They exist because torch's CPU paths leave most of this machine unused at decode sizes: MKL
packs every weight matrix on each call (5-16 GB/s for a few rows, where the machine reads ~45),
multiplies with 256-bit vectors on AMD CPUs that run 512-bit FMAs at twice the rate, and a
Python loop over experts or a gather of the cache into padded tensors adds an op per piece.
Measured side by side by `python -m bench.linear` (per path and row count) and in the decode
step by bench/decode_speed.py and bench/step_profile.py. Without a compiler or AVX2, or with
EPCLUSTER_CPU_KERNEL=0, the torch paths serve: one warning says so and why (not for the
variable, which asks for it), and cpu_kernels_name / kernels.backend.serving_kernels report it.
"""

import functools
import hashlib
import logging
import os
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

from kernels.cpu.prebuilt import FLAGS, HEADERS, HERE, LDFLAGS, SOURCES, load_prebuilt

log = logging.getLogger(__name__)

ENV_VAR = "EPCLUSTER_CPU_KERNEL"
JIT_ENV_VAR = "EPCLUSTER_CPU_KERNEL_JIT"
STALE_LOCK_S = 300.0  # a build lock older than this was left by a process killed mid-build


@functools.cache
def cpu_kernels() -> ModuleType | None:
    """The compiled module: the install's (kernels/cpu/prebuilt.py), else built now; or None
    (no AVX2, EPCLUSTER_CPU_KERNEL=0, or the build failed)."""
    if os.environ.get(ENV_VAR, "1") == "0":
        return None
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in FLAGS:
        log.warning(
            "this CPU's vectors are %s, and the compiled CPU kernels need AVX2 or AVX-512: fp32 "
            "CPU tensors take torch's reference paths (slower, the same results up to rounding)",
            capability,
        )
        return None
    module, why = load_prebuilt(capability, torch.__version__)
    if module is not None:
        log.info("CPU kernels (%s): %s", capability, why)
        return module
    if os.environ.get(JIT_ENV_VAR, "1") == "0":
        raise RuntimeError(f"the CPU kernels need a build ({why}), and {JIT_ENV_VAR}=0")
    log.warning("CPU kernels (%s): %s: building them now (50-90 s, once)", capability, why)
    from torch.utils import cpp_extension

    # NOTE: the venv's bin first: a pip-installed ninja lives there, and torch looks on PATH.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    # NOTE: the sources' paths and text and the vector width in the name: each checkout and
    # each CPU kind gets a build of its own (torch rebuilds a name whose sources changed, so two
    # checkouts would rebuild over each other, and an AVX-512 build must not run elsewhere).
    digest = hashlib.sha256(capability.encode())
    for name in SOURCES + HEADERS:
        digest.update(str(HERE / name).encode() + (HERE / name).read_bytes())
    name = f"epcluster_cpu_kernels_{digest.hexdigest()[:10]}"
    clear_stale_lock(Path(cpp_extension._get_build_directory(name, verbose=False)))
    try:
        return cpp_extension.load(
            name,
            [str(HERE / name) for name in SOURCES],
            extra_cflags=FLAGS[capability],
            extra_ldflags=LDFLAGS,
        )
    except Exception as e:  # no compiler, no headers: slower, still correct
        log.warning(
            "the compiled CPU kernels did not build (%s): fp32 CPU tensors take torch's "
            "reference paths (slower, the same results up to rounding)",
            e,
        )
        return None


def cpu_kernels_name() -> str:
    """What serves fp32 CPU tensors: "cpu-avx512" or "cpu-avx2" (the build for this CPU's
    vectors), or "reference" when the compiled kernels are off or did not build."""
    if cpu_kernels() is None:
        return "reference"
    return f"cpu-{torch.backends.cpu.get_cpu_capability().lower()}"


def clear_stale_lock(build_dir: Path, max_age_s: float = STALE_LOCK_S) -> bool:
    """Remove torch's build lock in `build_dir` when it is older than `max_age_s` (a build takes
    20-60 s). NOTE: torch's FileBaton waits forever for the lock to go, and a process killed
    mid-build (a stalled rank, Ctrl-C) leaves it behind: every later process would hang."""
    lock = build_dir / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age < max_age_s:
        return False
    log.warning("removing a stale CPU kernel build lock (%s, %.0f s old)", lock, age)
    lock.unlink(missing_ok=True)
    return True
