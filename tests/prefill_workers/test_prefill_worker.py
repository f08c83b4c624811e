"""PrefillWorker without Ray: a real engine on its loop thread; the first token and the prompt's
KV come back as one value, a request done on the prefill rank brings no KV, and an abort
while the prompt runs leaves no block, no request and no waiting future."""

import asyncio

import torch

from engine import EngineConfig, SamplingParams
from engine.messages import GenerateRequest, KVPayload, RankStopped
from engine.rank import RankConfig
from engine.rendezvous import Rendezvous
from prefill_workers import PrefillWorker

SOLO = Rendezvous("unused", "127.0.0.1", 0)  # a one-rank pool meets nobody


def make_worker() -> PrefillWorker:
    engine = EngineConfig(model="tiny-random", block_size=4, max_num_batched_tokens=64)
    return PrefillWorker(RankConfig("prefill", 0, 1, engine))


def request(rid: str, prompt: list[int], max_tokens: int = 8) -> GenerateRequest:
    return GenerateRequest(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0), 3)


def test_first_token_and_kv_come_back_together():
    async def main():
        worker = make_worker()
        await worker.join(SOLO)
        try:
            first, kv = await worker.prefill(request("a", list(range(5, 30))))
            assert first.request_id == "a" and len(first.token_ids) == 1
            assert first.finish_reason is None  # the decode rank carries on
            assert isinstance(kv, KVPayload) and kv.num_tokens == 25
            config = worker.engine.model.config
            assert kv.data.shape == (config.num_hidden_layers, 25, config.kv_cache_width)
            first, kv = await worker.prefill(request("b", [5, 6, 7], max_tokens=1))
            assert first.finish_reason == "length" and kv is None  # done here: nothing to send
            status = worker.status()
            assert (status.num_running, status.num_waiting, status.kv_used_blocks) == (0, 0, 0)
            assert not worker._waiting
        finally:
            worker.stop()

    asyncio.run(main())


def test_abort_while_the_prompt_runs_leaves_nothing():
    async def main():
        worker = make_worker()
        await worker.join(SOLO)
        try:
            long_prompt = torch.randint(2, 512, (1500,)).tolist()  # 24 steps of 64 tokens
            task = asyncio.create_task(worker.prefill(request("long", long_prompt)))
            while not await worker.call(lambda e: e.block_manager.num_used_blocks):
                await asyncio.sleep(0.01)
            task.cancel()  # what the router's cancel does to the awaiting call
            try:
                await task
            except asyncio.CancelledError:
                pass
            assert not worker._waiting
            leaks = await worker.call(lambda e: e.assert_no_leaks())
            assert leaks is None
        finally:
            worker.stop()

    asyncio.run(main())


def test_prefills_waiting_when_the_engine_stops_raise_rank_stopped():
    """What a collective failing under the engine (a peer died) does to the waiting prompts:
    RankStopped, which the router takes as a failed rank and resumes elsewhere."""

    async def main():
        worker = make_worker()
        await worker.join(SOLO)
        try:
            long_prompt = torch.randint(2, 512, (1500,)).tolist()
            task = asyncio.create_task(worker.prefill(request("long", long_prompt)))
            while "long" not in worker._waiting:
                await asyncio.sleep(0.01)
            worker.on_engine_stopped(RuntimeError("Connection closed by peer"))
            try:
                await task
            except RankStopped as e:
                assert "Connection closed by peer" in str(e) and "long" in str(e)
            else:
                raise AssertionError("the prefill did not raise")
        finally:
            worker.stop()

    asyncio.run(main())
