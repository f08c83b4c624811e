"""Weights on 2 MiB transparent huge pages (Linux): `collapse(tensors)`.

A decode step at batch 1 reads every weight it multiplies by from memory once (~300 MB a step
for `small`): it runs at the machine's read bandwidth. On 4 KiB pages that stream takes a TLB
miss every 4 KiB; on 2 MiB pages one every 2 MiB. Measured on the 2-core dev machine, two
engines in one process, one with its weights on huge pages, decode alternating between them
(bench/huge_pages.py): batch 32 1.026x tok/s (7 of 8 pairs faster), batch 1 0.98x and 1.03x in
two runs, within the machine's noise; a lone lm_head multiply at batch 1 ~8% faster.

Most distributions run THP in `madvise` mode (/sys/kernel/mm/transparent_hugepage/enabled):
only memory a process asks for gets huge pages, and torch's allocator does not ask (unless
THP_MEM_ALLOC_ENABLE=1 is set before its first allocation). `collapse` asks after the fact:
madvise(MADV_COLLAPSE) (Linux >= 6.1) moves the already-written pages of every 2 MiB-aligned
region a tensor touches into one huge page each, in place: addresses and contents stay, so
nothing that holds a pointer to the weights notices. It is best effort (a region the kernel
cannot collapse keeps its small pages) and a no-op where THP is off or the kernel predates
MADV_COLLAPSE. EPCLUSTER_HUGE_PAGES=0 turns it off.

NOTE: a region can reach past its tensor into a neighbouring allocation; collapsing that is
harmless (the neighbour's bytes stay where they are), and an unwritten page in it becomes
zero-filled memory, up to 2 MiB per region boundary.
"""

import ctypes
import errno
import logging
import mmap
import os
import sys
from collections.abc import Iterable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

MADV_HUGEPAGE = 14
MADV_COLLAPSE = 25
_THP = Path("/sys/kernel/mm/transparent_hugepage")
_state: dict = {}  # "libc", "size", "supported"


def enabled() -> bool:
    """Whether `collapse` acts: Linux with THP not `never`, and EPCLUSTER_HUGE_PAGES not 0."""
    if os.environ.get("EPCLUSTER_HUGE_PAGES", "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if not sys.platform.startswith("linux"):
        return False
    try:
        mode = (_THP / "enabled").read_text()
    except OSError:
        return False
    return "[never]" not in mode


def huge_page_size() -> int:
    if "size" not in _state:
        try:
            _state["size"] = int((_THP / "hpage_pmd_size").read_text())
        except (OSError, ValueError):
            _state["size"] = 2 << 20
    return _state["size"]


def regions(spans: Iterable[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """Byte spans (start, length) -> the size-aligned regions they touch, merged into runs of
    consecutive regions: [(start, length)], sorted."""
    starts = set()
    for start, length in spans:
        if length > 0:
            starts.update(range(start // size, (start + length - 1) // size + 1))
    runs: list[tuple[int, int]] = []
    for r in sorted(starts):
        if runs and runs[-1][0] + runs[-1][1] == r * size:
            runs[-1] = (runs[-1][0], runs[-1][1] + size)
        else:
            runs.append((r * size, size))
    return runs


def _madvise(start: int, length: int, advice: int = MADV_COLLAPSE) -> int:
    """madvise(start, length, advice) -> 0 or the errno."""
    libc = _state.get("libc")
    if libc is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        libc.madvise.restype = ctypes.c_int
        _state["libc"] = libc
    if libc.madvise(start, length, advice) == 0:
        return 0
    return ctypes.get_errno()


def supported() -> bool:
    """Whether this kernel takes MADV_COLLAPSE: tried once on a scratch mapping (EINVAL: a
    kernel before 6.1, or THP off)."""
    if "supported" not in _state:
        size = huge_page_size()
        scratch = mmap.mmap(-1, 2 * size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        scratch.write(b"\1" * len(scratch))
        view = ctypes.c_char.from_buffer(scratch)
        err = _madvise(-(-ctypes.addressof(view) // size) * size, size)
        del view
        scratch.close()
        _state["supported"] = err != errno.EINVAL
        if err == errno.EINVAL:
            log.info("huge pages: no madvise(MADV_COLLAPSE) here; weights keep 4 KiB pages")
    return _state["supported"]


def _runs(tensors: Iterable[torch.Tensor]) -> list[tuple[int, int]]:
    spans = []
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not t.is_meta:
            storage = t.untyped_storage()
            if storage.nbytes() > 0:
                spans.append((storage.data_ptr(), storage.nbytes()))
    return regions(spans, huge_page_size())


def advise(tensors: Iterable[torch.Tensor]) -> None:
    """Ask for huge pages for CPU tensors not written yet (torch.empty): their pages fault in
    huge (2 MiB zeroed at a time, no copy), where `collapse` copies written 4 KiB pages into
    huge ones (~0.4 GiB/s here). Pages already written keep their size."""
    if enabled():
        for start, length in _runs(tensors):
            _madvise(start, length, MADV_HUGEPAGE)


def collapse(tensors: Iterable[torch.Tensor]) -> int:
    """Back the CPU tensors' storage with huge pages, in place (best effort) -> bytes of the
    2 MiB regions they touch that are now on huge pages (about: see huge_bytes)."""
    if not enabled() or not supported():
        return 0
    runs = _runs(tensors)
    for start, length in runs:
        # NOTE: an error (ENOMEM: the run reaches past a mapping's end) still collapses every
        # region the kernel could: retrying the rest one by one finds the same regions refused
        _madvise(start, length)
    return huge_bytes(runs)


def huge_bytes(runs: list[tuple[int, int]]) -> int:
    """Bytes of the address ranges [(start, length)] that sit on huge pages (/proc/self/smaps),
    counted by whole mappings' AnonHugePages prorated to the ranges' overlap with them."""
    total = 0
    try:
        lines = Path("/proc/self/smaps").read_text().splitlines()
    except OSError:
        return 0
    lo = hi = 0
    for line in lines:
        head = line.split(maxsplit=1)[0] if line else ""
        if "-" in head and not head.endswith(":"):
            a, b = head.split("-")
            lo, hi = int(a, 16), int(b, 16)
        elif head == "AnonHugePages:" and hi > lo:
            huge = int(line.split()[1]) * 1024
            if huge:
                overlap = sum(max(0, min(hi, s + n) - max(lo, s)) for s, n in runs)
                total += min(huge, overlap) if overlap < hi - lo else huge
    return total
