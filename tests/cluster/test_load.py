"""Load on a real cluster (Ray, gRPC, 2 prefill + 2 decode ranks of tiny, small KV caches):
2,000 cancels and deadlines spread over every phase of a request leave nothing behind, and
overload gets back-pressure (RESOURCE_EXHAUSTED), never INTERNAL."""

import asyncio
import random
import time

import grpc
import pytest
import torch

from engine import SamplingParams
from engine.kv_transfer import KVTransferError
from engine.messages import GenerateRequest, KVPayload, RequestOutput
from router.client import AsyncInferenceClient, InferenceClient
from tests.cluster.conftest import start_cluster, wait_quiet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ADMISSION_CAP = 48
BLOCKS = 64  # per rank, of 16 tokens: the context is lowered to 1024 tokens


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster(
        {
            "admission.max_queued_requests": ADMISSION_CAP,
            "engine.kv_cache_bytes": BLOCKS * 16 * 3 * 40 * 4,
            "routing.reserve_wait_s": 2.0,
            "routing.kv_lease_s": 5.0,
        }
    )
    yield c
    c.shutdown()


def assert_nothing_held(client: InferenceClient) -> None:
    status = wait_quiet(client, timeout=60)
    for pool in status.pools:
        for r in pool.ranks:
            assert (r.kv_used_blocks, r.num_reserved, r.num_running, r.num_waiting) == (0,) * 4
            assert r.num_pending == 0, (pool.name, r.rank, r.num_pending)  # no waiting future
    assert (status.num_in_flight, status.num_queued, status.num_queued_tokens) == (0, 0, 0)


def test_2000_cancels_and_deadlines_in_every_phase_leave_nothing_behind(cluster):
    rng = random.Random(7)
    outcomes: dict[str, int] = {}

    async def one(client: AsyncInferenceClient, i: int) -> None:
        # long prompts queue on the prefill ranks; short ones reach the decode ranks fast
        length = rng.choice([4, 30, 200, 600, 900])
        prompt = [rng.randrange(2, 512) for _ in range(length)]
        params = SamplingParams(max_tokens=rng.randrange(1, 60), ignore_eos=True, seed=i)
        when = rng.uniform(0.0, 0.8)
        if i % 2:  # a client cancel at a random moment
            call = client.generate(prompt, params, timeout=120)
            try:
                async with asyncio.timeout(when):
                    async for _ in call:
                        pass
                outcome = "finished"
            except TimeoutError:
                call.cancel()
                outcome = "cancelled"
            except grpc.aio.AioRpcError as e:
                outcome = e.code().name
        else:  # a deadline at a random moment
            try:
                await client.complete(prompt, params, timeout=max(when, 0.01))
                outcome = "finished"
            except grpc.aio.AioRpcError as e:
                outcome = e.code().name
        outcomes[outcome] = outcomes.get(outcome, 0) + 1

    async def run() -> None:
        async with AsyncInferenceClient(cluster.address) as client:
            for wave in range(40):  # 40 waves of 50: under the admission cap most of the time
                await asyncio.gather(*(one(client, 50 * wave + i) for i in range(50)))

    asyncio.run(run())
    assert sum(outcomes.values()) == 2000
    assert outcomes.get("cancelled", 0) > 300 and outcomes.get("DEADLINE_EXCEEDED", 0) > 300
    assert set(outcomes) <= {"finished", "cancelled", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED"}
    with InferenceClient(cluster.address, timeout=10) as client:  # answers promptly
        assert_nothing_held(client)
        out = client.complete([5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        assert out.num_completion_tokens == 3


def test_overload_gets_back_pressure_never_internal(cluster):
    """4x the admission cap of long prompts at once: the router refuses what it cannot admit,
    and what it admits but has no decode KV room for waits reserve_wait_s, then is refused."""
    rng = random.Random(3)
    prompts = [[rng.randrange(2, 512) for _ in range(rng.randrange(500, 1000))] for _ in range(4)]
    codes: dict[str, int] = {}
    details: list[str] = []

    async def one(client: AsyncInferenceClient, i: int) -> None:
        params = SamplingParams(max_tokens=20, ignore_eos=True, seed=i)
        try:
            await client.complete(prompts[i % 4], params, timeout=60)
            code = "OK"
        except grpc.aio.AioRpcError as e:
            code = e.code().name
            details.append(e.details())
        codes[code] = codes.get(code, 0) + 1

    async def run() -> None:
        async with AsyncInferenceClient(cluster.address) as client:
            await asyncio.gather(*(one(client, i) for i in range(4 * ADMISSION_CAP)))

    start = time.monotonic()
    asyncio.run(run())
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED", "DEADLINE_EXCEEDED"}, (codes, details[:5])
    assert codes.get("OK", 0) >= 2 and codes.get("RESOURCE_EXHAUSTED", 0) >= 3 * ADMISSION_CAP
    assert all("retry later" in d for d in details if "RESOURCE" in d or "room" in d), details[:5]
    assert any("no decode rank has room" in d for d in details), (codes, details[:5])
    print(f"overload: {codes} in {time.monotonic() - start:.0f} s")
    with InferenceClient(cluster.address, timeout=10) as client:
        assert_nothing_held(client)


def test_a_rank_error_comes_back_as_its_own_exception_without_the_remote_traceback(cluster):
    """What a rank raises reaches the router as that exception with its one-line message (the
    Ray traceback, with pids and paths, goes to the log, never to a client)."""
    handle = cluster.backend.pools["decode"].ranks[0]
    request = GenerateRequest("nobody", [5, 6], SamplingParams(max_tokens=2), 1)
    first = RequestOutput("nobody", [7], "", None, 2, 1, 0)
    kv = KVPayload("nobody", torch.zeros(3, 2, 40), 0)
    with pytest.raises(KVTransferError) as err:
        cluster.server.call(handle.start(request, first, kv, "a-test"))
    assert "holds no reservation" in str(err.value)
    assert "Traceback" not in str(err.value) and "pid=" not in str(err.value)
