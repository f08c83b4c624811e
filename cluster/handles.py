"""Async handles over the rank actors: what the router's ClusterBackend calls.

Every call has a timeout, and liveness is kept apart from work:
- RankFailed (the pool must be re-formed) only when the rank is known gone: its actor died or is
  unreachable (RayActorError), or it raised RankStopped (its engine stopped).
- A call that gets no answer in time, or fails in Ray without the actor's death, raises
  RankCallFailed: the attempt that made it is lost, never the rank. Whether the rank is alive is
  for its status calls to say (router/backends/pools.py: `max_misses` status misses in a row
  fail it).
  Status calls travel in the actors' own "control" concurrency group, so thousands of queued
  prefills or a slow KV fetch never delay them.
- Decode `start` has its own, longer timeout (kv_start_timeout_s: the KV's turn and transfer,
  each up to routing.kv_lease_s, and its import); a `start` that times out, or whose KV object
  is lost (ObjectLostError, OwnerDiedError), raises KVTransferError: that request resumes with
  a new attempt, no pool re-forms.
Any other exception the rank raised comes back as that exception (its message, without Ray's
remote traceback, which goes to the log). A prefill the router stops waiting for is cancelled on
the rank (ray.cancel), so its slot and its waiting future go too.

The KV payload of a request stays an ObjectRef from the prefill call to the decode call: Ray
moves the bytes between the two ranks' object stores, never through the router.
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import ray
from ray.actor import ActorHandle
from ray.exceptions import ObjectLostError, RayActorError, RayError, RayTaskError

from engine.kv_transfer import KVTransferError
from engine.messages import GenerateRequest, RankStatus, RankStopped, RequestOutput
from router.backends.pools import RankCallFailed, RankFailed

log = logging.getLogger(__name__)
T = TypeVar("T")
CONTROL = "control"  # the actors' concurrency group for liveness calls (cluster/pool.py)
CONTROL_CONCURRENCY = 16


class RankHandle:
    def __init__(self, actor: ActorHandle, pool: str, rank: int, call_timeout_s: float) -> None:
        self.actor, self.pool, self.rank = actor, pool, rank
        self.call_timeout_s = call_timeout_s

    async def _call(self, ref: Awaitable[T], timeout: float | None = -1.0) -> T:
        """Await a remote call; RankFailed when the rank is gone, RankCallFailed when it is
        silent or Ray failed the call, KVTransferError when the call's KV object is lost, the
        rank's own exception when it raised one."""
        timeout = self.call_timeout_s if timeout == -1.0 else timeout
        try:
            return await asyncio.wait_for(ref, timeout)
        except TimeoutError:
            raise RankCallFailed(self.pool, self.rank, f"no answer in {timeout:.0f} s") from None
        except RayTaskError as e:  # the rank raised: hand over its own exception
            cause = e.cause if isinstance(e.cause, BaseException) else None
            log.debug("%s rank %d raised:\n%s", self.pool, self.rank, e)
            if isinstance(cause, (RankStopped, RayActorError)):  # as good as dead
                suspects = getattr(cause, "suspects", ())  # poison recognition (RankStopped)
                raise RankFailed(self.pool, self.rank, _first_line(cause), suspects) from None
            if cause is None or isinstance(cause, RayError):
                raise self._ray_error(cause or e) from None
            raise cause from None
        except RayActorError as e:
            raise RankFailed(self.pool, self.rank, _first_line(e)) from None
        except RayError as e:
            raise self._ray_error(e) from None

    def _ray_error(self, e: BaseException) -> Exception:
        if isinstance(e, ObjectLostError):  # the KV object is gone: the request's loss only
            return KVTransferError(f"the KV object was lost: {_first_line(e)}")
        return RankCallFailed(self.pool, self.rank, _first_line(e))

    async def status(self) -> RankStatus:
        """The liveness call: in the control group, so work never queues it."""
        return await self._call(self.actor.status.options(concurrency_group=CONTROL).remote())

    async def abort(self, request_id: str) -> None:
        await self._call(self.actor.abort.remote(request_id))

    async def expert_load(self) -> dict[int, tuple[list[int], list[int]]]:
        return await self._call(self.actor.expert_load.remote())

    async def request_rebalance(self) -> bool:
        return await self._call(self.actor.request_rebalance.remote())


class PrefillHandle(RankHandle):
    async def prefill(self, request: GenerateRequest, kv_dst: int) -> tuple[RequestOutput, Any]:
        """The first delta, and the KV's handle (an ObjectRef, left in the object store).
        No timeout: the router bounds it (deadline, abort, the health watch); cancelling the
        awaiting task cancels the call on the rank."""
        first_ref, kv_ref = self.actor.prefill.options(num_returns=2).remote(request, kv_dst)
        try:
            return await self._call(first_ref, timeout=None), kv_ref
        except asyncio.CancelledError:
            ray.cancel(first_ref)
            raise


class DecodeHandle(RankHandle):
    def __init__(
        self,
        actor: ActorHandle,
        pool: str,
        rank: int,
        call_timeout_s: float,
        kv_rank: int,
        start_timeout_s: float | None = None,
    ) -> None:
        """start_timeout_s: the `start` call's (default 3 x call_timeout_s); it waits for the
        KV (its turn and its transfer) and imports it."""
        super().__init__(actor, pool, rank, call_timeout_s)
        self.kv_rank = kv_rank  # its index in the KV transport group
        self.start_timeout_s = start_timeout_s or 3 * call_timeout_s

    async def reserve(
        self, request_id: str, token_ids: list[int], lease_s: float, router_id: str
    ) -> bool:
        return await self._call(
            self.actor.reserve.remote(request_id, token_ids, lease_s, router_id)
        )

    async def renew(self, router_id: str, request_ids: list[str], lease_s: float) -> int:
        return await self._call(self.actor.renew.remote(router_id, request_ids, lease_s))

    async def start(
        self, request: GenerateRequest, first: RequestOutput, kv: Any, router_id: str
    ) -> None:
        """Hand the KV to the rank. Slow or lost KV is KVTransferError (this request's loss);
        RankFailed only when the rank itself is gone."""
        # NOTE: kv is an ObjectRef passed at the top level: Ray resolves it on the decode
        # actor, fetching it from the prefill rank's object store.
        ref = self.actor.start.remote(request, first, kv, router_id)
        try:
            await self._call(ref, self.start_timeout_s)
        except RankCallFailed as e:
            raise KVTransferError(f"decode rank {self.rank} did not start it: {e.why}") from None

    async def discard_kv(self, kv: Any) -> None:
        """Take a KV nobody will start off the transport (a p2p send must be matched)."""
        await self._call(self.actor.discard_kv.remote(kv), self.start_timeout_s)

    async def register_router(self, router_id: str, lease_s: float) -> None:
        await self._call(self.actor.register_router.remote(router_id, lease_s))

    async def stream(self, router_id: str) -> AsyncIterator[list[RequestOutput]]:
        generator = self.actor.stream.options(num_returns="streaming").remote(router_id)
        try:
            async for ref in generator:
                yield await self._call(ref)
        except RankFailed:
            raise
        except (RayActorError, RayError) as e:
            raise RankFailed(self.pool, self.rank, _first_line(e)) from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:300] if text else type(e).__name__
