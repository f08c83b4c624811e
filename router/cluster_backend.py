"""ClusterBackend: the Backend over a prefill pool and a decode pool.

Per request: pick a decode rank and reserve KV blocks there; pick a prefill rank and run the
prompt; stream the first token (time to first token); hand the prompt's KV, unopened, to the
decode rank; then stream the decode rank's deltas, which arrive once per step on one stream per
decode rank. However the request ends (finish, client cancel, deadline, failure), both ranks are
told, so no block stays held.

The rank handles are duck-typed (cluster/ wraps Ray actors in them); this module imports no Ray.
"""

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Protocol

from engine.messages import (
    ClusterStatus,
    GenerateRequest,
    ModelInfo,
    PoolStatus,
    RankStatus,
    RequestOutput,
)
from engine.tokenizer import Tokenizer
from router.routing import decode_preference, prefill_choice, prefix_key

log = logging.getLogger(__name__)


class PrefillRank(Protocol):
    async def prefill(self, request: GenerateRequest, kv_dst: int) -> tuple[RequestOutput, Any]: ...
    async def abort(self, request_id: str) -> None: ...
    async def status(self) -> RankStatus: ...


class DecodeRank(Protocol):
    kv_rank: int  # where the prefill rank sends this rank's KV (the transport's numbering)

    async def reserve(self, request_id: str, prompt: list[int], timeout_s: float) -> bool: ...
    async def start(
        self, request: GenerateRequest, first: RequestOutput, kv: Any, router_id: str
    ) -> None: ...
    async def abort(self, request_id: str) -> None: ...
    async def discard_kv(self, kv: Any) -> None: ...
    async def status(self) -> RankStatus: ...
    async def register_router(self, router_id: str) -> None: ...
    def stream(self, router_id: str) -> AsyncIterator[list[RequestOutput]]: ...


class KVTransferFailed(RuntimeError):
    """The prompt's KV did not reach the decode rank; the request ends with an error."""


