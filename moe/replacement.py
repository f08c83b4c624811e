"""Live expert re-placement on one rank of a pool: which expert weights go where, and moving them
while the old ones keep serving.

Legend (kernels/__init__.py): S physical slots of the pool, S_r slots on a rank, R ranks,
D hidden, I intermediate.

Every rank works out the same plan from a layer's old and new placement rows: each of its new
slots takes its expert's weights from one of its own old slots (a local copy), or from the lowest
rank whose old slots held that expert (a point-to-point transfer on the pool's moves group, tagged
by slot). The weights land in fresh tensors; the old ones keep serving until every rank of the
pool has its new weights and all switch at the same step (engine/balancer.py decides when). When
a transfer fails, the rank reads the expert from the checkpoint instead.
"""

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from kernels import hugepages
from moe.layers import MoE

ExpertReader = Callable[[int], tuple[torch.Tensor, torch.Tensor]]  # expert -> (w13, w2)


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
        self.w13 = torch.empty_like(experts.w13)  # [S_r, 2I, D]
        self.w2 = torch.empty_like(experts.w2)  # [S_r, D, I]
        hugepages.advise([self.w13, self.w2])  # before they are written, as the loader does
        self.bytes_received = 0
        local_slot = {e: s for s, e in reversed(list(enumerate(experts.expert_ids)))}
        transfers = plan_layer(old, new, num_ranks)
        self._recvs: list[tuple[int, int, list[dist.Work]]] = []  # (local slot, expert, works)
        self._sends: list[dist.Work] = []
        # local copies: on the waiter thread, off the step
        self._copies = [(s - mine.start, local_slot[new[s]]) for s in mine if new[s] in local_slot]
        tag = layer_pos * len(new)
        for t in transfers:  # posted in the plan's order on every rank: tags match them up
            if t.dst == rank:
                i = t.slot - mine.start
                works = [
                    dist.irecv(self.w13[i], t.src, group=group, tag=2 * (tag + t.slot)),
                    dist.irecv(self.w2[i], t.src, group=group, tag=2 * (tag + t.slot) + 1),
                ]
                self._recvs.append((i, t.expert, works))
                self.bytes_received += self.w13[i].nbytes + self.w2[i].nbytes
            elif t.src == rank:
                j, key = local_slot[t.expert], 2 * (tag + t.slot)
                self._sends.append(dist.isend(experts.w13[j], t.dst, group=group, tag=key))
                self._sends.append(dist.isend(experts.w2[j], t.dst, group=group, tag=key + 1))

        # NOTE: a waiter thread: gloo's point-to-point works only complete inside wait().
        self._failed: list[tuple[int, int]] = []  # (local slot, expert) whose receive failed
        self._done = threading.Event()
        threading.Thread(target=self._wait_all, name="expert-moves", daemon=True).start()

    def _wait_all(self) -> None:
        with torch.inference_mode():  # like the weights they copy (moe.loader)
            for i, j in self._copies:
                self.w13[i].copy_(self.moe.experts.w13[j])
                self.w2[i].copy_(self.moe.experts.w2[j])
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
            w13, w2 = self.read_expert(expert)
            self.w13[i].copy_(w13)
            self.w2[i].copy_(w2)
        return len(self._failed)

    def apply(self) -> None:
        """Swap in the new weights and expert ids (the caller swaps the dispatch maps)."""
        experts = self.moe.experts
        experts.w13.data = self.w13
        experts.w2.data = self.w2
        experts.expert_ids = list(self.new_ids)
