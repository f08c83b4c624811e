"""A neighbour engine computing without pause on the machine's other core, for
bench/cpu_overheads.py's step 4: how much slower a rank's step computes while another rank
computes beside it (the two share the last-level cache and the memory bandwidth, so a step that
never waits for a core still takes longer than alone).
"""

import multiprocessing.synchronize
import time
from collections.abc import Callable

import torch

from engine.llm_engine import LLMEngine

NEIGHBOUR_BATCH = 3  # a decode rank's batch at the loads the local plan is checked at


def _neighbour(
    make: Callable[[], LLMEngine],
    work: Callable[[LLMEngine, int], object],
    ready: multiprocessing.synchronize.Event,
    stop: multiprocessing.synchronize.Event,
) -> None:
    """A spawned process: make an engine, then work(engine, i) for i = 0, 1, ... until `stop`."""
    torch.set_num_threads(1)
    engine = make()
    ready.set()
    i = 0
    while not stop.is_set():
        work(engine, i)
        i += 1


def beside(
    make: Callable[[], LLMEngine],
    work: Callable[[LLMEngine, int], object],
    measure: Callable[[], float],
) -> float:
    """`measure()` while a spawned neighbour engine (`make()`) does `work` without pause; both
    must pickle (module-level functions, partials of them)."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_neighbour, args=(make, work, ready, stop), daemon=True)
    proc.start()
    try:
        if not ready.wait(600):
            raise RuntimeError("the neighbour engine did not start in 600 s")
        time.sleep(2.0)  # past its first steps
        return measure()
    finally:
        stop.set()
        proc.join(60)
        if proc.is_alive():
            proc.kill()
