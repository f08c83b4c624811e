"""What this router expects each prefill rank to hold of a prompt's prefix (issue 28, routing).

The router never asks the ranks what they cache. It remembers, per prefill rank, the chained
block hashes of the prompts it sent there (the same hashes the paged cache and the tiers use,
`engine.block_manager.block_hashes`), in an LRU bounded by what the rank can hold: its paged
cache plus its host tier (plus its disk tier when that is the rank's own). A pool whose disk
tier is one directory for all its ranks adds one shared LRU, bounded by the disk budget: a block
any rank wrote there is a hit for every rank. A prompt's expected hit on a rank is then the
longest run of its leading block hashes found there, as the engine would reuse them (the last
prompt token is always recomputed).

It is an estimate: a rank evicts by its own LRU, sees other routers' prompts, and loses its
paged and host blocks when its pool re-forms (`reset` forgets those; the shared disk stays).
A wrong estimate costs a prefill, never a wrong token.
"""

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from engine.block_manager import block_hashes
from engine.config import KVTiersConfig


@dataclass(frozen=True, slots=True)
class IndexSize:
    """Blocks the index remembers: per rank (paged + host [+ a rank-own disk]) and shared
    (a disk directory the whole pool shares; 0: none)."""

    rank_blocks: int
    shared_blocks: int = 0

    def __post_init__(self) -> None:
        assert self.rank_blocks >= 0 and self.shared_blocks >= 0, self

    @classmethod
    def of(
        cls,
        kv_cache_bytes: int,
        block_bytes: int,
        tiers: KVTiersConfig | None,
        disk_shared: bool = True,
    ) -> "IndexSize":
        """From a prefill rank's budgets; block_bytes: one block of every layer
        (L x BS x C x itemsize). disk_shared: the pool's ranks share the disk_path (one node, or
        a shared file system; the config gives the pool one path)."""
        assert block_bytes > 0, block_bytes
        paged = kv_cache_bytes // block_bytes
        if tiers is None:
            return cls(paged)
        host, disk = tiers.host_bytes // block_bytes, tiers.disk_bytes // block_bytes
        if disk_shared:
            return cls(paged + host, disk)
        return cls(paged + host + disk)


class _Lru:
    """A bounded set of block hashes, least recently sent first."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.hashes: OrderedDict[bytes, None] = OrderedDict()

    def add(self, hashes: Sequence[bytes]) -> None:
        if self.capacity == 0:
            return
        for h in hashes:
            self.hashes[h] = None
            self.hashes.move_to_end(h)
        while len(self.hashes) > self.capacity:
            self.hashes.popitem(last=False)

    def run(self, hashes: Sequence[bytes]) -> int:
        """How many of hashes, from the first, it holds (a prefix reuses up to a first miss)."""
        n = 0
        while n < len(hashes) and hashes[n] in self.hashes:
            n += 1
        return n


class PrefixIndex:
    def __init__(self, num_ranks: int, block_size: int, size: IndexSize) -> None:
        self.block_size, self.size = block_size, size
        self.ranks = [_Lru(size.rank_blocks) for _ in range(num_ranks)]
        self.shared = _Lru(size.shared_blocks)

    def hashes(self, prompt_token_ids: Sequence[int]) -> list[bytes]:
        """The chained hashes of the prompt's full blocks (hashed once per request: the choice
        and the record both take them)."""
        return block_hashes(prompt_token_ids, self.block_size)

    def expected_hits(self, hashes: Sequence[bytes], num_tokens: int) -> list[int]:
        """-> per rank, the prompt tokens expected to hit: the longest leading run of the
        prompt's reusable blocks (as BlockManager._plan: the last token is always computed)
        held by that rank or by the pool's shared disk, in tokens. hashes: self.hashes(prompt)
        of the num_tokens-token prompt."""
        reusable = hashes[: (num_tokens - 1) // self.block_size]
        shared = self.shared.run(reusable)
        return [max(lru.run(reusable), shared) * self.block_size for lru in self.ranks]

    def sent(self, rank: int, hashes: Sequence[bytes]) -> None:
        """The prompt of these block hashes went to `rank`: its full blocks will be there (and
        on the shared disk)."""
        self.ranks[rank].add(hashes)
        self.shared.add(hashes)

    def reset(self, num_ranks: int) -> None:
        """The pool re-formed: its new ranks start with empty paged caches and host tiers; a
        shared disk keeps its blocks."""
        self.ranks = [_Lru(self.size.rank_blocks) for _ in range(num_ranks)]
