"""EngineLoop: an engine stepping on its own thread, fed through a thread-safe inbox.

A rank's actor (or any server) runs the engine here: callers submit functions that run on the
engine thread between steps (the engine is not thread-safe), and every step's StepResult
(deltas, handed-off prefills) goes to a callback. An idle loop blocks on its inbox with a short
timeout instead of spinning; in an expert-parallel pool it still reaches the step's agreement
all-reduce once per timeout, because the other ranks may have work. A rank that gets work while
its pool rests wakes the others (`on_work`, engine/wake.py: `wake()` on theirs), so its step
starts at once rather than when their waits run out.
"""

import concurrent.futures
import ctypes
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from engine.llm_engine import LLMEngine
from engine.messages import RankStopped, StepResult

log = logging.getLogger(__name__)

OS_THREAD_NAME = b"epc-engine"  # what top -H, /proc/<pid>/task/<tid>/comm and profilers show


def name_os_thread(name: bytes) -> None:
    """Give the calling thread its name in the kernel (Linux; elsewhere a no-op): Python 3.11
    names threads only for itself, and the CPU accounting of a rank (bench/goodput.py) tells its
    engine thread from its serving threads by this name."""
    try:
        ctypes.CDLL(None).prctl(15, ctypes.c_char_p(name[:15]), 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


_WAKE = ("wake",)  # an inbox item that only ends an idle wait


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        on_step: Callable[[StepResult], None],
        idle_wait_s: float = 0.02,
        on_tick: Callable[[], None] | None = None,
        on_stop: Callable[[BaseException | None], None] | None = None,
        on_work: Callable[[], None] | None = None,
    ) -> None:
        """on_step: what each step produced, when it produced something; on_tick: runs before
        every step (deadline checks);
        on_stop: runs last on the engine thread, with what killed the loop (None on stop());
        on_work: runs on the engine thread when a call gave this rank work while its pool
        rested (an expert-parallel pool's partners sleep: wake them)."""
        self.engine = engine
        self.on_step = on_step
        self.on_tick = on_tick
        self.on_stop = on_stop
        self.on_work = on_work
        self.idle_wait_s = idle_wait_s
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        # NOTE: submit's check and put, and the dying loop's closing, hold this lock: a call
        # can never land in the inbox after the loop failed what it held (its future would
        # never resolve).
        self._lock = threading.Lock()
        self._closed = False
        self.error: BaseException | None = None
        self.suspects: tuple[str, ...] = ()  # the requests of the step that killed the loop
        self.num_steps = 0
        self.num_rounds = 0  # turns of the loop, steps or idle waits (a spinning loop shows)
        self.num_wakes = 0  # wake() calls taken from the inbox
        self.last_progress = time.monotonic()  # when the thread last began a turn

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(None)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def wake(self) -> None:
        """End an idle wait now (any thread): a partner rank has work, so the pool steps."""
        self._inbox.put(_WAKE)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stop.is_set()

    def submit(self, fn: Callable[[LLMEngine], Any]) -> concurrent.futures.Future:
        """Run fn(engine) on the engine thread before its next step; -> a future of the result
        (RankStopped when the loop is not running, or stops before it runs fn)."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self.alive and not self._closed:
                self._inbox.put((fn, future))
                return future
        future.set_exception(self.stopped("the engine loop is not running"))
        return future

    def stopped(self, what: str) -> RankStopped:
        """The error for a call the stopped loop cannot serve (with the suspects, if a step's
        exception stopped it)."""
        return RankStopped(f"{what} ({self.error!r})", self.suspects)

    def _busy(self) -> bool:
        e = self.engine
        return e.has_unfinished() or (e.ep_size > 1 and e.pool_has_unfinished)

    def stalled_s(self) -> float:
        """Seconds the engine thread has had work (requests, or calls waiting in its inbox) and
        made no progress: 0 while it turns. Read from any thread: a rank's health."""
        if not self._thread.is_alive() or not (self._busy() or not self._inbox.empty()):
            return 0.0
        return max(0.0, time.monotonic() - self.last_progress)

    def _drain(self, wait: float) -> None:
        try:
            item = self._inbox.get(timeout=wait) if wait > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            if item is _WAKE:
                self.num_wakes += 1
                item = self._next()
                continue
            fn, future = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(self.engine))
                except BaseException as e:  # the caller gets it; the loop goes on
                    future.set_exception(e)
            item = self._next()

    def _next(self) -> object:
        """The next item of the inbox, None (as stop's) when it is empty."""
        try:
            return self._inbox.get_nowait()
        except queue.Empty:
            return None

    def _run(self) -> None:
        name_os_thread(OS_THREAD_NAME)
        try:
            while not self._stop.is_set():
                self.num_rounds += 1
                self.last_progress = time.monotonic()
                resting = not self._busy()
                self._drain(self.idle_wait_s if resting else 0.0)
                if self._stop.is_set():
                    break
                if resting and self.on_work is not None and self.engine.has_unfinished():
                    self.on_work()
                self.engine.reservations.expire(time.monotonic())
                if self.on_tick is not None:
                    self.on_tick()
                if self.engine.ep_size > 1 or self.engine.has_unfinished():
                    result = self.engine.step()
                    self.num_steps += 1
                    if result:
                        self.on_step(result)
                    # work that could not run anywhere: do not spin (a resting pool waits at
                    # the top of the next turn, once per idle_wait_s, not twice)
                    if self.engine.last_step_tokens == 0 and self._busy():
                        self._drain(self.idle_wait_s)
        except BaseException as e:  # a dead engine must be visible, not silent
            self.error = e
            self.suspects = self.engine.suspects()
            log.exception("engine loop died (requests in its step: %s)", self.suspects)
            self._stop.set()
        finally:
            with self._lock:
                self._closed = True  # nothing enters the inbox from now on
            self._drain(0.0)  # calls that raced with stop() still run (aborts, last words)
            self._fail_pending()
            if self.on_stop is not None:
                self.on_stop(self.error)

    def _fail_pending(self) -> None:
        while True:
            try:
                item = self._inbox.get_nowait()
            except queue.Empty:
                return
            if item is not None and item is not _WAKE and not item[1].done():
                item[1].set_exception(self.stopped("the engine loop stopped"))
