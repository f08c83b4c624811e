"""RankHandle's mapping of what a remote call ends with (no Ray cluster: the awaited call is a
coroutine that raises what Ray would)."""

import asyncio

import pytest
from ray.exceptions import RayTaskError

from cluster.handles import RankHandle
from engine.messages import RankStopped
from prefill_workers.worker import PrefillAborted
from router.backends.pools import RankFailed


def call_raising(error: BaseException):
    async def remote():
        raise RayTaskError("prefill", "Traceback (on the rank)", error)

    handle = RankHandle(None, "prefill", 1, call_timeout_s=5.0)
    return asyncio.run(handle._call(remote()))


def test_a_rank_whose_engine_stopped_counts_as_failed():
    with pytest.raises(RankFailed) as info:
        call_raising(RankStopped("the engine stopped (Connection closed by peer): r-1"))
    assert (info.value.pool, info.value.rank) == ("prefill", 1)
    assert "Connection closed by peer" in info.value.why


def test_the_ranks_own_exception_comes_back_as_itself():
    with pytest.raises(PrefillAborted, match="was aborted"):
        call_raising(PrefillAborted("request r-1 was aborted"))
    with pytest.raises(ValueError, match="bad prompt"):
        call_raising(ValueError("bad prompt"))
