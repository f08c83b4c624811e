"""KV transport over torch.distributed point-to-point: the prefill rank sends the [L, T, C]
tensor straight to the decode rank; only a small P2PHandle goes through the router.

The transport has a process group of its own, spanning every prefill and decode rank of the
cluster, built directly from a store (never the default group: each pool already uses that for
its expert-parallel group). Its ranks are this group's, not the pools'.

Order: NCCL ignores tags and matches the sends and receives between two ranks in the order they
are posted, so every send carries its number among the sender's sends to that receiver (`seq`)
and the receiver posts receives strictly in that order, whatever order the requests' `start`
calls arrive in (a receive waits for its turn, up to the timeout). Gloo matches by tag too.
A turn that does not come within half the timeout (its handle never reached this rank: the
router lost it) is given up, so one loss never holds the pair up for good: the receive waiting
for it goes ahead while its own send is still posted (a send waits for its match up to the
timeout; half leaves the other half for the transfer), and if the late handle comes after all,
gloo (matching by tag) still receives it. NOTE: a send that was posted and is never matched
still times out on the sender, and gloo then closes that pair: the transfers after it fail
over to the object store and the group is rebuilt (the router takes every KV off to avoid it).

NOTE: when one send or recv times out, gloo closes every connection of that rank (not only the
one to that peer): from then on every transfer of that rank, and every peer's transfer with it,
fails at once with KVTransferError (an error, not a hang). The router then resumes the request
with its KV through the object store (GenerateRequest.kv_fallback) and has every rank rebuild
the group (a new epoch; a handle of an old epoch is refused; the old group is closed once its
sends in flight are done). NCCL is untested here: with TORCH_NCCL_ASYNC_ERROR_HANDLING's default
a timed-out operation tears the process down, and a late handle cannot be matched out of order.
"""

import itertools
import logging
import queue
import threading
import time
import zlib
from datetime import timedelta

import torch
import torch.distributed as dist

from engine.kv_transfer import KVTransferError
from engine.messages import KVPayload, P2PHandle

log = logging.getLogger(__name__)


def request_tag(request_id: str, seq: int) -> int:
    """31-bit tag: 15 bits of a stable hash of request_id (to trace it), 16 bits of the sender's
    counter (so two requests from one sender collide only 65,536 sends apart)."""
    return (zlib.crc32(request_id.encode()) & 0x7FFF) << 16 | seq & 0xFFFF


