"""EngineLoop: requests submitted from other threads run to completion; an idle loop sleeps."""

import threading
import time

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loop import EngineLoop


def test_loop_runs_submitted_requests_and_idles_quietly():
    done = threading.Event()
    outputs: dict[str, list[int]] = {}
    finished: set[str] = set()

    def on_step(result):
        for d in result.outputs:
            outputs.setdefault(d.request_id, []).extend(d.token_ids)
            if d.finished:
                finished.add(d.request_id)
        if finished == {"a", "b"}:
            done.set()

    engine = LLMEngine(EngineConfig(model="tiny-random", block_size=4))
    loop = EngineLoop(engine, on_step).start()
    try:
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        loop.submit(lambda e: e.add_request("a", [5, 6, 7], params)).result(10)
        loop.submit(lambda e: e.add_request("b", [8, 9], params)).result(10)
        assert done.wait(30)
        assert [len(outputs["a"]), len(outputs["b"])] == [6, 6]
        # errors raised on the engine thread reach the caller; the loop goes on
        with pytest.raises(ValueError, match="empty"):
            loop.submit(lambda e: e.add_request("c", [], params)).result(10)
        assert loop.alive
        assert loop.submit(lambda e: e.block_manager.num_used_blocks).result(10) == 0
        # idle: the thread sleeps on its inbox (a round per 0.02 s wait) and takes no step
        steps, rounds = loop.num_steps, loop.num_rounds
        time.sleep(0.5)
        assert loop.num_steps == steps and loop.num_rounds - rounds < 100
    finally:
        loop.stop()
    assert not loop.alive
    with pytest.raises(RuntimeError, match="not running"):
        loop.submit(lambda e: None).result(1)
