"""TierLink: the engine's side of the tiers (docs/kv_tiers.md, "How it is wired").

Write-back: the engine hands over the paged blocks whose hashes a step registered; after the step
they are copied out (`paged.blocks_out`) and offered to the store, whose queue drops instead of
blocking. Blocks a tier already holds (loaded from it, or offered before) are not copied again.

Read-back: when a new request is admitted, the full blocks past its paged-cache hits (capped like
the block manager's reuse: the last token is always recomputed) are looked up in the store; the
ones it holds are loaded into the fresh blocks the allocation took (`paged.blocks_in`) and
committed, so the paged cache hashes them like computed blocks and the prefill skips them.

Legend (kernels/__init__.py): L layers, NB cache blocks, BS block size, C latent width.
"""

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.block_manager import BlockManager, block_hashes
from engine.config import KVTiersConfig
from engine.kv_tiers.disk import DiskTier
from engine.kv_tiers.host import HostTier
from engine.kv_tiers.key import KeySpace
from engine.kv_tiers.paged import blocks_in, blocks_out
from engine.kv_tiers.store import TieredStore


@dataclass(slots=True)
class LinkStats:
    """What the engine moved through the tiers (the store's stats() has the per-tier counts)."""

    blocks_offered: int = 0  # copied out and queued (or dropped by a full queue)
    blocks_loaded: int = 0  # read back into the paged cache
    tokens_loaded: int = 0  # prompt tokens the prefill skipped thanks to a tier


class TierLink:
    def __init__(
        self,
        config: KVTiersConfig,
        space: KeySpace,
        block_manager: BlockManager,
        kv_caches: list[torch.Tensor],
    ) -> None:
        """kv_caches: the runner's paged cache, L x [NB, BS, C] (the list itself, shared)."""
        host = HostTier(config.host_bytes, pin_memory=True) if config.host_bytes > 0 else None
        disk = None
        if config.disk_path is not None and config.disk_bytes > 0:
            disk = DiskTier(config.disk_path, config.disk_bytes)
        self.store = TieredStore(host, disk)
        self.space = space
        self.block_manager = block_manager
        self.kv_caches = kv_caches
        self.stats = LinkStats()
        self._filled: list[int] = []  # block ids hashed in this step, offered after it

    def filled(self, block_ids: list[int]) -> None:
        """Block ids a commit just hashed (their rows stay put until the step ends)."""
        self._filled.extend(block_ids)

    def offer_filled(self) -> None:
        """After a step: copy out the blocks hashed in it that no tier holds yet and offer them.
        NOTE: before the next schedule, so no hashed block has been reused for other tokens."""
        bm, todo = self.block_manager, []
        for block_id in self._filled:
            block_hash = bm.block_hash[block_id]
            if block_hash is None:  # freed unhashed meanwhile (a duplicate of another block)
                continue
            key = self.space.key(block_hash)
            if not self.store.contains(key):
                todo.append((block_id, key))
        self._filled.clear()
        if not todo:
            return
        copies = blocks_out(self.kv_caches, [block_id for block_id, _ in todo])
        for (_, key), kv in zip(todo, copies, strict=True):
            self.store.offer(key, kv)
        self.stats.blocks_offered += len(todo)

    def load_prefix(
        self, token_ids: Sequence[int], block_table: list[int], num_cached_tokens: int
    ) -> int:
        """Fill the fresh blocks after a new allocation's paged hits from the tiers; -> the
        tokens now cached (num_cached_tokens plus the loaded blocks' tokens)."""
        bs = self.block_manager.block_size
        first = num_cached_tokens // bs
        max_reuse = (len(token_ids) - 1) // bs  # as BlockManager._plan: the last token recomputes
        if first >= max_reuse:
            return num_cached_tokens
        hashes = block_hashes(token_ids[: max_reuse * bs], bs)[first:]
        keys = [self.space.key(h) for h in hashes]
        n = self.store.lookup(keys)
        if n == 0:
            return num_cached_tokens
        blocks = self.store.load(keys[:n])  # may be fewer than n: evicted or bad since lookup
        if not blocks:
            return num_cached_tokens
        blocks_in(self.kv_caches, block_table[first : first + len(blocks)], blocks)
        cached = (first + len(blocks)) * bs
        self.block_manager.commit(block_table, token_ids, cached)
        self.stats.blocks_loaded += len(blocks)
        self.stats.tokens_loaded += len(blocks) * bs
        return cached

    def flush(self) -> None:
        """Wait until every queued offer is written (tests; an orderly stop uses close)."""
        self.store.flush()

    def close(self, timeout_s: float = 10.0) -> bool:
        return self.store.close(timeout_s)
