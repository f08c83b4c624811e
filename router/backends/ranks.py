"""The rank handles the router drives, as Protocols: cluster/ wraps Ray actors in them
(cluster/handles.py), tests use plain objects. Everything the router calls on a rank is here,
so the router imports no Ray."""

from collections.abc import AsyncIterator
from typing import Any, Protocol

from engine.messages import GenerateRequest, RankStatus, RequestOutput

# MoE layer -> (tokens routed to each physical slot, the slot's logical expert)
ExpertLoad = dict[int, tuple[list[int], list[int]]]


class Rank(Protocol):
    """What every rank answers: its status (the health watch's call), aborts, and the expert
    load and rebalance calls of the admin."""

    async def status(self) -> RankStatus: ...
    async def abort(self, request_id: str) -> None: ...
    async def expert_load(self) -> ExpertLoad: ...
    async def request_rebalance(self) -> bool: ...


class PrefillRank(Rank, Protocol):
    async def prefill(self, request: GenerateRequest, kv_dst: int) -> tuple[RequestOutput, Any]: ...


class DecodeRank(Rank, Protocol):
    kv_rank: int  # where the prefill rank sends this rank's KV (the transport's numbering)

    async def reserve(
        self, request_id: str, token_ids: list[int], lease_s: float, router_id: str
    ) -> bool: ...
    async def renew(self, router_id: str, request_ids: list[str], lease_s: float) -> int: ...
    async def start(
        self, request: GenerateRequest, first: RequestOutput, kv: Any, router_id: str
    ) -> None: ...
    async def discard_kv(self, kv: Any) -> None: ...
    async def register_router(self, router_id: str, lease_s: float) -> None: ...
    def stream(self, router_id: str) -> AsyncIterator[list[RequestOutput]]: ...
