"""Async handles over the rank actors: what the router's ClusterBackend calls. The KV payload of
a request stays an ObjectRef from the prefill call to the decode call: Ray moves the bytes
between the two ranks' object stores, never through the router."""

from collections.abc import AsyncIterator
from typing import Any

from ray.actor import ActorHandle

from engine.messages import GenerateRequest, RankStatus, RequestOutput


class PrefillHandle:
    def __init__(self, actor: ActorHandle) -> None:
        self.actor = actor

    async def prefill(self, request: GenerateRequest, kv_dst: int) -> tuple[RequestOutput, Any]:
        first_ref, kv_ref = self.actor.prefill.options(num_returns=2).remote(request, kv_dst)
        return await first_ref, kv_ref  # the KV stays in the object store

    async def abort(self, request_id: str) -> None:
        await self.actor.abort.remote(request_id)

    async def status(self) -> RankStatus:
        return await self.actor.status.remote()


class DecodeHandle:
    def __init__(self, actor: ActorHandle, kv_rank: int) -> None:
        self.actor = actor
        self.kv_rank = kv_rank  # its index in the KV transport group

    async def reserve(self, request_id: str, prompt: list[int], timeout_s: float) -> bool:
        return await self.actor.reserve.remote(request_id, prompt, timeout_s)

    async def start(
        self, request: GenerateRequest, first: RequestOutput, kv: Any, router_id: str
    ) -> None:
        # NOTE: kv is an ObjectRef passed at the top level: Ray resolves it on the decode
        # actor, fetching it from the prefill rank's object store.
        await self.actor.start.remote(request, first, kv, router_id)

    async def abort(self, request_id: str) -> None:
        await self.actor.abort.remote(request_id)

    async def discard_kv(self, kv: Any) -> None:
        await self.actor.discard_kv.remote(kv)

    async def status(self) -> RankStatus:
        return await self.actor.status.remote()

    async def register_router(self, router_id: str) -> None:
        await self.actor.register_router.remote(router_id)

    async def stream(self, router_id: str) -> AsyncIterator[list[RequestOutput]]:
        async for ref in self.actor.stream.options(num_returns="streaming").remote(router_id):
            yield await ref
