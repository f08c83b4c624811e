"""Live expert load balancing for one rank of an expert-parallel pool.

Legend (kernels/__init__.py): L MoE layers, E logical experts, S physical slots, R ranks.

The dispatchers count the tokens this rank routes to each physical slot (on the device, no sync
per step). A rebalance is requested on any rank (`request`); the step's agreement all-reduce
carries the request, so every rank of the pool plans at the same step:
1. the pool sums its counts (all-reduce [L, S]) into a load window per logical expert (earlier
   windows decay by `eplb_decay`);
2. rank 0 chooses the new placement (moe.eplb, under a budget of moved slots when set) on a
   thread of its own while the pool keeps stepping, and broadcasts it (or a skip, when the
   predicted gain is under `eplb_min_gain`) at the first step the agreement shows it is done;
3. every rank starts moving the weights of its new slots (moe/replacement.py) into fresh
   tensors on the pool's moves group while the old weights keep serving;
4. once the agreement shows every rank has its weights, all ranks switch a round of layers at the
   same step (the weights, the dispatch maps and the counts together), `eplb_layers_per_round`
   layers at a time, so a switch costs a pointer swap, not a transfer.
In-flight requests go on with identical outputs: a token's experts compute the same function
whichever replica runs them, and the combine sums a token's K rows in a fixed order.
"""

import logging
import threading
import time

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.messages import RebalanceStatus
from engine.metrics.rank import RankStats
from moe.dispatch import AllToAllDispatcher
from moe.eplb import (
    align_placement,
    count_moves,
    gpu_loads,
    rebalance_experts,
    rebalance_experts_with_moves,
)
from moe.loader import read_expert
from moe.model import DeepseekForCausalLM
from moe.placement import Placement
from moe.replacement import LayerMove

log = logging.getLogger(__name__)


