"""The prefill and decode pools as the router sees them: rank handles, their health, and the
re-forming of a pool after one of its ranks dies or hangs.

A rank has failed when a call to it fails as a rank failure (RankFailed: its process died, or it
did not answer within the call timeout `max_misses` polls in a row), when its engine thread
stopped, or when its engine thread has had work and made no progress for stall_timeout_s (hung:
a stuck collective, a wedged kernel). One failed rank fails its whole pool: every MoE layer is a
collective, so the other ranks cannot step without it. The pool is then re-formed through the
PoolControl (cluster/ replaces the ranks, rebuilds the process group, reloads the experts); the
router's requests on it are resumed (ClusterBackend) and new requests wait, within their
deadline, until it is ready again.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from engine.messages import RankStatus

log = logging.getLogger(__name__)

POOLS = ("prefill", "decode")


class RankFailed(RuntimeError):
    """A rank died, hung or stopped answering: its pool must be re-formed."""

    def __init__(self, pool: str, rank: int, why: str) -> None:
        super().__init__(f"{pool} rank {rank} failed: {why}")
        self.pool, self.rank, self.why = pool, rank, why


class PoolControl(Protocol):
    async def reform(self, pool: str, placement: dict | None) -> list[Any]:
        """Replace every rank of `pool` (new processes, a new process group, the experts of
        `placement` (Placement.to_dict: the pool's last known) loaded); -> the new rank
        handles, ready."""
        ...

    async def rebuild_kv(self) -> None:
        """Have every rank of both pools join a new point-to-point KV transport group (after
        a transfer failed: gloo closes a rank's links after a timeout)."""
        ...


@dataclass(frozen=True, slots=True)
class HealthConfig:
    stall_timeout_s: float = 30.0  # work and no progress for this long: hung
    status_interval_s: float = 0.1  # how often every rank's status is polled
    max_misses: int = 3  # status calls in a row that time out before a rank counts as failed
    reform_retry_s: float = 2.0  # wait between attempts when re-forming itself fails


@dataclass(slots=True)
class Pool:
    name: str
    ranks: list[Any]  # rank handles
    generation: int = 0  # bumped on every failure: requests placed before it are resumed
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    reforming: asyncio.Task | None = None
    failed_at: float = 0.0
    num_reforms: int = 0
    last_failure: str = ""
    recovery_s: list[float] = field(default_factory=list)  # failure -> ready, each time


class Pools:
    """The pools, their ranks' last status, and the health watch (on the router's loop)."""

    def __init__(
        self,
        prefill: list[Any],
        decode: list[Any],
        control: PoolControl | None,
        health: HealthConfig,
        on_failed: Callable[[str, int], None],
        on_reformed: Callable[[str], Awaitable[None]],
        num_experts: int = 0,
    ) -> None:
        """on_failed(pool, old generation) runs when a pool fails; on_reformed(pool) once its
        new ranks answer, before the pool is marked ready."""
        self.pools = {"prefill": Pool("prefill", prefill), "decode": Pool("decode", decode)}
        self.control, self.health = control, health
        self.on_failed, self.on_reformed = on_failed, on_reformed
        self.num_experts = num_experts
        self.status: dict[tuple[str, int], RankStatus] = {}
        self.num_polls = 0  # completed status polls: fresher statuses than any count before
        self.placements: dict[str, dict] = {}  # pool -> its last known expert placement
        self._misses: dict[tuple[str, int], int] = {}
        self._poller: asyncio.Task | None = None

    def __getitem__(self, name: str) -> Pool:
        return self.pools[name]

    # ---- lifecycle ----

    async def start(self) -> None:
        await self.poll_once()
        for pool in self.pools.values():
            if not pool.reforming:
                pool.ready.set()
        self._poller = asyncio.create_task(self._poll_forever())

    async def close(self) -> None:
        tasks = [self._poller] + [p.reforming for p in self.pools.values()]
        for task in tasks:
            if task is not None:
                task.cancel()

    def ready(self) -> bool:
        """Both pools can take work: not re-forming, and every rank ready and not stalled."""
        for name, pool in self.pools.items():
            if not pool.ready.is_set():
                return False
            for i in range(len(pool.ranks)):
                s = self.status.get((name, i))
                if s is None or not s.ready or s.stalled_s > self.health.stall_timeout_s:
                    return False
        return True

    async def wait_ready(self, timeout: float) -> bool:
        """Until both pools are ready; False after `timeout` seconds."""
        end = time.monotonic() + timeout
        for pool in self.pools.values():
            left = end - time.monotonic()
            if left <= 0:
                return False
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(pool.ready.wait(), left)
            if not pool.ready.is_set():
                return False
        return True

    # ---- health ----

    async def poll_once(self) -> None:
        ranks = [
            (name, i, r)
            for name, pool in self.pools.items()
            if pool.reforming is None
            for i, r in enumerate(pool.ranks)
        ]
        results = await asyncio.gather(*(r.status() for _, _, r in ranks), return_exceptions=True)
        for (name, i, _), result in zip(ranks, results, strict=True):
            self._judge(name, i, result)
        for name, pool in self.pools.items():
            if pool.reforming is None:
                self._note_placement(name, len(pool.ranks))
        self.num_polls += 1

    def _note_placement(self, name: str, num_ranks: int) -> None:
        """The pool's placement from its ranks' statuses (each lists its slots' experts)."""
        ranks = [self.status.get((name, i)) for i in range(num_ranks)]
        if num_ranks < 2 or any(r is None or not r.expert_ids for r in ranks):
            return
        layers = sorted(ranks[0].expert_ids)
        self.placements[name] = {
            "layers": layers,
            "num_ranks": num_ranks,
            "num_experts": self.num_experts,
            "phy2log": [sum((r.expert_ids[layer] for r in ranks), []) for layer in layers],
        }

    def _judge(self, name: str, i: int, result: RankStatus | BaseException) -> None:
        key = (name, i)
        if isinstance(result, TimeoutError):
            self._misses[key] = self._misses.get(key, 0) + 1
            if self._misses[key] >= self.health.max_misses:
                self.fail(name, i, f"no status answer in {self._misses[key]} tries")
            return
        if isinstance(result, BaseException):
            self.fail(name, i, str(result) or type(result).__name__)
            return
        self._misses[key] = 0
        self.status[key] = result
        if result.stalled_s > self.health.stall_timeout_s:
            self.fail(name, i, f"hung: no progress with work for {result.stalled_s:.1f} s")
        elif not result.ready and self.pools[name].ready.is_set():
            self.fail(name, i, "its engine thread stopped")

    async def _poll_forever(self) -> None:
        while True:
            await asyncio.sleep(self.health.status_interval_s)
            try:
                await self.poll_once()
            except Exception:
                log.exception("status poll failed")

    # ---- failure and re-forming ----

    def fail(self, name: str, rank: int, why: str) -> None:
        """Mark `name` failed (idempotent while it re-forms) and start re-forming it."""
        pool = self.pools[name]
        if pool.reforming is not None:
            return
        log.warning("%s rank %d failed (%s): re-forming the %s pool", name, rank, why, name)
        pool.ready.clear()
        pool.failed_at = time.monotonic()
        pool.last_failure = f"rank {rank}: {why}"
        old = pool.generation
        pool.generation += 1
        for i in range(len(pool.ranks)):
            self.status.pop((name, i), None)
            self._misses.pop((name, i), None)
        pool.reforming = asyncio.create_task(self._reform(pool))
        self.on_failed(name, old)

    async def _reform(self, pool: Pool) -> None:
        if self.control is None:
            log.error("the %s pool failed and nothing can re-form it", pool.name)
            return  # stays not ready: health says NOT_SERVING
        while True:
            try:
                placement = self.placements.get(pool.name)
                pool.ranks = await self.control.reform(pool.name, placement)
                break
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("re-forming the %s pool failed; trying again", pool.name)
                await asyncio.sleep(self.health.reform_retry_s)
        pool.reforming = None
        await self.poll_once()
        await self.on_reformed(pool.name)
        pool.num_reforms += 1
        pool.recovery_s.append(time.monotonic() - pool.failed_at)
        pool.ready.set()
        log.warning("%s pool ready again after %.1f s", pool.name, pool.recovery_s[-1])
