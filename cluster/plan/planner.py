"""A plan end to end: search (or take) the deployment, size its memory, time its steps, check it
with the simulator (adding units while the simulated p90 misses an SLO), and the figures the
report prints."""

import functools
import math
from dataclasses import dataclass, field

import torch

from cluster.plan.cost import StepCost, Unit, decode_step, kv_transfer_s, prefill_step
from cluster.plan.hardware import Hardware
from cluster.plan.memory import MemoryPlan, MemoryPlanError, plan_memory
from cluster.plan.models import PlanModel
from cluster.plan.routing import eplb_imbalance
from cluster.plan.search import Deployment, Grid, PoolChoice, search
from cluster.plan.simulate import SimConfig, SimResult, goodput_fraction, percentile, simulate
from cluster.plan.workload import Request, Workload

REDUNDANT_SHARE = 1 / 8  # assumption: DeepSeek's 32 redundant of 256 experts
SECONDS_PER_DAY = 86400


def redundant_experts(num_experts: int, ep: int) -> int:
    """The fewest redundant slots >= num_experts / 8 that spread evenly over `ep` ranks (32 for
    256 experts on EP32 and EP144, as DeepSeek runs); none without EP."""
    if ep == 1:
        return 0
    r = math.ceil(num_experts * REDUNDANT_SHARE)
    return r + (-(num_experts + r)) % ep


@dataclass(frozen=True, slots=True)
class ModelCosts:
    """search.Costs over cost.py and memory.py for one model on one GPU type."""

    model: PlanModel
    hw: Hardware
    gpus_per_node: int = 8
    weight_dtype: str = "fp8"
    kv_dtype: str = "bf16"
    two_batch_overlap: bool = True
    # [L, E] tokens per expert (routing.py): the EPLB imbalance of each EP size comes from it;
    # None: Unit's assumed 1.05
    expert_tokens: torch.Tensor | None = None
    # the deployment's own settings where given (a local cluster's): redundant slots per pool
    # (None: the 1/8 rule) and the KV cache per rank (None: all memory left)
    redundant: int | None = None
    kv_budget_bytes: float | None = None
    _imbalance: dict[int, float] = field(default_factory=dict, repr=False, compare=False)

    @property
    def price_per_gpu_hour(self) -> float:
        return self.hw.price_per_hour

    def unit(self, ep: int) -> Unit:
        act = "fp32" if self.weight_dtype == "fp32" else None
        redundant = self.redundant_slots(ep)
        hw = self.hw
        measured = {} if hw.step_overhead_s is None else {"step_overhead_s": hw.step_overhead_s}
        return Unit(
            ep, self.gpus_per_node, redundant, self.weight_dtype, self.kv_dtype,
            act or "fp8", act or "bf16", two_batch_overlap=self.two_batch_overlap,
            sequence_overhead_s=hw.sequence_overhead_s, exchange_latency_s=hw.exchange_latency_s,
            ep_step_overhead_s=hw.ep_step_overhead_s,
            ep_sequence_overhead_s=hw.ep_sequence_overhead_s,
            prefill_token_overhead_s=hw.prefill_token_overhead_s,
            **measured,
            **({} if self.expert_tokens is None else {"imbalance": self.imbalance(ep)}),
        )  # fmt: skip

    def redundant_slots(self, ep: int) -> int:
        if self.redundant is not None:
            return self.redundant if ep > 1 else 0
        return redundant_experts(self.model.config.n_routed_experts, ep)

    def imbalance(self, ep: int) -> float:
        """max / mean rank load of EP size `ep` under the given routing statistics (cached:
        EPLB's placement takes about a second for DeepSeek-V3's 58 x 256)."""
        assert self.expert_tokens is not None
        if ep not in self._imbalance:
            c = self.model.config
            redundant = self.redundant_slots(ep)
            ratio = eplb_imbalance(self.expert_tokens, ep, redundant, c.n_group, self.gpus_per_node)
            self._imbalance[ep] = max(1.0, ratio)
        return self._imbalance[ep]

    def prefill_cost(self, ep: int, tokens: int, seqs: int, cached: float) -> StepCost:
        return prefill_step(self.model, self.hw, self.unit(ep), tokens, seqs, cached)

    def decode_cost(self, ep: int, batch: int, context: float) -> StepCost:
        return decode_step(self.model, self.hw, self.unit(ep), batch, context)

    def prefill_s(self, ep: int, tokens: int, seqs: int, cached: float) -> float:
        return self.prefill_cost(ep, tokens, seqs, cached).time_s

    def decode_s(self, ep: int, batch: int, context: float) -> float:
        return self.decode_cost(ep, batch, context).time_s

    def memory(self, ep: int, step_tokens: int, kv_tokens: float = 0) -> MemoryPlan:
        unit = self.unit(ep)
        return plan_memory(
            self.model, self.hw.memory_bytes, ep, self.weight_dtype, self.kv_dtype,
            unit.redundant_experts, step_tokens, self.kv_budget_bytes,
            min_kv_tokens=math.ceil(kv_tokens),
        )  # fmt: skip

    def fits(self, ep: int, step_tokens: int, kv_tokens: float) -> bool:
        try:
            self.memory(ep, step_tokens, kv_tokens)
        except MemoryPlanError:
            return False
        return True


