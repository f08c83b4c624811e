"""DiskTier: block files under a directory, least recently used evicted first, within a byte
budget; shared by the ranks that mount the same directory and warm across restarts.

Files: <path>/<name[:2]>/<name[2:4]>/<name> (name = BlockKey.name; the fan-out keeps directories
small). At start the tier scans the directory, so it sees the blocks an earlier run or another
rank wrote, oldest access first; a block another rank writes later is found on the first lookup
that misses the index (one stat). A hit touches the file's times, so every rank's scan (and a
restart) orders by the last use of any rank.

A full disk or an unwritable directory turns the tier off (one warning, stats.disabled = 1): it
then holds nothing and every lookup misses; no error reaches the caller.

NOTE: each rank enforces the budget on the files it knows; ranks sharing a directory should
share one budget (the pool's config) and may together briefly exceed it.
"""

import logging
import os
import threading
import time
from collections import OrderedDict

import torch

from engine.kv_tiers import block_file
from engine.kv_tiers.key import BlockKey
from engine.kv_tiers.stats import TierStats

log = logging.getLogger(__name__)

STALE_TMP_S = 600.0  # a temporary file this old is a dead writer's, not one in progress


class DiskTier:
    def __init__(self, path: str, budget_bytes: int) -> None:
        assert budget_bytes >= 0, budget_bytes
        self.path = path
        self.budget_bytes = budget_bytes
        self.stats = TierStats()
        self._files: OrderedDict[str, int] = OrderedDict()  # name -> size, oldest use first
        self._lock = threading.Lock()
        try:
            os.makedirs(path, exist_ok=True)
            self._scan()
        except OSError as e:
            self._disable(e)

    @property
    def enabled(self) -> bool:
        return not self.stats.disabled

    def __len__(self) -> int:
        return len(self._files)

    def file_path(self, key: BlockKey) -> str:
        name = key.name
        return os.path.join(self.path, name[:2], name[2:4], name)

    def _scan(self) -> None:
        found: list[tuple[float, str, int]] = []
        now = time.time()
        for root, _, names in os.walk(self.path):
            for name in names:
                full = os.path.join(root, name)
                try:
                    st = os.stat(full)
                except OSError:  # removed by another rank meanwhile
                    continue
                if name.endswith(block_file.TMP_SUFFIX):
                    if now - st.st_mtime > STALE_TMP_S:
                        block_file.remove(full)
                    continue
                found.append((max(st.st_atime, st.st_mtime), name, st.st_size))
        for _, name, size in sorted(found):
            self._files[name] = size
        self.stats.blocks = len(self._files)
        self.stats.bytes_held = sum(self._files.values())
        self._evict_to_fit(0)  # a smaller budget than the last run's

    def _disable(self, error: OSError) -> None:
        with self._lock:
            self.stats.errors += 1
            if self.stats.disabled:
                return
            self.stats.disabled = 1
            self._files.clear()
            self.stats.blocks = self.stats.bytes_held = 0
        log.warning("kv_tiers: disk tier %s turned off: %s", self.path, error)

    def _evict_to_fit(self, nbytes: int) -> None:
        """Remove the least recently used files until nbytes more fit (under the lock, or alone)."""
        while self._files and self.stats.bytes_held + nbytes > self.budget_bytes:
            name, size = self._files.popitem(last=False)
            block_file.remove(os.path.join(self.path, name[:2], name[2:4], name))
            self.stats.bytes_held -= size
            self.stats.evictions += 1
        self.stats.blocks = len(self._files)

    def contains(self, key: BlockKey) -> bool:
        """Whether the block is on disk: in the index, or written by another rank since the scan
        (then indexed). The LRU order stays as it was."""
        if not self.enabled:
            return False
        with self._lock:
            if key.name in self._files:
                return True
        try:
            size = os.stat(self.file_path(key)).st_size
        except OSError:
            return False
        with self._lock:
            if key.name not in self._files:
                self._adopt(key.name, size)
        return True

    def put(self, key: BlockKey, kv: torch.Tensor) -> bool:
        """Write kv [L, BS, C] (CPU) as key's file, evicting to fit; False if not written (off,
        the block exceeds the budget, or the write failed and turned the tier off)."""
        if not self.enabled:
            return False
        nbytes = block_file.file_size(key, kv)
        if nbytes > self.budget_bytes:
            return False
        path = self.file_path(key)
        with self._lock:
            self._forget(key.name)
            self._evict_to_fit(nbytes)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            written = block_file.write(path, key, kv)
        except OSError as e:  # ENOSPC, EACCES, EROFS, EDQUOT...: no tier rather than a failure
            self._disable(e)
            return False
        with self._lock:
            self._forget(key.name)  # NOTE: a lookup may have indexed it meanwhile (another rank's)
            self._files[key.name] = written
            self.stats.bytes_held += written
            self.stats.bytes_written += written
            self.stats.blocks = len(self._files)
        return True

    def get(self, key: BlockKey) -> torch.Tensor | None:
        """The block under key (now the most recently used), or None (missing, or a bad file,
        which block_file.read removes)."""
        if not self.enabled:
            return None
        start = time.perf_counter()
        path = self.file_path(key)
        kv = block_file.read(path, key)
        with self._lock:
            if kv is None:
                self._forget(key.name)
                self.stats.misses += 1
                return None
            if key.name in self._files:
                self._files.move_to_end(key.name)
            else:  # another rank wrote it since the scan
                self._adopt(key.name, block_file.file_size(key, kv))
            self.stats.record_read(kv.numel() * kv.element_size(), time.perf_counter() - start)
        try:
            os.utime(path)  # the last use, for every rank's scan and the next start
        except OSError:
            pass
        return kv

    def _adopt(self, name: str, size: int) -> None:
        """Index a file another rank wrote since the scan (under the lock)."""
        self._evict_to_fit(size)
        self._files[name] = size
        self.stats.bytes_held += size
        self.stats.blocks = len(self._files)

    def _forget(self, name: str) -> None:
        """Drop name from the index (under the lock); the file, if any, is the caller's."""
        size = self._files.pop(name, None)
        if size is not None:
            self.stats.bytes_held -= size
            self.stats.blocks = len(self._files)
