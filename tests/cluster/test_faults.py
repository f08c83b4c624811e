"""Faults on a real cluster (Ray, gRPC, 2 prefill + 2 decode ranks of tiny): a rank killed with
SIGKILL mid-stream, or hung, costs a pause and never a request. Every stream completes identical,
token for token, to the in-process engine's output for the same request; the pool comes back to
SERVING; no block is left held on any rank."""

import asyncio
import os
import signal
import time

import pytest
import ray
import torch

from engine import LLM, SamplingParams
from router.client import AsyncInferenceClient, InferenceClient
from tests.cluster.conftest import start_cluster, wait_quiet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster({"health.stall_timeout_s": 4.0, "admission.max_queued_requests": 64})
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def oracle():
    return LLM("tiny-random")


def workload(seed: int, n: int = 32, prompt_len=(8, 120), max_tokens=(30, 70)):
    gen = torch.Generator().manual_seed(seed)
    prompts, params = [], []
    for i in range(n):
        length = int(torch.randint(*prompt_len, (1,), generator=gen))
        prompts.append(torch.randint(2, 512, (length,), generator=gen).tolist())
        params.append(
            SamplingParams(
                max_tokens=int(torch.randint(*max_tokens, (1,), generator=gen)),
                ignore_eos=True,
                temperature=0.0 if i % 2 else 0.9,
                top_p=0.95,
                seed=1000 * seed + i,
            )
        )
    return prompts, params


def rank_pid(cluster, pool: str, rank: int) -> int:
    actor = cluster.pools[pool].actors[rank]
    return ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()), timeout=30)


async def streams_with_a_fault(cluster, prompts, params, fault, after_tokens: int):
    """Run every request as a stream; call fault() once: when `after_tokens` tokens have
    arrived in total, or (0) half a second after the requests were sent. -> each request's
    token ids and text."""
    received = {"tokens": 0}
    fired = asyncio.Event()

    async def one(client, i):
        tokens, text = [], ""
        async for msg in client.generate(prompts[i], params[i]):
            tokens += msg.token_ids
            text += msg.text
            received["tokens"] += len(msg.token_ids)
            if after_tokens and received["tokens"] >= after_tokens and not fired.is_set():
                fired.set()
                await asyncio.to_thread(fault)
        return tokens, text

    async with AsyncInferenceClient(cluster.address, timeout=600) as client:
        tasks = [asyncio.create_task(one(client, i)) for i in range(len(prompts))]
        if after_tokens == 0:
            await asyncio.sleep(0.5)  # the requests are queued on the ranks
            fired.set()
            await asyncio.to_thread(fault)
        return await asyncio.gather(*tasks)


def check_outputs(got, want):
    for i, ((tokens, text), expected) in enumerate(zip(got, want, strict=True)):
        assert tokens == expected.token_ids, i
        assert text == expected.text, i


def check_recovered(cluster, pool: str, reforms: int):
    with InferenceClient(cluster.address, timeout=60) as client:
        assert client.health() == "SERVING"
        status = wait_quiet(client, timeout=60)
        for p in status.pools:
            for r in p.ranks:
                assert r.ready and (r.kv_used_blocks, r.num_reserved, r.num_pending) == (0, 0, 0)
    assert cluster.backend.pools[pool].num_reforms == reforms


def test_decode_rank_killed_mid_stream(cluster, oracle):
    prompts, params = workload(seed=1)
    want = oracle.generate(prompts, params)
    reforms = cluster.backend.pools["decode"].num_reforms
    pid = rank_pid(cluster, "decode", 0)

    got = asyncio.run(
        streams_with_a_fault(cluster, prompts, params, lambda: os.kill(pid, signal.SIGKILL), 200)
    )
    check_outputs(got, want)
    check_recovered(cluster, "decode", reforms + 1)
    assert rank_pid(cluster, "decode", 0) != pid


def test_prefill_rank_killed_while_prompts_queue_on_it(cluster, oracle):
    prompts, params = workload(seed=2, prompt_len=(300, 600), max_tokens=(8, 20))
    want = oracle.generate(prompts, params)
    reforms = cluster.backend.pools["prefill"].num_reforms
    pid = rank_pid(cluster, "prefill", 0)

    got = asyncio.run(
        streams_with_a_fault(cluster, prompts, params, lambda: os.kill(pid, signal.SIGKILL), 0)
    )
    check_outputs(got, want)
    check_recovered(cluster, "prefill", reforms + 1)


def test_a_hung_rank_is_detected_and_its_requests_resume(cluster, oracle):
    prompts, params = workload(seed=3, n=12)
    want = oracle.generate(prompts, params)
    reforms = cluster.backend.pools["decode"].num_reforms
    seen_not_serving = []

    def hang():
        cluster.pools["decode"].actors[1].debug_block.remote(3600.0)  # its engine thread sleeps
        with InferenceClient(cluster.address, timeout=10) as client:
            end = time.monotonic() + 60
            while time.monotonic() < end:
                if client.health() == "NOT_SERVING":
                    seen_not_serving.append(True)
                    return
                time.sleep(0.05)

    got = asyncio.run(streams_with_a_fault(cluster, prompts, params, hang, 60))
    assert seen_not_serving, "health never went NOT_SERVING while the rank hung"
    check_outputs(got, want)
    check_recovered(cluster, "decode", reforms + 1)
    assert "hung" in cluster.backend.pools["decode"].last_failure
