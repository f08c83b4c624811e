"""The compiled CPU kernels (kernels/cpu/*.cpp) as an extension module of the package, so that
`pip install` builds them once and no rank compiles at start or in a re-form (the rest of the
build is in pyproject.toml).

torch must be importable at build time: `pip install --no-build-isolation` after torch, as the
Makefile does. Built for this machine's widest vectors (torch's CPU capability: AVX-512 or
AVX2) under the name kernels/cpu/prebuilt.py gives it; `pip install -e` builds it in place.
Without torch at build time (an isolated build) or without AVX2, no module is built and the
runtime builds the kernels on first use (kernels/cpu/build.py), as before.
"""

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from setuptools import setup

HERE = Path(__file__).resolve().parent


def load_prebuilt_module() -> ModuleType:
    """kernels/cpu/prebuilt.py by its path: the package is not importable while it builds."""
    spec = importlib.util.spec_from_file_location("prebuilt", HERE / "kernels/cpu/prebuilt.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def cpu_kernel_build() -> dict[str, object]:
    """setup()'s ext_modules and cmdclass for the CPU kernels; empty where they cannot build."""
    try:
        import torch
        from torch.utils.cpp_extension import BuildExtension, CppExtension
    except ImportError:
        print(
            "setup.py: no torch at build time (an isolated build): the CPU kernels will be "
            "built on first use; `pip install --no-build-isolation` after torch builds them now",
            file=sys.stderr,
        )
        return {}
    prebuilt = load_prebuilt_module()
    capability = torch.backends.cpu.get_cpu_capability()
    if capability not in prebuilt.FLAGS:
        print(f"setup.py: no CPU kernels for {capability} (they need AVX2)", file=sys.stderr)
        return {}
    name = prebuilt.module_name(capability, torch.__version__)
    # NOTE: torch looks for ninja on PATH, and a pip-installed one sits beside this Python.
    os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"

    class BuildCpuKernels(BuildExtension):
        def run(self) -> None:
            super().run()
            if self.inplace:  # editable: each source change is a new name; drop the old ones
                built = Path(self.get_ext_fullpath(f"{prebuilt.PACKAGE}.{name}")).resolve()
                for old in built.parent.glob(f"{prebuilt.PREFIX}*"):
                    if old != built:
                        old.unlink()

    extension = CppExtension(
        f"{prebuilt.PACKAGE}.{name}",
        [f"kernels/cpu/{source}" for source in prebuilt.SOURCES],
        extra_compile_args=prebuilt.FLAGS[capability],
        extra_link_args=prebuilt.LDFLAGS,
    )
    return {"ext_modules": [extension], "cmdclass": {"build_ext": BuildCpuKernels}}


if __name__ == "__main__":  # as setuptools runs it; tests import cpu_kernel_build
    setup(**cpu_kernel_build())
