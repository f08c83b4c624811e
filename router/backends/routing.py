"""Where a request goes: pure functions over the ranks' load snapshots, and the routing
settings (RoutingConfig: leases, waits, resumes, affinity, p2p KV, periodic rebalance).

Decode: the rank with the most free KV blocks (net of what this router has just sent there),
then the fewest running requests; it must fit the prompt, and have no preempted request waiting
for blocks (those are re-admitted first: a new reservation would take the blocks they need).
Prefill: expected prefix hits weighed against queued work. For each prefill rank the router
expects some of the prompt's leading tokens to hit its paged cache or its KV tiers
(router/backends/prefix_index.py); the rank chosen minimises its queued prompt tokens plus the
prompt tokens it would compute (those not expected to hit), among the ranks busier than the
least busy by at most `max_imbalance` tokens (so hits never pile all work on one rank). Ties
(e.g. a new prompt on idle ranks) go by rendezvous hashing of the prompt's first full blocks:
requests that share those blocks rank the ranks the same way, so they meet the same cache.
"""

import hashlib
from dataclasses import dataclass

from engine.block_manager import block_hashes
from engine.messages import RankStatus


@dataclass(frozen=True, slots=True)
class RoutingConfig:
    kv_lease_s: float = 30.0  # a reservation not renewed or started for this long is released
    reserve_wait_s: float = 10.0  # how long a request waits for room on a decode rank
    max_reserve_waiters: int = 1024  # requests waiting for decode room; more: refused at once
    recovery_wait_s: float = 120.0  # how long a request waits for a re-forming pool
    max_resumes: int = 3  # resumes of one request after rank failures, then UNAVAILABLE
    prefill_max_imbalance: int = 4096  # queued prompt tokens over the least busy: no candidate
    affinity_blocks: int = 1  # prompt blocks whose hash breaks ties between prefill ranks
    kv_p2p: bool = False  # KV goes point to point: a failed transfer falls back to objects
    eplb_interval_s: float = 0.0  # rebalance the experts of both pools this often (0: never)

    def __post_init__(self) -> None:
        for name in ("kv_lease_s", "reserve_wait_s", "recovery_wait_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"routing {name} must be > 0 (got {getattr(self, name)!r})")
        if self.max_reserve_waiters < 1:
            raise ValueError(
                f"routing max_reserve_waiters must be >= 1 (got {self.max_reserve_waiters!r})"
            )
        if self.prefill_max_imbalance < 0 or self.affinity_blocks < 1 or self.max_resumes < 0:
            raise ValueError(
                "routing prefill_max_imbalance and max_resumes must be >= 0, affinity_blocks "
                f">= 1 (got {self.prefill_max_imbalance!r}, {self.max_resumes!r}, "
                f"{self.affinity_blocks!r})"
            )


def decode_preference(
    ranks: list[RankStatus], pending_blocks: list[int], num_blocks: int
) -> list[int]:
    """-> indices of the ready ranks that could hold num_blocks more, best first.
    pending_blocks: blocks to take off each status (this router's since; negative: freed)."""
    free = [r.kv_free_blocks - pending for r, pending in zip(ranks, pending_blocks)]
    fits = [
        i
        for i, r in enumerate(ranks)
        if r.ready and r.num_waiting == 0 and i < len(free) and free[i] >= num_blocks
    ]
    return sorted(fits, key=lambda i: (-free[i], ranks[i].num_running + ranks[i].num_waiting, i))


def prefix_key(prompt_token_ids: list[int], block_size: int, num_blocks: int = 1) -> bytes:
    """The hash of the prompt's first num_blocks full blocks (of the whole prompt if shorter)."""
    hashes = block_hashes(prompt_token_ids[: block_size * num_blocks], block_size)
    if hashes:
        return hashes[-1]
    return hashlib.blake2b(repr(prompt_token_ids).encode(), digest_size=16).digest()


def prefill_choice(
    key: bytes, loads: list[int], hits: list[int], prompt_tokens: int, max_imbalance: int
) -> int:
    """-> the prefill rank for a prompt of prompt_tokens tokens. loads: queued prompt tokens
    per rank; hits: the prompt's tokens expected to hit per rank (PrefixIndex.expected_hits);
    key: prefix_key of the prompt (breaks ties). Cost of a rank = its load + the tokens it would
    compute; ranks busier than the least busy by more than max_imbalance are left out."""
    assert loads and len(hits) == len(loads), (loads, hits)
    least = min(loads)
    candidates = [i for i, load in enumerate(loads) if load - least <= max_imbalance]

    def rendezvous(i: int) -> int:
        digest = hashlib.blake2b(key + i.to_bytes(4, "little"), digest_size=8).digest()
        return int.from_bytes(digest, "little")

    return min(candidates, key=lambda i: (loads[i] + prompt_tokens - hits[i], -rendezvous(i)))
