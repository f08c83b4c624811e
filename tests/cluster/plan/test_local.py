"""The local deployment's sharing of the cores (cluster/plan/local.py), the serving work's
rates, and bench/serving_cpu.py's fit: hand-computed cases."""

import json

import pytest

from bench.serving_cpu import fit
from cluster.plan.local import LocalCluster, core_shares, rank_shares
from cluster.plan.probe import cpu_hardware
from tests.cluster.plan.test_probe import MEASURED


def test_serving_work_lands_where_cores_are_idle():
    """1 + 1 on 2 cores, prefill busy 0.2, decode 0.8, serving 0.3 cores: the idle time is
    (1 - 0.2) + (1 - 0.8) = 1.0, so prefill's core takes 0.3 x 0.8 = 0.24 of it, decode's 0.06."""
    p, d = core_shares(2, 1, 1, 0.2, 0.8, 0.3)
    assert (p, d) == pytest.approx((0.76, 0.94))


def test_empty_cores_take_their_part():
    """4 cores, 1 + 1 as above: idle 1.0 + 2 empty cores = 3.0; prefill loses 0.3 x 0.8 / 3."""
    p, d = core_shares(4, 1, 1, 0.2, 0.8, 0.3)
    assert (p, d) == pytest.approx((1 - 0.08, 1 - 0.02))


@pytest.mark.parametrize(
    "cores, p, d, b_p, b_d",
    [(2, 2, 2, 0.2, 0.8), (2, 1, 2, 0.1, 0.1), (2, 1, 1, 1.0, 1.0)],
)
def test_no_core_of_its_own_leaves_the_busy_thread_sharing(cores, p, d, b_p, b_d):
    """More rank threads than cores (or no idle time): the busy-thread sharing alone."""
    assert core_shares(cores, p, d, b_p, b_d, 0.3) == (1.0, 1.0)


def test_a_core_share_slows_compute_bandwidth_and_overheads(tmp_path, monkeypatch):
    """A rank thread with 3/4 of its core: 3/4 of one thread's bandwidth and FLOP/s (below the
    machine's shared totals at 1.5 busy threads) and its overheads 4/3 as long."""
    monkeypatch.setenv("EPCLUSTER_CACHE", str(tmp_path))
    (tmp_path / "probe.json").write_text(json.dumps(MEASURED))
    hw = cpu_hardware(busy_threads=1.5, core_share=0.75)
    assert hw.read_bw == pytest.approx(min(3e10 * 0.75, 4e10 / 1.5))
    assert hw.peak("fp32") == pytest.approx(1.2e11 * 0.75)
    assert hw.step_overhead_s == pytest.approx(2e-3 / 0.75)
    # the busy-thread share wins where it is the smaller: 4 threads on 2 cores get 1/2
    assert cpu_hardware(busy_threads=4.0, core_share=0.75).step_overhead_s == pytest.approx(4e-3)


def test_serving_work_per_request_and_per_step():
    c = LocalCluster(1, 1, background_busy=0.1, cpu_s_per_request=0.05, cpu_s_per_step=0.002)
    assert c.other_busy(2.0, 60.0) == pytest.approx(0.1 + 0.1 + 0.12)
    with pytest.raises(ValueError, match="cpu_s_per_step"):
        LocalCluster(1, 1, cpu_s_per_step=-1.0)


def test_fit_recovers_the_constants_of_exact_points():
    truth = (0.09, 0.05, 0.0025)
    rates = [(0.0, 0.0), (0.3, 30.0), (0.6, 50.0), (1.9, 63.0)]
    points = [
        {"requests_per_s": r, "decode_steps_per_s": s, "serving_cores": bg + a * r + b * s}
        for bg, a, b in [truth]
        for r, s in rates
    ]
    got = fit(points)
    assert (got["background_busy"], got["cpu_s_per_request"], got["cpu_s_per_step"]) == (
        pytest.approx(truth)
    )
    assert got["max_residual_cores"] < 1e-9


def test_a_rank_computes_slower_beside_the_other_pools_busy_rank():
    """1 + 1 on 2 cores, corun factors 1.2 (prefill) and 1.1 (decode), busy 0.2 / 0.8, no
    serving work: prefill's share 1 / (1 + 0.2 x 0.8), decode's 1 / (1 + 0.1 x 0.2)."""
    measured = {"cores": 2, "corun_prefill": 1.2, "corun_decode": 1.1}
    p, d = rank_shares(measured, 1, 1, 0.2, 0.8, 0.0)
    assert (p, d) == pytest.approx((1 / 1.16, 1 / 1.02))
    # with the serving work too: the placement's share over the slowdown
    p, d = rank_shares(measured, 1, 1, 0.2, 0.8, 0.3)
    assert (p, d) == pytest.approx((0.76 / 1.16, 0.94 / 1.02))
    # without a core of its own (2 + 2 on 2 cores) neither: the busy-thread sharing alone
    assert rank_shares(measured, 2, 2, 0.2, 0.8, 0.3) == (1.0, 1.0)
    # a probe without the factors: no slowdown
    assert rank_shares({"cores": 2}, 1, 1, 0.2, 0.8, 0.0) == (1.0, 1.0)
