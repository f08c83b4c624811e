"""Local search on expert placements: lower the most loaded rank of each row by swapping two slots
between ranks or by giving a slot to another expert (one replica less here, one more there).

Legend: X independent rows (a layer, or a layer's node), n experts of a row, S slots (S % R == 0),
R ranks, k = S / R slots per rank, CE candidate edits of a row.

Slot s lives on rank s // k. An expert's load splits evenly over its replicas, so a rank's load is
the sum over its slots of load[e] / count[e]. Every edit starts from the most loaded rank r*:
- swap: a slot of r* and a slot of another rank exchange experts (replica counts stay);
- reassign: a slot's expert a (a has >= 2 replicas) becomes expert b: either the slot is on r* (any
  b), or b already has a replica on r* (any slot), so that b's replicas on r* get lighter.
A row takes an edit when it lowers the row's largest rank load, or keeps it and lowers the sum of
squared rank loads; both strictly decrease (max, sum of squares), so the search ends. Swaps are
tried first (cheap); reassignments only when no swap helps. Under a budget of moves all edits
compete, each scored by its drop per moved slot (a swap moves 2 slots, a reassignment 1).

Constraints: `expert_node` / `rank_node` keep every slot of a rank on a node holding only that
node's experts (hierarchical placements); `reference` with `max_moves` bounds the slots whose
expert differs from the reference (the placement the cluster has now).
"""

import torch

_REL_TOL = 1e-9

# candidate edits: ([slot_x, new_x, slot_y, new_y], new_max, dsq, valid), each [a, CE]
_Candidates = tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, torch.Tensor]


def local_search(
    weight: torch.Tensor,
    slot2log: torch.Tensor,
    num_ranks: int,
    *,
    expert_node: torch.Tensor | None = None,
    rank_node: torch.Tensor | None = None,
    reference: torch.Tensor | None = None,
    max_moves: torch.Tensor | None = None,
    max_steps: int | None = None,
) -> torch.Tensor:
    """Improve each row's placement by edits from its most loaded rank (module docstring).

    weight [X, n] float: load per expert. slot2log [X, S] int64: the start (every expert has a
    slot). expert_node [X, n], rank_node [X, R] int64: when given, edits keep each expert on its
    node. reference [X, S] int64 and max_moves [X] int64: when given, the result differs from the
    reference in at most max_moves slots per row (the start must already satisfy it).
    Returns slot2log [X, S] int64: never a larger max rank load than the start, row by row.
    """
    num_rows, num_log = weight.shape
    num_slots = slot2log.shape[1]
    assert slot2log.shape[0] == num_rows and num_slots % num_ranks == 0, (slot2log.shape, num_ranks)
    weight = weight.double().cpu()
    slot2log = slot2log.clone()
    if expert_node is None:
        expert_node = torch.zeros(num_rows, num_log, dtype=torch.int64)
        rank_node = torch.zeros(num_rows, num_ranks, dtype=torch.int64)
    if reference is not None:
        assert max_moves is not None and bool(((slot2log != reference).sum(1) <= max_moves).all())
    max_steps = 20 * num_slots if max_steps is None else max_steps
    active = torch.arange(num_rows)
    for _ in range(max_steps):
        if active.numel() == 0:
            break
        row = _Row(
            weight[active], slot2log[active], num_ranks, expert_node[active], rank_node[active]
        )
        if reference is not None:  # every edit competes, scored per moved slot
            candidates = row.swaps()
            if num_slots > num_log:
                candidates = _concat(candidates, row.reassignments())
            ref = reference[active]
            left = max_moves[active] - (slot2log[active] != ref).sum(dim=1)
            edits, ok = row.best(candidates, ref, left)
        else:  # swaps first: cheap; reassignments where no swap helps
            edits, ok = row.best(row.swaps())
            stuck = (~ok).nonzero().flatten()
            if stuck.numel() and num_slots > num_log:
                part = row.select(stuck)
                edits_s, ok_s = part.best(part.reassignments())
                for e, es in zip(edits, edits_s, strict=True):
                    e[stuck] = es
                ok[stuck] = ok_s
        rows = active[ok]
        slot_x, new_x, slot_y, new_y = (e[ok] for e in edits)
        slot2log[rows, slot_x] = new_x
        slot2log[rows, slot_y] = new_y
        active = rows
    return slot2log


