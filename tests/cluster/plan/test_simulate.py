"""The simulator against closed forms: an M/D/1 prefill rank, a saturated decode batch; and
its bookkeeping (chunking, admission, preemption)."""

import statistics

import pytest

from cluster.plan.simulate import (
    SimConfig,
    goodput_fraction,
    percentile,
    poisson_arrivals,
    run_decode,
    run_prefill,
    simulate,
)
from cluster.plan.workload import Request


@pytest.mark.parametrize("rho", [0.3, 0.7])
def test_prefill_rank_is_md1(rho):
    """One prompt per step (budget = prompt), a constant step S, Poisson arrivals: the mean
    wait is rho S / (2 (1 - rho))."""
    s = 0.1
    reqs = [Request(100, 2, 0)] * 60000
    arrivals = poisson_arrivals(len(reqs), rho / s, seed=3)
    done, busy, end = run_prefill(lambda t, n, c: s, reqs, arrivals, 100, 10**9)
    waits = [d - a - s for d, a in zip(done, arrivals)]
    expected = rho * s / (2 * (1 - rho))
    assert sum(waits) / len(waits) == pytest.approx(expected, rel=0.06)
    assert busy / end == pytest.approx(rho, rel=0.03)


def test_saturated_decode_batch_is_batch_over_step():
    """All requests present at once: throughput = batch / step time."""
    reqs = [Request(10, 101, 0)] * 640
    last, mean_batch, preempted, end, busy, steps = run_decode(
        lambda b, c: 0.02, reqs, [0.0] * 640, 64, 10**9, lambda c: 0.0
    )
    assert 640 * 100 / end == pytest.approx(64 / 0.02)
    assert mean_batch == 64 and preempted == 0 and steps == 10 * 100
    assert busy == pytest.approx(end)  # saturated: it steps all the time
    assert sorted(set(last)) == pytest.approx([0.02 * 100 * k for k in range(1, 11)])


def test_decode_step_sees_batch_and_context():
    seen = []
    reqs = [Request(10, 3, 0), Request(20, 3, 0)]
    run_decode(lambda b, c: seen.append((b, c)) or 1.0, reqs, [0.0, 0.0], 8, 10**9, lambda c: 0)
    # the prompt and the first token (from prefill), then one more a step
    assert seen == [(2, 16.0), (2, 17.0)]


def test_preemption_when_the_cache_is_full():
    """A cache of 3,840 positions for 64 requests growing to 110: the newest are preempted,
    recomputed later, and every request still gets all its tokens."""
    reqs = [Request(10, 101, 0)] * 640
    last, _, preempted, end, _, _ = run_decode(
        lambda b, c: 0.02, reqs, [0.0] * 640, 64, 64 * 60, lambda c: 0.1
    )
    assert preempted > 0
    assert all(t > 0 for t in last)
    assert 640 * 100 / end < 64 / 0.02


def test_chunked_prefill_and_admission():
    steps = []
    reqs = [Request(250, 2, 50), Request(100, 2, 0)]

    def step(tokens, seqs, cached):
        steps.append((tokens, seqs, cached))
        return 1.0

    done, _, _ = run_prefill(step, reqs, [0.0, 0.0], 128, 10**9)
    # 200 new positions of the first prompt over two steps, the second prompt joins the second
    assert steps[0] == (128, 1, 50.0)
    assert steps[1] == (128, 2, 25.0)
    assert done == [2.0, 3.0]
    refused, _, _ = run_prefill(lambda *a: 1.0, reqs, [0.0, 0.0], 128, 250)
    assert refused[1] is None and refused[0] == 2.0


def test_simulate_combines_both_ranks_and_goodput():
    reqs = [Request(100, 11, 0)] * 2000
    config = SimConfig(prefill_ranks=2, decode_ranks=4, chunk_tokens=100, max_batch=8)
    result = simulate(reqs, 5.0, config, lambda t, n, c: 0.1, lambda b, c: 0.01, lambda n: 0.0)
    assert percentile(result.ttft_s, 0) == pytest.approx(0.1)  # an idle rank: one step
    assert percentile(result.tpot_s, 0) == pytest.approx(0.01)
    assert goodput_fraction(result, 10.0, 1.0) == 1.0
    assert goodput_fraction(result, 0.05, 1.0) == 0.0


def test_a_busy_decode_rank_delays_the_reservation_by_half_a_step():
    """The router reserves on a decode rank before the prefill, answered between its steps: an
    arrival waits out the step in progress, uniform over [0, step] when the rank steps (its busy
    fraction u) -> mean TTFT = prefill step + u x step / 2 (hand-computed; the prefill pool so
    large that a prompt never queues)."""
    reqs = [Request(100, 401, 0)] * 4000
    config = SimConfig(prefill_ranks=10**6, decode_ranks=1, chunk_tokens=100, max_batch=10**4)
    step = 0.04  # the decode rank: 4 s a request, ~20 at once at 5 req/s: busy almost always
    result = simulate(reqs, 5.0, config, lambda t, n, c: 0.1, lambda b, c: step, lambda n: 0.0)
    u = result.decode_busy
    assert 0.9 < u <= 1.0
    waits = [t - 0.1 for t in result.ttft_s]
    assert min(waits) >= -1e-12 and max(waits) <= step + 1e-12
    assert statistics.fmean(waits) == pytest.approx(u * step / 2, rel=0.08)
    idle = simulate(reqs[:50], 0.01, config, lambda t, n, c: 0.1, lambda b, c: 0.001, lambda n: 0)
    assert percentile(idle.ttft_s, 50) == pytest.approx(0.1)  # an idle decode rank answers now
