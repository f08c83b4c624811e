"""Spawned processes for the tests that need several ranks: one harness, one free-port helper.

A rank's function runs in a fresh `spawn` process with one torch thread, joined (unless told
otherwise) with the other ranks in one gloo group over loopback; what it returns comes back to
the test. Any rank's exception, non-zero exit or hang fails the call with the rank's traceback.
"""

import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

SPAWN = mp.get_context("spawn")  # make Queues for run_ranks' args from this context


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    fn: Callable[..., Any],
    num_ranks: int,
    *args: Any,
    timeout: float = 300,
    init_group: bool = True,
) -> list[Any]:
    """Run fn(rank, num_ranks, *args) in num_ranks spawned processes; -> each rank's result.

    init_group: join the ranks in the default process group (gloo, 127.0.0.1) first; without it
    fn builds what it needs itself (e.g. a store under a directory passed in args)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        procs = [
            SPAWN.Process(target=_rank_main, args=(fn, r, num_ranks, port, tmp, init_group, args))
            for r in range(num_ranks)
        ]
        for p in procs:
            p.start()
        end = time.monotonic() + timeout
        for p in procs:
            p.join(max(end - time.monotonic(), 0))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        errors = _errors(tmp, num_ranks)
        if errors:
            raise RuntimeError("rank failed:\n" + "\n".join(errors))
        if hung:
            raise RuntimeError(f"ranks {hung} still ran after {timeout:.0f} s")
        if any(p.exitcode != 0 for p in procs):
            raise RuntimeError(f"rank exit codes {[p.exitcode for p in procs]}")
        return [torch.load(Path(tmp, f"{r}.pt"), weights_only=False) for r in range(num_ranks)]


def _errors(tmp: str, num_ranks: int) -> list[str]:
    files = [Path(tmp, f"{r}.err") for r in range(num_ranks)]
    return [f.read_text() for f in files if f.exists()]


def _rank_main(fn, rank, num_ranks, port, tmp, init_group, args) -> None:
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        if init_group:
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=num_ranks
            )
        result = fn(rank, num_ranks, *args)
        torch.save(result, Path(tmp, f"{rank}.pt"))
        if init_group:
            dist.destroy_process_group()
    except BaseException:
        Path(tmp, f"{rank}.err").write_text(f"rank {rank}:\n{traceback.format_exc()}")
        raise SystemExit(1) from None
