"""Pools' health watch and re-form state machine without Ray: fake ranks whose status answers,
hangs or fails on command, and a fake PoolControl. Liveness is the status call alone: one miss
is not a death, `max_misses` in a row are; one silent rank does not hold up the others' polls;
a re-form is keyed by the pool's generation (a stale report is ignored, a failing on_reformed is
retried, the new ranks failing while checked start it over)."""

import asyncio

from engine.messages import RankStatus
from router.backends.pools import HealthConfig, Pools, RankCallFailed, RankFailed

HEALTH = HealthConfig(
    status_interval_s=0.01, status_timeout_s=0.05, max_misses=3, reform_retry_s=0.01
)


class Rank:
    """status: answers, or hangs (`hang` > 0: that many calls in a row never answer), or
    raises `error` (every call)."""

    def __init__(self, pool: str, rank: int) -> None:
        self.pool, self.rank = pool, rank
        self.hang = 0
        self.error: BaseException | None = None
        self.num_status = 0

    async def status(self) -> RankStatus:
        if self.error is not None:
            raise self.error
        if self.hang > 0:
            self.hang -= 1
            await asyncio.sleep(3600)
        self.num_status += 1
        return RankStatus(self.pool, self.rank, True, 0, 0, 0, 100)


class Control:
    """Re-forms a pool with new fake ranks; `gate` (when set) holds each re-form until it opens."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.made: list[list[Rank]] = []
        self.gate: asyncio.Event | None = None

    async def reform(self, pool: str, placement=None) -> list[Rank]:
        self.calls.append(pool)
        if self.gate is not None:
            await self.gate.wait()
        ranks = [Rank(pool, 0), Rank(pool, 1)]
        self.made.append(ranks)
        return ranks

    async def rebuild_kv(self) -> None:
        pass


class Reformed:
    """on_reformed: fails its first `failures` calls (a register_router that timed out)."""

    def __init__(self, failures: int = 0) -> None:
        self.failures, self.calls = failures, 0

    async def __call__(self, pool: str) -> None:
        self.calls += 1
        if self.calls <= self.failures:
            raise RankCallFailed("decode", 0, "no answer in 30 s")


async def started(on_reformed=None, control=None) -> tuple[Pools, list[Rank], list[Rank]]:
    prefill, decode = [Rank("prefill", 0), Rank("prefill", 1)], [Rank("decode", 0)]
    pools = Pools(
        prefill, decode, control or Control(), HEALTH, lambda *_: None, on_reformed or Reformed()
    )
    await pools.start()
    return pools, prefill, decode


async def until(condition, timeout: float = 10.0) -> None:
    end = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < end, "condition never held"
        await asyncio.sleep(0.005)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 30))


def test_one_status_miss_is_not_a_failure_max_misses_in_a_row_are():
    async def main():
        pools, prefill, _ = await started()
        prefill[1].hang = 2  # two misses, then it answers again
        await until(lambda: prefill[1].num_status >= 3)
        assert pools["prefill"].generation == 0 and pools.ready()
        prefill[1].hang = 3  # three in a row
        await until(lambda: pools["prefill"].generation == 1)
        assert "3 times in a row" in pools["prefill"].last_failure
        await until(pools.ready)
        await pools.close()

    run(main())


def test_a_status_call_that_fails_without_the_ranks_death_is_a_miss():
    async def main():
        pools, _, decode = await started()
        decode[0].error = RankCallFailed("decode", 0, "a Ray error")
        await until(lambda: pools["decode"].generation == 1)
        assert "no status answer 3 times in a row (a Ray error)" in pools["decode"].last_failure
        await pools.close()

    run(main())


def test_a_dead_rank_fails_at_once():
    async def main():
        pools, _, decode = await started()
        decode[0].error = RankFailed("decode", 0, "its process died")
        await until(lambda: pools["decode"].generation == 1)
        assert pools["decode"].last_failure == "rank 0: its process died"
        await pools.close()

    run(main())


def test_a_silent_rank_does_not_hold_up_the_others_polls():
    async def main():
        pools, prefill, decode = await started()
        prefill[0].hang = 1  # one call that never answers (and times out after 50 ms)
        await asyncio.sleep(0.02)
        before = decode[0].num_status, prefill[1].num_status
        await asyncio.sleep(0.04)  # inside the silent call's timeout
        assert decode[0].num_status > before[0] and prefill[1].num_status > before[1]
        await pools.close()

    run(main())


def test_a_stale_failure_report_is_ignored():
    async def main():
        control = Control()
        pools, _, _ = await started(control=control)
        pools.fail("decode", 0, "died", generation=0)
        await until(pools.ready)
        pools.fail("decode", 0, "a late report about the old ranks", generation=0)
        await asyncio.sleep(0.05)
        assert control.calls == ["decode"] and pools["decode"].generation == 1 and pools.ready()
        await pools.close()

    run(main())


def test_a_failing_on_reformed_is_retried_until_the_pool_is_ready():
    async def main():
        reformed = Reformed(failures=2)
        pools, _, _ = await started(on_reformed=reformed)
        pools.fail("decode", 0, "died")
        await until(pools.ready)
        assert reformed.calls == 3 and pools["decode"].num_reforms == 1
        await pools.close()

    run(main())


def test_new_ranks_failing_while_checked_start_the_reform_over_and_the_old_one_stays_stale():
    async def main():
        control = Control()
        reformed = Reformed()
        pools, _, _ = await started(on_reformed=reformed, control=control)
        gate = asyncio.Event()
        first_reformed = reformed.__call__

        async def held(pool: str) -> None:  # the first on_reformed waits for the gate
            if reformed.calls == 0:
                reformed.calls += 1
                await gate.wait()
                return
            await first_reformed(pool)

        pools.on_reformed = held
        pools.fail("decode", 0, "died")
        await until(lambda: len(control.made) == 1 and pools["decode"].checking)
        control.made[0][1].error = RankFailed("decode", 1, "the new rank died")  # while checked
        await until(lambda: len(control.made) == 2)
        gate.set()  # the first re-form's on_reformed would complete now: it must not count
        await until(pools.ready)
        assert pools["decode"].generation == 2 and pools["decode"].num_reforms == 1
        assert pools["decode"].ranks is control.made[1]
        await pools.close()

    run(main())


def test_failures_while_the_ranks_are_replaced_are_one_failure():
    async def main():
        control = Control()
        control.gate = asyncio.Event()
        pools, _, _ = await started(control=control)
        pools.fail("prefill", 0, "died")
        pools.fail("prefill", 1, "died too")
        pools.fail("prefill", 1, "died too", generation=1)  # about ranks still being replaced
        control.gate.set()
        await until(pools.ready)
        assert control.calls == ["prefill"] and pools["prefill"].generation == 1
        await pools.close()

    run(main())
