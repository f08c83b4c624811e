"""A discrete-event simulator of a disaggregated deployment, one representative rank per pool.

Ranks of a pool are symmetric (the router balances them; attention is data parallel; every
step is a lockstep collective whose cost the cost model already takes at the busiest rank), so
a pool of P ranks at rate r behaves as P copies of one rank at r / P. The simulator runs one
prefill rank and one decode rank on the same sampled requests, each at its share of the rate,
and scales per-rank throughput by the rank count: a day of DeepSeek-scale traffic (hundreds of
nodes, a hundred million requests) is a few tens of thousands of sampled requests. What it
leaves out: correlation between ranks' queues and the router's imperfect balance.

Prefill rank: FIFO queue, steps of up to `chunk_tokens` new positions (a long prompt is chunked
over steps), a prompt's cached prefix read not computed; admission refuses an arrival when the
queued tokens exceed `max_queued_tokens`. The first token is out at the end of the prompt's last
chunk (TTFT), plus the wait for the KV reservation the router makes on a decode rank first (the
rest of the decode step in progress: the rank answers between steps); its KV then travels to
the decode rank. Decode rank: continuous batching up to `max_batch` requests within `kv_tokens`
of cache; when the cache is full the newest request is preempted (recompute: it waits again and
pays a prefill of its context).
"""

import heapq
import random
import statistics
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from cluster.plan.workload import Request

# (tokens, sequences, cached positions per sequence) -> seconds
PrefillStep = Callable[[int, int, float], float]
# (batch, mean context) -> seconds
DecodeStep = Callable[[int, float], float]


@dataclass(frozen=True, slots=True)
class SimConfig:
    prefill_ranks: int
    decode_ranks: int
    chunk_tokens: int = 8192
    max_batch: int = 64
    kv_tokens: int = 10**9
    max_queued_tokens: int = 10**9
    warmup_fraction: float = 0.1  # the first requests (empty ranks) are left out of statistics

    def __post_init__(self) -> None:
        if min(self.prefill_ranks, self.decode_ranks, self.chunk_tokens, self.max_batch) < 1:
            raise ValueError("ranks, chunk_tokens and max_batch must be >= 1")


@dataclass(frozen=True, slots=True)
class SimResult:
    ttft_s: list[float | None]  # None: refused at admission
    tpot_s: list[float | None]  # None: one output token, or refused
    e2e_s: list[float | None]
    prefill_busy: float  # fraction of the time the prefill rank stepped
    decode_batch: float  # mean requests per decode step
    preemptions: int
    prefill_tokens_per_s: float  # per rank, input tokens (cached ones included)
    decode_tokens_per_s: float  # per rank, output tokens
    simulated_s: float
    decode_busy: float = 0.0  # fraction of the time the decode rank stepped


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed)
    t, out = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def run_prefill(
    step: PrefillStep,
    requests: list[Request],
    arrivals: list[float],
    chunk_tokens: int,
    max_queued_tokens: int,
) -> tuple[list[float | None], float, float]:
    """-> (first-token time of each request or None if refused, busy seconds, end time)."""
    done: list[float | None] = [None] * len(requests)
    queue: deque[list[int]] = deque()  # [request index, new positions left]
    queued, t, busy, i = 0, 0.0, 0.0, 0
    while i < len(requests) or queue:
        if not queue:
            t = max(t, arrivals[i])
        while i < len(requests) and arrivals[i] <= t:
            new = requests[i].prompt - requests[i].cached
            if queued + new <= max_queued_tokens:
                queue.append([i, new])
                queued += new
            i += 1
        if not queue:
            continue
        # Step 1: fill the token budget from the head of the queue, chunking the last prompt
        budget, seqs, cached, finished = chunk_tokens, 0, 0.0, []
        for item in queue:
            take = min(budget, item[1])
            item[1] -= take
            budget -= take
            seqs += 1
            cached += requests[item[0]].cached
            if item[1] == 0:
                finished.append(item[0])
            if budget == 0:
                break
        tokens = chunk_tokens - budget
        # Step 2: run it
        dt = step(tokens, seqs, cached / seqs)
        t += dt
        busy += dt
        queued -= tokens
        for idx in finished:
            done[idx] = t
            queue.popleft()
    return done, busy, t


