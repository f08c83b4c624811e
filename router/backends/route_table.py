"""The requests ClusterBackend has in flight on the pools, and the load it put on the ranks: the
state its parts share (the request path, the decode streams, the lease renewer, the admin)."""

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from engine.messages import GenerateRequest, RequestOutput
from router.backends.attempt_errors import AttemptLost
from router.backends.decode_room import DecodeRoom
from router.backends.pools import RankFailed

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


class RouteTable:
    """Routes by wire id (this attempt's, as the ranks know it) and by the client's id, the
    prompt tokens this router has in flight on each prefill rank, and its view of the decode
    ranks' free blocks (`room`)."""

    def __init__(
        self, num_prefill: int, num_decode: int, block_size: int, max_reserve_waiters: int
    ) -> None:
        self.by_wire: dict[str, Route] = {}
        self.by_client: dict[str, Route] = {}
        self.prefill_load = [0] * num_prefill
        self.room = DecodeRoom(num_decode, block_size, max_reserve_waiters)

    @property
    def decode_pending(self) -> list[int]:
        """Blocks this router reserved on each decode rank that its status does not show yet."""
        return self.room.pending()

    def reset_load(self, num_prefill: int, num_decode: int) -> None:
        """A pool re-formed: its new ranks hold nothing of this router's yet."""
        self.prefill_load = [0] * num_prefill
        self.room.reset(num_decode)

    def deliver(self, delta: RequestOutput) -> None:
        """A decode rank's delta to its request (a finished one gives its blocks back first:
        a request waiting for room may fit)."""
        if delta.finished:
            self.room.forget(
                delta.request_id, delta.num_prompt_tokens + delta.num_completion_tokens
            )
        route = self.by_wire.get(delta.request_id)
        if route is not None:
            route.queue.put_nowait(delta)

    def mark_suspects(self, suspects: tuple[str, ...]) -> None:
        """Mark the routes whose current attempt (wire id) was in the step that stopped a
        rank's engine. NOTE: every RankFailed of one engine's death carries the same suspects,
        and any of them may reach the router first (a bystander's, or the pool's re-form
        notice): marking from each keeps the count right whatever the order."""
        for rid in suspects:
            route = self.by_wire.get(rid)
            if route is not None:
                route.suspect = True

    def fail_pool(self, pool: str, generation: int) -> None:
        """Every request placed on the failed pool's ranks (of `generation`) resumes elsewhere
        (after it re-forms)."""
        for route in list(self.by_wire.values()):
            on_prefill = pool == "prefill" and route.prefill is not None and not route.first
            on_decode = pool == "decode" and route.decode is not None
            gen = route.prefill_gen if pool == "prefill" else route.decode_gen
            if (on_prefill or on_decode) and gen == generation and not route.done:
                rank = route.prefill if pool == "prefill" else route.decode
                route.queue.put_nowait(RankFailed(pool, rank, "its pool is re-forming"))

    def lose_attempts(self, decode_rank: int, generation: int, why: str) -> None:
        """The attempts placed on `decode_rank` (of `generation`) resume elsewhere."""
        for route in list(self.by_wire.values()):
            if route.decode == decode_rank and route.decode_gen == generation and not route.done:
                route.queue.put_nowait(AttemptLost(why))

    def reserved_not_started(self, num_decode: int, generation: int) -> list[list[str]]:
        """Per decode rank (of `generation`), the wire ids holding a reservation whose prefill
        runs: the leases to renew."""
        waiting: list[list[str]] = [[] for _ in range(num_decode)]
        for rid, route in self.by_wire.items():
            if route.decode is not None and not route.started and route.decode_gen == generation:
                waiting[route.decode].append(rid)
        return waiting
