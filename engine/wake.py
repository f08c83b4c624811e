"""PoolWaker: the ranks of an expert-parallel pool wake each other when one of them gets work.

An idle rank's engine loop sleeps on its inbox (EngineLoop.idle_wait_s) and meets its partners
only at the step's agreement all-reduce, so a request that reaches one rank of a resting pool
would wait until every partner's sleep ran out before its step could start. The rank that gets
work sends each partner one datagram (EngineLoop's on_work); on every rank a thread turns a
datagram into EngineLoop.wake(), which ends the sleep at once.

A lost datagram costs one idle wait, nothing else: the loops still meet once per idle_wait_s,
and nothing about a step depends on a wake.
"""

import logging
import socket
import threading
from collections.abc import Callable

import torch.distributed as dist

log = logging.getLogger(__name__)

_WAKE = b"w"
_KEY = "epcluster/wake/{}"


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _parse(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host, int(port)


class PoolWaker:
    """One rank's end: a UDP socket on `host` whose address the pool's store publishes, and a
    thread that calls `on_wake` for every datagram that arrives."""

    def __init__(self, host: str, on_wake: Callable[[], None]) -> None:
        self._sock = socket.socket(_family(host), socket.SOCK_DGRAM)
        self._sock.bind((host, 0))
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        self._on_wake = on_wake
        self._peers: list[tuple[str, int]] = []
        self._closed = False
        self.num_sent = 0
        self.num_received = 0
        self._thread = threading.Thread(target=self._listen, name="pool-waker", daemon=True)
        self._thread.start()

    def connect(self, store: dist.Store, rank: int, num_ranks: int) -> "PoolWaker":
        """Publish this rank's address in the pool's store and learn the others' (every rank of
        the pool calls this at once: each waits for the others' keys)."""
        store.set(_KEY.format(rank), self.address)
        others = [r for r in range(num_ranks) if r != rank]
        self._peers = [_parse(store.get(_KEY.format(r)).decode()) for r in others]
        return self

    def wake_peers(self) -> None:
        """Wake every other rank of the pool (non-blocking sends; a failed one is logged)."""
        for peer in self._peers:
            try:
                self._sock.sendto(_WAKE, peer)
                self.num_sent += 1
            except OSError as e:  # the partner's idle wait runs out instead
                log.warning("waking %s failed: %r", peer, e)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:  # end the listener's blocking receive
            self._sock.sendto(b"", _parse(self.address))
        except OSError:
            pass
        self._thread.join(5.0)
        self._sock.close()

    def _listen(self) -> None:
        while not self._closed:
            try:
                data = self._sock.recv(16)
            except OSError:  # closed under us
                return
            if data == _WAKE and not self._closed:
                self.num_received += 1
                self._on_wake()
