"""The KV tiers' Prometheus series on a rank: labelled by tier, at 0 while the tiers are off, and
equal to what the engine provably moved (blocks written, read back, bytes) once they are on;
a rank's stop writes what the tiers still had queued."""

import asyncio
import time

import pytest
import torch
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine import LLM, EngineConfig, SamplingParams
from engine.config import KVTiersConfig
from engine.kv_tiers.disk import DiskTier
from engine.kv_tiers.stats import TierStats
from engine.messages import GenerateRequest
from engine.metrics.rank import RankCollector, RankStats
from engine.metrics.tiers import tier_series
from engine.rank import RankConfig
from engine.rendezvous import Rendezvous
from prefill_workers import PrefillWorker
from tests.prometheus import binary, promtool

BS = 4
BLOCK_BYTES = 3 * BS * 40 * 4  # tiny-random: 3 layers x BS x C 40 x float32
GREEDY = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


def scrape(stats: RankStats, gauges) -> dict[str, list]:
    registry = CollectorRegistry()
    registry.register(RankCollector(stats, gauges, "m", "prefill", 0))
    text = generate_latest(registry).decode()
    return {f.name: f.samples for f in text_string_to_metric_families(text)}


def sample(families: dict[str, list], name: str, tier: str | None = None) -> float:
    family = families[name.removesuffix("_total")]
    (value,) = [s.value for s in family if s.name == name and s.labels.get("tier") == tier]
    return value


def test_tier_counters_start_at_zero_with_the_tiers_off():
    families = scrape(RankStats(), dict)
    for tier in ("host", "disk"):
        assert sample(families, "epcluster_kv_tier_hits_total", tier) == 0.0
        assert sample(families, "epcluster_kv_tier_written_bytes_total", tier) == 0.0
    assert tier_series({}) == {}


@pytest.mark.skipif(binary("promtool") is None, reason="promtool missing: run `make prometheus`")
def test_promtool_checks_a_scrape_with_the_tiers_on():
    stats = {"host": TierStats(hits=3, bytes_read=30), "disk": TierStats(), "dropped_writes": 2}
    registry = CollectorRegistry()
    registry.register(RankCollector(RankStats(), lambda: tier_series(stats), "m", "prefill", 0))
    text = generate_latest(registry).decode()
    assert (
        'epcluster_kv_tier_hits_total{model_name="m",pool="prefill",rank="0",tier="host"} 3.0'
        in text
    )
    result = promtool("check", "metrics", stdin=text)
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_tier_series_count_what_the_engine_moved():
    llm = LLM(
        "tiny-random", block_size=BS, kv_tiers=KVTiersConfig(host_bytes=10**6), kv_cache_bytes=10**6
    )
    prompt = torch.randint(2, 512, (32,), generator=torch.Generator().manual_seed(3)).tolist()
    llm.generate([prompt], GREEDY)
    llm.engine.tiers.flush()
    # the 8 full prompt blocks are written once, plus the one the decode filled (35 tokens)
    written = (32 + 4 - 1) // BS
    engine = llm.engine
    families = scrape(engine.stats, lambda: tier_series(engine.kv_tier_stats()))
    assert sample(families, "epcluster_kv_tier_written_bytes_total", "host") == (
        written * BLOCK_BYTES
    )
    assert sample(families, "epcluster_kv_tier_blocks", "host") == written
    assert sample(families, "epcluster_kv_tier_bytes", "host") == written * BLOCK_BYTES
    assert sample(families, "epcluster_kv_tier_dropped_writes_total") == 0.0
    assert sample(families, "epcluster_kv_tier_written_bytes_total", "disk") == 0.0  # no disk


def test_a_rank_stop_writes_the_queued_blocks(tmp_path, monkeypatch):
    """The prefill rank's stop closes the store: every offered block is on disk after it, as
    a restarted rank's scan finds, though the disk is slow (a write takes 50 ms: the queue
    still holds blocks when the prefill returns)."""
    put = DiskTier.put

    def slow_put(self: DiskTier, key: object, kv: torch.Tensor) -> None:
        time.sleep(0.05)
        put(self, key, kv)

    monkeypatch.setattr(DiskTier, "put", slow_put)
    tiers = KVTiersConfig(disk_path=str(tmp_path), disk_bytes=10**8)
    config = EngineConfig(model="tiny-random", block_size=BS, kv_tiers=tiers)
    prompt = torch.randint(2, 512, (40,), generator=torch.Generator().manual_seed(4)).tolist()

    async def main() -> int:
        rank = PrefillWorker(RankConfig("prefill", 0, 1, config, rank_metrics_port=None))
        await rank.join(Rendezvous("unused", "127.0.0.1", 0))
        try:
            request = GenerateRequest("r", prompt, GREEDY, seed=0, kv_fallback=True)
            await rank.prefill(request)
            return await rank.call(lambda e: e.tiers.stats.blocks_offered)
        finally:
            rank.stop()

    offered = asyncio.run(main())
    monkeypatch.setattr(DiskTier, "put", put)
    assert offered == 40 // BS  # the prompt's full blocks
    assert DiskTier(str(tmp_path), 10**8).stats.blocks == offered
