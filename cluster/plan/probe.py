"""This machine, measured: read bandwidth (a sum over 256 MiB of fp32) and the fp32 peak (the
engine's own dense kernel, kernels/linear.py, on 64 rows of 1536 x 1536: the rows of a decode
batch or a short prefill; torch's matmul where the compiled kernels are not built), of one
single-threaded process (a rank's torch_threads) and summed over one
such process per core measuring at once (the machine's total for such ranks), and the all-to-all
bandwidth and the latency of one small exchange between 2 local processes over gloo (what the
CPU cluster's EP pools use), alone and with every core taken by other threads, in a few
seconds, cached in <cache>/probe.json (EPCLUSTER_CACHE, else ~/.cache/epcluster). The numbers
are what kernels reach, so the CPU entry's efficiency is 1. bench/cpu_overheads.py adds the
engine's measured per-step and per-sequence overheads to the same file (what a rank's step
costs beyond the roofline of these numbers).

A rank on a shared machine (`cpu_hardware(busy_threads=n)`): n threads want the C cores, so one
thread runs C / n of the time when n > C, and the n share the memory bandwidth:
bandwidth = min(one thread's x min(1, C / n), all threads' / n), the same for FLOP/s; the
measured overheads (Python time of one thread) take n / C times as long when n > C.
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
SMALL_EXCHANGE_BYTES = 4096  # per rank: a decode step's few rows of one MoE layer
EXCHANGES = 300


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


def read_bandwidth(repeats: int = 5) -> float:
    x = torch.ones(2**26)  # 256 MiB
    return x.numel() * 4 / _best(lambda: x.sum(), repeats)


PEAK_ROWS, PEAK_FEATURES = 64, 1536


def fp32_peak(repeats: int = 3) -> float:
    """FLOP/s of the engine's dense projection (a layer's packed weight, kernels/linear.py) on
    PEAK_ROWS rows: what the ranks' matmuls reach. (torch's matmul, which the engine's compiled
    kernel beats 2-3x at these shapes, was the probe's first measure: it made the plan's
    decode steps too slow as the batch grew.)"""
    from kernels.linear import linear

    n = PEAK_FEATURES
    x, w = torch.randn(PEAK_ROWS, n), torch.randn(n, n)
    return 2 * PEAK_ROWS * n * n / _best(lambda: linear(x, w, packed=True), repeats)


def _all_to_all_worker(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    x = torch.ones(ALL_TO_ALL_BYTES // 4)
    y = torch.empty_like(x)
    seconds = _best(lambda: dist.all_to_all_single(y, x))
    a, b = torch.ones(SMALL_EXCHANGE_BYTES // 4), torch.empty(SMALL_EXCHANGE_BYTES // 4)
    c = torch.randn(256, 256)
    # small exchanges between bits of work (a decode layer's pattern): the mean wait is what a
    # step pays per exchange, a partner descheduled by busier cores included
    waited = 0.0
    for _ in range(EXCHANGES):
        c @ c
        start = time.perf_counter()
        dist.all_to_all_single(b, a)
        waited += time.perf_counter() - start
    if rank == 0:
        # half of each rank's buffer crosses to the other process
        Path(out).write_text(json.dumps([ALL_TO_ALL_BYTES / 2 / seconds, waited / EXCHANGES]))
    dist.destroy_process_group()


def _spin(stop: "mp.synchronize.Event") -> None:  # noqa: F821 (a string: no import here)
    torch.set_num_threads(1)
    x = torch.randn(512, 512)
    while not stop.is_set():
        x @ x


def all_to_all(spinners: int = 0) -> tuple[float, float]:
    """(bytes/s one rank sends to the other in a gloo all_to_all_single on this machine, mean
    seconds of one small exchange), while `spinners` other single-threaded processes compute."""
    import tempfile

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    spin = [ctx.Process(target=_spin, args=(stop,)) for _ in range(spinners)]
    for proc in spin:
        proc.start()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "bw.json")
            mp.spawn(_all_to_all_worker, args=(port, out), nprocs=2, join=True)
            bw, latency = json.loads(Path(out).read_text())
    finally:
        stop.set()
        for proc in spin:
            proc.join()
    return float(bw), float(latency)


def _single_thread_worker(barrier: object, queue: object) -> None:
    torch.set_num_threads(1)
    barrier.wait()  # type: ignore[attr-defined]
    bw = read_bandwidth(10)
    barrier.wait()  # type: ignore[attr-defined]
    queue.put((bw, fp32_peak(repeats=6)))  # type: ignore[attr-defined]


def single_thread_processes(n: int) -> tuple[float, float]:
    """(read bandwidth, fp32 FLOP/s) summed over `n` single-threaded processes measuring at
    once: what n single-threaded ranks get together (independent processes, as the cluster's
    ranks are, not one process's threads, whose matmul waits for its slowest thread)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=_single_thread_worker, args=(barrier, queue)) for _ in range(n)]
    for proc in procs:
        proc.start()
    results = [queue.get() for _ in procs]
    for proc in procs:
        proc.join()
    return sum(r[0] for r in results), sum(r[1] for r in results)


def measure() -> dict[str, float]:
    threads = torch.get_num_threads()
    cores = os.cpu_count() or 1
    bw_1t, flops_1t = single_thread_processes(1)
    bw, flops = single_thread_processes(cores)
    result = {"read_bw": bw, "fp32_flops": flops, "read_bw_1t": bw_1t, "fp32_flops_1t": flops_1t}
    bw, latency = all_to_all()
    # the same with every core taken by 2 more threads: ranks then wait for a descheduled partner
    _, busy_latency = all_to_all(spinners=cores)
    return result | {
        "all_to_all_bw": bw,
        "exchange_latency_s": latency,
        "exchange_latency_busy_s": busy_latency,  # 2 + cores threads busy
        "threads": threads,
        "cores": cores,
        "date": time.time(),
    }


def probe(refresh: bool = False) -> dict[str, float]:
    """The cached measurement, taken now if there is none (or `refresh`, or it predates the
    one-thread and latency figures); measured overheads already in the file are kept."""
    path = cache_file()
    old = json.loads(path.read_text()) if path.exists() else {}
    if not refresh and "exchange_latency_s" in old:
        return old
    keep = {k: old[k] for k in (*OVERHEADS, "overheads") if k in old}
    result = measure() | keep
    save(result)
    return result


# what bench/cpu_overheads.py measures on the engine and adds to the cache (Hardware's fields)
OVERHEADS = ("step_overhead_s", "sequence_overhead_s", "ep_step_overhead_s",
             "ep_sequence_overhead_s", "prefill_token_overhead_s")  # fmt: skip


def save(result: dict[str, float]) -> None:
    path = cache_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def _shared(one: float, every: float, share: float, busy: float) -> float:
    """What one of `busy` threads, running `share` of the time, gets of a resource that one
    thread alone reaches at `one` and all the cores together at `every`."""
    return min(one * share, every / busy)


def cpu_hardware(
    refresh: bool = False, busy_threads: float | None = None, core_share: float = 1.0
) -> Hardware:
    """This machine: whole (`busy_threads` None: all threads of one process), or as one
    single-threaded rank among `busy_threads` threads that compete for its cores and memory
    bandwidth (the module docstring's sharing)."""
    import psutil

    m = probe(refresh)
    bw, flops, memory = m["read_bw"], m["fp32_flops"], float(psutil.virtual_memory().total)
    what = f"{int(m['threads'])} threads"
    latency = m.get("exchange_latency_s", 0.0)
    slow = 1.0  # Python's time on a shared core
    if busy_threads is not None:
        if busy_threads < 1:
            raise ValueError(f"busy_threads must be >= 1 (got {busy_threads})")
        cores = float(m.get("cores", m["threads"]))
        share = min(1.0, cores / busy_threads, core_share)
        bw = _shared(m["read_bw_1t"], bw, share, busy_threads)
        flops = _shared(m["fp32_flops_1t"], flops, share, busy_threads)
        memory /= max(1.0, busy_threads)
        what = f"one thread of {busy_threads:.2f} busy on {cores:.0f} cores"
        # measured with 2 busy threads and with 2 + cores: linear in the threads beyond 2
        busy = m.get("exchange_latency_busy_s", latency)
        latency = max(latency, latency + (busy - latency) * (busy_threads - 2) / cores)
        slow = 1.0 / share
    step = m.get("step_overhead_s")
    return Hardware(
        name="cpu",
        memory_bytes=memory,
        memory_bw=bw,
        flops={"fp32": flops, "bf16": flops, "fp8": flops},  # no faster low-precision path
        intra_node_bw=m["all_to_all_bw"],
        inter_node_bw=m["all_to_all_bw"],
        price_per_hour=0.0,
        sources={"all": f"measured by cluster/plan/probe.py ({what}), cached in {cache_file()}"},
        efficiency=Efficiency(1.0, 1.0, 1.0),
        step_overhead_s=None if step is None else step * slow,
        sequence_overhead_s=m.get("sequence_overhead_s", 0.0) * slow,
        exchange_latency_s=latency,
        ep_step_overhead_s=m.get("ep_step_overhead_s", 0.0) * slow,
        ep_sequence_overhead_s=m.get("ep_sequence_overhead_s", 0.0) * slow,
        prefill_token_overhead_s=m.get("prefill_token_overhead_s", 0.0) * slow,
    )


def get_hardware(name: str) -> Hardware:
    """A catalog entry, or `cpu` (this machine, measured by probe.py, cached)."""
    if name.lower() == "cpu":
        return cpu_hardware()
    try:
        return CATALOG[name.upper()]
    except KeyError:
        raise ValueError(f"gpu {name!r}: one of {[*CATALOG, 'cpu']}") from None
