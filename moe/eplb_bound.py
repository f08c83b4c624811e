"""Lower bounds on the largest GPU load any placement can reach: how far a placement is from optimal.

Legend: L MoE layers, E logical experts, S physical slots, G expert groups, N nodes, R GPUs,
k = S / R slots per GPU, X independent rows, n items of a row.

A placement gives every expert c_e >= 1 of the S slots (sum c_e = S), each replica carries
w_e / c_e, and every GPU holds exactly k replicas; its load is the sum of theirs. Every bound
here holds for every such placement, so it holds for the optimum; the tests check it against
both algorithms and against brute force on tiny shapes.
"""

import torch

_SLACK = 1e-9  # relative: float rounding may only make a bound smaller, never larger
_STEPS = 60  # bisection steps


def lower_bound(
    weight: torch.Tensor, num_replicas: int, num_groups: int, num_nodes: int, num_gpus: int
) -> torch.Tensor:
    """weight [L, E] -> [L] float64: no placement (of rebalance_experts' policy for these
    arguments) has a max GPU load below it.

    Global: the largest of the mean load W / R and the slot bound (`slot_bound`). Hierarchical
    (num_groups % num_nodes == 0 and num_nodes > 1), also: the node bound (`group_bound`), and for
    every group the slot bound of that group alone, on the R / N GPUs of its node with the node's
    S / N slots less one per expert of the other groups on that node. A hierarchical placement is
    also a global one, so the global bounds hold for it too.
    """
    num_layers, num_log = weight.shape
    assert num_replicas % num_gpus == 0 and num_replicas >= num_log, (num_replicas, num_gpus)
    weight = weight.double().cpu()
    mean = weight.sum(dim=1) / num_gpus  # [L]
    bound = torch.maximum(mean, slot_bound(weight, num_replicas, num_gpus))
    if num_groups % num_nodes == 0 and num_nodes > 1:
        assert num_log % num_groups == 0 and num_gpus % num_nodes == 0
        group_size, groups_per_node = num_log // num_groups, num_groups // num_nodes
        gpus_per_node = num_gpus // num_nodes
        group_load = weight.view(num_layers, num_groups, group_size).sum(dim=-1)  # [L, G]
        bound = torch.maximum(bound, group_bound(group_load, num_nodes) / gpus_per_node)
        slots = num_replicas // num_nodes - (groups_per_node - 1) * group_size
        per_group = slot_bound(
            weight.view(num_layers * num_groups, group_size),
            slots,
            gpus_per_node,
            slots_per_rank=num_replicas // num_gpus,
        )  # [L * G]
        bound = torch.maximum(bound, per_group.view(num_layers, num_groups).max(dim=1).values)
    return bound


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
    weight: torch.Tensor, num_slots: int, num_ranks: int, slots_per_rank: int | None = None
) -> torch.Tensor:
    """weight [X, n] -> [X]: a lower bound on the max rank load over all ways to give n experts
    c_e >= 1 of num_slots slots and pack the replicas slots_per_rank (k) to a rank
    (default num_slots / num_ranks; a rank may take fewer when the slots are a node's share).

    Proof: call T feasible when a placement with max load <= T exists. Then
    (0) every replica is <= T, so c_e >= m_e = max(1, ceil(w_e / T)) and sum m_e <= S;
    (j) for 1 <= j < k, at most jR replicas exceed T / (j + 1) (else some rank holds j + 1 of them
        and exceeds T). An expert with c_e < a_e = ceil((j + 1) w_e / T) has all its c_e replicas
        above T / (j + 1), so the fewest such replicas, given sum c_e <= S, is at least
        sum m_e [m_e < a_e] minus the most a fractional knapsack (value m_e, cost a_e - m_e,
        capacity S - sum m_e) saves: a relaxation, hence a lower value, still a valid test.
    A T that fails a test is not feasible, and then neither is any smaller T: so T < optimum.
    Bisection keeps the largest failing T it met (the tests get easier as T grows, so it lands
    near the least passing T). Test (0) alone gives the least max replica load (what
    replicate_experts reaches).
    """
    weight = weight.double().cpu().clamp(min=0)
    num_rows = weight.shape[0]
    k = num_slots // num_ranks if slots_per_rank is None else slots_per_rank
    lo = torch.zeros(num_rows, dtype=torch.float64)  # every T <= lo fails (or lo = 0)
    hi = weight.sum(dim=1).clamp(min=1e-300)  # feasible: one rank can take everything
    for _ in range(_STEPS):
        mid = (lo + hi) / 2
        fails = ~_passes(weight, mid, num_slots, num_ranks, k)
        lo, hi = torch.where(fails, mid, lo), torch.where(fails, hi, mid)
    return lo * (1 - _SLACK)


def _passes(weight: torch.Tensor, limit: torch.Tensor, num_slots: int, num_ranks: int,
            k: int) -> torch.Tensor:
    """Necessary conditions for a max load <= limit [X]: weight [X, n] -> [X] bool."""
    ratio = weight / limit[:, None]  # [X, n]
    need = _ceil(ratio).clamp(min=1)  # [X, n]: m_e
    spare = num_slots - need.sum(dim=1)  # [X]
    ok = spare >= 0
    for j in range(1, k):
        split = _ceil((j + 1) * ratio).clamp(min=1)  # a_e
        over = need < split  # [X, n]: at c_e = m_e its replicas exceed limit / (j + 1)
        value = torch.where(over, need, 0.0)
        cost = torch.where(over, split - need, 1.0)
        order = (value / cost).argsort(dim=1, descending=True)
        value, cost = value.gather(1, order), cost.gather(1, order)
        before = cost.cumsum(dim=1) - cost  # [X, n]
        taken = ((spare.clamp(min=0)[:, None] - before) / cost).clamp(0, 1)
        fewest = value.sum(dim=1) - (value * taken).sum(dim=1)  # [X]
        ok &= fewest <= j * num_ranks
    return ok


def _ceil(x: torch.Tensor) -> torch.Tensor:
    """ceil that rounds a value within float noise above an integer down to it."""
    return torch.ceil(x * (1 - _SLACK))
