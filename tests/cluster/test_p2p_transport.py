"""The cluster with the torch.distributed point-to-point KV transport (gloo here, NCCL on GPUs),
serving the trained default model: the same tokens and text as the in-process engine, and no
block left behind; a transfer that is lost resumes its request through the object store, the
transport group is rebuilt, and later transfers go point to point again; no pool re-forms for it
(a short routing.kv_lease_s keeps the lost transfer's wait short; test_p2p_timeouts runs the
shipped defaults)."""

import asyncio
import time

import pytest
import ray
import torch

from engine import LLM, SamplingParams
from router.client import AsyncInferenceClient, InferenceClient
from tests.cluster.conftest import start_cluster, wait_quiet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster(
        {
            "model": "tiny",
            "routing.kv_p2p": True,
            "prefill.num_ranks": 1,
            "decode.num_ranks": 2,
            "routing.kv_lease_s": 3.0,
        }
    )
    yield c
    c.shutdown()


def workload(seed: int, n: int = 6):
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(2, 512, (int(k),), generator=gen).tolist() for k in
               torch.randint(3, 90, (n,), generator=gen)]  # fmt: skip
    prompts += ["In Python,", "A class"]  # a test_tiny_preset prompt; the README's
    params = [
        SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
        for i in range(n + 2)
    ]
    return prompts, params


def run(cluster, prompts, params):
    async def go():
        async with AsyncInferenceClient(cluster.address, timeout=120) as client:
            return await asyncio.gather(*(client.complete(p, sp) for p, sp in zip(prompts, params)))

    return asyncio.run(go())


def p2p_received(cluster) -> int:
    """KV transfers the decode ranks have received point to point."""
    refs = [
        a.__ray_call__.remote(lambda self: self.transport.num_received)
        for a in cluster.pools["decode"].actors
    ]
    return sum(ray.get(refs, timeout=30))


def assert_quiet(cluster):
    with InferenceClient(cluster.address, timeout=60) as client:
        status = wait_quiet(client)
        for pool in status.pools:
            assert all(r.kv_used_blocks == 0 and r.num_reserved == 0 for r in pool.ranks)


def test_p2p_transport_gives_the_engine_tokens(cluster):
    prompts, params = workload(3)
    want = LLM("tiny").generate(prompts, params)
    before = p2p_received(cluster)
    got = run(cluster, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [o.text for o in got] == [o.text for o in want]
    assert p2p_received(cluster) - before == len(prompts)  # every KV went point to point
    assert_quiet(cluster)


def test_a_lost_send_falls_back_to_the_object_store_and_the_group_is_rebuilt(cluster):
    prompts, params = workload(4)
    want = LLM("tiny").generate(prompts, params)
    backend = cluster.backend
    fallbacks, rebuilds = backend.num_kv_fallbacks, backend.num_kv_rebuilds
    reforms = [backend.pools[name].num_reforms for name in ("prefill", "decode")]
    ray.get(cluster.pools["prefill"].actors[0].debug_drop_kv_sends.remote(1), timeout=30)

    got = run(cluster, prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert backend.num_kv_fallbacks > fallbacks  # at least the lost one went as an object
    end = time.monotonic() + 60
    while backend.num_kv_rebuilds == rebuilds and time.monotonic() < end:
        time.sleep(0.1)
    assert backend.num_kv_rebuilds == rebuilds + 1
    assert [backend.pools[name].num_reforms for name in ("prefill", "decode")] == reforms
    assert_quiet(cluster)

    before = p2p_received(cluster)  # the rebuilt group carries the next transfers
    prompts, params = workload(5)
    got = run(cluster, prompts, params)
    assert [o.token_ids for o in got] == [
        o.token_ids for o in LLM("tiny").generate(prompts, params)
    ]
    assert p2p_received(cluster) - before == len(prompts)
    assert_quiet(cluster)
