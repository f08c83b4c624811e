"""What a CUDA graph cannot hold, found on the CPU: every operation of a step that would wait
for the device or copy host data to it while `torch.cuda.graph` captures.

Under capture a host read (`.item()`, `.tolist()`, `bool(t)`, `.cpu()`) raises, a tensor built
from Python numbers or lists is a host-to-device copy that the graph would replay from freed
host memory, and an op whose output shape depends on the data (nonzero, boolean-mask indexing,
unique, bincount, masked_select, repeat_interleave without output_size) reads a count back. On
a GPU those fail at capture; this check names them on any machine, by watching a step run:

- a TorchDispatchMode sees every aten op: the data-dependent ones, `_local_scalar_dense` (what
  `bool`/`int`/`.item()` call), copies between devices, and collectives with split sizes from
  the host;
- patched Tensor methods see the host reads that a CPU tensor never dispatches (`.tolist()`,
  `.cpu()`, `.numpy()` are no-ops or pure C on the CPU) and the conversions (`__bool__`,
  `__int__`, `__float__`, `__index__`);
- wrapped factories (`torch.tensor`, `torch.as_tensor`, `torch.asarray`, `torch.from_numpy`,
  `Tensor.new_tensor`) see tensors built from host data: on a CPU engine the CPU is "the
  device", so every such tensor counts (on a GPU engine, those aimed at the step's device).

Ops issued by Triton's interpreter (its copies in and out of a kernel) are a kernel launch on a
GPU and are not reported. Each finding names the innermost frame of this repository.

Usage: `with CaptureCheck(device) as check: step()`, then `check.findings`.
"""

import functools
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()
STACK_DEPTH = 3  # repository frames kept per finding

aten = torch.ops.aten
# aten ops whose output shape depends on the data: the size is read back before allocating
_DATA_DEPENDENT = {
    aten.nonzero,
    aten.masked_select,
    aten.bincount,
    aten.unique_dim,
    aten.unique_consecutive,
    aten._unique,
    aten._unique2,
}
_HOST_READ_OPS = {aten._local_scalar_dense, aten.is_nonzero, aten.equal}
_INDEX_OPS = {aten.index, aten.index_put, aten.index_put_, aten._index_put_impl_}
_COPY_OPS = {aten._to_copy, aten.copy_}
# Tensor methods that read a tensor on the host, whether or not they dispatch an op
HOST_READ_METHODS = (
    "item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__",
)  # fmt: skip
FACTORIES = ("tensor", "as_tensor", "asarray", "from_numpy")
_MISSING = object()


@dataclass(frozen=True, slots=True)
class Finding:
    """One operation a captured step cannot hold."""

    kind: str  # "host read" | "host data" | "data-dependent shape" | "device copy" | ...
    op: str  # e.g. "Tensor.tolist", "torch.as_tensor", "aten.nonzero", "c10d.alltoall_base_"
    where: str  # "path:line (function)" of the innermost repository frame, "?" if none
    stack: tuple[str, ...]  # up to STACK_DEPTH repository frames, innermost first

    @property
    def key(self) -> str:
        """op and place without the line number (what docs can name and edits keep)."""
        path, _, rest = self.where.partition(":")
        return f"{self.op} at {path} {rest.partition(' ')[2]}".strip()

    def __str__(self) -> str:
        return f"{self.kind}: {self.op} at {' <- '.join(self.stack) or self.where}"


def _is_tensor(data: Any) -> bool:
    return isinstance(data, torch.Tensor)


