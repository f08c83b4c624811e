"""A rank's metrics: bucket arithmetic by hand, an exposition that carries every series of the
catalog (pre-created at 0), and counters that equal what the engine provably did."""

import asyncio
import urllib.request

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from decode_workers import DecodeWorker
from engine import LLM, EngineConfig, SamplingParams
from engine.metrics.catalog import RANK, specs
from engine.metrics.rank import HistogramStats, RankCollector, RankStats
from engine.rank import RankConfig
from engine.rendezvous import Rendezvous
from kernels.backend import ENV_VAR
from kernels.cpu.build import cpu_kernels

SOLO = Rendezvous("unused", "127.0.0.1", 0)  # a one-rank pool meets nobody


def scrape(stats: RankStats, gauges=dict) -> dict[str, list]:
    registry = CollectorRegistry()
    registry.register(RankCollector(stats, gauges, "m", "decode", 1))
    text = generate_latest(registry).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def value(samples, name: str, **labels: str) -> float:
    (match,) = [
        s.value
        for s in samples
        if s.name == name and all(s.labels[k] == v for k, v in labels.items())
    ]
    return match


def test_histogram_buckets_are_cumulative_by_hand():
    h = HistogramStats((1.0, 2.0, 5.0))
    for v in (0.5, 1.0, 1.5, 7.0):
        h.observe(v)
    assert h.counts == [2, 1, 0, 1]  # <= 1, (1, 2], (2, 5], > 5
    assert h.buckets() == [("1.0", 2), ("2.0", 3), ("5.0", 3), ("+Inf", 4)]
    assert h.sum == 10.0


def test_every_rank_series_is_exposed_with_its_labels_and_starts_at_zero():
    families = scrape(RankStats())
    for spec in specs(RANK):
        if spec.kind == "gauge":
            continue  # live state: comes from the gauges callable
        family = spec.name.removesuffix("_total")
        assert family in families, spec.name
        for sample in families[family]:
            assert (sample.labels["model_name"], sample.labels["pool"]) == ("m", "decode")
            assert sample.labels["rank"] == "1"
    samples = families["epcluster_kv_reservations"]
    for outcome in ("granted", "rejected", "expired", "released", "started"):
        assert value(samples, "epcluster_kv_reservations_total", outcome=outcome) == 0.0


def test_engine_counters_equal_the_work_done():
    llm = LLM("tiny-random", block_size=4)
    prompts = [list(range(5, 25)), list(range(5, 13)) + [100, 101]]  # a shared prefix
    llm.generate(prompts[:1], SamplingParams(max_tokens=6, ignore_eos=True))
    llm.generate(prompts[1:], SamplingParams(max_tokens=6, ignore_eos=True))
    engine = llm.engine
    families = scrape(engine.stats)
    moe_layers, top_k = len(engine.model.config.moe_layers), engine.model.config.num_experts_per_tok
    routed = value(families["epcluster_routed_tokens"], "epcluster_routed_tokens_total")
    assert routed == engine.num_computed_tokens * moe_layers * top_k
    queried = value(
        families["epcluster_prefix_cache_queries"], "epcluster_prefix_cache_queries_total"
    )
    hits = value(families["epcluster_prefix_cache_hits"], "epcluster_prefix_cache_hits_total")
    assert (queried, hits) == (20 + 10, 8)  # the second prompt reuses two blocks of 4
    steps = value(
        families["epcluster_step_duration_seconds"], "epcluster_step_duration_seconds_count"
    )
    assert steps == engine.num_steps
    tokens = value(families["epcluster_step_tokens"], "epcluster_step_tokens_sum")
    assert tokens == engine.num_computed_tokens


@pytest.mark.parametrize("mode", ["reference", "auto"])
def test_the_rank_reports_which_kernels_serve_it(mode, monkeypatch):
    """A rank (no Ray: a DecodeWorker alone) exposes epcluster_kernels_info{kernels=...} = 1 on
    its /metrics and the same value in its status: the references when forced, else the
    compiled kernels for this CPU's vectors where they built."""
    monkeypatch.setenv(ENV_VAR, mode)
    expected = "reference"
    if mode == "auto" and cpu_kernels() is not None:
        expected = f"cpu-{torch.backends.cpu.get_cpu_capability().lower()}"

    async def main() -> tuple[str, dict]:
        decode = DecodeWorker(RankConfig("decode", 0, 1, EngineConfig(model="tiny-random")))
        await decode.join(SOLO)
        try:
            url = f"http://{decode.status().metrics_endpoint}/metrics"
            text = await asyncio.to_thread(lambda: urllib.request.urlopen(url).read().decode())
            families = {f.name: f.samples for f in text_string_to_metric_families(text)}
            return decode.status().kernels, families
        finally:
            decode.stop()

    kernels, families = asyncio.run(main())
    assert kernels == expected
    (sample,) = families["epcluster_kernels_info"]
    assert sample.labels["kernels"] == expected and sample.value == 1.0
    assert (sample.labels["pool"], sample.labels["rank"]) == ("decode", "0")
