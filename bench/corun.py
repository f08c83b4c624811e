"""A neighbour engine computing without pause on the machine's other core, for
bench/cpu_overheads.py's step 4: how much slower a rank's step computes while another rank
computes beside it (the two share the last-level cache and the memory bandwidth, so a step that
never waits for a core still takes longer than alone). The neighbour decodes NEIGHBOUR_BATCH
requests (beside a timed prefill) or prefills 128-token prompts (beside a timed decode).
"""

import multiprocessing.synchronize
import time
from collections.abc import Callable

import torch

NEIGHBOUR_BATCH = 3  # a decode rank's batch at the loads the local plan is checked at


def _neighbour(model: str, work: str, ready, stop: multiprocessing.synchronize.Event) -> None:
    """A spawned engine that decodes (or prefills) without pause until `stop` is set."""
    from bench.cpu_overheads import _config, decode_seconds, prefill_seconds
    from engine.llm_engine import LLMEngine

    torch.set_num_threads(1)
    engine = LLMEngine(_config(model, NEIGHBOUR_BATCH))
    ready.set()
    first = 10_000
    while not stop.is_set():
        first += 100
        if work == "decode":
            decode_seconds(engine, NEIGHBOUR_BATCH, 20, first)
        else:
            prefill_seconds(engine, 1, first)


def beside(model: str, work: str, measure: Callable[[], float]) -> float:
    """`measure()` while a spawned neighbour engine does `work` ("decode" or "prefill")."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    ready, stop = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=_neighbour, args=(model, work, ready, stop), daemon=True)
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
