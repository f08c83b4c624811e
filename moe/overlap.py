"""Staged forward passes and two-batch overlap.

The model's forward is a generator (`DeepseekForCausalLM.stages`): each MoE layer yields right
after it starts an async all-to-all (the dispatch rows, then the combine). `run_to_end` drives one
such generator straight through: the plain forward. `run_interleaved` advances several in turn,
so that while one micro-batch's rows travel, the other computes its attention or its experts
(two-batch overlap). Per MoE layer the collectives go out in the same order on every rank
(counts 0, rows 0, counts 1, rows 1, combine 0, combine 1), so ranks never deadlock, whatever
their batch sizes (an empty micro-batch still joins every collective).
"""

from collections.abc import Generator
from typing import TypeVar

Out = TypeVar("Out")
Stages = Generator[None, None, Out]


def run_to_end(stages: Stages[Out]) -> Out:
    """Advance one generator until it returns; -> its result."""
    while True:
        try:
            next(stages)
        except StopIteration as stop:
            return stop.value


def run_interleaved(stages: list[Stages[Out]]) -> list[Out]:
    """Advance each generator to its next yield in turn until all return; -> their results."""
    results: dict[int, Out] = {}
    while len(results) < len(stages):
        for i, gen in enumerate(stages):
            if i in results:
                continue
            try:
                next(gen)
            except StopIteration as stop:
                results[i] = stop.value
    return [results[i] for i in range(len(stages))]
