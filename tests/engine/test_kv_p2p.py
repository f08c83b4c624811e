"""TorchP2PTransport over gloo: spawned ranks form the transport group from a FileStore; what a
decode rank receives equals, bit for bit, the tensor the prefill rank built from the same seed."""

import logging.handlers
import os
import tempfile
import threading
import time

import pytest
import torch
import torch.distributed as dist

from engine.kv_p2p import TorchP2PTransport, request_tag
from engine.kv_transfer import KVTransferError
from engine.messages import KVPayload, P2PHandle
from tests.procs import SPAWN, run_ranks

# request_id -> (seed, [L, T, C], dtype, num_cached_tokens, dst)
CASES = {
    "req-a": (1, (3, 17, 40), torch.float32, 0, 2),
    "req-b": (2, (2, 5, 64), torch.bfloat16, 4, 2),
    "req-c": (3, (4, 9, 8), torch.float32, 8, 1),
    "req-d": (4, (1, 3, 16), torch.float32, 0, 2),
}
DISCARDED = {"req-d"}  # its request ended before its decode started


def _expected(request_id: str) -> torch.Tensor:
    """The payload of a case, rebuilt from its seed in whichever process asks -> [L, T, C]."""
    seed, shape, dtype, _, _ = CASES[request_id]
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen).to(dtype)


def _p2p_rank(rank: int, world_size: int, tmp: str, timeout_s: float, worker, *args) -> None:
    """One rank of the transport group (its own store: no default process group)."""
    store = dist.FileStore(os.path.join(tmp, "store"), world_size)
    transport = TorchP2PTransport(store, rank, world_size, timeout_s=timeout_s)
    dropped = logging.handlers.BufferingHandler(capacity=1000)
    logging.getLogger("engine.kv_p2p").addHandler(dropped)
    worker(rank, transport, *args)
    transport.close()  # waits for the sends in flight
    lost = [r.getMessage() for r in dropped.buffer if "dropped" in r.getMessage()]
    assert not lost, lost  # every send was received


def _run(worker, world_size: int, timeout_s: float, *args) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        run_ranks(
            _p2p_rank, world_size, tmp, timeout_s, worker, *args, timeout=90, init_group=False
        )


