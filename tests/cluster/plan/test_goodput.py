"""bench/goodput.py's reading of guidellm's records, and the plan's prediction of a fixed
deployment that it sets beside them."""

import pytest

from bench.goodput_report import summarise
from cluster.plan.hardware import CATALOG
from cluster.plan.models import load_model
from cluster.plan.planner import ModelCosts, predict_fixed
from cluster.plan.workload import Workload


def _record(ttft_ms: float, itl_ms: float) -> dict:
    return {
        "time_to_first_token_ms": ttft_ms, "inter_token_latency_ms": itl_ms,
        "request_latency": ttft_ms / 1000 + 9 * itl_ms / 1000,
        "prompt_tokens": 100, "output_tokens": 10,
    }  # fmt: skip


def test_summarise_counts_goodput_against_both_slos():
    done = [_record(100, 10), _record(300, 10), _record(100, 50), _record(150, 20)]
    report = {"benchmarks": [{"duration": 2.0, "requests": {
        "successful": done, "errored": [{}], "incomplete": []}}]}  # fmt: skip
    s = summarise(report, slo_ttft=0.2, slo_tpot=0.03)
    assert s["requests"] == 4 and s["failed"] == 1
    assert s["goodput_rps"] == 2 / 2.0  # the first and the last meet both
    assert s["throughput_rps"] == 2.0 and s["output_tokens_per_s"] == 20.0
    assert s["ttft_p50_s"] == pytest.approx(0.125)
    assert s["tpot_p50_s"] == pytest.approx(0.015)


def test_predict_fixed_at_a_low_rate_is_one_step_per_token():
    """At 0.01 requests/s every request finds both ranks idle: its TTFT is one prefill step of
    its prompt, its TPOT a decode step of batch 1 (plus the KV transfer spread over the
    tokens), as the cost model times them."""
    costs = ModelCosts(load_model("small"), CATALOG["H100"], 1, "fp32", "fp32")
    work = Workload("low", 0.01, 128, 33)
    plan = predict_fixed(costs, work, 1, 1, slo_ttft=1.0, slo_tpot=1.0, samples=200)
    s = plan.summary()
    assert s["ttft_s"] == pytest.approx(costs.prefill_s(1, 128, 1, 0.0))
    lo, hi = costs.decode_s(1, 1, 129.0), costs.decode_s(1, 1, 161.0)
    assert lo <= s["tpot_s"] <= hi + 1e-3
    assert s["prefill_nodes"] == 1 and s["decode_nodes"] == 1
    assert s["goodput_rps"] == pytest.approx(0.01)


def test_summarise_records_delivered_rate_and_tpot():
    """bench/openloop.py's records: the delivered rate is n - 1 gaps over the span of the sends;
    TPOT is (last - first token) / (tokens - 1); a failed request counts only as failed."""
    from bench.goodput_report import summarise_records
    from bench.openloop import Record, arrivals

    recs = [
        Record(0.0, 0.0, 0.1, 1.0, 10, 100, None),  # TTFT 0.1, TPOT 0.1
        Record(1.0, 1.0, 1.5, 1.95, 10, 100, None),  # TTFT 0.5, TPOT 0.05
        Record(2.0, 2.0, 2.2, 3.1, 10, 100, None),  # TTFT 0.2, TPOT 0.1
        Record(4.0, 4.0, None, None, 0, 100, "HTTP 503"),
    ]
    s = summarise_records(recs, slo_ttft=0.3, slo_tpot=0.2)
    assert s["requests"] == 3 and s["failed"] == 1
    assert s["delivered_rps"] == pytest.approx(3 / 4.0)
    assert s["duration_s"] == pytest.approx(3.1)
    assert s["throughput_rps"] == pytest.approx(3 / 3.1)
    assert s["goodput_rps"] == pytest.approx(2 / 3.1)  # the second misses the TTFT SLO
    assert s["ttft_p50_s"] == pytest.approx(0.2) and s["tpot_p50_s"] == pytest.approx(0.1)
    times = arrivals(20000, 4.0, seed=1)  # seeded Poisson: mean gap 1 / rate
    assert times[0] == 0.0 and (len(times) - 1) / times[-1] == pytest.approx(4.0, rel=0.03)
    assert times == arrivals(20000, 4.0, seed=1)


def test_each_load_of_a_series_sends_prompts_of_its_own():
    """A prompt an earlier load sent would hit the prefix cache (ci: the calibration's later
    loads measured cached TTFTs): each level draws its own unique parts; the arrivals and the
    shared prefix stay the seed's."""
    from bench.openloop import OpenLoop, prompts

    levels = [OpenLoop("http://x", "small", 2.0, 50, 16, 8, 4, 32000, seed=3, level=i)
              for i in range(3)]  # fmt: skip
    drawn = [prompts(cfg) for cfg in levels]
    assert all(len(p) == 24 and p[:8] == drawn[0][0][:8] for ps in drawn for p in ps)
    uniques = [{tuple(p[8:]) for p in ps} for ps in drawn]
    assert [len(u) for u in uniques] == [50, 50, 50]
    assert not (uniques[0] & uniques[1]) and not (uniques[1] & uniques[2])
    assert not (uniques[0] & uniques[2])
    assert drawn[1] == prompts(levels[1])  # seeded
    assert all(min(t for p in ps for t in p) >= 2 for ps in drawn)  # not BOS/EOS