class TorchP2PTransport:
    """KVTransport over torch.distributed send/recv. Every participant constructs it at start-up
    with the same store and world_size (a collective: it blocks until all ranks have joined)."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        backend: str = "gloo",
        timeout_s: float = 30.0,
        epoch: int = 0,
    ) -> None:
        assert 0 <= rank < world_size, (rank, world_size)
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.epoch, self.backend = epoch, backend
        self.turn_timeout_s = timeout_s / 2  # a receive waits this long for its turn
        timeout = timedelta(seconds=timeout_s)
        store = dist.PrefixStore("kv_p2p", store)  # keys apart from any other group on the store
        if backend == "gloo":
            self.device = torch.device("cpu")
            self.group = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        elif backend == "nccl":
            # Untested here (CPU-only CI). The caller sets the CUDA device first. NCCL ignores
            # tags: sends and recvs between two ranks match in the order they are posted, so a
            # decode rank must receive in the order its prefill rank sent.
            self.device = torch.device("cuda", torch.cuda.current_device())
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout
            self.group = dist.ProcessGroupNCCL(store, rank, world_size, options)
        else:
            raise ValueError(f"unknown backend {backend!r} (gloo or nccl)")
        self._seq = itertools.count()
        self._send_seq = {dst: itertools.count() for dst in range(world_size)}  # per receiver
        self._recv_next = dict.fromkeys(range(world_size), 0)  # per sender: the seq due next
        self._given_up: dict[int, set[int]] = {src: set() for src in range(world_size)}
        self.num_given_up = 0  # turns given up (their handles never came in time)
        self._order = threading.Condition()
        self.num_received = 0  # transfers received or discarded (for health and tests)
        self._drop_sends = 0  # debug_drop_sends: sends that are numbered but never posted
        # (work, tensor, handle, dst, deadline), or None to stop
        self._pending: queue.Queue = queue.Queue()
        self._waiter = threading.Thread(target=self._wait_sends, name="kv-p2p-send", daemon=True)
        self._waiter.start()

    def send(self, payload: KVPayload, dst: int) -> P2PHandle:
        """Start sending payload.data [L, T, C] to rank dst of this group; returns at once.
        Raises KVTransferError if the send cannot even start."""
        assert dst != self.rank and 0 <= dst < self.world_size, (dst, self.rank)
        data = payload.data.to(self.device).contiguous()  # [L, T, C]
        tag = request_tag(payload.request_id, next(self._seq))
        with self._order:  # numbers and posts in one order
            seq = next(self._send_seq[dst])
            lost = self._drop_sends > 0  # the receiver waits for it, then times out
            self._drop_sends -= lost
            try:
                work = None if lost else self.group.send([data], dst, tag)
            except RuntimeError as e:  # e.g. the link to dst closed after an earlier timeout
                where = f"request {payload.request_id} from rank {self.rank} to rank {dst}"
                raise KVTransferError(f"KV send of {where} failed: {e}") from e
        handle = P2PHandle(
            request_id=payload.request_id,
            src=self.rank,
            tag=tag,
            shape=tuple(data.shape),
            dtype=str(data.dtype).removeprefix("torch."),
            num_cached_tokens=payload.num_cached_tokens,
            seq=seq,
            epoch=self.epoch,
        )
        if work is not None:
            self._pending.put((work, data, handle, dst, time.monotonic() + self.timeout_s))
        return handle

    def debug_drop_sends(self, n: int) -> None:
        """Test hook: the next n sends get numbers and handles but are never posted (lost)."""
        self._drop_sends = n

    def receive(self, handle: P2PHandle | KVPayload) -> KVPayload:
        """Receive the tensor a handle describes -> KVPayload with data [L, T, C] on this
        transport's device (the CPU for gloo); a KVPayload (the prefill rank fell back to the
        object store) is returned as it is. Receives from one sender are posted in its send
        order. Raises KVTransferError on timeout or error."""
        if isinstance(handle, KVPayload):
            return handle
        dtype = getattr(torch, handle.dtype, None)
        if not isinstance(dtype, torch.dtype):
            raise KVTransferError(f"request {handle.request_id}: bad dtype {handle.dtype!r}")
        where = f"request {handle.request_id} from rank {handle.src} to rank {self.rank}"
        if handle.epoch != self.epoch:
            raise KVTransferError(f"KV of {where} was sent on an older transport group")
        data = torch.empty(handle.shape, dtype=dtype, device=self.device)  # [L, T, C]
        src, seq = handle.src, handle.seq
        with self._order:
            if not self._order.wait_for(lambda: self._recv_next[src] >= seq, self.turn_timeout_s):
                self._give_up(src, seq)
            late = self._recv_next[src] > seq
            if late and (seq not in self._given_up[src] or self.backend == "nccl"):
                raise KVTransferError(f"KV of {where} (#{seq}) was received already")
            self._given_up[src].discard(seq)
            try:
                work = self.group.recv([data], src, handle.tag)
            except RuntimeError as e:
                raise KVTransferError(f"KV of {where} (tag {handle.tag}) failed: {e}") from e
            finally:
                if not late:
                    self._recv_next[src] += 1
                    self._order.notify_all()
        try:
            work.wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            raise KVTransferError(f"KV of {where} (tag {handle.tag}) failed: {e}") from e
        self.num_received += 1
        return KVPayload(handle.request_id, data, handle.num_cached_tokens)

    def _give_up(self, src: int, seq: int) -> None:
        """The turns of `src` before `seq` did not come within turn_timeout_s: give them up
        (the caller holds _order), so the pair goes on."""
        missing = range(self._recv_next[src], seq)
        log.warning(
            "KV from rank %d to rank %d: #%d-#%d never came in %.1f s: their turns are given up",
            src,
            self.rank,
            missing.start,
            missing.stop - 1,
            self.turn_timeout_s,
        )
        given_up = self._given_up[src]
        given_up.update(missing)
        while len(given_up) > 4096:  # a late handle this old will not come
            given_up.discard(min(given_up))
        self.num_given_up += len(missing)
        self._recv_next[src] = seq
        self._order.notify_all()

    def discard(self, handle: P2PHandle | KVPayload) -> None:
        """Receive and drop a transfer nobody will use, so the sender's send completes (and the
        receives after it get their turn)."""
        self.receive(handle)

    def close(self) -> None:
        """Wait for the sends in flight (each up to its timeout), then shut the group down."""
        self._pending.put(None)
        self._waiter.join()
        self.group.shutdown()

    def _wait_sends(self) -> None:
        # One thread waits for every send, in order, each until timeout_s after its start.
        while (item := self._pending.get()) is not None:
            work, data, handle, dst, deadline = item
            # NOTE: at least 1 ms: a zero timedelta means "no timeout" to c10d
            left_s = max(deadline - time.monotonic(), 1e-3)
            try:
                work.wait(timedelta(seconds=left_s))
            except RuntimeError as e:
                log.warning(
                    "KV send of request %s from rank %d to rank %d (tag %d) dropped: %s",
                    handle.request_id,
                    self.rank,
                    dst,
                    handle.tag,
                    e,
                )
            del work, data, item  # the tensor may be large: let it go now, not at the next get
