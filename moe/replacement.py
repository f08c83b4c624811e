"""Live expert re-placement on one rank of a pool: which expert weights go where, and moving them
while the old ones keep serving.

Legend (kernels/__init__.py): S physical slots of the pool, S_r slots on a rank, R ranks,
D hidden, I intermediate.

Every rank works out the same plan from a layer's old and new placement rows: each of its new
slots takes its expert's weights from one of its own old slots (a local copy), or from the lowest
rank whose old slots held that expert (a point-to-point transfer on the pool's moves group, tagged
by slot). The weights land in fresh tensors; the old ones keep serving until every rank of the
pool has its new weights and all switch at the same step (engine/balancer.py decides when). When
a transfer fails, the rank reads the expert from the checkpoint instead. FP8 experts move as
stored, their block scales with them (Experts.slot_tensors).
"""

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels import hugepages
from moe.layers import MoE

# expert -> its tensors in Experts.slot_tensors' order: (w13, w2), FP8 experts their scales too
ExpertReader = Callable[[int], tuple[torch.Tensor, ...]]


@dataclass(frozen=True, slots=True)
class Transfer:
    slot: int  # the new physical slot (global, rank-major)
    expert: int
    src: int  # the rank that sends it (the lowest that held the expert)
    dst: int  # the rank that receives it (the slot's owner)


def plan_layer(old: list[int], new: list[int], num_ranks: int) -> list[Transfer]:
    """Every weight transfer between ranks that turning row `old` into row `new` needs (a slot
    whose owner already held the expert copies it locally: no transfer)."""
    assert len(old) == len(new) and len(old) % num_ranks == 0, (len(old), len(new), num_ranks)
    per_rank = len(old) // num_ranks
    held = [set(old[r * per_rank : (r + 1) * per_rank]) for r in range(num_ranks)]
    moves = []
    for slot, expert in enumerate(new):
        dst = slot // per_rank
        if expert in held[dst]:
            continue
        src = next(r for r in range(num_ranks) if expert in held[r])
        moves.append(Transfer(slot, expert, src, dst))
    return moves


class LayerMove:
    """One MoE layer's new weights on this rank, on their way. The old weights keep serving;
    `apply` swaps in the new ones (every rank of the pool at the same step)."""

    def __init__(
        self,
        moe: MoE,
        layer_pos: int,
        old: list[int],
        new: list[int],
        rank: int,
        num_ranks: int,
        group: dist.ProcessGroup | None,
        read_expert: ExpertReader,
    ) -> None:
        experts = moe.experts
        per_rank = len(new) // num_ranks
        mine = range(rank * per_rank, (rank + 1) * per_rank)
        self.moe, self.new_ids = moe, new[mine.start : mine.stop]
        self.read_expert = read_expert
        # w13 [S_r, 2I, D], w2 [S_r, D, I] (FP8: and their block scales): each moves with a slot
        old_tensors = experts.slot_tensors()
        self.new = {name: torch.empty_like(t) for name, t in old_tensors.items()}
        hugepages.advise(list(self.new.values()))  # before they are written, as the loader does
        self.bytes_received = 0
        local_slot = {e: s for s, e in reversed(list(enumerate(experts.expert_ids)))}
        transfers = plan_layer(old, new, num_ranks)
        self._recvs: list[tuple[int, int, list[dist.Work]]] = []  # (local slot, expert, works)
        self._sends: list[dist.Work] = []
        # local copies: on the waiter thread, off the step
        self._copies = [(s - mine.start, local_slot[new[s]]) for s in mine if new[s] in local_slot]
        tag, per_slot = layer_pos * len(new), len(self.new)
        for t in transfers:  # posted in the plan's order on every rank: tags match them up
            key = per_slot * (tag + t.slot)
            if t.dst == rank:
                i = t.slot - mine.start
                works = [
                    dist.irecv(_wire(w[i]), t.src, group=group, tag=key + k)
                    for k, w in enumerate(self.new.values())
                ]
                self._recvs.append((i, t.expert, works))
                self.bytes_received += sum(w[i].nbytes for w in self.new.values())
            elif t.src == rank:
                j = local_slot[t.expert]
                for k, w in enumerate(old_tensors.values()):
                    self._sends.append(dist.isend(_wire(w[j]), t.dst, group=group, tag=key + k))

        # NOTE: a waiter thread: gloo's point-to-point works only complete inside wait().
        self._failed: list[tuple[int, int]] = []  # (local slot, expert) whose receive failed
        self._done = threading.Event()
        threading.Thread(target=self._wait_all, name="expert-moves", daemon=True).start()

    def _wait_all(self) -> None:
        with torch.inference_mode():  # like the weights they copy (moe.loader)
            old = self.moe.experts.slot_tensors()
            for i, j in self._copies:
                for name, w in self.new.items():
                    w[i].copy_(old[name][j])
        for i, expert, works in self._recvs:
            try:
                for w in works:
                    w.wait()
            except RuntimeError:
                self._failed.append((i, expert))
        for w in self._sends:
            try:
                w.wait()
            except RuntimeError:
                pass  # the receiver falls back to the checkpoint
        self._done.set()

    def done(self) -> bool:
        """Every transfer of this rank (sent and received) has completed (or failed)."""
        return self._done.is_set()

    def finish(self) -> int:
        """Wait for the transfers; a receive that failed reads its expert from the checkpoint.
        -> how many experts came from the checkpoint."""
        self._done.wait()
        for i, expert in self._failed:
            tensors = self.read_expert(expert)
            assert len(tensors) == len(self.new), (len(tensors), list(self.new))
            for w, t in zip(self.new.values(), tensors):
                w[i].copy_(t)
        return len(self._failed)

    def apply(self) -> None:
        """Swap in the new weights and expert ids (the caller swaps the dispatch maps)."""
        experts = self.moe.experts
        for name, w in self.new.items():
            getattr(experts, name).data = w
        experts.expert_ids = list(self.new_ids)


def _wire(t: torch.Tensor) -> torch.Tensor:
    """What goes on the wire for t: FP8 as its bytes (a backend may have no float8 type)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