class ClusterBackend:
    def __init__(
        self,
        prefill: list[PrefillRank],
        decode: list[DecodeRank],
        model_info: ModelInfo,
        tokenizer: Tokenizer,
        block_size: int,
        kv_transfer_timeout_s: float = 30.0,
        reserve_wait_s: float = 10.0,
        prefill_max_imbalance: int = 4096,
        affinity_blocks: int = 1,
        status_interval_s: float = 0.1,
    ) -> None:
        self.prefill, self.decode = prefill, decode
        self._model_info, self.tokenizer = model_info, tokenizer
        self.block_size = block_size
        self.kv_transfer_timeout_s = kv_transfer_timeout_s
        self.reserve_wait_s = reserve_wait_s
        self.prefill_max_imbalance = prefill_max_imbalance
        self.affinity_blocks = affinity_blocks
        self.status_interval_s = status_interval_s
        self.router_id = uuid.uuid4().hex
        self._queues: dict[str, asyncio.Queue] = {}
        self._prefill_load = [0] * len(prefill)  # prompt tokens this router has in flight
        self._decode_pending = [0] * len(decode)  # blocks reserved since the last status
        self._status: dict[tuple[str, int], RankStatus] = {}
        self._tasks: list[asyncio.Task] = []
        self._started = False

    # ---- lifecycle ----

    async def start(self) -> None:
        """Open the delta streams and the status poller (on the server's event loop)."""
        await asyncio.gather(*(d.register_router(self.router_id) for d in self.decode))
        self._tasks = [asyncio.create_task(self._read_stream(d)) for d in self.decode]
        await self._poll_status_once()
        self._tasks.append(asyncio.create_task(self._poll_status()))
        self._started = True

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._started = False

    def ready(self) -> bool:
        return (
            self._started
            and len(self._status) == len(self.prefill) + len(self.decode)
            and all(s.ready for s in self._status.values())
            and not any(t.done() for t in self._tasks)
        )

    def model_info(self) -> ModelInfo:
        return self._model_info

    async def status(self) -> ClusterStatus:
        await self._poll_status_once()
        pools = [
            PoolStatus(name, [self._status[(name, i)] for i in range(n)])
            for name, n in (("prefill", len(self.prefill)), ("decode", len(self.decode)))
        ]
        return ClusterStatus(pools, num_in_flight=len(self._queues))

    async def _poll_status_once(self) -> None:
        ranks = [("prefill", i, r) for i, r in enumerate(self.prefill)]
        ranks += [("decode", i, r) for i, r in enumerate(self.decode)]
        results = await asyncio.gather(*(r.status() for _, _, r in ranks), return_exceptions=True)
        for (pool, i, _), result in zip(ranks, results):
            if isinstance(result, BaseException):
                old = self._status.get((pool, i))
                self._status[(pool, i)] = RankStatus(
                    pool, i, False, 0, 0, 0, old.kv_total_blocks if old else 0
                )
            else:
                self._status[(pool, i)] = result
        self._decode_pending = [0] * len(self.decode)

    async def _poll_status(self) -> None:
        while True:
            await asyncio.sleep(self.status_interval_s)
            with contextlib.suppress(Exception):
                await self._poll_status_once()

    async def _read_stream(self, rank: DecodeRank) -> None:
        async for deltas in rank.stream(self.router_id):
            for delta in deltas:
                queue = self._queues.get(delta.request_id)
                if queue is not None:
                    queue.put_nowait(delta)

    # ---- requests ----

    async def abort(self, request_id: str) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(None)  # generate() sees it, aborts on the ranks, ends with "abort"

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        rid, prompt = request.request_id, request.prompt_token_ids
        if rid in self._queues:
            raise ValueError(f"request id {rid!r} is already in flight")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[rid] = queue
        decode_idx: int | None = None
        prefill_idx: int | None = None
        kv = None  # the transport's handle of the prompt's KV, until the decode rank takes it
        done = False
        try:
            decode_idx = await self._reserve(request)
            prefill_idx = prefill_choice(
                prefix_key(prompt, self.block_size, self.affinity_blocks),
                self._prefill_load,
                self.prefill_max_imbalance,
            )
            self._prefill_load[prefill_idx] += len(prompt)
            try:
                result = await self._within(
                    request,
                    self.prefill[prefill_idx].prefill(request, self.decode[decode_idx].kv_rank),
                    abort_queue=queue,
                )
            finally:
                self._prefill_load[prefill_idx] -= len(prompt)
            if result is None:  # deadline or abort during the prefill
                yield self._aborted(request)
                return  # not done: the finally aborts on both ranks
            first, kv = result
            if first.finished:  # done on the prefill rank: release the decode reservation
                done = True
                await asyncio.shield(self.decode[decode_idx].abort(rid))
            yield first
            if done:
                return
            try:
                handle, kv = kv, None
                await self.decode[decode_idx].start(request, first, handle, self.router_id)
            except Exception as e:
                raise KVTransferFailed(
                    f"the prompt's KV cache did not reach decode rank {decode_idx}: {e}"
                ) from e
            while True:
                delta = await self._within(request, queue.get())
                if delta is None:  # deadline or abort
                    yield self._aborted(request)
                    return
                if delta.finished:
                    done = True
                yield delta
                if done:
                    return
        finally:
            self._queues.pop(rid, None)
            if not done:  # cancelled, failed or aborted: free the blocks on both ranks
                await asyncio.shield(self._abort_on_ranks(rid, prefill_idx, decode_idx))
            if kv is not None:  # sent but never started: a p2p send must still be matched
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.decode[decode_idx].discard_kv(kv))

    async def _reserve(self, request: GenerateRequest) -> int:
        """Reserve the prompt's blocks on the best decode rank with room, waiting for room up
        to reserve_wait_s. -> the decode rank."""
        needed = -(-(len(request.prompt_token_ids) + 1) // self.block_size)
        give_up = time.monotonic() + self.reserve_wait_s
        while True:
            ranks = [self._status.get(("decode", i)) for i in range(len(self.decode))]
            live = [r or RankStatus("decode", i, False, 0, 0, 0, 0) for i, r in enumerate(ranks)]
            for i in decode_preference(live, self._decode_pending, needed):
                ok = await self.decode[i].reserve(
                    request.request_id, request.prompt_token_ids, self.kv_transfer_timeout_s
                )
                if ok:
                    self._decode_pending[i] += needed
                    return i
            if time.monotonic() > give_up:
                raise RuntimeError(
                    f"no decode rank has room for {needed} KV blocks after "
                    f"{self.reserve_wait_s:.0f} s"
                )
            await asyncio.sleep(0.05)
            await self._poll_status_once()

    async def _within(
        self, request: GenerateRequest, awaitable: Any, abort_queue: asyncio.Queue | None = None
    ) -> Any:
        """Await `awaitable` until the request's deadline, or until an abort marker arrives on
        abort_queue; -> None in those cases."""
        timeout = None if request.deadline is None else max(0.0, request.deadline - time.time())
        task = asyncio.ensure_future(awaitable)
        waits = {task}
        if abort_queue is not None:
            waits.add(asyncio.ensure_future(abort_queue.get()))
        try:
            finished, _ = await asyncio.wait(
                waits, timeout=timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            for waiter in waits:
                waiter.cancel()
        return task.result() if task in finished else None

    def _aborted(self, request: GenerateRequest) -> RequestOutput:
        return RequestOutput(
            request.request_id, [], "", "abort", len(request.prompt_token_ids), 0, 0
        )

    async def _abort_on_ranks(
        self, rid: str, prefill_idx: int | None, decode_idx: int | None
    ) -> None:
        calls = []
        if prefill_idx is not None:
            calls.append(self.prefill[prefill_idx].abort(rid))
        if decode_idx is not None:
            calls.append(self.decode[decode_idx].abort(rid))
        for result in await asyncio.gather(*calls, return_exceptions=True):
            if isinstance(result, BaseException):
                log.warning("abort of %s failed: %r", rid, result)