class _Row:
    """The loads of a batch of rows, and the candidate edits from each row's most loaded rank.

    An edit is (slot_x, new_x, slot_y, new_y) [a, CE] each: slot_x takes expert new_x and slot_y
    takes new_y (a reassignment repeats slot_x in slot_y). Candidates come with their row's new
    largest rank load, change of the sum of squared loads, and validity, each [a, CE].
    """

    def __init__(
        self,
        weight: torch.Tensor,
        slot2log: torch.Tensor,
        num_ranks: int,
        expert_node: torch.Tensor,
        rank_node: torch.Tensor,
    ) -> None:
        self.w, self.p2l, self.num_ranks = weight, slot2log, num_ranks
        self.expert_node, self.rank_node = expert_node, rank_node
        num_rows, num_slots = slot2log.shape
        self.k = num_slots // num_ranks
        self.slot_rank = torch.arange(num_slots) // self.k  # [S]
        self.cnt = torch.zeros_like(weight).scatter_add_(
            1, slot2log, torch.ones_like(slot2log, dtype=weight.dtype)
        )  # [a, n]
        self.per_slot = (weight / self.cnt).gather(1, slot2log)  # [a, S]
        self.load = self.per_slot.view(num_rows, num_ranks, -1).sum(dim=-1)  # [a, R]
        top = self.load.topk(min(3, num_ranks), dim=1)
        pad = 3 - top.values.shape[1]
        self.top_val = torch.nn.functional.pad(top.values, (0, pad), value=-torch.inf)  # [a, 3]
        self.top_idx = torch.nn.functional.pad(top.indices, (0, pad), value=-1)  # [a, 3]
        self.lmax, self.rstar = self.top_val[:, 0], self.top_idx[:, 0]  # [a]
        self.star_slots = self.rstar[:, None] * self.k + torch.arange(self.k)  # [a, k]
        self.star_node = self.rank_node.gather(1, self.rstar[:, None])  # [a, 1]

    def select(self, rows: torch.Tensor) -> "_Row":
        return _Row(
            self.w[rows],
            self.p2l[rows],
            self.num_ranks,
            self.expert_node[rows],
            self.rank_node[rows],
        )

    def swaps(self) -> _Candidates:
        """A slot of r* [a, k] against every slot [a, S]: C = k * S."""
        a, num_slots = self.p2l.shape
        p1 = self.per_slot.gather(1, self.star_slots)  # [a, k]
        d = p1[:, :, None] - self.per_slot[:, None, :]  # [a, k, S]
        other = self.load[:, self.slot_rank][:, None, :]  # [a, 1, S]
        new_star, new_other = self.lmax[:, None, None] - d, other + d
        # the largest load outside r* and the partner rank
        partner_is_second = self.slot_rank[None, :] == self.top_idx[:, 1:2]  # [a, S]
        rest = torch.where(partner_is_second, self.top_val[:, 2:3], self.top_val[:, 1:2])
        new_max = torch.maximum(rest[:, None, :], torch.maximum(new_star, new_other))
        dsq = new_star**2 + new_other**2 - self.lmax[:, None, None] ** 2 - other**2
        partner_node = self.rank_node[:, self.slot_rank]  # [a, S]
        valid = (self.slot_rank[None, :] != self.rstar[:, None]) & (partner_node == self.star_node)
        valid = valid[:, None, :] & (d != 0)  # [a, k, S]
        e1 = self.p2l.gather(1, self.star_slots)  # [a, k]
        slot_x = self.star_slots[:, :, None].expand(-1, -1, num_slots)
        slot_y = torch.arange(num_slots).expand(a, self.k, -1)
        new_x = self.p2l[:, None, :].expand(-1, self.k, -1)
        new_y = e1[:, :, None].expand(-1, -1, num_slots)
        edits = [t.reshape(a, -1) for t in (slot_x, new_x, slot_y, new_y)]
        return edits, new_max.reshape(a, -1), dsq.reshape(a, -1), valid.reshape(a, -1)

    def reassignments(self) -> _Candidates:
        """(a) a slot of r* to a target expert (`_targets`): C = k * B; (b) any slot of an expert
        with >= 2 replicas to an expert with a replica on r*: C = m * k, m = min(S, 2 (S - n))."""
        a, num_slots = self.p2l.shape
        num_log = self.w.shape[1]
        star_experts = self.p2l.gather(1, self.star_slots)  # [a, k]
        # (a)
        dst_a = _targets(self.w, self.cnt, star_experts, self.expert_node == self.star_node)
        dst_a = dst_a[:, None, :].expand(-1, self.k, -1)  # [a, k, B]
        src_a = self.star_slots[:, :, None].expand_as(dst_a)
        # (b): the slots of replicated experts, at most 2 (S - n) of them
        m = min(num_slots, 2 * (num_slots - num_log))
        replicated = self.cnt.gather(1, self.p2l) >= 2  # [a, S]
        src_b = replicated.double().topk(m, dim=1).indices  # [a, m]
        src_b = src_b[:, :, None].expand(-1, -1, self.k)  # [a, m, k]
        dst_b = star_experts[:, None, :].expand(-1, m, -1)
        src = torch.cat([src_a.reshape(a, -1), src_b.reshape(a, -1)], dim=1)  # [a, CE]
        dst = torch.cat([dst_a.reshape(a, -1), dst_b.reshape(a, -1)], dim=1)  # [a, CE]
        new_max, dsq, valid = self._reassign_effect(src, dst)
        return [src, dst, src, dst], new_max, dsq, valid

    def _reassign_effect(
        self, src: torch.Tensor, dst: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Slot src [a, CE] changes to expert dst [a, CE]: new max, change of squares, validity."""
        a, num_slots = self.p2l.shape
        num_log, num_ranks = self.w.shape[1], self.num_ranks
        old = self.p2l.gather(1, src)  # [a, CE]
        c_old, w_old = self.cnt.gather(1, old), self.w.gather(1, old)
        c_new, w_new = self.cnt.gather(1, dst), self.w.gather(1, dst)
        src_rank = self.slot_rank[src]  # [a, CE]
        valid = (c_old >= 2) & (old != dst)
        valid &= self.expert_node.gather(1, dst) == self.rank_node.gather(1, src_rank)
        up_old = torch.where(valid, w_old / (c_old - 1).clamp(min=1), 0.0)  # each remaining replica
        d_old = torch.where(valid, up_old - w_old / c_old, 0.0)  # [a, CE]
        new_load = w_new / (c_new + 1)
        d_new = new_load - w_new / c_new  # [a, CE]
        on_rank = torch.zeros(a, num_log * num_ranks, dtype=self.w.dtype)
        on_rank.scatter_add_(
            1, self.p2l * num_ranks + self.slot_rank, torch.ones_like(self.per_slot)
        )
        on_rank = on_rank.view(a, num_log, num_ranks)  # [a, n, R]: replicas of e on rank r
        idx = lambda e: e[:, :, None].expand(-1, -1, num_ranks)
        load = (
            self.load[:, None, :]
            + on_rank.gather(1, idx(old)) * d_old[:, :, None]
            + on_rank.gather(1, idx(dst)) * d_new[:, :, None]
        )  # [a, CE, R]
        load.scatter_add_(2, src_rank[:, :, None], (new_load - up_old)[:, :, None])
        new_max = load.max(dim=-1).values
        dsq = (load**2).sum(dim=-1) - (self.load**2).sum(dim=-1)[:, None]
        return new_max, dsq, valid

    def best(
        self,
        candidates: _Candidates,
        reference: torch.Tensor | None = None,
        left: torch.Tensor | None = None,
    ) -> tuple[list[torch.Tensor], torch.Tensor]:
        """The best edit of each row and whether it improves the row: (edits [a] x 4, ok [a]).

        Best: the largest drop of the max rank load, then of the sum of squares. With reference
        [a, S] and left [a] (moves still allowed), edits that fit, each drop per moved slot."""
        edits, new_max, dsq, valid = candidates
        per_move = torch.ones_like(new_max)
        if reference is not None:
            delta = _moves_delta(self.p2l, reference, edits)  # [a, CE]
            valid = valid & (delta <= left[:, None])
            per_move = delta.clamp(min=1).to(new_max.dtype)
        lmax = self.lmax[:, None]
        tol = _REL_TOL * lmax
        lower = new_max < lmax - tol
        flatter = (new_max <= lmax) & (dsq < -tol * lmax)
        better = valid & (lower | flatter)
        drop = torch.where(better, (lmax - new_max) / per_move, -torch.inf)
        near = better & (drop >= drop.max(dim=1, keepdim=True).values - tol)
        pick = torch.where(near, -dsq / per_move, -torch.inf).argmax(dim=1, keepdim=True)
        return [e.gather(1, pick).flatten() for e in edits], better.any(dim=1)


def _concat(*candidates: _Candidates) -> _Candidates:
    """Join candidate lists (edits, new_max, dsq, valid) along the candidate dim."""
    edits = [torch.cat(parts, dim=1) for parts in zip(*(c[0] for c in candidates), strict=True)]
    rest = [torch.cat(parts, dim=1) for parts in zip(*(c[1:] for c in candidates), strict=True)]
    return edits, *rest


def _targets(
    w: torch.Tensor, cnt: torch.Tensor, on_star: torch.Tensor, allowed: torch.Tensor, num: int = 8
) -> torch.Tensor:
    """Experts worth one more replica [a, B]: those on the most loaded rank (on_star [a, k]), the
    `num` whose replicas would get the lightest (tiny replicas fill up heavy ranks: with 2 slots
    per rank the best packing pairs the heaviest replica with the lightest) and the `num` heaviest
    per replica; among the `allowed` [a, n] ones (a disallowed pick is repeated from on_star)."""
    num = min(num, w.shape[1])
    cnt = cnt.double()
    lightest = torch.where(allowed, w / (cnt + 1), torch.inf).topk(num, dim=1, largest=False)
    heaviest = torch.where(allowed, w / cnt, -torch.inf).topk(num, dim=1)
    fallback = on_star[:, :1]
    light = torch.where(lightest.values < torch.inf, lightest.indices, fallback)
    heavy = torch.where(heaviest.values > -torch.inf, heaviest.indices, fallback)
    return torch.cat([on_star, light, heavy], dim=1)


def _moves_delta(
    slot2log: torch.Tensor, reference: torch.Tensor, edits: list[torch.Tensor]
) -> torch.Tensor:
    """How many more slots differ from the reference after each edit [a, CE]."""
    slot_x, new_x, slot_y, new_y = edits
    ref_x, ref_y = reference.gather(1, slot_x), reference.gather(1, slot_y)
    cur_x, cur_y = slot2log.gather(1, slot_x), slot2log.gather(1, slot_y)
    two = (slot_x != slot_y).long()
    before = (cur_x != ref_x).long() + two * (cur_y != ref_y).long()
    after = (new_x != ref_x).long() + two * (new_y != ref_y).long()
    return after - before


def count_search(
    weight: torch.Tensor,
    slot2log: torch.Tensor,
    num_ranks: int,
    num_targets: int = 4,
    num_sources: int = 8,
    max_rounds: int = 64,
) -> torch.Tensor:
    """Improve the replica counts of each row: move one replica from expert a to expert b, repack
    all slots (`pack_rounds`), polish with `local_search`, and keep it when the max rank load
    drops; repeat until no candidate helps.

    weight [X, n], slot2log [X, S] -> slot2log [X, S]: never a larger max rank load, row by row.
    Candidates: a among the num_sources replicated experts whose remaining replicas stay lightest;
    b among `_targets` (num_targets lightest and heaviest, and those on the most loaded rank).
    """
    num_rows, num_log = weight.shape
    num_slots = slot2log.shape[1]
    weight = weight.double().cpu()
    slot2log = local_search(weight, slot2log, num_ranks)
    if num_slots == num_log:
        return slot2log
    active = torch.arange(num_rows)
    for _ in range(max_rounds):
        if active.numel() == 0:
            break
        w, p2l = weight[active], slot2log[active]
        counts = torch.zeros(p2l.shape[0], num_log, dtype=torch.int64).scatter_add_(
            1, p2l, torch.ones_like(p2l)
        )  # [a, n]
        load = _rank_loads(w, p2l, counts, num_ranks)  # [a, R]
        current, star = load.max(dim=1)  # [a]
        cand = _count_candidates(w, p2l, counts, star, num_ranks, num_targets, num_sources)
        cand_counts, valid = cand  # [a, CE, n], [a, CE]
        num_cand = valid.shape[1]
        packed, best = pack_rounds(
            w.repeat_interleave(num_cand, dim=0), cand_counts.flatten(0, 1), num_ranks
        )  # [a * CE, S], [a * CE]
        best = torch.where(valid, best.view(-1, num_cand), torch.inf)
        value, pick = best.min(dim=1)  # [a]
        ok = value < current * (1 - _REL_TOL)
        rows = active[ok]
        chosen = packed.view(-1, num_cand, num_slots)[ok, pick[ok]]  # [a', S]
        slot2log[rows] = local_search(weight[rows], chosen, num_ranks)
        active = rows
    return slot2log


def _rank_loads(
    w: torch.Tensor, p2l: torch.Tensor, counts: torch.Tensor, num_ranks: int
) -> torch.Tensor:
    per_slot = (w / counts.clamp(min=1)).gather(1, p2l)  # [a, S]
    return per_slot.view(w.shape[0], num_ranks, -1).sum(dim=-1)


def _count_candidates(
    w: torch.Tensor,
    p2l: torch.Tensor,
    counts: torch.Tensor,
    star: torch.Tensor,
    num_ranks: int,
    num_targets: int,
    num_sources: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts after moving one replica a -> b: ([a, CE, n] int64, valid [a, CE])."""
    num_rows, num_log = w.shape
    k = p2l.shape[1] // num_ranks
    c = counts.double()
    num_src = min(num_sources, num_log, p2l.shape[1] - num_log)
    harm = torch.where(counts >= 2, w / (c - 1).clamp(min=1), torch.inf)
    src = harm.topk(num_src, dim=1, largest=False)  # [a, A]
    src_ok = src.values < torch.inf
    on_star = p2l.gather(1, star[:, None] * k + torch.arange(k))  # [a, k]
    dst = _targets(w, counts, on_star, torch.ones_like(counts, dtype=torch.bool), num_targets)
    a_idx = src.indices[:, :, None].expand(-1, -1, dst.shape[1]).flatten(1)  # [a, CE]
    b_idx = dst[:, None, :].expand(-1, num_src, -1).flatten(1)  # [a, CE]
    valid = src_ok[:, :, None].expand(-1, -1, dst.shape[1]).flatten(1) & (a_idx != b_idx)
    rows = torch.arange(num_rows)[:, None]
    cand = counts[:, None, :].repeat(1, a_idx.shape[1], 1)  # [a, CE, n]
    cols = torch.arange(a_idx.shape[1])[None, :]
    cand[rows, cols, a_idx] -= valid.long()
    cand[rows, cols, b_idx] += valid.long()
    return cand, valid


def pack_rounds(
    weight: torch.Tensor, counts: torch.Tensor, num_ranks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack c_e replicas of each expert onto ranks, S / R per rank, in S / R rounds: each round
    gives the next R heaviest replicas to the ranks, the heaviest to the lightest rank. With two
    slots per rank this pairs the i-th heaviest with the i-th lightest replica: optimal.

    weight [M, n] float, counts [M, n] int64 (rows sum to S) -> (slot2log [M, S], max load [M]).
    """
    num_rows, num_log = weight.shape
    num_slots = int(counts[0].sum()) if num_rows else 0
    k = num_slots // num_ranks
    per_replica = weight / counts.clamp(min=1)  # [M, n]
    order = per_replica.argsort(dim=1, descending=True, stable=True)  # [M, n]
    # every row has S replicas: one flat repeat lists them heaviest first, row by row
    expert = order.flatten().repeat_interleave(counts.gather(1, order).flatten())
    expert = expert.view(num_rows, num_slots)  # [M, S]
    load = per_replica.gather(1, expert)  # [M, S]
    bin_load = load[:, :num_ranks].clone()  # round 0: the R heaviest, one per rank
    slot2log = torch.empty_like(expert)
    slot2log[:, ::k] = expert[:, :num_ranks]
    for r in range(1, k):
        ranks = bin_load.argsort(dim=1, stable=True)  # [M, R]: lightest first
        part = slice(r * num_ranks, (r + 1) * num_ranks)
        bin_load.scatter_add_(1, ranks, load[:, part])
        slot2log.scatter_(1, ranks * k + r, expert[:, part])
    return slot2log, bin_load.max(dim=1).values
