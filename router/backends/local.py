"""LocalBackend: the Backend over one LLMEngine in this process (single-process serving, and the
router's tests).

The engine is not thread-safe, so an EngineLoop thread owns it: every engine call happens there.
Requests, aborts and status queries reach it as callables through its inbox; deltas go back to
each request's asyncio queue on the loop that asked (call_soon_threadsafe). The thread steps
while the engine has work and otherwise sleeps on the inbox (never spins).
"""

import asyncio
import concurrent.futures
import dataclasses
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from engine.llm_engine import LLMEngine
from engine.loop import EngineLoop
from engine.messages import (
    ClusterStatus,
    GenerateRequest,
    ModelInfo,
    PoolLoad,
    PoolStatus,
    RequestOutput,
    StepResult,
)
from engine.model_info import PromptLimits, build_model_info

T = TypeVar("T")


@dataclasses.dataclass(slots=True)
class _Stream:
    """Where one request's deltas go (owned by the engine thread)."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput deltas, or one exception
    deadline: float | None


class LocalBackend:
    """Backend over one LLMEngine, stepped by an EngineLoop (see the module docstring)."""

    def __init__(self, engine: LLMEngine, *, start: bool = True, idle_wait_s: float = 0.05) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._model_info = build_model_info(
            engine.config.model,
            engine.model.config,
            engine.max_model_len,
            engine.config.torch_dtype,
            engine.runner.kernels,
        )
        self._limits = engine.prompt_limits
        self._streams: dict[str, _Stream] = {}  # NOTE: touched on the engine thread only
        self._loop = EngineLoop(
            engine, self._publish, idle_wait_s, self._expire_deadlines, self._stopped
        )
        if start:
            self.start()

    # ---- lifecycle (any thread) ----

    def start(self) -> None:
        self._loop.start()

    def close(self, timeout: float = 10.0) -> None:
        """Abort every request (their streams end with "abort") and stop the engine thread."""
        self._loop.stop(timeout)

    def ready(self) -> bool:
        return self._loop.alive

    @property
    def error(self) -> BaseException | None:
        """What killed the engine thread, if anything."""
        return self._loop.error

    def model_info(self) -> ModelInfo:
        return self._model_info

    def prompt_limits(self) -> PromptLimits:
        return self._limits

    # ---- Backend API (asyncio) ----

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if not self.ready():
            raise RuntimeError("the local engine thread is not running")
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue = asyncio.Queue()
        rid = request.request_id
        stream = _Stream(loop, deltas, request.deadline)
        added = self._loop.submit(lambda _: self._add(request, stream))
        # NOTE: a loop that stopped before adding it fails the future: the stream must end too.
        added.add_done_callback(lambda f: _deliver_failure(stream, f))
        finished = False
        try:
            while not finished:
                item = await deltas.get()
                if isinstance(item, BaseException):
                    finished = True  # never added, or the engine died: nothing to abort
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:  # cancelled, closed early or failed: free the request's blocks
                self._loop.submit(lambda _: self._abort(rid))

    async def abort(self, request_id: str) -> None:
        self._loop.submit(lambda _: self._abort(request_id))

    async def status(self) -> ClusterStatus:
        if not self._loop.alive:  # nobody else touches the engine: read it here
            return self._status()
        return await self.call(lambda _: self._status())

    async def rebalance(self, pool: str | None = None) -> list:
        raise ValueError("one engine holds every expert: there is nothing to balance")

    async def expert_load(self) -> list[PoolLoad]:
        num_experts = self._model_info.num_routed_experts
        return [PoolLoad("local", 1, num_experts, await self.call(lambda e: e.expert_load()))]

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread between steps and return its result (for status
        queries and tests; fn must be quick and must not keep references to engine state)."""
        if not self.ready():
            raise RuntimeError("the local engine thread is not running")
        return await asyncio.wrap_future(self._loop.submit(fn))

    # ---- on the engine thread ----

    def _stopped(self, error: BaseException | None) -> None:
        """The loop's last act: end every open stream (with the error that killed the engine,
        or as aborted)."""
        for rid, stream in list(self._streams.items()):
            if error is not None:
                _deliver(stream, error)
                self._streams.pop(rid)
            else:
                self._abort(rid)

    def _add(self, request: GenerateRequest, stream: _Stream) -> None:
        # NOTE: the request's resolved seed wins, so its tokens do not depend on this engine's
        # own seed generator (the cluster must give the same tokens).
        params = dataclasses.replace(request.params, seed=request.seed)
        try:
            self.engine.add_request(request.request_id, request.prompt_token_ids, params)
        except ValueError as e:
            _deliver(stream, e)
            return
        self._streams[request.request_id] = stream

    def _abort(self, request_id: str) -> None:
        out = self.engine.abort_request(request_id)
        stream = self._streams.pop(request_id, None)
        if stream is not None and out is not None:
            _deliver(stream, out)

    def _expire_deadlines(self) -> None:
        now = time.time()
        for rid, stream in list(self._streams.items()):
            if stream.deadline is not None and now >= stream.deadline:
                self._abort(rid)

    def _publish(self, result: StepResult) -> None:
        for out in result.outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            # a request that failed alone: its stream raises the error, never yields the delta
            if not _deliver(stream, out.failure or out):  # its loop is gone: nobody listens
                self._abort(out.request_id)

    def _status(self) -> ClusterStatus:
        rank = self.engine.rank_status("local", 0, self.ready())
        return ClusterStatus(pools=[PoolStatus("local", [rank])], num_in_flight=len(self._streams))


def _deliver_failure(stream: _Stream, future: concurrent.futures.Future) -> None:
    """If the call that adds the request failed (the loop stopped first), end its stream."""
    error = future.exception()
    if error is not None:
        _deliver(stream, error)


def _deliver(stream: _Stream, item: RequestOutput | BaseException) -> bool:
    """Hand item to the stream's loop; False if that loop is closed."""
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:
        return False
    return True
