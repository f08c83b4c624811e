"""This machine, measured: read bandwidth (a sum over 256 MiB of fp32), the fp32 peak (a 1536^3
matmul) and the all-to-all bandwidth between 2 local processes over gloo (what the CPU cluster's
EP pools use), in a few seconds, cached in <cache>/probe.json (EPCLUSTER_CACHE, else
~/.cache/epcluster). The numbers are what kernels reach, so the CPU entry's efficiency is 1.
"""

import json
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import torch

from cluster.plan.hardware import CATALOG, Efficiency, Hardware

ALL_TO_ALL_BYTES = 16 * 2**20  # per rank per exchange


def cache_file() -> Path:
    from moe.presets import cache_root

    return cache_root() / "probe.json"


def _best(fn: Callable[[], object], repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def read_bandwidth() -> float:
    x = torch.ones(2**26)  # 256 MiB
    return x.numel() * 4 / _best(lambda: x.sum())


def fp32_peak(n: int = 1536) -> float:
    a, b = torch.randn(n, n), torch.randn(n, n)
    return 2 * n**3 / _best(lambda: a @ b, repeats=3)


def _all_to_all_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.ones(ALL_TO_ALL_BYTES // 4)
    y = torch.empty_like(x)
    seconds = _best(lambda: dist.all_to_all_single(y, x))
    if rank == 0:
        # half of each rank's buffer crosses to the other process
        Path(out).write_text(json.dumps(ALL_TO_ALL_BYTES / 2 / seconds))
    dist.destroy_process_group()


def all_to_all_bandwidth() -> float:
    """Bytes/s one rank sends to the other in a gloo all_to_all_single on this machine."""
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bw.json")
        mp.spawn(_all_to_all_worker, args=(port, out), nprocs=2, join=True)
        return float(json.loads(Path(out).read_text()))


def measure() -> dict[str, float]:
    threads = torch.get_num_threads()
    return {
        "read_bw": read_bandwidth(),
        "fp32_flops": fp32_peak(),
        "all_to_all_bw": all_to_all_bandwidth(),
        "threads": threads,
        "date": time.time(),
    }


def probe(refresh: bool = False) -> dict[str, float]:
    """The cached measurement, taken now if there is none (or `refresh`)."""
    path = cache_file()
    if not refresh and path.exists():
        return json.loads(path.read_text())
    result = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    return result


def cpu_hardware(refresh: bool = False, share: float = 1.0) -> Hardware:
    """This machine as one rank's device; `share` (0, 1]: the part of its cores and memory
    bandwidth one rank gets when several ranks run on it at once (e.g. cores / ranks)."""
    import psutil

    if not 0 < share <= 1:
        raise ValueError(f"share must be in (0, 1] (got {share})")
    m = probe(refresh)
    flops = m["fp32_flops"] * share
    return Hardware(
        name="cpu",
        memory_bytes=float(psutil.virtual_memory().total) * share,
        memory_bw=m["read_bw"] * share,
        flops={"fp32": flops, "bf16": flops, "fp8": flops},  # no faster low-precision path
        intra_node_bw=m["all_to_all_bw"],
        inter_node_bw=m["all_to_all_bw"],
        price_per_hour=0.0,
        sources={"all": f"measured by cluster/plan/probe.py ({int(m['threads'])} threads), "
                 f"cached in {cache_file()}"},
        efficiency=Efficiency(1.0, 1.0, 1.0),
    )  # fmt: skip


def get_hardware(name: str) -> Hardware:
    """A catalog entry, or `cpu` (this machine, measured by probe.py, cached)."""
    if name.lower() == "cpu":
        return cpu_hardware()
    try:
        return CATALOG[name.upper()]
    except KeyError:
        raise ValueError(f"gpu {name!r}: one of {[*CATALOG, 'cpu']}") from None