@dataclass(frozen=True, slots=True)
class Plan:
    deployment: Deployment
    workload: Workload
    prefill_memory: MemoryPlan
    decode_memory: MemoryPlan
    prefill_step: StepCost
    decode_step: StepCost
    sim: SimResult
    slo_ttft: float
    slo_tpot: float
    sampled_requests: int

    @property
    def input_tokens_per_s(self) -> float:
        return self.workload.rate * self.workload.prompt_mean

    @property
    def output_tokens_per_s(self) -> float:
        return self.workload.rate * self.workload.output_mean

    def summary(self) -> dict[str, float | int | None]:
        d, w = self.deployment, self.workload
        p_cost = d.prefill.gpus * d.price_per_gpu_hour * 24
        o_cost = d.decode.gpus * d.price_per_gpu_hour * 24
        day_in = self.input_tokens_per_s * SECONDS_PER_DAY / 1e6
        day_out = self.output_tokens_per_s * SECONDS_PER_DAY / 1e6
        return {
            "prefill_tokens_per_s_per_node": self.input_tokens_per_s / d.prefill.nodes,
            "decode_tokens_per_s_per_node": self.output_tokens_per_s / d.decode.nodes,
            "prefill_capacity_tokens_per_s_per_node": d.prefill.capacity_per_gpu
            * d.prefill.gpus_per_node,
            "decode_capacity_tokens_per_s_per_node": d.decode.capacity_per_gpu
            * d.decode.gpus_per_node,
            "ttft_s": percentile(self.sim.ttft_s, 50),
            "ttft_p90_s": percentile(self.sim.ttft_s, 90),
            "tpot_s": percentile(self.sim.tpot_s, 50),
            "tpot_p90_s": percentile(self.sim.tpot_s, 90),
            "e2e_s": percentile(self.sim.e2e_s, 50),
            "e2e_p90_s": percentile(self.sim.e2e_s, 90),
            "goodput_rps": w.rate * goodput_fraction(self.sim, self.slo_ttft, self.slo_tpot),
            "rate_rps": w.rate,
            "prefill_nodes": d.prefill.nodes,
            "decode_nodes": d.decode.nodes,
            "prefill_ep": d.prefill.ep,
            "decode_ep": d.decode.ep,
            "prefill_units": d.prefill.units,
            "decode_units": d.decode.units,
            "prefill_chunk_tokens": d.prefill.size,
            "decode_batch_per_gpu": d.decode.size,
            "decode_mean_batch_simulated": self.sim.decode_batch,
            "preemptions_simulated": self.sim.preemptions,
            "cost_per_day_usd": d.cost_per_day,
            "cost_per_million_input_tokens_usd": p_cost / day_in,
            "cost_per_million_output_tokens_usd": o_cost / day_out,
            "sampled_requests": self.sampled_requests,
            "requests_per_day": w.rate * SECONDS_PER_DAY,
        }


def make_plan(
    costs: ModelCosts,
    work: Workload,
    slo_ttft: float,
    slo_tpot: float,
    grid: Grid,
    samples: int = 20000,
    seed: int = 0,
    max_rounds: int = 6,
) -> Plan:
    """Search the grid, then simulate; while the simulated p90 TTFT (TPOT) misses its SLO, add a
    prefill (decode) unit, at most `max_rounds` times."""
    dep = search(costs, work, grid, slo_ttft, slo_tpot)
    requests = work.sample(samples, seed)
    for _ in range(max_rounds + 1):
        sim = _simulate(costs, dep, work, requests, seed)
        late_ttft = (percentile(sim.ttft_s, 90) or math.inf) > slo_ttft
        late_tpot = (percentile(sim.tpot_s, 90) or 0.0) > slo_tpot
        if not (late_ttft or late_tpot):
            break
        dep = Deployment(
            _more(dep.prefill) if late_ttft else dep.prefill,
            _more(dep.decode) if late_tpot else dep.decode,
            dep.price_per_gpu_hour,
        )
    p, d = dep.prefill, dep.decode
    return Plan(
        dep, work,
        costs.memory(p.ep, p.size, work.prompt_mean),
        costs.memory(d.ep, d.size, d.size * (work.prompt_mean + work.output_mean)),
        *_mean_steps(costs, work, p.ep, p.size, d.ep, d.size),
        sim, slo_ttft, slo_tpot, samples,
    )  # fmt: skip


