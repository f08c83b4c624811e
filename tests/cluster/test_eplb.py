"""Live expert load balancing on a real cluster: the trained tiny model (its routing is skewed, as
a real model's is) on EP = 2 pools serves English; a rebalance in the middle of decoding changes
no token of any in-flight request, the measured imbalance drops, no block leaks, and the saved
placement starts a new cluster balanced."""

import asyncio
import json

import pytest

from engine import LLM, SamplingParams
from router.client import AsyncInferenceClient, InferenceClient
from tests.cluster.conftest import start_cluster, wait_quiet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def english(n: int, offset: int = 0) -> list[str]:
    import pydoc_data.topics as topics

    words = " ".join(topics.topics[k] for k in sorted(topics.topics)).split()
    return [" ".join(words[(offset + i) * 89 : (offset + i) * 89 + 50]) for i in range(n)]


def balancedness(pools) -> dict[str, float]:
    return {pool.pool: pool.balancedness() for pool in pools}


def loads_since(before, after):
    return [a.since(b) for b, a in zip(before, after, strict=True)]


@pytest.fixture
def cluster():  # gone before the next test starts a cluster of its own on the same Ray CPUs
    c = start_cluster({"model": "tiny", "engine.eplb_min_gain": 0.0})
    yield c
    c.shutdown()


def test_a_rebalance_mid_decoding_changes_no_token_and_evens_the_load(cluster, tmp_path_factory):
    prompts = english(24)
    params = [
        SamplingParams(max_tokens=48 + i, temperature=0.0 if i % 2 else 0.7, seed=i,
                       ignore_eos=True)
        for i in range(len(prompts))
    ]  # fmt: skip
    want = LLM("tiny").generate(prompts, params)
    result = {}

    async def run():
        received = {"tokens": 0}
        async with AsyncInferenceClient(cluster.address, timeout=600) as client:

            async def one(i):
                tokens, text = [], ""
                async for msg in client.generate(prompts[i], params[i]):
                    tokens += msg.token_ids
                    text += msg.text
                    received["tokens"] += len(msg.token_ids)
                return tokens, text

            async def rebalance_mid_decoding():
                while received["tokens"] < 300:
                    await asyncio.sleep(0.05)
                with InferenceClient(cluster.address, timeout=300) as sync:
                    # the load so far, on the old placement: what the rebalance works from
                    result["before"] = await asyncio.to_thread(sync.expert_load)
                    result["tokens_then"] = received["tokens"]
                    result["pools"] = await asyncio.to_thread(sync.rebalance)

            rebalance = asyncio.create_task(rebalance_mid_decoding())
            outs = await asyncio.gather(*(one(i) for i in range(len(prompts))))
            await rebalance
            return outs

    outs = asyncio.run(run())
    total = sum(len(o.token_ids) for o in want)
    assert result["tokens_then"] < total  # the streams were mid-decoding
    for i, ((tokens, text), expected) in enumerate(zip(outs, want, strict=True)):
        assert tokens == expected.token_ids and text == expected.text, i
    for pool, status in result["pools"]:
        assert status.outcome == "applied" and status.slots_moved > 0, (pool, status)
        assert status.balancedness_after > status.balancedness_before, (pool, status)
        assert status.from_checkpoint == 0
    with InferenceClient(cluster.address, timeout=300) as client:
        wait_quiet(client)
        before = balancedness(result["before"])
        # the same kind of load again, on the new placement (counts restarted at the switch)
        mark = client.expert_load()
        for prompt in english(24, offset=24):
            client.complete(prompt, SamplingParams(max_tokens=24, temperature=0))
        after = balancedness(loads_since(mark, client.expert_load()))
        for pool in ("prefill", "decode"):
            assert after[pool] > before[pool], (pool, before, after)
        status = wait_quiet(client)
        for p in status.pools:
            assert all(r.rebalance.number >= 1 and not r.rebalance.moving for r in p.ranks)
        # save the placement, for the next test
        path = tmp_path_factory.getbasetemp() / "placement.json"
        from cluster.cli import main

        assert main(["rebalance", "--target", cluster.address, "--save", str(path)]) == 0
        saved = json.loads(path.read_text())
        for pool in client.cluster_status().pools:
            layer = min(pool.ranks[0].expert_ids)
            held = sum((r.expert_ids[layer] for r in pool.ranks), [])
            assert held == saved[pool.name]["phy2log"][saved[pool.name]["layers"].index(layer)]
    print(f"measured balancedness before {before}, after {after}")


def test_a_saved_placement_starts_a_cluster(tmp_path_factory):
    path = tmp_path_factory.getbasetemp() / "placement.json"
    saved = json.loads(path.read_text())
    c = start_cluster(
        {"model": "tiny", "prefill.placement_file": str(path), "decode.placement_file": str(path)}
    )
    try:
        with InferenceClient(c.address, timeout=120) as client:
            for pool in client.cluster_status().pools:
                ranks = pool.ranks
                layer = min(ranks[0].expert_ids)
                held = sum((r.expert_ids[layer] for r in ranks), [])
                position = saved[pool.name]["layers"].index(layer)
                assert held == saved[pool.name]["phy2log"][position], pool.name
            params = SamplingParams(max_tokens=16, temperature=0)
            out = client.complete("A class", params)
            assert out.token_ids == LLM("tiny").generate("A class", params)[0].token_ids
    finally:
        c.shutdown()