class CaptureCheck(TorchDispatchMode):
    """Records, on the thread that enters it, what a CUDA graph capture of the code run inside
    would fail on (the module docstring). `device`: the step's device."""

    def __init__(self, device: torch.device | str) -> None:
        super().__init__()
        self.device = torch.device(device)
        self.findings: list[Finding] = []
        self._thread = 0
        self._inside = 0  # >0 while a patched method or factory runs: its inner ops are its own
        # (owner, name) -> what owner.__dict__ held there (_MISSING: it inherited the name)
        self._saved: dict[tuple[Any, str], Any] = {}

    # ---- entering and leaving ----

    def __enter__(self) -> "CaptureCheck":
        self._thread = threading.get_ident()
        for name in HOST_READ_METHODS:
            self._patch(torch.Tensor, name, self._host_read(name))
        for name in FACTORIES:
            self._patch(torch, name, self._factory(f"torch.{name}", getattr(torch, name)))
        self._patch(
            torch.Tensor, "new_tensor", self._factory("Tensor.new_tensor", torch.Tensor.new_tensor)
        )
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        try:
            super().__exit__(*exc)
        finally:
            for (owner, name), held in self._saved.items():
                if held is _MISSING:
                    delattr(owner, name)
                else:
                    setattr(owner, name, held)
            self._saved.clear()

    def _patch(self, owner: Any, name: str, fn: Callable) -> None:
        self._saved[owner, name] = vars(owner).get(name, _MISSING)
        setattr(owner, name, fn)

    # ---- the three watchers ----

    def _host_read(self, name: str) -> Callable:
        original = getattr(torch.Tensor, name)
        check = self

        @functools.wraps(original)
        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() != check._thread or check._inside:
                return original(tensor, *args, **kwargs)
            check._record("host read", f"Tensor.{name}")
            check._inside += 1
            try:
                return original(tensor, *args, **kwargs)
            finally:
                check._inside -= 1

        return read

    def _factory(self, op: str, original: Callable) -> Callable:
        check = self

        @functools.wraps(original)
        def build(*args: Any, **kwargs: Any) -> Any:
            data = args[1] if op == "Tensor.new_tensor" else args[0] if args else None
            if threading.get_ident() != check._thread or check._inside or _is_tensor(data):
                return original(*args, **kwargs)  # from a tensor: a copy, if any, dispatches
            check._inside += 1
            try:
                out = original(*args, **kwargs)
            finally:
                check._inside -= 1
            if out.device.type == check.device.type:
                check._record("host data", op)
            return out

        return build

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None
    ) -> Any:
        kwargs = kwargs or {}
        if not self._inside:
            kind = self._classify(func, args, kwargs)
            if kind is not None:
                self._record(kind, f"{func.namespace}.{func.overloadpacket.__name__}")
        return func(*args, **kwargs)

    def _classify(self, func: Any, args: tuple, kwargs: dict) -> str | None:
        """The kind of finding an aten call is, or None for one a graph can hold."""
        packet = func.overloadpacket
        if packet in _HOST_READ_OPS:
            return "host read"
        if packet in _DATA_DEPENDENT:
            return "data-dependent shape"
        if packet is aten.repeat_interleave:
            # NOTE: int repeats, or output_size given: the length is known without a read back
            tensor_repeats = func._overloadname in ("Tensor", "self_Tensor")
            return (
                "data-dependent shape"
                if tensor_repeats and kwargs.get("output_size") is None
                else None
            )
        if packet in _INDEX_OPS:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices):
                return "boolean mask"
            return None
        if packet in _COPY_OPS:
            return "device copy" if _crosses_devices(packet, args, kwargs) else None
        if func.namespace == "c10d" and any(
            isinstance(a, list) and a and all(isinstance(v, int) for v in a) for a in args
        ):
            return "host-sized collective"
        return None

    # ---- where ----

    def _record(self, kind: str, op: str) -> None:
        frames = _repo_frames(sys._getframe(1))
        if frames is None:  # inside a Triton kernel launch (the interpreter's own copies)
            return
        self.findings.append(Finding(kind, op, frames[0] if frames else "?", tuple(frames)))


def _crosses_devices(packet: Any, args: tuple, kwargs: dict) -> bool:
    """A copy between the host and a device (never true on a CPU-only machine)."""
    if packet is aten.copy_:
        return args[0].device.type != args[1].device.type
    device = kwargs.get("device")
    return device is not None and torch.device(device).type != args[0].device.type


def _triton_dir() -> str | None:
    """Where triton's modules are, as their frames name them (None: not imported)."""
    module = sys.modules.get("triton")
    file = getattr(module, "__file__", None)
    return str(Path(file).parent) if file else None


@functools.cache
def _repo_path(filename: str) -> str | None:
    """filename relative to the repository, or None outside it (the venv counts as outside)."""
    path = Path(filename)
    if not path.is_absolute():
        return None
    path = path.resolve()
    if path == HERE or not path.is_relative_to(REPO):
        return None
    rel = path.relative_to(REPO)
    return None if rel.parts[0].startswith(".") else str(rel)


def _repo_frames(frame: FrameType | None) -> list[str] | None:
    """The repository's frames from `frame` outwards ("path:line (function)", innermost first,
    at most STACK_DEPTH), or None when the call comes from inside Triton (a kernel launch)."""
    triton_dir, out = _triton_dir(), []
    while frame is not None:
        filename = frame.f_code.co_filename
        if triton_dir is not None and filename.startswith(triton_dir):
            return None
        rel = _repo_path(filename)
        if rel is not None and len(out) < STACK_DEPTH:
            out.append(f"{rel}:{frame.f_lineno} ({frame.f_code.co_name})")
        frame = frame.f_back
    return out
