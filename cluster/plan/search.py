"""The cheapest deployment that meets the SLOs at a workload's rate.

Prefill and decode pools are sized apart (their cost adds, their SLOs are separate: TTFT is
the prefill queue and step, TPOT the decode step): for each EP size (nodes per unit) and chunk,
the prefill rank's step time gives its capacity and, from the M/D/1 wait
rho S / (2 (1 - rho)) <= slo_ttft - S, the utilisation it may run at; for each EP size and
batch per GPU whose step meets the TPOT SLO, the decode rank's capacity is batch / step. The
rate then fixes the units of each, hence the P:D ratio; the cheapest pair wins. Candidates that
do not fit memory are skipped (memory.py says why). The simulator then checks the winner.
"""

import math
from dataclasses import dataclass
from typing import Protocol

from cluster.plan.workload import Workload

MAX_UTILISATION = 0.9  # assumption: headroom for load swings within the hour


class Costs(Protocol):
    """What the search asks of a cost model (cost.py through report.ModelCosts; stubs in tests)."""

    price_per_gpu_hour: float

    def prefill_s(self, ep: int, tokens: int, seqs: int, cached: float) -> float: ...
    def decode_s(self, ep: int, batch: int, context: float) -> float: ...
    def fits(self, ep: int, step_tokens: int, kv_tokens: float) -> bool: ...


@dataclass(frozen=True, slots=True)
class Grid:
    prefill_nodes: tuple[int, ...] = (1, 2, 4, 8)
    decode_nodes: tuple[int, ...] = (1, 2, 4, 8, 18, 36)
    chunks: tuple[int, ...] = (2048, 4096, 8192, 16384)
    batches: tuple[int, ...] = (8, 16, 32, 48, 64, 96, 128, 160, 192, 256)
    gpus_per_node: int = 8


@dataclass(frozen=True, slots=True)
class PoolChoice:
    """One pool's pick: nodes per unit, units, the chunk or batch per GPU, its step."""

    nodes_per_unit: int
    units: int
    size: int  # prefill: chunk tokens per step per GPU; decode: batch per GPU
    step_s: float
    capacity_per_gpu: float  # prefill: input tokens/s (cached included); decode: output tok/s
    utilisation: float
    gpus_per_node: int

    @property
    def ep(self) -> int:
        return self.nodes_per_unit * self.gpus_per_node

    @property
    def nodes(self) -> int:
        return self.nodes_per_unit * self.units

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def best_prefill(costs: Costs, work: Workload, grid: Grid, slo_ttft: float) -> PoolChoice | None:
    new = work.prompt_mean * (1 - work.prefix_hit)  # computed positions per prompt
    best = None
    for nodes in grid.prefill_nodes:
        ep = nodes * grid.gpus_per_node
        for chunk in grid.chunks:
            if not costs.fits(ep, chunk, work.prompt_mean):
                continue
            seqs = max(1, round(chunk / new))
            step = costs.prefill_s(ep, chunk, seqs, work.prompt_mean * work.prefix_hit)
            slack = slo_ttft - step
            if slack <= 0:
                continue
            rho = min(MAX_UTILISATION, 2 * slack / (step + 2 * slack))
            per_gpu = chunk / step / (1 - work.prefix_hit)  # input tokens/s incl. cache hits
            need = work.rate * work.prompt_mean / (per_gpu * rho)  # GPUs
            units = max(1, math.ceil(need / ep))
            pick = PoolChoice(nodes, units, chunk, step, per_gpu, rho, grid.gpus_per_node)
            if best is None or (pick.gpus, step) < (best.gpus, best.step_s):
                best = pick
    return best


def best_decode(costs: Costs, work: Workload, grid: Grid, slo_tpot: float) -> PoolChoice | None:
    context = work.prompt_mean + work.output_mean / 2  # mean positions a decode step attends
    best = None
    for nodes in grid.decode_nodes:
        ep = nodes * grid.gpus_per_node
        for batch in grid.batches:
            if not costs.fits(ep, batch, batch * (work.prompt_mean + work.output_mean)):
                continue
            step = costs.decode_s(ep, batch, context)
            if step > slo_tpot:
                continue
            per_gpu = batch / step
            need = work.rate * work.output_mean / (per_gpu * MAX_UTILISATION)
            units = max(1, math.ceil(need / ep))
            pick = PoolChoice(
                nodes, units, batch, step, per_gpu, MAX_UTILISATION, grid.gpus_per_node
            )
            if best is None or (pick.gpus, step) < (best.gpus, best.step_s):
                best = pick
    return best


@dataclass(frozen=True, slots=True)
class Deployment:
    prefill: PoolChoice
    decode: PoolChoice
    price_per_gpu_hour: float

    @property
    def cost_per_day(self) -> float:
        return (self.prefill.gpus + self.decode.gpus) * self.price_per_gpu_hour * 24


def search(
    costs: Costs, work: Workload, grid: Grid, slo_ttft: float, slo_tpot: float
) -> Deployment:
    """The cheapest deployment of the grid; ValueError naming the pool that nothing fits."""
    prefill = best_prefill(costs, work, grid, slo_ttft)
    decode = best_decode(costs, work, grid, slo_tpot)
    for name, pick, slo in (
        ("prefill", prefill, f"TTFT {slo_ttft}"),
        ("decode", decode, f"TPOT {slo_tpot}"),
    ):
        if pick is None:
            raise ValueError(
                f"no {name} configuration of the grid fits memory and meets {slo} s "
                f"(nodes {getattr(grid, name + '_nodes')}); try other GPUs or a looser SLO"
            )
    return Deployment(prefill, decode, costs.price_per_gpu_hour)
