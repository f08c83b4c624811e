"""ClusterBackend when work is slow or lost but no rank died (issue 24 H1, H2, M2, M4, M10, L11),
with the fake ranks of test_cluster_backend: a decode `start` slower than the call timeout (through
the real DecodeHandle) costs nothing; a reservation granted by a pool that failed meanwhile, or
one whose reserve call was cancelled, is released on its rank; with p2p, the KV of a prefill the
request stopped waiting for is taken off on its decode rank; a decode rank that drops the
router's lease has its requests resumed and a new stream opened; none of these re-forms a pool.
"""

import asyncio
import time

from cluster.handles import DecodeHandle
from engine.handoff import LeaseLapsed
from engine.tokenizer import Tokenizer
from router.backends.attempt_waits import within
from router.backends.cluster import ClusterBackend
from router.backends.pools import HealthConfig, RankFailed
from router.backends.routing import RoutingConfig
from tests.router.backends.test_cluster_backend import (
    BLOCK,
    INFO,
    FakeControl,
    FakeDecode,
    FakePrefill,
    request,
    run,
    started_backend,
    tokens,
    wait_for,
)

HEALTH = HealthConfig(status_interval_s=0.01, status_timeout_s=0.05, stall_timeout_s=0.5)


class ActorOver:
    """A fake Ray actor over a fake rank: `.method.options(...).remote(*args)` runs the rank's
    method (a stream yields its items as ready refs)."""

    def __init__(self, rank: FakeDecode) -> None:
        self.rank = rank

    def __getattr__(self, name: str) -> "ActorOver._Method":
        return ActorOver._Method(self.rank, name)

    class _Method:
        def __init__(self, rank: FakeDecode, name: str) -> None:
            self.rank, self.name = rank, name

        def options(self, **_) -> "ActorOver._Method":
            return self

        def remote(self, *args):
            call = getattr(self.rank, self.name)(*args)
            return _refs(call) if self.name == "stream" else asyncio.ensure_future(call)


async def _refs(items):
    async for item in items:
        ref = asyncio.get_running_loop().create_future()
        ref.set_result(item)
        yield ref


class SlowStart(FakeDecode):
    async def start(self, request, first, kv, router_id) -> None:
        await asyncio.sleep(0.3)  # six call timeouts: a slow object-store fetch
        await super().start(request, first, kv, router_id)


class RemoteReserve(FakeDecode):
    """reserve as Ray runs it: on the rank, to the end, whether or not the caller still waits
    (and an abort sent after it runs after it); `gate` holds it."""

    def __init__(self, rank: int = 0) -> None:
        super().__init__(rank)
        self.gate = asyncio.Event()
        self.asked = 0
        self._inflight: dict[str, asyncio.Future] = {}

    async def reserve(self, request_id, token_ids, lease_s, router_id) -> bool:
        self.asked += 1

        async def on_rank() -> bool:
            await self.gate.wait()
            return await FakeDecode.reserve(self, request_id, token_ids, lease_s, router_id)

        self._inflight[request_id] = asyncio.ensure_future(on_rank())
        return await asyncio.shield(self._inflight[request_id])

    async def abort(self, request_id: str) -> None:
        if request_id in self._inflight:
            await asyncio.shield(self._inflight[request_id])
        await super().abort(request_id)


class Registering(FakeDecode):
    def __init__(self, rank: int = 0) -> None:
        super().__init__(rank)
        self.registered = 0

    async def register_router(self, router_id: str, lease_s: float) -> None:
        self.registered += 1


async def backend_over(decode: list, control=None, **routing) -> tuple[ClusterBackend, FakePrefill]:
    prefill = FakePrefill(0)
    backend = ClusterBackend(
        [prefill], decode, INFO, Tokenizer(None, 512, 1, None), BLOCK, RoutingConfig(**routing),
        HEALTH, control,
    )  # fmt: skip
    await backend.start()
    return backend, prefill


def test_a_start_slower_than_the_call_timeout_does_not_fail_the_pool():
    async def main():
        control = FakeControl()
        rank = SlowStart(0)
        handle = DecodeHandle(ActorOver(rank), "decode", 0, 0.05, 7, start_timeout_s=5.0)
        backend, prefill = await backend_over([handle], control)
        deltas = [d async for d in backend.generate(request("slow", max_tokens=4))]
        assert tokens(deltas) == [100, 101, 102, 103] and len(prefill.calls) == 1
        assert control.calls == [] and backend.pools["decode"].num_reforms == 0
        assert rank.num_status > 10 and backend.ready()  # polled all along, never failed
        await backend.close()

    run(main())