def _mean_steps(
    costs: ModelCosts, work: Workload, p_ep: int, chunk: int, d_ep: int, batch: int
) -> tuple[StepCost, StepCost]:
    """A prefill step of `chunk` new positions of mean prompts, a decode step of `batch`
    requests at the mean context."""
    seqs = max(1, round(chunk / (work.prompt_mean * (1 - work.prefix_hit))))
    return (
        costs.prefill_cost(p_ep, chunk, seqs, work.prompt_mean * work.prefix_hit),
        costs.decode_cost(d_ep, batch, work.prompt_mean + work.output_mean / 2),
    )


def predict_fixed(
    costs: ModelCosts,
    work: Workload,
    prefill_ranks: int,
    decode_ranks: int,
    slo_ttft: float,
    slo_tpot: float,
    chunk: int = 2048,  # the engine's max_num_batched_tokens (engine/config.py)
    batch: int = 64,  # the engine's max_num_seqs
    samples: int = 5000,
    decode_costs: ModelCosts | None = None,
    seed: int = 0,
    warmup_fraction: float = 0.1,
) -> Plan:
    """A given deployment (one unit of each pool, `costs.gpus_per_node` ranks a node), simulated
    at the workload's rate without search or added units: what a benchmark of it should see.
    `decode_costs`: the decode pool's, where its ranks see other hardware (a CPU share; None:
    `costs`). `seed` draws the arrivals; `warmup_fraction`: the first requests left out of
    the statistics (0: a run from an empty cluster, as a benchmark of `samples` requests)."""
    g = costs.gpus_per_node
    d_costs = decode_costs or costs
    if prefill_ranks % g or decode_ranks % g:
        raise ValueError(f"{prefill_ranks} and {decode_ranks} ranks must fill nodes of {g}")
    p_step = _mean_steps(costs, work, prefill_ranks, chunk, decode_ranks, batch)[0]
    d_step = _mean_steps(d_costs, work, prefill_ranks, chunk, decode_ranks, batch)[1]
    per_gpu = chunk / p_step.time_s / (1 - work.prefix_hit)
    p = PoolChoice(prefill_ranks // g, 1, chunk, p_step.time_s, per_gpu, 0.0, g)
    d = PoolChoice(decode_ranks // g, 1, batch, d_step.time_s, batch / d_step.time_s, 0.0, g)
    dep = Deployment(p, d, costs.price_per_gpu_hour)
    sim = _simulate(costs, dep, work, work.sample(samples, seed), seed, d_costs, warmup_fraction)
    return Plan(
        dep, work, costs.memory(p.ep, chunk), d_costs.memory(d.ep, batch), p_step, d_step,
        sim, slo_ttft, slo_tpot, samples,
    )  # fmt: skip


def _more(pick: PoolChoice) -> PoolChoice:
    units = pick.units + max(1, pick.units // 5)
    return PoolChoice(
        pick.nodes_per_unit, units, pick.size, pick.step_s, pick.capacity_per_gpu,
        pick.utilisation * pick.units / units, pick.gpus_per_node,
    )  # fmt: skip


def _simulate(
    costs: ModelCosts,
    dep: Deployment,
    work: Workload,
    requests: list[Request],
    seed: int,
    decode_costs: ModelCosts | None = None,
    warmup_fraction: float = 0.1,
) -> SimResult:
    p, d = dep.prefill, dep.decode
    d_costs = decode_costs or costs
    kv_tokens = d_costs.memory(d.ep, d.size).kv_tokens

    @functools.lru_cache(maxsize=4096)
    def prefill(tokens: int, seqs: int, cached: float) -> float:
        return costs.prefill_s(p.ep, tokens, seqs, cached)

    @functools.lru_cache(maxsize=1 << 16)
    def decode_bucket(batch: int, ctx_bucket: int) -> float:
        return d_costs.decode_s(d.ep, batch, ctx_bucket * 64.0)

    unit = d_costs.unit(d.ep)
    config = SimConfig(p.gpus, d.gpus, chunk_tokens=p.size, max_batch=d.size, kv_tokens=kv_tokens,
                       warmup_fraction=warmup_fraction)  # fmt: skip
    return simulate(
        requests, work.rate, config,
        lambda t, s, c: prefill(t, s, round(c)),
        lambda b, c: decode_bucket(b, round(c / 64)),
        lambda n: kv_transfer_s(costs.model, costs.hw, unit, n),
        seed,
    )  # fmt: skip
