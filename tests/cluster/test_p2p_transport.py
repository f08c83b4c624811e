"""The cluster with the torch.distributed point-to-point KV transport (gloo here, NCCL on GPUs),
serving the trained default model: the same tokens and text as the in-process engine, and no block
left behind."""

import asyncio

import pytest
import torch

from engine import LLM, SamplingParams
from router.client import AsyncInferenceClient, InferenceClient
from tests.cluster.conftest import start_cluster, wait_quiet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_p2p_transport_gives_the_engine_tokens():
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (5, 40, 90, 17, 64, 3)]
    prompts += ["In Python,", "A class"]  # a test_tiny_preset prompt; the README's, greedy
    params = [
        SamplingParams(max_tokens=12, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    want = LLM("tiny").generate(prompts, params)
    cluster = start_cluster(model="tiny", kv_transport="p2p", prefill_ranks=1, decode_ranks=2)
    try:

        async def run():
            async with AsyncInferenceClient(cluster.address, timeout=120) as client:
                return await asyncio.gather(
                    *(client.complete(p, sp) for p, sp in zip(prompts, params))
                )

        got = asyncio.run(run())
        assert [o.token_ids for o in got] == [o.token_ids for o in want]
        assert [o.text for o in got] == [o.text for o in want]
        with InferenceClient(cluster.address, timeout=60) as client:
            status = wait_quiet(client)
            decode = next(p for p in status.pools if p.name == "decode")
            assert all(r.kv_used_blocks == 0 and r.num_reserved == 0 for r in decode.ranks)
    finally:
        cluster.shutdown()
