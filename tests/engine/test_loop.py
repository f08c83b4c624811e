"""EngineLoop: requests submitted from other threads run to completion; an idle loop sleeps."""

import threading
import time
from pathlib import Path

import pytest

from engine import EngineConfig, LLMEngine, SamplingParams
from engine.loop import OS_THREAD_NAME, EngineLoop, name_os_thread


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


class _RestingEPEngine:
    """An expert-parallel rank's engine as the loop sees it, without a pool: no requests
    anywhere until `work` is set (the step's agreement always finds nothing to run)."""

    ep_size = 2
    pool_has_unfinished = False
    last_step_tokens = 0

    def __init__(self) -> None:
        self.work = False
        self.reservations = type("NoReservations", (), {"expire": lambda self, now: []})()

    def has_unfinished(self) -> bool:
        return self.work

    def step(self):
        from engine.messages import StepResult

        return StepResult()

    def suspects(self) -> tuple[str, ...]:
        return ()


def _until(condition, seconds: float = 30.0) -> bool:
    end = time.monotonic() + seconds
    while not condition() and time.monotonic() < end:
        time.sleep(0.01)
    return condition()


def test_resting_ep_loop_steps_once_per_wake_and_waits_once_per_turn():
    """A resting EP rank's loop reaches the agreement once per idle wait, and a wake() ends the
    wait: with a wait that never runs out, each wake is one step. (It used to wait twice a turn,
    after the empty step and again before the next: the second wake then ended the first wait
    and the loop slept again without stepping.)"""
    loop = EngineLoop(_RestingEPEngine(), lambda r: None, idle_wait_s=3600).start()
    try:
        assert _until(lambda: loop.num_rounds == 1)  # asleep before its first step
        for n in (1, 2, 3):
            loop.wake()
            assert _until(lambda n=n: loop.num_steps == n), (n, loop.num_steps)
            assert _until(lambda n=n: loop.num_rounds == n + 1)  # asleep again, at the turn's top
        assert loop.num_wakes == 3 and loop.num_steps == 3
    finally:
        loop.stop()


def test_work_given_to_a_resting_rank_wakes_its_partners_once():
    """on_work runs when a call gives the rank work while the pool rests, not on every call."""
    engine, woke = _RestingEPEngine(), []
    loop = EngineLoop(engine, lambda r: None, idle_wait_s=3600, on_work=lambda: woke.append(1))
    loop.start()
    try:
        loop.submit(lambda e: None).result(10)  # a call that gives no work
        assert woke == []
        loop.submit(lambda e: setattr(e, "work", True)).result(10)
        assert _until(lambda: len(woke) == 1)
        engine.pool_has_unfinished = True  # the agreement now says the pool is busy
        for _ in range(3):  # calls to a busy rank (its partners are awake), each then a step
            steps = loop.num_steps
            loop.submit(lambda e: None).result(10)
            assert _until(lambda steps=steps: loop.num_steps > steps)
        assert woke == [1]
    finally:
        loop.stop()


def test_the_engine_thread_gets_its_kernel_name():
    """Its name in /proc (what bench/goodput.py's CPU accounting of a rank looks for)."""
    seen = []

    def body() -> None:
        name_os_thread(OS_THREAD_NAME)
        comm = Path(f"/proc/self/task/{threading.get_native_id()}/comm")
        seen.append(comm.read_bytes().strip())

    t = threading.Thread(target=body)
    t.start()
    t.join(10)
    assert seen == [OS_THREAD_NAME]