def run_decode(
    step: DecodeStep,
    requests: list[Request],
    arrivals: list[float],
    max_batch: int,
    kv_tokens: int,
    recompute: Callable[[int], float],
) -> tuple[list[float], float, int, float, float, int]:
    """-> (time each request's last token is out, mean batch, preemptions, end time, busy
    seconds, steps).
    A request arrives with its prompt's KV and its first token; it needs output - 1 steps."""
    end = [0.0] * len(requests)
    waiting: deque[tuple[int, int, float]] = deque()  # (index, tokens done, ready time)
    finish: list[tuple[int, int]] = []  # heap of (step it finishes at, index)
    joined: list[int] = []  # join order, for preemption (newest first); lazy deletion
    join_step, base = {}, {}  # index -> step it (re)joined, context then
    t, n_step, kv_used, ctx_sum, batch_sum, preempted, i = 0.0, 0, 0, 0, 0, 0, 0
    running, busy = 0, 0.0
    while i < len(requests) or waiting or running:
        if not waiting and not running:
            t = max(t, arrivals[i])
        while i < len(requests) and arrivals[i] <= t:
            if requests[i].output <= 1:
                end[i] = arrivals[i]
            else:
                waiting.append((i, 1, arrivals[i]))
            i += 1
        # Step 1: admit (FIFO) what fits the batch and the cache
        while waiting and running < max_batch and waiting[0][2] <= t:
            idx, done, _ = waiting[0]
            ctx = requests[idx].prompt + done
            if kv_used + ctx > kv_tokens and running:
                break
            waiting.popleft()
            join_step[idx], base[idx] = n_step, ctx
            heapq.heappush(finish, (n_step + requests[idx].output - done, idx))
            joined.append(idx)
            kv_used += ctx
            ctx_sum += ctx
            running += 1
        if not running:
            # NOTE: FIFO: wait for the head (a preempted request is ready after its recompute)
            t = max(t, waiting[0][2]) if waiting else t
            continue
        # Step 2: one token for every running request
        dt = step(running, ctx_sum / running)
        t += dt
        busy += dt
        n_step += 1
        batch_sum += running
        kv_used += running
        ctx_sum += running
        while finish and finish[0][0] == n_step:
            _, idx = heapq.heappop(finish)
            end[idx] = t
            ctx = base.pop(idx) + n_step - join_step.pop(idx)
            kv_used -= ctx
            ctx_sum -= ctx
            running -= 1
        # Step 3: a full cache preempts the newest requests (recompute later)
        while kv_used > kv_tokens and running > 1:
            idx = joined.pop()
            if idx not in base:
                continue
            ctx = base.pop(idx) + n_step - join_step.pop(idx)
            kv_used -= ctx
            ctx_sum -= ctx
            running -= 1
            preempted += 1
            finish = [f for f in finish if f[1] != idx]
            heapq.heapify(finish)
            waiting.appendleft((idx, ctx - requests[idx].prompt, t + recompute(ctx)))
    return end, batch_sum / max(n_step, 1), preempted, t, busy, n_step


def simulate(
    requests: list[Request],
    rate: float,
    config: SimConfig,
    prefill_step: PrefillStep,
    decode_step: DecodeStep,
    kv_transfer: Callable[[int], float],
    seed: int = 0,
) -> SimResult:
    """Run one prefill rank at rate / prefill_ranks and one decode rank at rate / decode_ranks
    on the same `requests`; request k's latencies combine both ranks' k-th outcomes."""
    n = len(requests)
    p_arr = poisson_arrivals(n, rate / config.prefill_ranks, seed)
    first, busy, p_end = run_prefill(
        prefill_step, requests, p_arr, config.chunk_tokens, config.max_queued_tokens
    )
    d_arr = poisson_arrivals(n, rate / config.decode_ranks, seed + 1)

    def recompute(ctx: int) -> float:
        return prefill_step(ctx, 1, 0.0)

    last, mean_batch, preempted, d_end, d_busy, d_steps = run_decode(
        decode_step, requests, d_arr, config.max_batch, config.kv_tokens, recompute
    )
    # The router reserves a request's KV blocks on a decode rank before its prefill, and the
    # rank answers between its steps: an arrival that finds the rank stepping (its busy
    # fraction) waits out the rest of that step (uniform over a mean step), before the prefill.
    rng = random.Random(seed + 2)
    d_util, d_step_s = d_busy / max(d_end, 1e-12), d_busy / max(d_steps, 1)
    ttft, tpot, e2e = [], [], []
    for k, r in enumerate(requests):
        reserve_s = rng.uniform(0.0, d_step_s) if rng.random() < d_util else 0.0
        if first[k] is None:
            ttft.append(None), tpot.append(None), e2e.append(None)
            continue
        t1 = reserve_s + first[k] - p_arr[k]
        decode_s = kv_transfer(r.prompt) + last[k] - d_arr[k]
        ttft.append(t1)
        tpot.append(decode_s / (r.output - 1) if r.output > 1 else None)
        e2e.append(t1 + decode_s)
    skip = int(n * config.warmup_fraction)
    admitted = [r for r, f in zip(requests, first) if f is not None]
    return SimResult(
        ttft[skip:], tpot[skip:], e2e[skip:], busy / p_end, mean_batch, preempted,
        sum(r.prompt for r in admitted) / p_end, sum(r.output - 1 for r in requests) / d_end,
        max(p_end, d_end), d_busy / d_end,
    )  # fmt: skip


def percentile(values: list[float | None], q: float) -> float | None:
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(q / 100 * len(xs)))]


def goodput_fraction(result: SimResult, slo_ttft: float, slo_tpot: float) -> float:
    """Share of requests that were admitted and met both SLOs."""
    ok = sum(
        1
        for a, b in zip(result.ttft_s, result.tpot_s)
        if a is not None and a <= slo_ttft and (b is None or b <= slo_tpot)
    )
    return ok / max(len(result.ttft_s), 1)


def mean(values: list[float | None]) -> float:
    return statistics.fmean(v for v in values if v is not None)
