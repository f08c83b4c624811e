"""PoolWaker: a datagram from one rank wakes the other; in an expert-parallel pool whose idle
loops would sleep for an hour, a request given to one rank runs, because its partner is woken."""

import threading

import torch
import torch.distributed as dist

from engine import EngineConfig, SamplingParams
from engine.ep import build_ep_engine
from engine.loop import EngineLoop
from engine.wake import PoolWaker
from moe.presets import ensure_preset
from tests.procs import free_port, run_ranks


def test_wakers_wake_each_other_through_the_store():
    store = dist.HashStore()
    woken = [threading.Event(), threading.Event()]
    wakers = [PoolWaker("127.0.0.1", woken[r].set) for r in range(2)]
    threads = [threading.Thread(target=w.connect, args=(store, r, 2)) for r, w in enumerate(wakers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    try:
        wakers[0].wake_peers()
        assert woken[1].wait(30)
        assert not woken[0].is_set()  # a rank does not wake itself
        wakers[1].wake_peers()
        assert woken[0].wait(30)
        assert [w.num_sent for w in wakers] == [1, 1]
        assert [w.num_received for w in wakers] == [1, 1]
    finally:
        for w in wakers:
            w.close()


def _resting_pool_rank(rank: int, num_ranks: int, port: int) -> dict:
    store = dist.TCPStore("127.0.0.1", port, num_ranks, rank == 0)
    config = EngineConfig(model="tiny-random", block_size=4)
    engine = build_ep_engine(config, None, rank, num_ranks)
    done, tokens = threading.Event(), []

    def on_step(result) -> None:
        for delta in result.outputs:
            tokens.extend(delta.token_ids)
            if delta.finished:
                done.set()

    loop_box: list[EngineLoop] = []
    waker = PoolWaker("127.0.0.1", lambda: loop_box[0].wake() if loop_box else None)
    waker.connect(store, rank, num_ranks)
    # NOTE: an idle wait that never runs out: only a wake gets the partner to the agreement
    loop = EngineLoop(engine, on_step, idle_wait_s=3600, on_work=waker.wake_peers)
    loop_box.append(loop)
    loop.start()
    store.set(f"started/{rank}", "1")
    store.wait([f"started/{r}" for r in range(num_ranks)])
    if rank == 0:
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        loop.submit(lambda e: e.add_request("a", [5, 6, 7, 8], params)).result(60)
        finished = done.wait(120)
        store.set("done", "1")
    else:
        store.wait(["done"])
        finished = False
    loop.stop()
    waker.close()
    return {"finished": finished, "tokens": tokens, "sent": waker.num_sent,
            "received": waker.num_received, "steps": loop.num_steps}  # fmt: skip


def test_a_request_to_one_rank_of_a_resting_pool_wakes_its_partner():
    ensure_preset("tiny-random")
    r0, r1 = run_ranks(_resting_pool_rank, 2, free_port(), timeout=240)
    assert r0["finished"] and len(r0["tokens"]) == 5
    assert (r0["sent"], r1["received"]) == (1, 1)  # one wake, when the pool left its rest
    assert (r1["sent"], r0["received"]) == (0, 0)
    assert r0["steps"] == r1["steps"]  # lockstep: the partner took part in every step
    torch.testing.assert_close(torch.tensor(r0["steps"]), torch.tensor(r1["steps"]))
