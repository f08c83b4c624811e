"""The compiled CPU kernels as `pip install` builds them (setup.py, beside pyproject.toml): one
extension module in this folder, named by the vector width it was built for and a hash of what
it was built from, `kernels.cpu._ext_<avx512|avx2>_<hash>`.

The name is the whole check, made before anything is loaded: the runtime asks for the module of
this CPU's vector width (torch's capability) and of the sources, flags and torch it sees now.
So an AVX-512 build is never imported on a CPU without AVX-512, and an editable checkout whose
C++ changed since `make install` (or a torch that changed under it) finds no module and falls
back to the JIT build (kernels/cpu/build.py). NOTE: a stale module must not be imported to be
checked: the JIT module defines the same pybind11 types, which cannot be registered twice in one
process.

Standard library only: setup.py loads this file by its path, before the package is installed.
"""

import hashlib
import importlib
import importlib.util
import logging
from pathlib import Path
from types import ModuleType

log = logging.getLogger(__name__)

HERE = Path(__file__).resolve().parent
PACKAGE = "kernels.cpu"
PREFIX = "_ext_"
SOURCES = (
    "gemm.cpp",
    "quantized.cpp",
    "attention.cpp",
    "ops.cpp",
    "decode_layer.cpp",
    "bindings.cpp",
)
HEADERS = ("simd.h", "kernels.h")
# NOTE: no -march=native: a build must depend only on the capability in its name.
FLAGS = {
    "AVX512": ["-O3", "-mavx512f", "-mavx2", "-mfma", "-fopenmp"],
    "AVX2": ["-O3", "-mavx2", "-mfma", "-fopenmp"],
}
LDFLAGS = ["-fopenmp"]


def sources_hash(capability: str, torch_version: str, folder: Path | None = None) -> str:
    """16 hex digits over the sources' names and bytes (in `folder`, default this one), the
    capability's flags and the torch version (an extension is tied to the torch it was compiled
    against)."""
    folder = folder or HERE
    digest = hashlib.sha256(f"{capability} {' '.join(FLAGS[capability])} {torch_version}".encode())
    for name in SOURCES + HEADERS:
        digest.update(name.encode() + b"\0" + (folder / name).read_bytes())
    return digest.hexdigest()[:16]


def module_name(capability: str, torch_version: str, folder: Path | None = None) -> str:
    """The module's last name component (what PYBIND11_MODULE is given: TORCH_EXTENSION_NAME)."""
    return f"{PREFIX}{capability.lower()}_{sources_hash(capability, torch_version, folder)}"


def load_prebuilt(capability: str, torch_version: str) -> tuple[ModuleType | None, str]:
    """(the installed module for this CPU's `capability` and the sources now, or None; why, in a
    line for the log)."""
    name = module_name(capability, torch_version)
    if importlib.util.find_spec(f"{PACKAGE}.{name}") is None:
        others = sorted(p.name.split(".")[0] for p in HERE.glob(f"{PREFIX}*.so"))
        if not others:
            return None, "no prebuilt module (the install built none: run `make install`)"
        return None, (
            f"the prebuilt {', '.join(others)} is not {name}: built for another vector width, "
            "other sources or another torch (an editable checkout changed since `make install`)"
        )
    try:
        module = importlib.import_module(f"{PACKAGE}.{name}")
    except ImportError as e:  # a broken file (a half-copied install): the JIT build still serves
        return None, f"the prebuilt {name} did not import ({e})"
    return module, f"prebuilt {name} ({module.__file__})"
