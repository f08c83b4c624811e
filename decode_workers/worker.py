"""DecodeWorker: one decode rank. Requests arrive in two calls: `reserve` (before the prefill
starts, so the KV never arrives to a full cache) and `start` (with the first token and the KV).
Deltas go out through one stream per router: a list of deltas per step, not a call per token.

Every router holds a lease here, renewed with its reservations (`renew`): a router that stops
renewing (it died) loses its requests and reservations after the lease, so nothing it left
behind holds blocks for good.
"""

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from engine.handoff import LeaseLapsed
from engine.kv_transfer import KVTransport
from engine.messages import GenerateRequest, RankStopped, RequestOutput, StepResult
from engine.rank import Rank, RankConfig


class DecodeWorker(Rank):
    def __init__(self, config: RankConfig, transport: KVTransport | None = None) -> None:
        super().__init__(config, transport)
        self._streams: dict[str, asyncio.Queue] = {}  # router id -> lists of deltas
        self._owner: dict[str, str] = {}  # request id -> router id
        self._leases: dict[str, float] = {}  # router id -> time.monotonic() its lease ends
        self._reaper: asyncio.Task | None = None
        # NOTE: p2p receives wait for their turn (the sender's order): one thread each, never
        # the default executor's few, or the receive they wait for could find no thread.
        self._kv_threads = ThreadPoolExecutor(max_workers=1000, thread_name_prefix="kv-recv")

    @property
    def num_pending(self) -> int:
        return len(self._owner)

    async def reserve(
        self, request_id: str, token_ids: list[int], lease_s: float, router_id: str = ""
    ) -> bool:
        """Hold blocks for token_ids (the prompt, and a resumed request's earlier output);
        False if there is no room. Released unless renewed or started within lease_s."""
        self._renew_router(router_id, lease_s)
        deadline = time.monotonic() + lease_s
        return await self.call(lambda e: e.reserve(request_id, token_ids, deadline))

    async def renew(self, router_id: str, request_ids: list[str], lease_s: float) -> int:
        """The router is alive, and these reservations are still wanted for lease_s more
        seconds; -> how many of them are still held."""
        self._renew_router(router_id, lease_s)
        deadline = time.monotonic() + lease_s
        if not request_ids:
            return 0
        return await self.call(lambda e: e.reservations.renew(request_ids, deadline))

    async def start(
        self, request: GenerateRequest, first: RequestOutput, kv_handle: Any, router_id: str
    ) -> None:
        """Receive the prompt's KV (kv_handle: what the prefill rank's transport sent), import it
        into the reserved blocks and join the running batch. Raises (and releases the
        reservation) when the KV cannot be received or imported."""
        rid = request.request_id
        self._owner[rid] = router_id
        stats, started, stage = self.engine.stats, time.perf_counter(), "receive"
        try:
            loop = asyncio.get_running_loop()
            kv = await loop.run_in_executor(self._kv_threads, self.transport.receive, kv_handle)
            stage = "import"
            await self.call(lambda e: e.start_prefilled(request, first, kv))
        except BaseException as e:
            if not isinstance(e, asyncio.CancelledError):
                stats.inc("epcluster_kv_transfer_failures_total", 1, stage)
            self._owner.pop(rid, None)
            await asyncio.shield(self.abort(rid))
            raise
        stats.observe(
            "epcluster_kv_transfer_duration_seconds", time.perf_counter() - started, "receive"
        )
        stats.inc("epcluster_kv_transfer_bytes_total", kv.nbytes, "receive")

    async def discard_kv(self, kv_handle: Any) -> None:
        """The request ended between its prefill and its start here: take the KV off the
        transport anyway and drop it (None: there was no KV)."""
        if kv_handle is None:
            return
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._kv_threads, self.transport.discard, kv_handle)

    async def abort(self, request_id: str) -> None:
        self._owner.pop(request_id, None)
        if self.loop is not None and self.loop.alive:
            await self.call(lambda e: e.abort_request(request_id))

    async def register_router(self, router_id: str, lease_s: float = 60.0) -> None:
        """Open the router's delta queue (before its first request, so nothing is dropped)."""
        self._streams.setdefault(router_id, asyncio.Queue())
        self._renew_router(router_id, lease_s)
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_routers())

    async def stream(self, router_id: str) -> AsyncIterator[list[RequestOutput]]:
        """The deltas of this router's requests, one list per engine step (a Ray streaming
        generator: the router keeps one open per decode rank). Raises when the engine stops."""
        queue = self._streams.setdefault(router_id, asyncio.Queue())
        try:
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
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

    def on_engine_stopped(self, error: BaseException | None) -> None:
        """Every router's stream raises RankStopped, naming the requests of the step that
        stopped the engine (the router recognises a poison request by them). A request that
        failed alone (RequestOutput.failure) is not this: its delta goes out like any other."""
        suspects = self.loop.suspects if self.loop is not None else ()
        for queue in self._streams.values():
            why = f"decode rank {self.config.rank} stopped: {error!r}"
            queue.put_nowait(RankStopped(why, suspects))

    # ---- router leases ----

    def _renew_router(self, router_id: str, lease_s: float) -> None:
        if router_id:
            self._leases[router_id] = max(
                self._leases.get(router_id, 0.0), time.monotonic() + lease_s
            )

    async def _reap_routers(self) -> None:
        """Abort the requests of routers whose lease ran out (they died or lost us), and end
        their streams with LeaseLapsed: a router that is alive after all opens a new stream
        and resumes those requests, where a stream left open would drop its deltas for good."""
        while True:
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for router_id in [r for r, end in self._leases.items() if end < now]:
                del self._leases[router_id]
                queue = self._streams.pop(router_id, None)
                if queue is not None:
                    why = f"decode rank {self.config.rank} dropped router {router_id}'s lease"
                    queue.put_nowait(LeaseLapsed(why))
                for rid in [r for r, owner in self._owner.items() if owner == router_id]:
                    with contextlib.suppress(Exception):
                        await self.abort(rid)
