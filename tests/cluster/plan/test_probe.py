"""The CPU entry comes from the probe's cache (no measuring when one is there), whole or as one
single-threaded rank among busy threads."""

import json

import pytest

from cluster.plan.probe import cpu_hardware, get_hardware

MEASURED = {
    "read_bw": 4e10, "fp32_flops": 2e11, "read_bw_1t": 3e10, "fp32_flops_1t": 1.2e11,
    "all_to_all_bw": 2e9, "exchange_latency_s": 1e-4, "exchange_latency_busy_s": 5e-4,
    "threads": 2, "cores": 2,
    "step_overhead_s": 2e-3, "sequence_overhead_s": 1e-4, "ep_step_overhead_s": 4e-3,
    "ep_sequence_overhead_s": 2e-4, "prefill_token_overhead_s": 1e-5,
}  # fmt: skip


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EPCLUSTER_CACHE", str(tmp_path))
    (tmp_path / "probe.json").write_text(json.dumps(MEASURED))


def test_cpu_hardware_from_the_cache(cache):
    hw = get_hardware("cpu")
    assert hw.read_bw == 4e10 and hw.peak("fp32") == 2e11  # measured: efficiency 1
    assert hw.intra_node_bw == hw.inter_node_bw == 2e9
    assert "probe.py" in hw.sources["all"]
    assert (hw.step_overhead_s, hw.sequence_overhead_s, hw.exchange_latency_s) == (2e-3, 1e-4, 1e-4)


@pytest.mark.parametrize(
    "busy, bw, flops",
    [
        (1.0, 3e10, 1.2e11),  # alone: one thread's
        (2.0, 2e10, 1e11),  # two on two cores: each half of what all threads reach
        (4.0, 1e10, 5e10),  # four on two cores: a quarter of the machine each
        (1.5, 4e10 / 1.5, 1.2e11),  # bandwidth: the shared total; FLOPs: one thread's
    ],
)
def test_a_rank_shares_cores_and_bandwidth(cache, busy, bw, flops):
    """min(one thread's x min(1, cores / busy), all threads' / busy), hand-computed."""
    hw = cpu_hardware(busy_threads=busy)
    assert hw.read_bw == pytest.approx(bw)
    assert hw.peak("fp32") == pytest.approx(flops)


@pytest.mark.parametrize("busy, latency", [(1.0, 1e-4), (2.0, 1e-4), (3.0, 3e-4), (4.0, 5e-4)])
def test_exchange_latency_grows_with_the_threads_beyond_two(cache, busy, latency):
    """Measured alone (2 threads busy) and with 2 + cores busy; linear between, hand-computed."""
    assert cpu_hardware(busy_threads=busy).exchange_latency_s == pytest.approx(latency)


@pytest.mark.parametrize("busy, slow", [(1.0, 1.0), (2.0, 1.0), (3.0, 1.5), (5.0, 2.5)])
def test_measured_overheads_stretch_when_threads_outnumber_cores(cache, busy, slow):
    """The overheads are one thread's Python time, measured alone: on a core it gets 2 / busy
    of, they take busy / 2 times as long (hand-computed for 2 cores)."""
    hw = cpu_hardware(busy_threads=busy)
    got = (hw.step_overhead_s, hw.sequence_overhead_s, hw.ep_step_overhead_s,
           hw.ep_sequence_overhead_s, hw.prefill_token_overhead_s)  # fmt: skip
    assert got == pytest.approx(tuple(slow * x for x in (2e-3, 1e-4, 4e-3, 2e-4, 1e-5)))
