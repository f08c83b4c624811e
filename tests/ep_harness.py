"""Spawn an expert-parallel pool as local processes (gloo over loopback) for tests and benches."""

import os
import socket
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_pool(fn, num_ranks: int, *args, timeout: float = 300) -> list:
    """Run fn(rank, num_ranks, *args) in num_ranks spawned processes joined in one gloo group;
    -> each rank's return value. A failure in any rank fails the call."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_worker, args=(fn, r, num_ranks, port, tmp, args))
            for r in range(num_ranks)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        for p in procs:
            if p.is_alive():
                p.kill()
        errors = [
            Path(tmp, f"{r}.err").read_text()
            for r in range(num_ranks)
            if Path(tmp, f"{r}.err").exists()
        ]
        if errors:
            raise RuntimeError("rank failed:\n" + "\n".join(errors))
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"rank exit codes {[p.exitcode for p in procs]} (timeout?)")
        return [torch.load(Path(tmp, f"{r}.pt"), weights_only=False) for r in range(num_ranks)]


def _worker(fn, rank, num_ranks, port, tmp, args) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks
        )
        result = fn(rank, num_ranks, *args)
        torch.save(result, Path(tmp, f"{rank}.pt"))
        dist.destroy_process_group()
    except BaseException:
        Path(tmp, f"{rank}.err").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        raise SystemExit(1) from None
