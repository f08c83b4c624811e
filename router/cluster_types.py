"""The pieces ClusterBackend is made of: the rank handles it expects (duck-typed: cluster/ wraps
Ray actors in them), its routing settings, the state of one request, and the errors a KV
transfer ends in."""

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.messages import GenerateRequest, RankStatus, RequestOutput


class PrefillRank(Protocol):
    async def prefill(self, request: GenerateRequest, kv_dst: int) -> tuple[RequestOutput, Any]: ...
    async def abort(self, request_id: str) -> None: ...
    async def status(self) -> RankStatus: ...


class DecodeRank(Protocol):
    kv_rank: int  # where the prefill rank sends this rank's KV (the transport's numbering)

    async def reserve(
        self, request_id: str, token_ids: list[int], lease_s: float, router_id: str
    ) -> bool: ...
    async def renew(self, router_id: str, request_ids: list[str], lease_s: float) -> int: ...
    async def start(
        self, request: GenerateRequest, first: RequestOutput, kv: Any, router_id: str
    ) -> None: ...
    async def abort(self, request_id: str) -> None: ...
    async def discard_kv(self, kv: Any) -> None: ...
    async def status(self) -> RankStatus: ...
    async def register_router(self, router_id: str, lease_s: float) -> None: ...
    def stream(self, router_id: str) -> AsyncIterator[list[RequestOutput]]: ...


class AttemptLost(RuntimeError):
    """This attempt cannot go on, and no rank is known to have failed (its KV was lost or came
    late, a work call went unanswered, a decode rank dropped this router's lease, its
    reservation was granted by a pool that failed meanwhile): the request resumes with a new
    attempt (one of max_resumes), and no pool re-forms."""


class KVTransferFailed(AttemptLost):
    """The prompt's KV did not reach the decode rank: the request resumes with a new attempt."""


class P2PTransferFailed(KVTransferFailed):
    """A point-to-point KV transfer failed: resume the request with its KV through the object
    store; `rebuild`: the transport group is broken (a timeout, a closed link), so rebuild it (a
    handle of an older group is no reason to)."""

    def __init__(self, why: str, rebuild: bool = True) -> None:
        super().__init__(why)
        self.rebuild = rebuild


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    kv_lease_s: float = 30.0  # a reservation not renewed or started for this long is released
    reserve_wait_s: float = 10.0  # how long a request waits for room on a decode rank
    max_reserve_waiters: int = 1024  # requests waiting for decode room; more: refused at once
    recovery_wait_s: float = 120.0  # how long a request waits for a re-forming pool
    max_resumes: int = 3  # resumes of one request after rank failures, then UNAVAILABLE
    prefill_max_imbalance: int = 4096  # queued prompt tokens before affinity gives way to load
    affinity_blocks: int = 1  # prompt blocks whose hash picks the preferred prefill rank
    kv_p2p: bool = False  # KV goes point to point: a failed transfer falls back to objects
    eplb_interval_s: float = 0.0  # rebalance the experts of both pools this often (0: never)

    def __post_init__(self) -> None:
        for name in ("kv_lease_s", "reserve_wait_s", "recovery_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"routing {name} must be > 0 (got {getattr(self, name)!r})")
        if self.max_reserve_waiters < 1:
            raise ValueError(
                f"routing max_reserve_waiters must be >= 1 (got {self.max_reserve_waiters!r})"
            )
        if self.prefill_max_imbalance < 0 or self.affinity_blocks < 1 or self.max_resumes < 0:
            raise ValueError(
                "routing prefill_max_imbalance and max_resumes must be >= 0, affinity_blocks "
                f">= 1 (got {self.prefill_max_imbalance!r}, {self.max_resumes!r}, "
                f"{self.affinity_blocks!r})"
            )


POISON_STRIKES = 2  # attempts found in a rank-killing step: the request is not resumed again


@dataclass(slots=True)
class Route:
    """One request: what the client received, and where its current attempt runs."""

    request: GenerateRequest  # as the client sent it
    wire: GenerateRequest  # this attempt, as the ranks see it (router-issued id, resume state)
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)  # deltas, None, RankFailed
    token_ids: list[int] = field(default_factory=list)  # received by the client
    text: str = ""
    resumes: int = 0
    decode: int | None = None  # the decode rank holding its reservation (then its blocks)
    decode_gen: int = -1
    prefill: int | None = None
    prefill_gen: int = -1
    first: RequestOutput | None = None  # the first token's delta, from the prefill rank
    kv: Any = None  # the transport's handle of the prompt's KV until the decode rank has it
    done: bool = False  # finished on a rank: nothing left to abort there
    started: bool = False  # the decode rank took the request (its reservation is used)
    kv_fallback: bool = False  # its p2p transfer failed once: the object store from now on
    arrival: float = field(default_factory=time.monotonic)
    # Poison recognition: this attempt was in the step whose exception stopped a rank's engine
    # (RankFailed.suspects), and how many of its attempts were (POISON_STRIKES ends it).
    suspect: bool = False
    strikes: int = 0

    def strike(self) -> bool:
        """After a rank failure: count this attempt if it was a suspect; -> True when the
        request is poison (POISON_STRIKES attempts killed a rank): it must not be resumed."""
        if self.suspect:
            self.strikes, self.suspect = self.strikes + 1, False
        return self.strikes >= POISON_STRIKES


def mark_suspects(routes: dict[str, Route], suspects: tuple[str, ...]) -> None:
    """Mark the routes whose current attempt (wire id) was in the step that stopped a rank's
    engine. NOTE: every RankFailed of one engine's death carries the same suspects, and any of
    them may reach the router first (a bystander's, or the pool's re-form notice): marking from
    each keeps the count right whatever the order."""
    for rid in suspects:
        route = routes.get(rid)
        if route is not None:
            route.suspect = True
