"""LocalBackend on a real engine, without gRPC: streaming, aborts, deadlines, refusals, status,
and an idle engine thread that sleeps."""

import asyncio
import time

import pytest

from engine import SamplingParams
from engine.messages import GenerateRequest
from router.backends.local import LocalBackend
from tests.router.conftest import engine_load, make_engine, on_engine, wait_idle

LONG = SamplingParams(max_tokens=1500, ignore_eos=True, temperature=0.0)


def request(rid, prompt, params, deadline=None):
    return GenerateRequest(rid, prompt, params, params.seed or 0, deadline)


async def collect(backend, req):
    return [out async for out in backend.generate(req)]


def test_deltas_add_up_to_the_in_process_engine(backend, oracle):
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14, 15], [300]]
    params = [
        SamplingParams(max_tokens=12, temperature=0.0),
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=3, logprobs=2),
        SamplingParams(max_tokens=12, temperature=1.0, seed=11, stop_token_ids=[7]),
    ]

    async def run():
        reqs = [request(f"d{i}", p, sp) for i, (p, sp) in enumerate(zip(prompts, params))]
        return await asyncio.gather(*(collect(backend, r) for r in reqs))

    streams = asyncio.run(run())
    for deltas, want in zip(streams, oracle.generate(prompts, params)):
        assert all(d.finish_reason is None for d in deltas[:-1])
        assert deltas[-1].finish_reason == want.finish_reason
        assert sum((d.token_ids for d in deltas), []) == want.token_ids
        assert "".join(d.text for d in deltas) == want.text
        if want.logprobs is not None:
            assert sum((d.logprobs for d in deltas), []) == want.logprobs
    assert wait_idle(backend) == (False, 0)


def test_closing_the_stream_early_aborts_the_request(backend):
    async def run():
        stream = backend.generate(request("early", [5, 6, 7], LONG))
        first = await anext(stream)
        await anext(stream)
        unfinished, used = await backend.call(engine_load)
        assert unfinished and used >= 1
        await stream.aclose()
        return first

    assert asyncio.run(run()).finish_reason is None
    assert wait_idle(backend) == (False, 0)


def test_deadline_ends_the_request_with_abort(backend):
    deltas = asyncio.run(collect(backend, request("late", [5, 6, 7], LONG, time.time() + 0.3)))
    assert deltas[-1].finish_reason == "abort"
    assert len(deltas) < LONG.max_tokens
    assert wait_idle(backend) == (False, 0)


def test_abort_by_id_is_idempotent_and_ends_the_stream(backend):
    async def run():
        stream = backend.generate(request("ab", [5, 6, 7], LONG))
        await anext(stream)
        await backend.abort("ab")
        rest = [d async for d in stream]
        await backend.abort("ab")  # already gone
        await backend.abort("never-seen")
        return rest

    rest = asyncio.run(run())
    assert rest[-1].finish_reason == "abort"
    assert wait_idle(backend) == (False, 0)


def test_refusals_raise_value_error_and_leave_others_running():
    small = LocalBackend(make_engine(kv_cache_bytes=32 * 480))  # 8 blocks of 4 tokens
    try:

        async def run():
            # the cache (32 tokens) lowered the context: a 40-token prompt cannot fit
            with pytest.raises(ValueError, match="context is 32: shorten it to at most 31"):
                await collect(small, request("big", list(range(5, 45)), LONG))
            stream = small.generate(request("a", [5, 6], SamplingParams(max_tokens=20)))
            await anext(stream)
            with pytest.raises(ValueError, match="already in use"):
                await collect(small, request("a", [5, 6], LONG))
            # the duplicate's failure did not abort the original
            rest = [d async for d in stream]
            assert rest[-1].finish_reason == "length"

        asyncio.run(run())
        assert wait_idle(small) == (False, 0)
    finally:
        small.close()


def test_status_reports_the_engine(backend):
    async def run():
        stream = backend.generate(request("st", [5, 6, 7, 8, 9], LONG))
        await anext(stream)
        busy = await backend.status()
        await stream.aclose()
        return busy

    busy = asyncio.run(run())
    (pool,) = busy.pools
    (rank,) = pool.ranks
    assert (pool.name, rank.ready, rank.num_running, busy.num_in_flight) == ("local", True, 1, 1)
    assert rank.kv_used_blocks >= 2  # 5 prompt tokens + 1 in 4-token blocks
    num_blocks, moe_layers = on_engine(
        backend, lambda e: (e.block_manager.num_blocks, e.model.config.moe_layers)
    )
    assert rank.kv_total_blocks == num_blocks
    assert rank.expert_ids == {layer: list(range(16)) for layer in moe_layers}
    assert wait_idle(backend) == (False, 0)
    idle = asyncio.run(backend.status())
    assert (idle.pools[0].ranks[0].kv_used_blocks, idle.num_in_flight) == (0, 0)


def test_idle_engine_thread_sleeps_instead_of_spinning(backend):
    assert wait_idle(backend) == (False, 0)
    loop = backend._loop
    steps, rounds = loop.num_steps, loop.num_rounds
    time.sleep(0.5)
    # no step, and about one round per idle wait (0.05 s): a spinning thread makes thousands
    assert loop.num_steps == steps and loop.num_rounds - rounds < 50


def test_close_ends_open_streams_with_abort():
    local = LocalBackend(make_engine())

    async def run():
        stream = local.generate(request("c", [5, 6, 7], LONG))
        await anext(stream)
        await asyncio.to_thread(local.close)
        return [d async for d in stream]

    rest = asyncio.run(run())
    assert rest[-1].finish_reason == "abort"
    assert not local.ready() and local.error is None
    assert engine_load(local.engine) == (False, 0)  # the thread is gone: safe to read here
    with pytest.raises(RuntimeError, match="not running"):
        asyncio.run(collect(local, request("d", [5], LONG)))


def test_expert_load_counts_every_routed_token(backend):
    """Each MoE layer routes every computed token to K experts: the per-slot counts sum to
    tokens x K, and the per-expert view matches the slots (no replicas here)."""

    def computed():
        return on_engine(backend, lambda e: e.num_computed_tokens)

    async def run():
        before = await backend.expert_load()
        await collect(backend, request("load", list(range(7, 40)), SamplingParams(max_tokens=5)))
        return before, await backend.expert_load()

    start = computed()
    (before,), (after,) = asyncio.run(run())
    k = on_engine(backend, lambda e: e.model.config.num_experts_per_tok)
    tokens_run = computed() - start
    assert tokens_run >= 4  # the decode steps at least (the prompt may be prefix-cached)
    for layer, (tokens, experts) in after.layers.items():
        assert sum(tokens) - sum(before.layers[layer][0]) == tokens_run * k
        assert after.expert_tokens()[layer] == [tokens[experts.index(e)] for e in range(16)]
        assert after.rank_tokens()[layer] == [sum(tokens)]