def _transfer_worker(rank: int, transport: TorchP2PTransport, handles: list) -> None:
    if rank == 0:
        for request_id, (_, _, _, cached, dst) in CASES.items():
            payload = KVPayload(request_id, _expected(request_id), cached)
            handles[dst].put(transport.send(payload, dst))
        return
    mine = [rid for rid, case in CASES.items() if case[4] == rank]
    got = {h.request_id: h for h in (handles[rank].get(timeout=30) for _ in mine)}
    errors = []

    def take(request_id):  # each on its own thread, as a decode rank's start calls are
        try:
            _, shape, dtype, cached, _ = CASES[request_id]
            handle = got[request_id]
            if request_id in DISCARDED:
                transport.discard(handle)
                return
            assert isinstance(handle, P2PHandle) and handle.src == 0, handle
            assert handle.shape == shape and handle.dtype == str(dtype).removeprefix("torch.")
            payload = transport.receive(handle)
            assert payload.request_id == request_id and payload.num_cached_tokens == cached
            assert payload.data.dtype == dtype and payload.data.shape == shape
            assert torch.equal(payload.data, _expected(request_id)), request_id
        except BaseException as e:
            errors.append(e)

    # out of send order: the transport posts them in order, the tags match them up
    threads = [threading.Thread(target=take, args=(rid,)) for rid in reversed(mine)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors


def _timeout_worker(rank: int, transport: TorchP2PTransport, done) -> None:
    if rank == 0:  # stays up until rank 1 is done: a peer that exits would fail it sooner
        done.get(timeout=30)
        return
    handle = P2PHandle("req-lost", src=0, tag=12345, shape=(2, 3, 4), dtype="float32",
                       num_cached_tokens=0)  # fmt: skip
    with pytest.raises(KVTransferError, match=r"req-lost from rank 0 to rank 1") as info:
        transport.receive(handle)  # an error after the transport's timeout, not a hang
    done.put(True)
    assert "Timed out" in str(info.value), info.value


@pytest.mark.timeout(120)
def test_send_receive_exact_tensors() -> None:
    """Rank 0 sends fp32 and bf16 payloads of different shapes to rank 2 and one to rank 1;
    rank 2 also discards one; no send of rank 0 is dropped."""
    handles = [None, SPAWN.Queue(), SPAWN.Queue()]
    _run(_transfer_worker, 3, 30.0, handles)


@pytest.mark.timeout(120)
def test_receive_without_send_times_out() -> None:
    _run(_timeout_worker, 2, 2.0, SPAWN.Queue())


def test_tag_fits_31_bits_and_differs_per_send() -> None:
    tags = {request_tag(f"req-{i % 3}", seq) for i, seq in enumerate(range(2**16 - 10, 2**16 + 10))}
    assert len(tags) == 20 and all(0 <= t < 2**31 for t in tags)
    assert request_tag("req-a", 7) == request_tag("req-a", 7 + 2**16)  # the documented wrap


def _order_worker(rank: int, transport: TorchP2PTransport, handles) -> None:
    if rank == 0:
        for request_id in ("first", "second", "third"):
            handles.put(transport.send(KVPayload(request_id, _expected("req-a"), 0), 1))
        return
    got = [handles.get(timeout=30) for _ in range(3)]
    posted = []

    class Recording:  # the group, recording the order of the receives posted on it
        def __init__(self, group):
            self.group = group

        def recv(self, tensors, src, tag):
            posted.append(tag)
            return self.group.recv(tensors, src, tag)

    transport.group = Recording(transport.group)
    # The decode rank's start calls arrive last-sent first; the receives must still be posted
    # in send order (NCCL matches by posting order, not by tag).
    threads = [threading.Thread(target=transport.receive, args=(h,)) for h in reversed(got)]
    for t in threads:
        t.start()
        time.sleep(0.1)
    for t in threads:
        t.join(30)
    assert [h.seq for h in got] == [0, 1, 2]
    assert posted == [h.tag for h in got], (posted, [h.tag for h in got])
    assert transport.num_received == 3
    transport.group = transport.group.group


@pytest.mark.timeout(120)
def test_receives_are_posted_in_send_order() -> None:
    _run(_order_worker, 2, 30.0, SPAWN.Queue())


def _old_epoch_worker(rank: int, transport: TorchP2PTransport) -> None:
    if rank == 1:
        stale = P2PHandle("old", src=0, tag=1, shape=(1, 1, 1), dtype="float32",
                          num_cached_tokens=0, epoch=transport.epoch + 1)  # fmt: skip
        with pytest.raises(KVTransferError, match="older transport group"):
            transport.receive(stale)
        payload = KVPayload("fell-back", torch.ones(1, 2, 3), 0)
        assert transport.receive(payload) is payload  # an object-store fallback passes through


@pytest.mark.timeout(120)
def test_a_handle_of_another_group_is_refused_and_payloads_pass_through() -> None:
    _run(_old_epoch_worker, 2, 30.0)


def _given_up_worker(rank: int, transport: TorchP2PTransport, handles) -> None:
    if rank == 0:
        transport.debug_drop_sends(1)  # "lost": numbered #0, its handle goes nowhere
        for request_id in ("lost", "next", "after"):
            handles.put(transport.send(KVPayload(request_id, _expected("req-b"), 0), 1))
        return
    got = {h.request_id: h for h in (handles.get(timeout=30) for _ in range(3))}
    assert [got[r].seq for r in ("lost", "next", "after")] == [0, 1, 2]
    # #1 waits for #0's turn, which never comes: the turn is given up and #1 goes ahead
    for request_id in ("next", "after"):
        payload = transport.receive(got[request_id])
        assert torch.equal(payload.data, _expected("req-b")), request_id
    assert transport.num_given_up == 1 and transport.num_received == 2


@pytest.mark.timeout(120)
def test_a_turn_that_never_comes_is_given_up_and_the_pair_goes_on() -> None:
    _run(_given_up_worker, 2, 2.0, SPAWN.Queue())
