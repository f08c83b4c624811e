"""DecodeWorker: one decode rank. Requests arrive in two calls: `reserve` (before the prefill
starts, so the KV never arrives to a full cache) and `start` (with the first token and the KV).
Deltas go out through one stream per router: a list of deltas per step, not a call per token."""

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from engine.kv_transfer import KVTransport
from engine.messages import GenerateRequest, RequestOutput, StepResult
from engine.rank import Rank, RankConfig


class DecodeWorker(Rank):
    def __init__(self, config: RankConfig, transport: KVTransport | None = None) -> None:
        super().__init__(config, transport)
        self._streams: dict[str, asyncio.Queue] = {}  # router id -> lists of deltas
        self._owner: dict[str, str] = {}  # request id -> router id

    async def reserve(self, request_id: str, prompt_token_ids: list[int], timeout_s: float) -> bool:
        """Hold blocks for the prompt; False if there is no room. Released if `start` does not
        come within timeout_s."""
        deadline = time.monotonic() + timeout_s
        return await self.call(lambda e: e.reserve(request_id, prompt_token_ids, deadline))

    async def start(
        self, request: GenerateRequest, first: RequestOutput, kv_handle: Any, router_id: str
    ) -> None:
        """Receive the prompt's KV (kv_handle: what the prefill rank's transport sent), import it
        into the reserved blocks and join the running batch. Raises (and releases the
        reservation) when the KV cannot be received or imported."""
        rid = request.request_id
        self._owner[rid] = router_id
        try:
            kv = await asyncio.to_thread(self.transport.receive, kv_handle)
            await self.call(
                lambda e: e.start_prefilled(
                    rid, request.prompt_token_ids, request.params, request.seed, first, kv
                )
            )
        except BaseException:
            self._owner.pop(rid, None)
            await asyncio.shield(self.abort(rid))
            raise

    async def discard_kv(self, kv_handle: Any) -> None:
        """The request ended between its prefill and its start here: take the KV off the
        transport anyway and drop it."""
        await asyncio.to_thread(self.transport.discard, kv_handle)

    async def abort(self, request_id: str) -> None:
        await self.call(lambda e: e.abort_request(request_id))

    async def register_router(self, router_id: str) -> None:
        """Open the router's delta queue (before its first request, so nothing is dropped)."""
        self._streams.setdefault(router_id, asyncio.Queue())

    async def stream(self, router_id: str) -> AsyncIterator[list[RequestOutput]]:
        """The deltas of this router's requests, one list per engine step (a Ray streaming
        generator: the router keeps one open per decode rank)."""
        queue = self._streams.setdefault(router_id, asyncio.Queue())
        try:
            while True:
                yield await queue.get()
        finally:
            if self._streams.get(router_id) is queue:
                del self._streams[router_id]

    def on_step(self, result: StepResult) -> None:
        by_router: dict[str, list[RequestOutput]] = {}
        for delta in result.outputs:
            router = self._owner.get(delta.request_id)
            if router is None:
                continue
            by_router.setdefault(router, []).append(delta)
            if delta.finished:
                del self._owner[delta.request_id]
        for router, deltas in by_router.items():
            queue = self._streams.get(router)
            if queue is not None:
                queue.put_nowait(deltas)
