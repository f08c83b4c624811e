"""DecodeWorker without Ray: a real PrefillWorker hands requests to a real DecodeWorker over the
object-store transport and the tokens equal the in-process engine's; a transport that fails
(injected) ends the request with KVTransferError and leaves no block or reservation."""

import asyncio

import pytest
import torch

from decode_workers import DecodeWorker
from engine import LLM, EngineConfig, SamplingParams
from engine.kv_transfer import KVTransferError, ObjectStoreTransport
from engine.messages import GenerateRequest
from engine.rank import RankConfig
from engine.rendezvous import Rendezvous
from prefill_workers import PrefillWorker

SOLO = Rendezvous("unused", "127.0.0.1", 0)  # a one-rank pool meets nobody

ENGINE = EngineConfig(model="tiny-random", block_size=4)


class BrokenLink(ObjectStoreTransport):
    def receive(self, handle):
        raise KVTransferError("the link to the prefill rank is down")


def workload():
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (3, 19, 40, 8)]
    params = [
        SamplingParams(max_tokens=9, temperature=0.0 if i % 2 else 0.9, seed=i, ignore_eos=True)
        for i in range(len(prompts))
    ]
    return prompts, params


async def generate(prefill, decode, rid, prompt, params, seed) -> list[int]:
    request = GenerateRequest(rid, prompt, params, seed)
    assert await decode.reserve(rid, prompt, lease_s=30, router_id="router")
    first, kv = await prefill.prefill(request)
    await decode.start(request, first, kv, "router")
    return first.token_ids


async def read(decode, num_requests: int) -> dict[str, list[int]]:
    tokens, finished = {}, set()
    async for deltas in decode.stream("router"):
        for d in deltas:
            tokens.setdefault(d.request_id, []).extend(d.token_ids)
            finished.update([d.request_id] if d.finished else [])
        if len(finished) == num_requests:
            return tokens


def test_prefill_worker_to_decode_worker_equals_the_engine():
    prompts, params = workload()
    want = LLM("tiny-random", block_size=4).generate(prompts, params)

    async def main():
        prefill = PrefillWorker(RankConfig("prefill", 0, 1, ENGINE))
        decode = DecodeWorker(RankConfig("decode", 0, 1, ENGINE))
        await asyncio.gather(prefill.join(SOLO), decode.join(SOLO))
        try:
            await decode.register_router("router")
            reader = asyncio.create_task(read(decode, len(prompts)))
            firsts = await asyncio.gather(
                *(
                    generate(prefill, decode, str(i), p, sp, sp.seed)
                    for i, (p, sp) in enumerate(zip(prompts, params))
                )
            )
            rest = await asyncio.wait_for(reader, 60)
            for i, expected in enumerate(want):
                assert firsts[i] + rest[str(i)] == expected.token_ids, i
            await decode.call(lambda e: e.assert_no_leaks())
        finally:
            prefill.stop()
            decode.stop()

    asyncio.run(main())


def test_a_failing_transport_ends_the_request_and_frees_the_reservation():
    async def main():
        prefill = PrefillWorker(RankConfig("prefill", 0, 1, ENGINE))
        decode = DecodeWorker(RankConfig("decode", 0, 1, ENGINE), transport=BrokenLink())
        await asyncio.gather(prefill.join(SOLO), decode.join(SOLO))
        try:
            with pytest.raises(KVTransferError, match="link to the prefill rank is down"):
                await generate(prefill, decode, "x", list(range(5, 40)), SamplingParams(), 1)
            status = decode.status()
            assert (status.num_reserved, status.kv_used_blocks, status.num_running) == (0, 0, 0)
            assert not decode._owner
        finally:
            prefill.stop()
            decode.stop()

    asyncio.run(main())
