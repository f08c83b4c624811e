"""HostTier: blocks in host memory, least recently used evicted first, within a byte budget.

Thread-safe: the store's writer thread puts while the engine's step gets.
"""

import threading
import time
from collections import OrderedDict

import torch

from engine.kv_tiers.key import BlockKey
from engine.kv_tiers.stats import TierStats


class HostTier:
    def __init__(self, budget_bytes: int, pin_memory: bool = False) -> None:
        """pin_memory: keep blocks in page-locked memory (faster, asynchronous copies to a GPU);
        only where CUDA is available."""
        assert budget_bytes >= 0, budget_bytes
        self.budget_bytes = budget_bytes
        self.pin_memory = pin_memory and torch.cuda.is_available()
        self.stats = TierStats()
        self._blocks: OrderedDict[BlockKey, torch.Tensor] = OrderedDict()  # oldest use first
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._blocks)

    def contains(self, key: BlockKey) -> bool:
        """Whether key is held (a lookup: the LRU order stays as it was)."""
        with self._lock:
            return key in self._blocks

    def put(self, key: BlockKey, kv: torch.Tensor) -> bool:
        """Hold kv [L, BS, C] (CPU) under key, evicting the least recently used blocks to fit.
        False if one block alone exceeds the budget (nothing changes then)."""
        nbytes = kv.numel() * kv.element_size()
        if nbytes > self.budget_bytes:
            return False
        if self.pin_memory and not kv.is_pinned():
            kv = kv.pin_memory()
        with self._lock:
            old = self._blocks.pop(key, None)
            if old is not None:
                self.stats.bytes_held -= old.numel() * old.element_size()
            while self.stats.bytes_held + nbytes > self.budget_bytes:
                _, evicted = self._blocks.popitem(last=False)
                self.stats.bytes_held -= evicted.numel() * evicted.element_size()
                self.stats.evictions += 1
            self._blocks[key] = kv
            self.stats.bytes_held += nbytes
            self.stats.bytes_written += nbytes
            self.stats.blocks = len(self._blocks)
        return True

    def get(self, key: BlockKey) -> torch.Tensor | None:
        """The block under key (now the most recently used), or None."""
        start = time.perf_counter()
        with self._lock:
            kv = self._blocks.get(key)
            if kv is None:
                self.stats.misses += 1
                return None
            self._blocks.move_to_end(key)
            self.stats.record_read(kv.numel() * kv.element_size(), time.perf_counter() - start)
        return kv
