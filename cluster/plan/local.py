"""The plan's prediction for a cluster of CPU ranks on this machine (bench/goodput.py's `--plan`):
P prefill and D decode ranks of one thread each share the machine's cores and memory bandwidth
(cluster/plan/probe.py's sharing), so a pool's step depends on how busy the other pool is.

A fixed point: time the decode pool's steps as one of D + P x u_p + other busy threads (u_p:
the prefill pool's busy fraction) and the prefill pool's as one of P + D x u_d + other (u_d: the
decode pool's), simulate, take the busy fractions the simulation reports, and again, a few
rounds (it settles in two or three: a busier pool slows the other, which then is busier).
`other`: the serving work, the cores kept busy besides the ranks' engine threads: Ray's daemons
and idle threads (a constant), and the router, the load generator and the ranks' serving
threads, which spend CPU per request (HTTP, the reservation, prefill and decode calls) and per
decode step (a step's deltas streamed through Ray, the router and the HTTP stream): constants
measured by bench/serving_cpu.py on loads apart from the compared ones.

Where every rank thread has a core of its own (P + D <= cores), two things the even sharing
misses (`rank_shares`): the serving work is not spread evenly (the kernel puts a woken thread
where a core is idle, so it lands on each core in proportion to the time that core's rank
thread leaves it idle, and a bursty prefill rank shares its core with most of it), and a rank
computes slower while the other pool's rank computes beside it (shared cache and bandwidth: the
probe's measured corun factors, bench/corun.py, weighed by the other pool's busy fraction).
"""

import statistics
from dataclasses import dataclass

from cluster.plan.cost import StepCost, exchanges_per_step
from cluster.plan.models import PlanModel
from cluster.plan.planner import ModelCosts, predict_fixed
from cluster.plan.probe import cpu_hardware, probe
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
    cpu_s_per_request: float = 0.0  # serving CPU seconds per request
    cpu_s_per_step: float = 0.0  # serving CPU seconds per decode step of a rank
    # the router's own part of a TTFT (HTTP, the decode reservation and the prefill call as Ray
    # actor calls, the first delta back), measured on the idle cluster: added to TTFT and e2e
    request_latency_s: float = 0.0

    def __post_init__(self) -> None:
        if min(self.prefill_ranks, self.decode_ranks) < 1:
            raise ValueError("prefill_ranks, decode_ranks >= 1")
        costs = (self.background_busy, self.cpu_s_per_request, self.cpu_s_per_step)
        if min(*costs, self.request_latency_s) < 0:
            raise ValueError(
                "background_busy, cpu_s_per_request, cpu_s_per_step, request_latency_s must be >= 0"
            )

    def other_busy(self, requests_per_s: float, decode_steps_per_s: float) -> float:
        """Cores the serving work keeps busy at these rates (decode steps of all its ranks)."""
        return (
            self.background_busy
            + self.cpu_s_per_request * requests_per_s
            + self.cpu_s_per_step * decode_steps_per_s
        )

    def costs(self, model: PlanModel, busy_threads: float, core_share: float = 1.0) -> ModelCosts:
        hw = cpu_hardware(busy_threads=max(1.0, busy_threads), core_share=core_share)
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
    m = probe()
    u_p = u_d = 1.0  # start from everything busy: the fixed point is approached from above
    c_p = c_d = 1.0  # the share of a step a rank's thread computes (not waiting in an exchange)
    steps = 1.0 / cluster.costs(model, p + d).decode_cost(d, 1, work.prompt_mean).time_s
    for _ in range(rounds):
        other = cluster.other_busy(work.rate, d * steps)
        busy_p, busy_d = p + d * u_d * c_d + other, d + p * u_p * c_p + other
        # the per-request part runs around the request's own prefill (parsing and the
        # reservation before it, the first token and the decode call after), not beside it
        streaming = cluster.other_busy(0.0, d * steps)
        share_p, share_d = rank_shares(m, p, d, u_p * c_p, u_d * c_d, streaming)
        costs_p, costs_d = (
            cluster.costs(model, busy_p, share_p),
            cluster.costs(model, busy_d, share_d),
        )
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
        # a decode rank's steps per second: its output tokens over the requests in a step
        steps = statistics.fmean(
            x.sim.decode_tokens_per_s / x.sim.decode_batch for x in plans if x.sim.decode_batch
        )
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
        "prefill_core_share": share_p, "decode_core_share": share_d, "other_busy": other,
    }  # fmt: skip


def rank_shares(
    measured: dict[str, float], p: int, d: int, b_p: float, b_d: float, streaming: float
) -> tuple[float, float]:
    """A prefill and a decode rank thread's effective share of a core (`measured`: the probe's
    cache): where each has a core of its own, the serving work's placement (`core_shares`) and
    the slowdown beside the other pool's computing rank, weighed by its busy fraction."""
    cores = measured["cores"]
    share_p, share_d = core_shares(cores, p, d, b_p, b_d, streaming)
    if p + d > cores:
        return share_p, share_d
    beside_p = 1 + (measured.get("corun_prefill", 1.0) - 1) * min(1.0, d * b_d)
    beside_d = 1 + (measured.get("corun_decode", 1.0) - 1) * min(1.0, p * b_p)
    return share_p / beside_p, share_d / beside_d


def core_shares(
    cores: float, p: int, d: int, b_p: float, b_d: float, other: float
) -> tuple[float, float]:
    """The share of its core a computing prefill and decode rank thread gets, when every rank
    thread has a core of its own (P + D <= cores; else 1, 1: the busy-thread sharing alone).
    b_p, b_d: a rank thread's busy fraction; other: the cores' worth of serving work (router,
    load generator, Ray, the ranks' own serving threads). The kernel puts a woken thread where a
    core is idle, so the serving work lands on each core in proportion to the time its rank
    thread leaves it idle, and the rank thread on that core waits while it runs: a bursty rank
    (prefill at low load) shares its core with most of it, a steady one (decode) with little."""
    if p + d > cores:
        return 1.0, 1.0
    idle = cores - p * b_p - d * b_d  # cores' worth of idle time, the empty cores' included
    if idle <= 0:
        return 1.0, 1.0
    lost_p, lost_d = other * (1 - b_p) / idle, other * (1 - b_d) / idle
    return max(0.1, 1 - lost_p), max(0.1, 1 - lost_d)


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
    rate, c_p, c_d, steps = 0.0, 1.0, 1.0, 0.0
    for _ in range(8):
        other = cluster.other_busy(rate, d * steps)
        costs = cluster.costs(model, p * c_p + d * c_d + other)
        prefill = costs.prefill_cost(p, int(seqs * new), seqs, work.prompt_mean - new)
        decode = costs.decode_cost(d, BATCH, work.prompt_mean + work.output_mean / 2)
        steps = 1.0 / decode.time_s
        c_p, c_d = _computing(model, costs, p, prefill), _computing(model, costs, d, decode)
        per_request = max(work.output_mean - 1, 1)
        rate = min(p * seqs / prefill.time_s, d * BATCH / decode.time_s / per_request)
    return rate
