"""TieredStore: the write-back front over the host and disk tiers.

offer() hands a block to a background writer thread through a bounded queue and returns at once:
a full queue drops the block (counted), so the engine's step never waits on a tier. The writer
puts the block in host memory and writes it to disk. lookup() says how much of a prompt's prefix
the tiers hold; load() reads it back, host first, promoting disk hits to host.
"""

import logging
import queue
import threading

import torch

from engine.kv_tiers.disk import DiskTier
from engine.kv_tiers.host import HostTier
from engine.kv_tiers.key import BlockKey
from engine.kv_tiers.stats import TierStats

log = logging.getLogger(__name__)

_STOP = object()


class TieredStore:
    def __init__(self, host: HostTier | None, disk: DiskTier | None, max_queued: int = 64) -> None:
        assert max_queued >= 1, max_queued
        self.host, self.disk = host, disk
        self.dropped_writes = 0  # offers refused by a full queue (or after close)
        self.writer_errors = 0
        self._queue: queue.Queue[object] = queue.Queue(max_queued)
        self._closed = False
        self._writer = threading.Thread(
            target=self._write_loop, name="kv-tiers-writer", daemon=True
        )
        self._writer.start()

    def offer(self, key: BlockKey, kv: torch.Tensor) -> bool:
        """Queue kv [L, BS, C] (CPU; the store keeps it, so the caller must not change it) for
        the tiers. Never blocks: False, counted in dropped_writes, if the queue is full."""
        if self._closed:
            self.dropped_writes += 1
            return False
        try:
            self._queue.put_nowait((key, kv))
        except queue.Full:
            self.dropped_writes += 1
            return False
        return True

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is _STOP:
                    return
                key, kv = item  # type: ignore[misc]
                if self.host is not None:
                    self.host.put(key, kv)
                if self.disk is not None and not self.disk.contains(key):
                    self.disk.put(key, kv)
            except Exception:  # a bug in a tier must not end the writer (later offers would pile)
                self.writer_errors += 1
                if self.writer_errors == 1:
                    log.exception("kv_tiers: writing a block failed (later failures only counted)")
            finally:
                self._queue.task_done()

    def contains(self, key: BlockKey) -> bool:
        return (self.host is not None and self.host.contains(key)) or (
            self.disk is not None and self.disk.contains(key)
        )

    def lookup(self, keys: list[BlockKey]) -> int:
        """How many leading keys some tier holds: a prefix ends at its first missing block."""
        for n, key in enumerate(keys):
            if not self.contains(key):
                return n
        return len(keys)

    def load(self, keys: list[BlockKey]) -> list[torch.Tensor]:
        """The blocks [L, BS, C] of the leading keys, host first, then disk (a disk hit is put in
        host). Stops at the first block no tier gives (a block evicted since lookup, or a bad
        file), so the result may be shorter than keys. NOTE: the tensors are the tiers' own:
        copy them into the paged cache, never write to them."""
        blocks: list[torch.Tensor] = []
        for key in keys:
            kv = self.host.get(key) if self.host is not None else None
            if kv is None and self.disk is not None:
                kv = self.disk.get(key)
                if kv is not None and self.host is not None:
                    self.host.put(key, kv)
            if kv is None:
                break
            blocks.append(kv)
        return blocks

    def stats(self) -> dict[str, TierStats]:
        """The counters per tier, by tier name ("host", "disk"), for the metrics."""
        tiers = {"host": self.host, "disk": self.disk}
        return {name: tier.stats for name, tier in tiers.items() if tier is not None}

    def flush(self) -> None:
        """Block until every block queued so far is written (or dropped by a failing tier)."""
        self._queue.join()

    def close(self, timeout_s: float = 10.0) -> bool:
        """Stop taking offers and let the writer finish what is queued, for at most timeout_s;
        True if everything queued was written."""
        if not self._closed:
            self._closed = True
            try:
                self._queue.put(_STOP, timeout=timeout_s)
            except queue.Full:
                return False
        self._writer.join(timeout_s)
        return not self._writer.is_alive()