class Balancer:
    def __init__(
        self,
        model: DeepseekForCausalLM,
        placement: Placement,
        group: dist.ProcessGroup | None,
        moves_group: dist.ProcessGroup | None,
        rank: int,
        config: EngineConfig,
        stats: RankStats,
    ) -> None:
        self.model, self.placement = model, placement
        self.group, self.moves_group, self.rank = group, moves_group, rank
        self.config, self.stats = config, stats
        self.moes = model.moe_layers()
        assert all(isinstance(m.dispatcher, AllToAllDispatcher) for m in self.moes)
        num_layers, num_experts = placement.num_layers, placement.num_experts
        self.window = torch.zeros(num_layers, num_experts)  # [L, E] decayed pool load
        self.last = RebalanceStatus()
        self.balancedness = (1.0, 1.0)  # (mean, worst) over layers, at the last plan
        self._requested = threading.Event()
        self._rounds: list[list[int]] = []  # layer positions still to switch
        self._moves: list[tuple[int, LayerMove]] = []  # the round in flight
        self._new: Placement | None = None
        self._deciding: threading.Thread | None = None  # rank 0's placement search
        self._weight: torch.Tensor | None = None  # [L, E] the load window it works from
        self._decision: torch.Tensor | None = None
        self._started = self._plan_pause = 0.0

    # ---- from any thread ----

    def request(self) -> None:
        """Ask for a rebalance; every rank of the pool plans at the next agreed step."""
        self._requested.set()

    # ---- on the engine thread, every step of the pool ----

    def flags(self) -> list[int]:
        """What this rank adds to the step's agreement: a request, and busy (its placement
        search, or its weights of the round, not done yet)."""
        busy = (self._deciding is not None and self._deciding.is_alive()) or (
            bool(self._moves) and not all(m.done() for _, m in self._moves)
        )
        return [int(self._requested.is_set()), int(busy)]

    @torch.inference_mode()  # the weights are inference tensors (moe.loader): so are new ones
    def on_agreement(self, requested: bool, busy: bool) -> None:
        """After the agreement all-reduce (the same step on every rank of the pool)."""
        if busy:
            return
        if self._moves:  # every rank has this round's weights: switch them together
            self._switch()
        elif self._weight is not None:  # rank 0's decision is ready: share it, start moving
            self._start()
        elif requested:
            self._plan()

    # ---- the plan (collective) ----

    def _plan(self) -> None:
        """Sum the pool's load (a collective); rank 0 starts its search on a thread."""
        started = time.perf_counter()
        self._started = started
        self._requested.clear()
        c, p = self.config, self.placement
        taken = [m.dispatcher.load.take() for m in self.moes]  # counts start over
        loads = torch.stack(  # [L, S] tokens this rank routed to each slot since the last plan
            [
                load
                if load is not None
                else torch.zeros(p.num_slots, dtype=torch.int64, device=c.device)
                for load in taken
            ]
        )
        dist.all_reduce(loads, group=self.group)  # the pool's load
        weight = self.window.clone()  # [L, E]
        weight.scatter_add_(1, p.phy2log, loads.cpu().float())
        self.window = c.eplb_decay * weight
        self._weight = weight
        self._decision = torch.zeros(1 + p.num_layers * p.num_slots, dtype=torch.int64)
        if self.rank == 0:

            def decide() -> None:
                self._decision = self._decide(weight)

            self._deciding = threading.Thread(target=decide, name="eplb-decide", daemon=True)
            self._deciding.start()
        self._plan_pause = time.perf_counter() - started

    def _start(self) -> None:
        """Rank 0's decision to every rank (a collective), then this round's weights moving."""
        started = time.perf_counter()
        c, p, weight = self.config, self.placement, self._weight
        self._weight = self._deciding = None
        decision = self._decision.to(c.device)
        dist.broadcast(decision, src=0, group=self.group)
        decision = decision.cpu()
        before = _balancedness(weight, p.phy2log, p.num_ranks)
        self.balancedness = (before.mean().item(), before.min().item())
        new_phy2log = decision[1:].view(p.num_layers, p.num_slots)
        after = _balancedness(weight, new_phy2log, p.num_ranks)
        self.last = RebalanceStatus(
            self.last.number + 1,
            "applied" if decision[0] else "skipped",
            bool(decision[0]),
            before.mean().item(),
            after.mean().item(),
        )
        if not decision[0]:
            self.last.moving = False
            self.stats.inc("epcluster_eplb_rebalances_total", 1, "skipped")
            log.info("expert rebalance %d skipped: the gain is too small", self.last.number)
            return
        self._new = Placement(p.layers, new_phy2log, p.num_ranks, p.num_experts)
        changed = [i for i in range(p.num_layers) if not torch.equal(p.phy2log[i], new_phy2log[i])]
        self.last.slots_moved = int(count_moves(p.phy2log, new_phy2log).sum())
        self.last.layers_moved = len(changed)
        per_round = c.eplb_layers_per_round or len(changed) or 1
        self._rounds = [changed[i : i + per_round] for i in range(0, len(changed), per_round)]
        self._start_round()
        self.last.longest_pause_s = max(self._plan_pause, time.perf_counter() - started)
        if not self._moves:  # nothing to move after all
            self._finish()

    def _decide(self, weight: torch.Tensor) -> torch.Tensor:
        """Rank 0: [applied?, new phy2log [L, S] flattened] for the load window [L, E]."""
        c, p, mc = self.config, self.placement, self.model.config
        groups = mc.n_group if mc.n_routed_experts % mc.n_group == 0 else 1
        if c.eplb_max_moves > 0:
            new = rebalance_experts_with_moves(
                weight, p.phy2log, c.eplb_max_moves, groups, 1, p.num_ranks
            )[0]
        else:
            new = rebalance_experts(weight, p.num_slots, groups, 1, p.num_ranks)[0]
            new = align_placement(new, p.phy2log, p.num_ranks)  # fewest moves for that load
        before = gpu_loads(weight, p.phy2log, p.num_ranks).max(dim=1).values.sum()
        after = gpu_loads(weight, new, p.num_ranks).max(dim=1).values.sum()
        gain = float(before / after.clamp(min=1e-9) - 1) if before > 0 else 0.0
        applied = gain >= c.eplb_min_gain and not torch.equal(new, p.phy2log)
        return torch.cat([torch.tensor([int(applied)]), new.flatten()])

    # ---- moving weights and switching ----

    def _start_round(self) -> None:
        layers = self._rounds.pop(0) if self._rounds else []
        old, new = self.placement.phy2log, self._new.phy2log
        self._moves = []
        for pos in layers:
            layer, fp8 = self.placement.layers[pos], self.moes[pos].experts.fp8

            def reader(
                expert: int, layer: int = layer, fp8: bool = fp8
            ) -> tuple[torch.Tensor, ...]:
                c = self.config  # FP8 experts read as stored, scales too (Experts.slot_tensors)
                return read_expert(c.model, layer, expert, c.torch_dtype, c.device, fp8)

            move = LayerMove(
                self.moes[pos],
                pos,
                old[pos].tolist(),
                new[pos].tolist(),
                self.rank,
                self.placement.num_ranks,
                self.moves_group,
                reader,
            )
            self._moves.append((pos, move))

    def _switch(self) -> None:
        """Weights, dispatch maps and counts of this round's layers, all at once."""
        started = time.perf_counter()
        for pos, move in self._moves:
            self.last.from_checkpoint += move.finish()
            move.apply()
            self.moes[pos].dispatcher.set_placement(self._new)  # its counts start over
            self.stats.inc("epcluster_eplb_weight_bytes_moved_total", move.bytes_received)
        self._moves = []
        self._start_round()
        self.last.longest_pause_s = max(self.last.longest_pause_s, time.perf_counter() - started)
        if not self._moves:
            self._finish()

    def _finish(self) -> None:
        self.placement = self._new
        self.last.moving = False
        self.last.duration_s = time.perf_counter() - self._started
        self.stats.inc("epcluster_eplb_rebalances_total", 1, "applied")
        self.stats.observe("epcluster_eplb_rebalance_duration_seconds", self.last.duration_s)
        log.info(
            "expert rebalance %d applied: %d slots in %d layers moved in %.3f s (longest pause "
            "%.1f ms), balancedness %.3f -> %.3f",
            self.last.number,
            self.last.slots_moved,
            self.last.layers_moved,
            self.last.duration_s,
            1000 * self.last.longest_pause_s,
            self.last.balancedness_before,
            self.last.balancedness_after,
        )


def _balancedness(weight: torch.Tensor, phy2log: torch.Tensor, num_ranks: int) -> torch.Tensor:
    """[L]: mean rank load / max rank load of each layer (1 when a layer has no load)."""
    loads = gpu_loads(weight, phy2log, num_ranks)  # [L, R]
    peak = loads.max(dim=1).values
    return torch.where(peak > 0, loads.mean(dim=1) / peak.clamp(min=1e-9), torch.ones_like(peak))
