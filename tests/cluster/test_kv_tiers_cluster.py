"""The KV tiers in a cluster (local Ray, tiny-random): the prefill pool, set from the config with
a small paged cache, a host budget and a disk directory, serves a long prefix that other prompts
evicted from its paged cache out of its tiers: the same tokens as the in-process engine, the
usage's cached tokens and the rank's tier hits count it, and no block is held afterwards."""

import urllib.request

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from engine import LLM, SamplingParams
from router.client import InferenceClient
from tests.cluster.conftest import start_cluster, wait_quiet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

BS = 16  # the engine's default block size
BLOCK_BYTES = 3 * BS * 40 * 4  # tiny-random: 3 layers x BS x C 40 x float32
NUM_BLOCKS = 24  # the prefill rank's paged cache: a few prompts evict the prefix
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def tokens(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (length,), generator=gen).tolist() for _ in range(n)]


def tier_hits(status) -> dict[str, float]:
    """epcluster_kv_tier_hits_total of the prefill ranks, by tier (their /metrics)."""
    hits: dict[str, float] = {}
    for pool in status.pools:
        if pool.name != "prefill":
            continue
        for rank in pool.ranks:
            url = f"http://{rank.metrics_endpoint}/metrics"
            with urllib.request.urlopen(url, timeout=30) as r:
                page = r.read().decode()
            for family in text_string_to_metric_families(page):
                for s in family.samples:
                    if s.name == "epcluster_kv_tier_hits_total":
                        hits[s.labels["tier"]] = hits.get(s.labels["tier"], 0.0) + s.value
    return hits


def test_an_evicted_prefix_is_served_from_the_prefill_tiers(tmp_path):
    tiers = {"host_bytes": 8 * BLOCK_BYTES, "disk_path": str(tmp_path), "disk_bytes": 10**8}
    cluster = start_cluster(
        {
            "prefill.num_ranks": 1,
            "decode.num_ranks": 1,
            "prefill.engine": {"kv_cache_bytes": NUM_BLOCKS * BLOCK_BYTES, "kv_tiers": tiers},
        }
    )
    prefix = tokens(1, 10 * BS, seed=5)[0]  # 10 blocks: more than the host tier's 8
    first, again = prefix + [7, 8, 9], prefix + [11, 12]
    fillers = tokens(4, 12 * BS, seed=6)  # 48 blocks through a 24-block paged cache
    try:
        with InferenceClient(cluster.address, timeout=120) as client:

            def run(prompt: list[int]) -> tuple[list[int], int]:
                messages = list(client.generate(prompt, GREEDY))
                ids = sum((list(m.token_ids) for m in messages), [])
                return ids, messages[-1].usage.cached_tokens

            run(first)
            for filler in fillers:
                run(filler)
            before = tier_hits(wait_quiet(client))
            ids, cached = run(again)
            after = tier_hits(wait_quiet(client))
            want = LLM("tiny-random").generate([again], GREEDY)[0]
            assert ids == want.token_ids
            # the prefix's 10 blocks: none left in the paged cache, all from host or disk
            assert cached == 10 * BS
            served = sum(after.values()) - sum(before.values())
            assert served == 10, (before, after)
            assert after["disk"] > before["disk"]  # 8 host blocks cannot hold all 10
            status = wait_quiet(client)
            for pool in status.pools:
                for rank in pool.ranks:
                    assert rank.kv_used_blocks == 0, (pool.name, rank.rank)
    finally:
        cluster.shutdown()
