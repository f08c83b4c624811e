"""Liveness apart from work in the rank handles (no Ray cluster: a fake actor whose methods'
`.remote()` run coroutines, raising what Ray would). A slow decode `start` is not a dead rank;
a `start` past its own timeout, or whose KV object is lost, is a KV failure; a work call that
goes unanswered is RankCallFailed; only the actor's death (or its engine's stop) is RankFailed;
status travels in the control concurrency group. The config checks the start timeout's
relation to the transfer timeout."""

import asyncio

import pytest
from ray.exceptions import ActorDiedError, ObjectLostError, RayTaskError

from cluster.config import ClusterConfig
from cluster.config_checks import ConfigError
from cluster.config_sections import CallsConfig
from cluster.handles import CONTROL, DecodeHandle
from engine.kv_transfer import KVTransferError
from router.backends.pools import RankCallFailed, RankFailed
from router.backends.routing import RoutingConfig


class Method:
    def __init__(self, actor: "FakeActor", name: str) -> None:
        self.actor, self.name = actor, name

    def options(self, **options) -> "Method":
        self.actor.options.append((self.name, options))
        return self

    def remote(self, *args):
        return asyncio.ensure_future(self.actor.behaviour[self.name](*args))


class FakeActor:
    def __init__(self, **behaviour) -> None:
        self.behaviour = behaviour
        self.options: list[tuple[str, dict]] = []

    def __getattr__(self, name: str) -> Method:
        return Method(self, name)


def sleeps(seconds: float, result=None):
    async def call(*_):
        await asyncio.sleep(seconds)
        return result

    return call


def raises(error: BaseException):
    async def call(*_):
        raise error

    return call


def handle(**behaviour) -> DecodeHandle:
    return DecodeHandle(FakeActor(**behaviour), "decode", 1, 0.05, 3, start_timeout_s=0.5)


def start(h: DecodeHandle):
    return asyncio.run(h.start(None, None, "kv-ref", "router"))


def test_a_start_slower_than_the_call_timeout_is_not_a_failure():
    start(handle(start=sleeps(0.2)))  # four call timeouts, within the start's own


def test_a_start_past_its_own_timeout_is_a_kv_failure_not_a_rank_failure():
    with pytest.raises(KVTransferError, match="decode rank 1 did not start it: no answer in 0 s"):
        start(handle(start=sleeps(5)))


def test_a_lost_kv_object_is_a_kv_failure():
    with pytest.raises(KVTransferError, match="the KV object was lost"):
        start(handle(start=raises(ObjectLostError("ab" * 14, "owner", "call site"))))
    wrapped = RayTaskError("start", "Traceback", ObjectLostError("cd" * 14, "owner", "call site"))
    with pytest.raises(KVTransferError, match="the KV object was lost"):
        start(handle(start=raises(wrapped)))


def test_only_the_actors_death_is_a_rank_failure():
    with pytest.raises(RankFailed) as info:
        start(handle(start=raises(ActorDiedError())))
    assert (info.value.pool, info.value.rank) == ("decode", 1)
    h = handle(reserve=sleeps(5, True), abort=raises(ActorDiedError()))
    with pytest.raises(RankCallFailed, match="a call to decode rank 1 failed: no answer"):
        asyncio.run(h.reserve("r", [1, 2], 30.0, "router"))
    with pytest.raises(RankFailed):
        asyncio.run(h.abort("r"))


def test_status_goes_through_the_control_group_and_a_silent_one_is_a_miss():
    actor = FakeActor(status=sleeps(5))
    h = DecodeHandle(actor, "decode", 0, 0.05, 2)
    with pytest.raises(RankCallFailed):
        asyncio.run(h.status())
    assert actor.options == [("status", {"concurrency_group": CONTROL})]
    assert h.start_timeout_s == 3 * 0.05  # without its own: three call timeouts


def test_the_start_timeout_must_leave_room_for_two_transfer_timeouts():
    default = ClusterConfig()
    assert default.calls.kv_start_timeout_s > 2 * default.routing.kv_lease_s
    with pytest.raises(ConfigError, match="kv_start_timeout_s must be more than 2 x routing.kv_"):
        ClusterConfig(routing=RoutingConfig(kv_lease_s=30.0), calls=CallsConfig(60.0, 60.0))
    ClusterConfig(routing=RoutingConfig(kv_lease_s=3.0), calls=CallsConfig(3.0, 7.0))
