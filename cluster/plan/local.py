"""The plan's prediction for a cluster of CPU ranks on this machine (bench/goodput.py's `--plan`):
P prefill and D decode ranks of one thread each share the machine's cores and memory bandwidth
(cluster/plan/probe.py's sharing), so a pool's step depends on how busy the other pool is.

A fixed point: time the decode pool's steps as one of D + P x u_p + other busy threads (u_p:
the prefill pool's busy fraction) and the prefill pool's as one of P + D x u_d + other (u_d: the
decode pool's), simulate, take the busy fractions the simulation reports, and again, a few
rounds (it settles in two or three: a busier pool slows the other, which then is busier).
`other`: threads besides the ranks that take a core while the cluster serves (the router and
the load generator), an input the caller states.
"""

import statistics
from dataclasses import dataclass

from cluster.plan.cost import StepCost
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
    other_busy: float = 0.0  # threads besides the ranks that keep a core busy

    def __post_init__(self) -> None:
        if min(self.prefill_ranks, self.decode_ranks) < 1 or self.other_busy < 0:
            raise ValueError("prefill_ranks, decode_ranks >= 1 and other_busy >= 0")

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
    p, d, other = cluster.prefill_ranks, cluster.decode_ranks, cluster.other_busy
    u_p = u_d = 1.0  # start from everything busy: the fixed point is approached from above
    for _ in range(rounds):
        busy_p, busy_d = p + d * u_d + other, d + p * u_p + other
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
    ttft = [t for x in plans for t in x.sim.ttft_s]
    tpot = [t for x in plans for t in x.sim.tpot_s]
    e2e = [t for x in plans for t in x.sim.e2e_s]
    good = statistics.fmean(goodput_fraction(x.sim, slo_ttft, slo_tpot) for x in plans)
    # a run's throughput: its requests over the time from the first arrival to the last token
    throughput = statistics.fmean(requests / x.sim.simulated_s for x in plans)
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
        "prefill_busy_threads": busy_p, "decode_busy_threads": busy_d,
    }  # fmt: skip


def capacity_rps(model: PlanModel, work: Workload, cluster: LocalCluster) -> float:
    """Requests/s the cluster carries with both pools saturated (every rank busy): the lesser
    of the prefill pool's (full chunks of the workload's prompts) and the decode pool's (full
    batches at the mean context)."""
    p, d = cluster.prefill_ranks, cluster.decode_ranks
    costs = cluster.costs(model, p + d + cluster.other_busy)
    new = work.prompt_mean * (1 - work.prefix_hit)
    seqs = max(1, int(CHUNK // new))
    prefill: StepCost = costs.prefill_cost(p, int(seqs * new), seqs, work.prompt_mean - new)
    decode = costs.decode_cost(d, BATCH, work.prompt_mean + work.output_mean / 2)
    per_request_decode = max(work.output_mean - 1, 1)
    return min(p * seqs / prefill.time_s, d * BATCH / decode.time_s / per_request_decode)
