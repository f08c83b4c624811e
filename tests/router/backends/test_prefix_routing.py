"""ClusterBackend's prefill choice over fake ranks (tests/router/backends/test_cluster_backend.py):
a multi-turn conversation's turns land on the prefill rank that holds their prefix, even when
its first turn went elsewhere because the rank its first block prefers was busy."""

import asyncio

from engine.messages import GenerateRequest
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from router.backends.cluster import ClusterBackend
from router.backends.pools import HealthConfig
from router.backends.prefix_index import IndexSize
from router.backends.routing import RoutingConfig
from tests.router.backends.test_cluster_backend import (
    BLOCK,
    INFO,
    FakeDecode,
    FakePrefill,
    run,
    wait_for,
)

SYSTEM = list(range(10, 10 + 2 * BLOCK))  # a shared system prompt: 2 blocks


def wire(rid: str, prompt: list[int]) -> GenerateRequest:
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=2, temperature=0), seed=1)


async def consume(backend: ClusterBackend, request: GenerateRequest) -> list[int]:
    return sum([d.token_ids async for d in backend.generate(request)], [])


def test_turns_follow_their_prefix_not_their_first_block():
    async def main():
        prefill = [FakePrefill(0), FakePrefill(1)]
        backend = ClusterBackend(
            prefill,
            [FakeDecode(0)],
            INFO,
            Tokenizer(None, 512, 1, None),
            BLOCK,
            RoutingConfig(),
            HealthConfig(status_interval_s=0.01, stall_timeout_s=5.0),
            prefix_index=IndexSize(rank_blocks=100),
        )
        await backend.start()
        gate = asyncio.Event()
        for rank in prefill:
            rank.gate = gate
        # a long prompt with the system prompt: no hits anywhere, idle ranks: the rank its
        # first block prefers (home); it stays in flight there (100 queued prompt tokens)
        long = asyncio.create_task(consume(backend, wire("long", SYSTEM + [7] * 92)))
        await wait_for(lambda: sum(len(r.calls) for r in prefill) == 1)
        home = next(r for r in prefill if r.calls)
        other = next(r for r in prefill if not r.calls)
        # turn 1 (14 tokens, 8 expected to hit home): home costs 100 + 14 - 8, the other 14
        turn1 = SYSTEM + [1, 2, 3, 4, 5, 6]
        first = asyncio.create_task(consume(backend, wire("t1", turn1)))
        await wait_for(lambda: len(other.calls) == 1)
        gate.set()
        await long
        answer = await first
        assert answer == [100, 101]
        # turn 2 on idle ranks: its 3 leading blocks are on the other rank, 2 on home
        turn2 = turn1 + answer + [8, 9, 11, 12, 13]
        await consume(backend, wire("t2", turn2))
        assert [len(home.calls), len(other.calls)] == [1, 2]
        assert other.calls[-1].prompt_token_ids == turn2
        # a new conversation with the system prompt: 2 blocks expected on both, load equal:
        # the first block's preferred rank again
        await consume(backend, wire("new", SYSTEM + [99] * 5))
        assert home.calls[-1].prompt_token_ids == SYSTEM + [99] * 5
        await backend.close()

    run(main())
