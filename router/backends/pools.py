"""The prefill and decode pools as the router sees them: rank handles, their health, and the
re-forming of a pool after one of its ranks dies or hangs.

Liveness is the status call alone (the heartbeat: the rank's engine thread reports its steps and
how long it has had work without progress), polled on every rank by a task of its own, so one
silent rank never delays the others' health. A rank has failed when a call to it fails as a rank
failure (RankFailed: its process died, its engine stopped), when `max_misses` status calls in a
row get no answer (RankCallFailed or a timeout: one slow answer is not a death), when its engine
thread stopped, or when it has had work and made no progress for stall_timeout_s (hung: a stuck
collective, a wedged kernel). Work calls that are slow (a decode `start` waiting on its KV) are
never liveness signals. One failed rank fails its whole pool: every MoE layer is a collective, so
the other ranks cannot step without it. The pool is then re-formed through the PoolControl
(cluster/ replaces the ranks, rebuilds the process group, reloads the experts); the router's
requests on it are resumed (ClusterBackend) and new requests wait, within their deadline, until
it is ready again.

Re-forming is one state machine per pool, keyed by its generation: a failure bumps it; a report
about an older generation is stale and ignored; the new ranks are checked (a status each, then
on_reformed, retried until it succeeds) and the pool is ready only if its generation is still
the one the re-form began for. A failure of the new ranks while they are checked starts over.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol

from engine.messages import RankStatus
from router.backends.ranks import DecodeRank, PrefillRank

Ranks = list[PrefillRank] | list[DecodeRank]  # one pool's rank handles

log = logging.getLogger(__name__)

POOLS = ("prefill", "decode")


class RankFailed(RuntimeError):
    """A rank died, hung or stopped answering: its pool must be re-formed. suspects: the wire
    ids of the requests in the step whose exception stopped its engine (RankStopped.suspects)."""

    def __init__(self, pool: str, rank: int, why: str, suspects: tuple[str, ...] = ()) -> None:
        super().__init__(f"{pool} rank {rank} failed: {why}")
        self.pool, self.rank, self.why = pool, rank, why
        self.suspects = tuple(suspects)


class RankCallFailed(RuntimeError):
    """A call to a rank got no answer in time, or Ray failed it without the rank's death: the
    attempt that made it is lost, not the rank (for a status call: one miss)."""

    def __init__(self, pool: str, rank: int, why: str) -> None:
        super().__init__(f"a call to {pool} rank {rank} failed: {why}")
        self.pool, self.rank, self.why = pool, rank, why


class PoolControl(Protocol):
    async def reform(self, pool: str, placement: dict | None) -> Ranks:
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
    status_interval_s: float = 0.1  # how often each rank's status is polled
    status_timeout_s: float = 30.0  # a status call unanswered for this long is one miss
    max_misses: int = 3  # status calls in a row that miss before a rank counts as failed
    reform_retry_s: float = 2.0  # wait between attempts when re-forming itself fails


@dataclass(slots=True)
class Pool:
    name: str
    ranks: Ranks
    generation: int = 0  # bumped on every failure: requests placed before it are resumed
    ready: asyncio.Event = field(default_factory=asyncio.Event)
    reforming: asyncio.Task | None = None
    checking: bool = False  # its re-form is checking the new ranks (a failure starts over)
    watchers: list[asyncio.Task] = field(default_factory=list)  # one status poller per rank
    failed_at: float = 0.0
    num_reforms: int = 0
    last_failure: str = ""
    recovery_s: list[float] = field(default_factory=list)  # failure -> ready, each time

    @property
    def is_reforming(self) -> bool:
        return self.reforming is not None and not self.reforming.done()


class Pools:
    """The pools, their ranks' last status, and the health watch (on the router's loop)."""

    def __init__(
        self,
        prefill: list[PrefillRank],
        decode: list[DecodeRank],
        control: PoolControl | None,
        health: HealthConfig,
        on_failed: Callable[[str, int], None],
        on_reformed: Callable[[str], Awaitable[None]],
        num_experts: int = 0,
    ) -> None:
        """on_failed(pool, old generation) runs when a pool fails; on_reformed(pool) once its
        new ranks answer, before the pool is marked ready (retried until it succeeds)."""
        self.pools = {"prefill": Pool("prefill", prefill), "decode": Pool("decode", decode)}
        self.control, self.health = control, health
        self.on_failed, self.on_reformed = on_failed, on_reformed
        self.num_experts = num_experts
        self.status: dict[tuple[str, int], RankStatus] = {}
        self.num_polls = 0  # rounds in which every rank answered: fresher than any before
        self.placements: dict[str, dict] = {}  # pool -> its last known expert placement
        self._misses: dict[tuple[str, int], int] = {}
        self._answered: set[tuple[str, int]] = set()  # ranks that answered this round
        # called with (pool, rank) after each healthy status is stored (ClusterBackend wakes
        # the requests waiting for decode room on it: they never poll the ranks themselves)
        self.on_status: list[Callable[[str, int], None]] = []

    def __getitem__(self, name: str) -> Pool:
        return self.pools[name]

    # ---- lifecycle ----

    async def start(self) -> None:
        await self.poll_once()
        for pool in self.pools.values():
            if not pool.is_reforming:
                pool.ready.set()
                self._watch(pool)

    async def close(self) -> None:
        for pool in self.pools.values():
            for task in [*pool.watchers, pool.reforming]:
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
        """Every rank's status now, each call judged on its own (pools not re-forming)."""
        calls = [
            self._poll_rank(pool, i, pool.generation)
            for pool in self.pools.values()
            if not pool.is_reforming
            for i in range(len(pool.ranks))
        ]
        await asyncio.gather(*calls)

    def _watch(self, pool: Pool) -> None:
        """A status poller per rank of the pool's current generation."""
        for task in pool.watchers:
            task.cancel()
        gen = pool.generation
        pool.watchers = [
            asyncio.create_task(self._watch_rank(pool, i, gen)) for i in range(len(pool.ranks))
        ]

    async def _watch_rank(self, pool: Pool, i: int, gen: int) -> None:
        while pool.generation == gen:
            await asyncio.sleep(self.health.status_interval_s)
            try:
                await self._poll_rank(pool, i, gen)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("status poll of %s rank %d failed", pool.name, i)

    async def _poll_rank(self, pool: Pool, i: int, gen: int) -> None:
        """One status call, judged unless the rank was replaced meanwhile."""
        try:
            rank = pool.ranks[i]
            result = await asyncio.wait_for(rank.status(), self.health.status_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            result = e
        if pool.generation == gen:
            self._judge(pool.name, i, result, gen)

    def _note_placement(self, name: str, num_ranks: int) -> None:
        """The pool's placement from its ranks' statuses (each lists its slots' experts); a
        torn one (statuses from both sides of a rebalance: an expert with no slot) is not
        kept."""
        ranks = [self.status.get((name, i)) for i in range(num_ranks)]
        if num_ranks < 2 or any(r is None or not r.expert_ids for r in ranks):
            return
        layers = sorted(ranks[0].expert_ids)
        phy2log = [sum((r.expert_ids.get(layer, []) for r in ranks), []) for layer in layers]
        if self.num_experts and any(set(row) != set(range(self.num_experts)) for row in phy2log):
            return
        self.placements[name] = {
            "layers": layers,
            "num_ranks": num_ranks,
            "num_experts": self.num_experts,
            "phy2log": phy2log,
        }

    def _judge(self, name: str, i: int, result: RankStatus | BaseException, gen: int) -> None:
        key = (name, i)

        def fail(why: str) -> None:
            self.fail(name, i, why, generation=gen)

        if isinstance(result, RankFailed):
            fail(result.why)
            return
        if isinstance(result, BaseException):  # no answer (in time): a miss
            self._misses[key] = self._misses.get(key, 0) + 1
            if self._misses[key] >= self.health.max_misses:
                fail(f"no status answer {self._misses[key]} times in a row ({_why(result)})")
            return
        self._misses[key] = 0
        self.status[key] = result
        if result.stalled_s > self.health.stall_timeout_s:
            fail(f"hung: no progress with work for {result.stalled_s:.1f} s")
            return
        if not result.ready and self.pools[name].ready.is_set():
            fail("its engine thread stopped")
            return
        self._count_round(key)
        for hook in self.on_status:
            hook(name, i)

    def _count_round(self, key: tuple[str, int]) -> None:
        """num_polls += 1 once every rank of the pools not re-forming has answered again."""
        self._answered.add(key)
        everyone = {
            (name, i)
            for name, pool in self.pools.items()
            if not pool.is_reforming
            for i in range(len(pool.ranks))
        }
        if everyone <= self._answered:
            self._answered.clear()
            self.num_polls += 1
            for name, pool in self.pools.items():
                if not pool.is_reforming:
                    self._note_placement(name, len(pool.ranks))

    # ---- failure and re-forming ----

    def fail(self, name: str, rank: int, why: str, generation: int | None = None) -> None:
        """Mark `name` failed and start re-forming it. `generation`: the pool's generation the
        failure was seen in; a report about an older one is stale (ranks already gone) and
        ignored. While the pool re-forms, only a failure of its new ranks (their generation
        given) counts: the re-form starts over."""
        pool = self.pools[name]
        if generation is not None and generation != pool.generation:
            return
        if pool.is_reforming:
            if not (pool.checking and generation == pool.generation):
                return
            pool.reforming.cancel()  # the new ranks failed while checked: start over
        log.warning("%s rank %d failed (%s): re-forming the %s pool", name, rank, why, name)
        if pool.ready.is_set() or not pool.failed_at:
            pool.failed_at = time.monotonic()
        pool.ready.clear()
        pool.last_failure = f"rank {rank}: {why}"
        old = pool.generation
        pool.generation += 1
        for task in pool.watchers:
            task.cancel()
        pool.watchers = []
        for i in range(len(pool.ranks)):
            self.status.pop((name, i), None)
            self._misses.pop((name, i), None)
            self._answered.discard((name, i))
        pool.checking = False
        pool.reforming = asyncio.create_task(self._reform(pool, pool.generation))
        self.on_failed(name, old)

    async def _reform(self, pool: Pool, gen: int) -> None:
        """Replace the ranks, check them, run on_reformed; ready only if `gen` is current."""
        if self.control is None:
            log.error("the %s pool failed and nothing can re-form it", pool.name)
            return  # stays not ready: health says NOT_SERVING
        while True:
            try:
                placement = self.placements.get(pool.name)
                ranks = await self.control.reform(pool.name, placement)
                break
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("re-forming the %s pool failed; trying again", pool.name)
                await asyncio.sleep(self.health.reform_retry_s)
        if pool.generation != gen:
            return
        pool.ranks, pool.checking = ranks, True
        # NOTE: from here a failure of the new ranks (a status, a watcher) cancels this task
        # and starts a new re-form; nothing below may set `ready` for an older generation.
        await asyncio.gather(*(self._poll_rank(pool, i, gen) for i in range(len(ranks))))
        self._watch(pool)
        while True:
            try:
                await self.on_reformed(pool.name)
                break
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("the re-formed %s pool could not be opened; trying again", pool.name)
                await asyncio.sleep(self.health.reform_retry_s)
        if pool.generation != gen:
            return
        pool.checking = False
        pool.num_reforms += 1
        pool.recovery_s.append(time.monotonic() - pool.failed_at)
        pool.ready.set()
        log.warning("%s pool ready again after %.1f s", pool.name, pool.recovery_s[-1])


def _why(e: BaseException) -> str:
    return getattr(e, "why", "") or str(e) or type(e).__name__
