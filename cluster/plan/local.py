"""The plan's prediction for a cluster of CPU ranks on this machine (bench/goodput.py's `--plan`):
P prefill and D decode ranks of one thread each share the machine's cores and memory bandwidth
(cluster/plan/probe.py's sharing), so a pool's step depends on how busy the other pool is.

A fixed point: time the decode pool's steps as one of D + P x u_p + other busy threads (u_p:
the prefill pool's busy fraction) and the prefill pool's as one of P + D x u_d + other (u_d: the
decode pool's), simulate, take the busy fractions the simulation reports, and again, a few
rounds (it settles in two or three: a busier pool slows the other, which then is busier).
`other`: the cores kept busy besides the ranks: Ray's daemons (a constant) and the router and
the load generator, which spend CPU per output token they stream (measured constants the caller
states: bench/goodput.py's CPU accounting of a run outside the compared ones).
"""

import statistics
from dataclasses import dataclass

from cluster.plan.cost import StepCost, exchanges_per_step
from cluster.plan.models import PlanModel
from cluster.plan.planner import ModelCosts, predict_fixed
from cluster.plan.probe import cpu_hardware
from cluster.plan.simulate import goodput_fraction, percentile
from cluster.plan.workload import Workload

CHUNK, BATCH = 2048, 64  # the engine's max_num_batched_tokens and max_num_seqs (engine/config.py)


@dataclass(frozen=True, slots=True)
class LocalCluster:
    """P prefill and D decode ranks of one thread each on this machine, as `epcluster serve`
    starts them (no redundant experts, `kv_cache_bytes` of latent cache per rank)."""

    prefill_ranks: int
    decode_ranks: int
    kv_cache_bytes: float = 256 * 2**20  # EngineConfig.kv_cache_bytes
    background_busy: float = 0.0  # cores busy whatever the load (Ray's daemons)
    cpu_s_per_token: float = 0.0  # router + load generator CPU seconds per output token
    # the router's own part of a TTFT (HTTP, the decode reservation and the prefill call as Ray
    # actor calls, the first delta back), measured on the idle cluster: added to TTFT and e2e
    request_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.prefill_ranks, self.decode_ranks) < 1:
            raise ValueError("prefill_ranks, decode_ranks >= 1")
        if min(self.background_busy, self.cpu_s_per_token, self.request_latency_s) < 0:
            raise ValueError("background_busy, cpu_s_per_token, request_latency_s must be >= 0")

    def other_busy(self, output_tokens_per_s: float) -> float:
        """Cores busy besides the ranks at this output rate."""
        return self.background_busy + self.cpu_s_per_token * output_tokens_per_s

    def costs(self, model: PlanModel, busy_threads: float) -> ModelCosts:
        hw = cpu_hardware(busy_threads=max(1.0, busy_threads))
        # NOTE: no two-batch overlap: a rank's one thread both computes and drives gloo
        return ModelCosts(model, hw, 1, "fp32", "fp32", two_batch_overlap=False, redundant=0,
                          kv_budget_bytes=self.kv_cache_bytes)  # fmt: skip


