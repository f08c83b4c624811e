"""Lower bounds on the largest GPU load of any placement: how far a placement is from optimal.

Legend (kernels/__init__.py): L MoE layers, E logical experts, S physical slots, G expert groups,
ND nodes, R GPUs,
k = S / R slots per GPU, X independent rows, n items of a row.

A placement gives every expert c_e >= 1 of the S slots (sum c_e = S), each replica carries
w_e / c_e, and every GPU holds exactly k replicas; its load is the sum of theirs. Every bound
here holds for every such placement, so it holds for the optimum; the tests check it against
both algorithms and against brute force on tiny shapes.
"""

import torch

from moe.eplb.groups import block_weights, group_partitions, quick_max

_SLACK = 1e-9  # relative: float rounding may only make a bound smaller, never larger
_STEPS = 40  # bisection steps at most
_PRECISION = 1e-5  # relative: bisection stops when the bracket is this narrow
_GRID = 24  # values of y in test (y) of slot_bound
# Test (y) binds when a GPU has few slots (2 for DeepSeek-V3 decode); with 5 and more it never
# did on bench/eplb.py's shapes and costs 20x the rest, so it is left out there (still a bound).
_PAIRING_MAX_SLOTS = 4


def lower_bound(
    weight: torch.Tensor,
    num_replicas: int,
    num_groups: int,
    num_nodes: int,
    num_gpus: int,
    upper: torch.Tensor | None = None,
) -> torch.Tensor:
    """weight [L, E] -> [L] float64: no placement (of rebalance_experts' policy for these
    arguments) has a max GPU load below it. upper [L]: the max GPU load of some placement, only to
    narrow the search (the bound is valid whatever it is).

    Global: the largest of the mean load W / R and the slot bound (`slot_bound`). A hierarchical
    placement (num_groups % num_nodes == 0 and num_nodes > 1) is also a global one, so those hold
    for it too; and it puts some partition of the groups on the nodes, each node's experts on its
    R / N GPUs with its S / N slots. When the partitions are few (moe.eplb.groups): the least, over
    partitions, of the largest, over their nodes, of the node's slot bound (at least the node's
    mean). Else: the node bound (`group_bound`), and for every group the slot bound of that group
    alone on its node, with the node's S / N slots less one per expert of the other groups there
    (those slots count as free slots: possibly light replicas).
    """
    num_layers, num_log = weight.shape
    assert num_replicas % num_gpus == 0 and num_replicas >= num_log, (num_replicas, num_gpus)
    weight = weight.double().cpu()
    upper = weight.sum(dim=1) if upper is None else upper.double().cpu()
    bound = weight.sum(dim=1) / num_gpus  # [L]: the mean
    hierarchical = num_groups % num_nodes == 0 and num_nodes > 1
    if hierarchical:
        assert num_log % num_groups == 0 and num_gpus % num_nodes == 0
        group_size, groups_per_node = num_log // num_groups, num_groups // num_nodes
        gpus_per_node = num_gpus // num_nodes
        group_load = weight.view(num_layers, num_groups, group_size).sum(dim=-1)  # [L, G]
        bound = torch.maximum(bound, group_bound(group_load, num_nodes) / gpus_per_node)
    bound = slot_bound(weight, num_replicas, num_gpus, lower=bound, upper=upper)
    if not hierarchical:
        return bound
    node_args = (num_replicas // num_nodes, gpus_per_node)
    found = group_partitions(num_groups, groups_per_node)
    if found is not None:  # every partition of the groups into nodes: the best one's worst node
        blocks, partitions = found
        rows = block_weights(weight, num_groups, blocks)  # [L, B, E / ND]
        # a real placement of each block's node bounds its bound from above; no partition needs
        # more than the best partition of those
        quick = quick_max(rows, *node_args)  # [L, B]
        best_quick = quick[:, partitions].max(dim=-1).values.min(dim=1).values  # [L]
        cap = torch.minimum(quick, torch.minimum(upper, best_quick)[:, None])
        per_block = slot_bound(
            rows.flatten(0, 1),
            *node_args,
            lower=rows.sum(dim=-1).flatten() / gpus_per_node,
            upper=cap.flatten(),
        ).view(num_layers, -1)  # [L, B]
        best = per_block[:, partitions].max(dim=-1).values.min(dim=1).values  # [L]
        return torch.maximum(bound, best)
    slots = node_args[0] - (groups_per_node - 1) * group_size
    per_group = slot_bound(
        weight.view(num_layers * num_groups, group_size),
        slots,
        gpus_per_node,
        slots_per_rank=num_replicas // num_gpus,
        free_slots=(groups_per_node - 1) * group_size,
        lower=bound.repeat_interleave(num_groups),
        upper=upper.repeat_interleave(num_groups),
    )  # [L * G]
    return per_group.view(num_layers, num_groups).max(dim=1).values


def group_bound(group_load: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """group_load [L, G] -> [L]: a lower bound on the largest node load when whole groups go to
    nodes, G / N per node.

    Proof: sort the groups by load, g_0 >= g_1 >= ... For j < G / N, among the jN + 1 heaviest
    groups some node holds j + 1 (pigeonhole); its load is at least the j + 1 lightest of those
    (g_{jN-j} .. g_{jN}) plus its G/N - j - 1 other groups, at least the lightest ones overall
    (those are outside the jN + 1 heaviest, since G - jN - 1 >= G/N - j - 1). j = 0: the heaviest
    group plus the lightest G/N - 1.
    """
    num_layers, num_groups = group_load.shape
    per_node = num_groups // num_nodes
    g = group_load.sort(dim=1, descending=True).values  # [L, G]
    light = g.flip(1).cumsum(dim=1)  # [L, G]: light[:, i] = the i + 1 lightest
    bound = torch.zeros(num_layers, dtype=g.dtype)
    for j in range(per_node):
        shared = g[:, j * num_nodes - j : j * num_nodes + 1].sum(dim=1)
        rest = per_node - j - 1
        others = light[:, rest - 1] if rest > 0 else torch.zeros_like(shared)
        bound = torch.maximum(bound, shared + others)
    return bound


def slot_bound(
    weight: torch.Tensor,
    num_slots: int,
    num_ranks: int,
    slots_per_rank: int | None = None,
    free_slots: int = 0,
    lower: torch.Tensor | None = None,
    upper: torch.Tensor | None = None,
) -> torch.Tensor:
    """weight [X, n] -> [X]: a lower bound on the max rank load over all ways to give n experts
    c_e >= 1 of num_slots slots and pack the replicas slots_per_rank (k) to a rank
    (default num_slots / num_ranks). free_slots: slots on the same ranks held by other experts
    (a node's other groups); they may only help, as the lightest replicas. lower [X]: a known
    lower bound (the result is at least it); upper [X]: where to start the search from above.

    Proof: call T feasible when a placement with max load <= T exists. Then
    (0) every replica is <= T, so c_e >= m_e = max(1, ceil(w_e / T)) and sum m_e <= S.
    (j) For 1 <= j < k, at most jR replicas exceed T / (j + 1) (else some rank holds j + 1 of them
        and exceeds T). An expert with c_e < a_e = ceil((j + 1) w_e / T) has all its c_e replicas
        above T / (j + 1), so the fewest such replicas, given sum c_e <= S, is at least
        sum m_e [m_e < a_e] minus the most a fractional knapsack (value m_e, cost a_e - m_e,
        capacity S - sum m_e) saves: a relaxation, hence a lower value, still a valid test.
    (y) For 0 < y < T / 2: a replica >= T - y (> T / 2) shares its rank with no other such
        replica, and with k - 1 replicas <= y; so N(<= y) >= (k - 1) N(>= T - y) (`_pairing`;
        only for k <= _PAIRING_MAX_SLOTS).
    A T that fails a test is not feasible, and then neither is any smaller T: so T < optimum.
    Bisection keeps the largest failing T it met (the tests get easier as T grows, so it lands
    near the least passing T). Test (0) alone gives the least max replica load (what
    replicate_experts reaches).
    """
    weight = weight.double().cpu().clamp(min=0)
    num_rows = weight.shape[0]
    k = num_slots // num_ranks if slots_per_rank is None else slots_per_rank
    zero = torch.zeros(num_rows, dtype=torch.float64)
    lo = zero if lower is None else lower.double().clone()  # a bound already, or a failing T
    hi = weight.sum(dim=1) if upper is None else torch.maximum(upper.double(), lo)
    for _ in range(_STEPS):
        live = (hi - lo > _PRECISION * hi).nonzero().flatten()  # rows still bisecting
        if live.numel() == 0:
            break
        mid = (lo[live] + hi[live]) / 2
        fails = ~_passes(weight[live], mid, num_slots, num_ranks, k, free_slots)
        lo[live] = torch.where(fails, mid, lo[live])
        hi[live] = torch.where(fails, hi[live], mid)
    failed = lo * (1 - _SLACK)
    return failed if lower is None else torch.maximum(failed, lower.double())


def _passes(
    weight: torch.Tensor,
    limit: torch.Tensor,
    num_slots: int,
    num_ranks: int,
    k: int,
    free_slots: int,
) -> torch.Tensor:
    """Tests (0), (j) and (y) of `slot_bound` for a max load <= limit [X]: -> [X] bool."""
    ratio = weight / limit[:, None]  # [X, n]
    need = _ceil(ratio).clamp(min=1)  # [X, n]: m_e
    spare = num_slots - need.sum(dim=1)  # [X]
    ok = spare >= 0
    spare = spare.clamp(min=0)
    for j in range(1, k):
        split = _ceil((j + 1) * ratio).clamp(min=1)  # a_e
        over = need < split  # [X, n]: at c_e = m_e its replicas exceed limit / (j + 1)
        value = torch.where(over, need, 0.0)
        cost = torch.where(over, split - need, 1.0)
        fewest = value.sum(dim=1) - _knapsack(value, cost, spare)  # [X]
        ok &= fewest <= j * num_ranks
    if 2 <= k <= _PAIRING_MAX_SLOTS:
        ok &= _pairing(weight, limit, need, spare, k, free_slots)
    return ok


def _pairing(
    weight: torch.Tensor,
    limit: torch.Tensor,
    need: torch.Tensor,
    spare: torch.Tensor,
    k: int,
    free_slots: int,
) -> torch.Tensor:
    """Test (y) of `slot_bound` on a grid of y in (0, T / 2): -> [X] bool.

    With c_e replicas of w_e / c_e, expert e adds c_e to phi(y) = N(<= y) - (k - 1) N(>= T - y)
    if w_e / c_e <= y (a supplier), -(k - 1) c_e if w_e / c_e >= T - y (a demander), else 0.
    From c_e = m_e, every extra slot adds 1 (a supplier's extra replica, or a free slot), or buys
    an option: a demander turning neutral (c_n - m_e slots, c_n the least c with w_e / c < T - y,
    for (k - 1) m_e), or a non-supplier turning supplier (c_s - m_e slots, c_s the least c with
    w_e / c <= y, for c_s plus (k - 1) m_e for a demander). Counted over 1 per slot, an option
    adds its excess. An expert takes at most one option: the concave hull of (0, 0) and its two
    (slots, excess) points, split into two knapsack items, bounds what it can add for any number
    of slots; a fractional knapsack over all items bounds the sum, so the test stays necessary.
    """
    frac = torch.linspace(0, 0.5, _GRID + 2, dtype=weight.dtype)[1:-1, None]  # [Y, 1]: y / T
    r = (weight / limit[:, None])[:, None, :]  # [X, 1, n]: w_e / T
    m = need[:, None, :]  # [X, 1, n]
    supplier = r <= frac * m * (1 + _SLACK)  # [X, Y, n]: w_e / m_e <= y
    demander = r >= (1 - frac) * m * (1 + _SLACK)  # w_e / m_e >= T - y
    base = (supplier * m).sum(dim=-1) - (k - 1) * (demander * m).sum(dim=-1)  # [X, Y]
    cost_n = (torch.floor(r / (1 - frac) * (1 - _SLACK)) + 1 - m).clamp(min=1)
    cost_s = (_ceil(r / frac) - m).clamp(min=1)
    excess_n = torch.where(demander, ((k - 1) * m - cost_n).clamp(min=0), 0.0)
    excess_s = torch.where(supplier, 0.0, m * (1 + (k - 1) * demander))
    value, cost = _hull(cost_n, excess_n, cost_s, excess_s)  # [X, Y, 2n]
    budget = spare[:, None].expand_as(base)  # [X, Y]
    total = base + budget + _knapsack(value, cost, budget) + free_slots
    return (total >= 0).all(dim=1)


def _hull(
    cost_a: torch.Tensor, value_a: torch.Tensor, cost_b: torch.Tensor, value_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Two options per item (cost >= 1, value >= 0) -> two knapsack items [..., 2n] (value,
    cost >= 1) whose fractional use traces the concave hull of (0, 0) and the two options."""
    swap = cost_a > cost_b  # order the options by cost: a the cheaper
    cost_a, cost_b = torch.where(swap, cost_b, cost_a), torch.where(swap, cost_a, cost_b)
    value_a, value_b = torch.where(swap, value_b, value_a), torch.where(swap, value_a, value_b)
    # b alone when a lies under the line from (0, 0) to b; then a's item is empty
    direct = value_a * cost_b < value_b * cost_a
    first_value = torch.where(direct, value_b, value_a)
    first_cost = torch.where(direct, cost_b, cost_a)
    second_value = torch.where(direct, 0.0, (value_b - value_a).clamp(min=0))
    second_cost = torch.where(direct, 1.0, (cost_b - cost_a).clamp(min=1))
    value = torch.cat([first_value, second_value], dim=-1)
    return value, torch.cat([first_cost, second_cost], dim=-1)


def _knapsack(value: torch.Tensor, cost: torch.Tensor, capacity: torch.Tensor) -> torch.Tensor:
    """Fractional knapsack over the last dim: value, cost [..., n] (every cost >= 1),
    capacity [...]. Only the best ceil(capacity) + 1 items can be (partly) taken."""
    most = min(value.shape[-1], int(capacity.max()) + 1 if capacity.numel() else 1)
    order = (value / cost).topk(most, dim=-1).indices
    value, cost = value.gather(-1, order), cost.gather(-1, order)
    before = cost.cumsum(dim=-1) - cost
    taken = ((capacity[..., None] - before) / cost).clamp(0, 1)
    return (value * taken).sum(dim=-1)


def _ceil(x: torch.Tensor) -> torch.Tensor:
    """ceil that rounds a value within float noise above an integer down to it."""
    return torch.ceil(x * (1 - _SLACK))
