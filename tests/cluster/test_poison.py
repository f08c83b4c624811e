"""Poison requests on a real cluster (Ray, 2 prefill + 2 decode ranks of tiny-random, gRPC and
HTTP): the issue's bodies (top_k 2**63 and 2**70, max_tokens 2**64) get 400 while 8 gRPC streams
run; a sampling failure injected on the ranks for one request ends that request alone with
INTERNAL (before its first token, or mid-stream). Either way no pool re-forms, the 8 streams
equal the in-process engine's output token for token, and no block stays held."""

import asyncio
import http.client
import json

import grpc
import pytest
import ray
import torch

from engine import LLM, SamplingParams
from router.client import AsyncInferenceClient, InferenceClient
from tests.cluster.conftest import start_cluster, wait_quiet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

POISON_BODIES = [
    ("/v1/completions", {"prompt": "A class", "max_tokens": 4, "top_k": 9223372036854775808}),
    ("/v1/completions", {"prompt": "A class", "max_tokens": 4, "top_k": 2**70}),
    ("/v1/completions", {"prompt": "A class", "max_tokens": 2**64}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "top_k": 2**63}),
]
POISON_SEED = 777


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster()
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def oracle():
    return LLM("tiny-random")


def workload(n: int = 8, seed: int = 0) -> tuple[list[list[int]], list[SamplingParams]]:
    gen = torch.Generator().manual_seed(seed)
    prompts, params = [], []
    for i in range(n):
        length = int(torch.randint(6, 60, (1,), generator=gen))
        prompts.append(torch.randint(2, 512, (length,), generator=gen).tolist())
        params.append(
            SamplingParams(
                max_tokens=int(torch.randint(30, 50, (1,), generator=gen)),
                ignore_eos=True,
                temperature=0.0 if i % 2 else 0.9,
                top_k=40 if i % 4 == 0 else 0,
                seed=1000 * seed + i,
            )
        )
    return prompts, params


def post(address: str, path: str, body: dict) -> tuple[int, dict]:
    host, port = address.rsplit(":", 1)
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        reply = conn.getresponse()
        return reply.status, json.loads(reply.read() or b"{}")
    finally:
        conn.close()


async def stream(client: AsyncInferenceClient, prompt, params, seen: dict) -> tuple:
    """-> (token ids, text, the gRPC status code name it ended with)."""
    tokens, text = [], ""
    try:
        async for msg in client.generate(prompt, params):
            tokens += msg.token_ids
            text += msg.text
            seen["tokens"] += len(msg.token_ids)
    except grpc.aio.AioRpcError as e:
        return tokens, text, e.code().name, e.details()
    return tokens, text, "OK", ""


async def streams_while(cluster, prompts, params, during) -> list[tuple]:
    """Run the requests as gRPC streams; once 40 tokens have arrived, run during() (blocking,
    on a thread) while they go on."""
    seen = {"tokens": 0}
    async with AsyncInferenceClient(cluster.address, timeout=300) as client:
        tasks = [asyncio.create_task(stream(client, p, s, seen)) for p, s in zip(prompts, params)]
        for _ in range(3000):
            if seen["tokens"] >= 40:
                break
            await asyncio.sleep(0.01)
        await asyncio.to_thread(during)
        return await asyncio.gather(*tasks)


def check_streams(got: list[tuple], want, skip: set[int] = frozenset()) -> None:
    for i, ((tokens, text, code, details), expected) in enumerate(zip(got, want, strict=True)):
        if i in skip:
            continue
        assert code == "OK", (i, code, details)
        assert tokens == expected.token_ids, i
        assert text == expected.text, i


def check_nothing_reformed_or_held(cluster) -> None:
    assert cluster.backend.pools["prefill"].num_reforms == 0
    assert cluster.backend.pools["decode"].num_reforms == 0
    with InferenceClient(cluster.address, timeout=60) as client:
        assert client.health() == "SERVING"
        status = wait_quiet(client, timeout=60)
    for pool in status.pools:
        for r in pool.ranks:
            assert r.ready and (r.kv_used_blocks, r.num_reserved, r.num_pending) == (0, 0, 0)


def test_the_issues_poison_bodies_get_400_and_hurt_nobody(cluster, oracle):
    prompts, params = workload(seed=1)
    want = oracle.generate(prompts, params)
    replies = []

    def poison() -> None:
        for path, body in POISON_BODIES:
            replies.append(post(cluster.http_address, path, body))

    got = asyncio.run(streams_while(cluster, prompts, params, poison))
    for (status, reply), (_, body) in zip(replies, POISON_BODIES, strict=True):
        assert status == 400, (body, status, reply)
        assert reply["error"]["type"] == "invalid_request_error", reply
    check_streams(got, want)
    check_nothing_reformed_or_held(cluster)


def failing_sampler(seed: int, from_position: int):
    """-> a function for the rank actor (__ray_call__): its runner's sample raises for the rows
    of `seed` at positions >= from_position (nested, so cloudpickle ships it by value)."""

    def install(rank) -> None:
        runner = rank.engine.runner
        real = type(runner).sample.__get__(runner)

        def sample(logits, params, seeds, positions):
            for s, pos in zip(seeds, positions):
                if s == seed and pos >= from_position:
                    raise RuntimeError("injected sampling failure")
            return real(logits, params, seeds, positions)

        runner.sample = sample

    return install


def uninstall(rank) -> None:
    rank.engine.runner.__dict__.pop("sample", None)


@pytest.mark.parametrize("after", [0, 3], ids=["on-the-prefill-rank", "mid-stream-on-decode"])
def test_a_sampling_failure_on_a_rank_fails_that_request_alone(cluster, oracle, after):
    prompts, params = workload(seed=2 + after)
    # NOTE: a sampled request: its rows reach runner.sample whatever the greedy rows' head
    # (engine/greedy_head.py screens a large head's greedy rows, which then skip it)
    poisoned = 2
    params[poisoned].seed = POISON_SEED
    want = oracle.generate(prompts, params)
    actors = [a for pool in ("prefill", "decode") for a in cluster.pools[pool].actors]
    install = failing_sampler(POISON_SEED, len(prompts[poisoned]) + after)
    ray.get([a.__ray_call__.remote(install) for a in actors], timeout=60)
    try:
        got = asyncio.run(streams_while(cluster, prompts, params, lambda: None))
    finally:
        ray.get([a.__ray_call__.remote(uninstall) for a in actors], timeout=60)
    tokens, _, code, details = got[poisoned]
    assert code == "INTERNAL", (code, details)
    assert "failed in sampling: RuntimeError: injected sampling failure" in details
    assert tokens == want[poisoned].token_ids[:after]  # what it had before, exact
    check_streams(got, want, skip={poisoned})
    check_nothing_reformed_or_held(cluster)
