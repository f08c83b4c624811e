import os
import pathlib
import sys

import torch

# Local Ray clusters in tests stay on loopback (Ray reads this when first imported).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
# Without CUDA, Triton kernels run on CPU tensors in Triton's interpreter (tests/kernels), which
# must be on before triton is first imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