def test_a_reservation_granted_after_its_pool_failed_is_released_and_the_request_resumes():
    async def main():
        control = FakeControl()
        old = RemoteReserve(0)
        backend, prefill = await backend_over([old], control)
        task = asyncio.create_task(_collect(backend.generate(request("m2", max_tokens=3))))
        await wait_for(lambda: old.asked == 1)
        backend.pools.fail("decode", 0, "a peer died")  # the reserve is still in flight
        await wait_for(lambda: control.calls == ["decode"])
        old.gate.set()  # the old rank grants it now
        assert tokens(await task) == [100, 101, 102]
        lost = f"{backend.router_id}-0"
        await wait_for(lambda: lost in old.aborted)
        assert not old.reserved and prefill.calls[0].request_id != lost  # never prefilled
        assert backend.pools["decode"].num_reforms == 1 and not control.new["decode"].reserved
        await backend.close()

    run(main())


async def _collect(stream) -> list:
    return [d async for d in stream]


def test_a_cancel_during_the_reserve_call_releases_what_the_rank_grants():
    async def main():
        decode = RemoteReserve(0)
        backend, _ = await backend_over([decode])
        task = asyncio.create_task(_collect(backend.generate(request("m10"))))
        await wait_for(lambda: decode.asked == 1)
        task.cancel()
        await asyncio.sleep(0.01)
        decode.gate.set()  # the rank grants the reservation after the router gave up
        await asyncio.gather(task, return_exceptions=True)
        wire = f"{backend.router_id}-0"
        await wait_for(lambda: wire in decode.aborted)
        assert not decode.reserved and not backend.routes.by_wire
        await backend.close()

    run(main())


def test_p2p_the_kv_of_a_prefill_abandoned_at_its_deadline_is_taken_off_on_the_decode_rank():
    async def main():
        control = FakeControl()
        backend, prefill, decode = await started_backend(control=control, kv_p2p=True)
        prefill.gate = asyncio.Event()
        deadline = time.time() + 0.2
        out = await _collect(backend.generate(request("late", deadline=deadline)))
        assert [d.finish_reason for d in out] == ["abort"]
        prefill.gate.set()  # its prefill returns after all, having sent the KV
        wire = prefill.calls[0].request_id
        await wait_for(lambda: decode.discarded == [("kv", wire)])
        assert backend.num_kv_discards == 1 and decode.started == []
        assert control.calls == [] and control.kv_rebuilds == 0 and not decode.reserved
        await backend.close()

    run(main())


def test_object_store_an_abandoned_prefill_is_cancelled_and_nothing_is_discarded():
    async def main():
        backend, prefill, decode = await started_backend()
        prefill.gate = asyncio.Event()
        out = await _collect(backend.generate(request("os", deadline=time.time() + 0.2)))
        assert [d.finish_reason for d in out] == ["abort"]
        prefill.gate.set()
        await asyncio.sleep(0.05)
        assert decode.discarded == [] and backend.num_kv_discards == 0
        await backend.close()

    run(main())


def test_a_prefill_failure_notice_that_lands_with_the_prefills_result_is_moot():
    async def main():
        backend, _, _ = await started_backend()
        route = backend.routes.by_client["x"] = _route(backend)
        route.queue.put_nowait(RankFailed("prefill", 1, "its pool is re-forming"))
        done = asyncio.get_running_loop().create_future()
        done.set_result("first")
        assert await within(route, done) == "first"
        assert route.queue.empty()  # dropped: the decode goes on, no resume spent
        route.queue.put_nowait(RankFailed("decode", 0, "its pool is re-forming"))
        done = asyncio.get_running_loop().create_future()
        done.set_result("first")
        assert await within(route, done) == "first"
        assert isinstance(route.queue.get_nowait(), RankFailed)  # kept: the decode must resume
        del backend.routes.by_client["x"]
        await backend.close()

    run(main())


def _route(backend: ClusterBackend):
    from router.backends.route_table import Route

    req = request("x")
    return Route(req, req)


def test_a_lapsed_lease_resumes_the_requests_on_that_rank_and_opens_a_new_stream():
    async def main():
        control = FakeControl()
        decode = Registering(0)
        backend, prefill = await backend_over([decode], control)
        decode.go = asyncio.Semaphore(1)
        stream = backend.generate(request("lease", max_tokens=6))
        got = [await anext(stream), await anext(stream)]
        decode._out.put_nowait(LeaseLapsed("decode rank 0 dropped router r's lease"))
        decode.go = None  # the resumed attempt decodes at once
        got += await _collect(stream)
        assert tokens(got) == list(range(100, 106))
        assert prefill.calls[-1].resume.token_ids == [100, 101]
        assert decode.registered == 2 and control.calls == []
        assert backend.pools["decode"].num_reforms == 0 and backend.ready()
        await backend.close()

    run(main())
