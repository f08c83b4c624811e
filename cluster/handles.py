"""Async handles over the rank actors: what the router's ClusterBackend calls.

Every call has a timeout. A call that fails because the rank is gone (its process died, the
actor is unreachable) or does not answer in time raises router.pools.RankFailed, as does a
RankStopped the rank raised (its engine stopped); any other exception the rank raised comes back
as that exception (its message, without Ray's remote traceback, which goes to the log). A prefill
the router stops waiting for is cancelled on the rank
(ray.cancel), so its slot and its waiting future go too.

The KV payload of a request stays an ObjectRef from the prefill call to the decode call: Ray
moves the bytes between the two ranks' object stores, never through the router.
"""

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import ray
from ray.actor import ActorHandle
from ray.exceptions import RayActorError, RayError, RayTaskError, TaskCancelledError

from engine.messages import GenerateRequest, RankStatus, RankStopped, RequestOutput
from router.pools import RankFailed

log = logging.getLogger(__name__)
T = TypeVar("T")


class RankHandle:
    def __init__(self, actor: ActorHandle, pool: str, rank: int, call_timeout_s: float) -> None:
        self.actor, self.pool, self.rank = actor, pool, rank
        self.call_timeout_s = call_timeout_s

    async def _call(self, ref: Awaitable[T], timeout: float | None = -1.0) -> T:
        """Await a remote call; RankFailed when the rank is gone or silent, the rank's own
        exception when it raised one."""
        timeout = self.call_timeout_s if timeout == -1.0 else timeout
        try:
            return await asyncio.wait_for(ref, timeout)
        except TimeoutError as e:
            raise RankFailed(self.pool, self.rank, f"no answer in {timeout:.0f} s") from e
        except RayTaskError as e:  # the rank raised: hand over its own exception
            cause = e.cause if isinstance(e.cause, BaseException) else None
            log.debug("%s rank %d raised:\n%s", self.pool, self.rank, e)
            if cause is None or isinstance(cause, (RayError, TaskCancelledError)):
                raise RankFailed(self.pool, self.rank, _first_line(e)) from None
            if isinstance(cause, RankStopped):  # its engine stopped: as good as dead
                raise RankFailed(self.pool, self.rank, str(cause)) from None
            raise cause from None
        except (RayActorError, RayError) as e:
            raise RankFailed(self.pool, self.rank, _first_line(e)) from None

    async def status(self) -> RankStatus:
        return await self._call(self.actor.status.remote())

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
        self, actor: ActorHandle, pool: str, rank: int, call_timeout_s: float, kv_rank: int
    ) -> None:
        super().__init__(actor, pool, rank, call_timeout_s)
        self.kv_rank = kv_rank  # its index in the KV transport group

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
        # NOTE: kv is an ObjectRef passed at the top level: Ray resolves it on the decode
        # actor, fetching it from the prefill rank's object store.
        await self._call(self.actor.start.remote(request, first, kv, router_id))

    async def discard_kv(self, kv: Any) -> None:
        await self._call(self.actor.discard_kv.remote(kv))

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
