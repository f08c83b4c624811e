"""PrefillWorker: one prefill rank. The engine runs each prompt as a prefill-only request; when
its first token is sampled, the engine hands the request off as a PrefillResult (the first token
and the prompt's latent KV), and its blocks go back to the prefix cache."""

import asyncio
import logging
import time
from typing import Any

from engine.kv_transfer import KVTransferError, KVTransport
from engine.messages import GenerateRequest, KVPayload, RankStopped, RequestOutput, StepResult
from engine.rank import Rank, RankConfig

log = logging.getLogger(__name__)


class PrefillAborted(RuntimeError):
    """The request was aborted by its router while its prompt was queued or running here (when
    the engine stops, the waiting prefills raise RankStopped)."""


class PrefillWorker(Rank):
    def __init__(self, config: RankConfig, transport: KVTransport | None = None) -> None:
        super().__init__(config, transport)
        # request id -> (first delta, its KV, or None when the request finished here)
        self._waiting: dict[str, asyncio.Future] = {}

    @property
    def num_pending(self) -> int:
        return len(self._waiting)

    async def prefill(self, request: GenerateRequest, kv_dst: int = 0) -> tuple[RequestOutput, Any]:
        """Run the prompt; -> (first delta, the transport's handle of the prompt's KV for the
        decode rank). The handle is None when the request already finished with its first token
        (EOS, max_tokens=1, a stop). kv_dst: the decode rank's index in the KV transport group.
        Raises PrefillAborted when the request is aborted meanwhile, RequestFailed when it
        failed alone here (its rows could not be sampled), RankStopped when the engine stopped.
        """
        rid = request.request_id
        future = asyncio.get_running_loop().create_future()
        self._waiting[rid] = future
        try:
            await self.call(
                lambda e: e.add_request(
                    rid,
                    request.prompt_token_ids,
                    request.params,
                    seed=request.seed,
                    prefill_only=True,
                    resume=request.resume,
                )
            )
            first, kv = await future
        except BaseException:  # cancelled or failed: the prompt must not hold blocks
            await asyncio.shield(self._abort_in_engine(rid))
            raise
        finally:
            self._waiting.pop(rid, None)
        if kv is None:  # done here
            return first, None
        stats, started = self.engine.stats, time.perf_counter()
        stats.observe("epcluster_kv_transfer_size_bytes", kv.nbytes)
        stats.inc("epcluster_kv_transfer_bytes_total", kv.nbytes, "send")
        if request.kv_fallback:  # the KV goes as an object
            return first, kv
        try:
            handle = self.transport.send(kv, kv_dst)
        except KVTransferError as e:  # the p2p link is down: the payload travels as an object
            log.warning("KV of %s goes through the object store: %s", rid, e)
            stats.inc("epcluster_kv_transfer_failures_total", 1, "send")
            return first, kv
        stats.observe(
            "epcluster_kv_transfer_duration_seconds", time.perf_counter() - started, "send"
        )
        return first, handle

    async def abort(self, request_id: str) -> None:
        """End the request here however far it got; a prefill call waiting on it raises."""
        future = self._waiting.pop(request_id, None)
        if future is not None and not future.done():
            future.set_exception(PrefillAborted(f"request {request_id} was aborted"))
        await self._abort_in_engine(request_id)

    async def _abort_in_engine(self, request_id: str) -> None:
        if self.loop is not None and self.loop.alive:
            await self.call(lambda e: e.abort_request(request_id))

    def on_step(self, result: StepResult) -> None:
        for delta in result.outputs:
            if delta.failure is not None:  # failed alone: its prefill call raises the error
                future = self._waiting.get(delta.request_id)
                if future is not None and not future.done():
                    future.set_exception(delta.failure)
            elif delta.finished:
                self._resolve(delta.request_id, delta, None)
        for handed_off in result.prefilled:
            self._resolve(handed_off.first.request_id, handed_off.first, handed_off.kv)

    def on_engine_stopped(self, error: BaseException | None) -> None:
        """Every waiting prefill raises RankStopped, naming the requests of the step that
        stopped the engine (the router recognises a poison request by them)."""
        suspects = self.loop.suspects if self.loop is not None else ()
        for rid, future in list(self._waiting.items()):
            if not future.done():
                future.set_exception(
                    RankStopped(f"the engine stopped ({error!r}): {rid}", suspects)
                )

    def _resolve(self, rid: str, first: RequestOutput, kv: KVPayload | None) -> None:
        future = self._waiting.get(rid)
        if future is not None and not future.done():
            future.set_result((first, kv))