def predict_local(
    model: PlanModel,
    work: Workload,
    cluster: LocalCluster,
    slo_ttft: float,
    slo_tpot: float,
    requests: int = 100,
    replicas: int = 20,
    rounds: int = 3,
) -> dict[str, float | None]:
    """What a benchmark of `requests` Poisson arrivals at `work.rate`, from an empty cluster,
    should see: medians and p90s pooled over `replicas` seeded runs, throughput and goodput, the
    mean steps, and the busy fractions and threads of the last round."""
    p, d = cluster.prefill_ranks, cluster.decode_ranks
    other = cluster.other_busy(work.rate * work.output_mean)
    u_p = u_d = 1.0  # start from everything busy: the fixed point is approached from above
    c_p = c_d = 1.0  # the share of a step a rank's thread computes (not waiting in an exchange)
    for _ in range(rounds):
        busy_p, busy_d = p + d * u_d * c_d + other, d + p * u_p * c_p + other
        costs_p, costs_d = cluster.costs(model, busy_p), cluster.costs(model, busy_d)
        plans = [
            predict_fixed(
                costs_p, work, p, d, slo_ttft, slo_tpot, CHUNK, BATCH, requests,
                decode_costs=costs_d, seed=seed, warmup_fraction=0.0,
            )
            for seed in range(replicas)
        ]  # fmt: skip
        u_p = statistics.fmean(x.sim.prefill_busy for x in plans)
        u_d = statistics.fmean(x.sim.decode_busy for x in plans)
        c_p = _computing(model, costs_p, p, plans[0].prefill_step)
        c_d = _computing(model, costs_d, d, plans[0].decode_step)
    extra = cluster.request_latency_s
    ttft = [None if t is None else t + extra for x in plans for t in x.sim.ttft_s]
    tpot = [t for x in plans for t in x.sim.tpot_s]
    e2e = [None if t is None else t + extra for x in plans for t in x.sim.e2e_s]
    good = statistics.fmean(goodput_fraction(x.sim, slo_ttft - extra, slo_tpot) for x in plans)
    # a run's throughput as the benchmark counts it: its requests over the time from the
    # first arrival to the last token, about (n - 1) / rate + a request's e2e
    e2e_mean = statistics.fmean(t for t in e2e if t is not None)
    throughput = requests / ((requests - 1) / work.rate + e2e_mean)
    return {
        "rate_rps": work.rate,
        "throughput_rps": throughput,
        "goodput_rps": good * throughput,
        "ttft_s": percentile(ttft, 50), "ttft_p90_s": percentile(ttft, 90),
        "tpot_s": percentile(tpot, 50), "tpot_p90_s": percentile(tpot, 90),
        "e2e_s": percentile(e2e, 50),
        "decode_mean_batch": statistics.fmean(x.sim.decode_batch for x in plans),
        "prefill_step_s": plans[0].prefill_step.time_s,
        "decode_step_s": plans[0].decode_step.time_s,
        "prefill_busy": u_p, "decode_busy": u_d,
        "prefill_computing": c_p, "decode_computing": c_d,
        "prefill_busy_threads": busy_p, "decode_busy_threads": busy_d,
    }  # fmt: skip


def _computing(model: PlanModel, costs: ModelCosts, ranks: int, step: StepCost) -> float:
    """The share of a step its rank's thread computes: a thread blocked in an exchange (waiting
    for its partner's rows) leaves its core to others."""
    if ranks == 1:
        return 1.0
    waiting = exchanges_per_step(model, ranks) * costs.hw.exchange_latency_s
    return max(0.0, 1.0 - waiting / step.time_s)


def capacity_rps(model: PlanModel, work: Workload, cluster: LocalCluster) -> float:
    """Requests/s the cluster carries with both pools saturated (every rank busy): the lesser
    of the prefill pool's (full chunks of the workload's prompts) and the decode pool's (full
    batches at the mean context), the router's share taken at that rate (a fixed point)."""
    p, d = cluster.prefill_ranks, cluster.decode_ranks
    new = work.prompt_mean * (1 - work.prefix_hit)
    seqs = max(1, int(CHUNK // new))
    rate, c_p, c_d = 0.0, 1.0, 1.0
    for _ in range(8):
        other = cluster.other_busy(rate * work.output_mean)
        costs = cluster.costs(model, p * c_p + d * c_d + other)
        prefill = costs.prefill_cost(p, int(seqs * new), seqs, work.prompt_mean - new)
        decode = costs.decode_cost(d, BATCH, work.prompt_mean + work.output_mean / 2)
        c_p, c_d = _computing(model, costs, p, prefill), _computing(model, costs, d, decode)
        per_request = max(work.output_mean - 1, 1)
        rate = min(p * seqs / prefill.time_s, d * BATCH / decode.time_s / per_request)
    return rate
