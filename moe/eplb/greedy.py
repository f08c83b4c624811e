"""DeepSeek's EPLB greedy, its pieces: packing items into equal-size packs, and replicating the
hottest experts.

Legend: X independent rows, n items (experts) of a row.
"""

import torch


def balanced_packing(weight: torch.Tensor, num_packs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split the items of each row into `num_packs` packs of equal size, balancing their sums.

    Greedy: the heaviest remaining item goes to the lightest pack that still has room.
    weight [X, n] float -> (pack [X, n] int64, pos [X, n] int64: the item's place in its pack).
    """
    num_rows, num_items = weight.shape
    assert num_items % num_packs == 0, (num_items, num_packs)
    per_pack = num_items // num_packs
    if per_pack == 1:
        pack = torch.arange(num_items, dtype=torch.int64).expand(num_rows, -1).clone()
        return pack, torch.zeros_like(pack)
    order = weight.float().cpu().argsort(dim=1, descending=True, stable=True)  # [X, n]
    pack = torch.full((num_rows, num_items), -1, dtype=torch.int64)
    pos = torch.full_like(pack, -1)
    for row, (items, values) in enumerate(zip(order.tolist(), weight.tolist(), strict=True)):
        loads = [0.0] * num_packs
        sizes = [0] * num_packs
        for item in items:
            best = min((p for p in range(num_packs) if sizes[p] < per_pack), key=loads.__getitem__)
            pack[row, item], pos[row, item] = best, sizes[best]
            loads[best] += values[item]
            sizes[best] += 1
    return pack, pos


def replicate_experts(weight: torch.Tensor, num_phy: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Give num_phy - E extra replicas, one at a time, to the expert with the largest load per
    replica (this minimizes the largest per-replica load).

    weight [X, E] float -> (phy2log [X, num_phy]: slot j < E holds expert j, then the extras;
    logcnt [X, E]).
    """
    num_rows, num_log = weight.shape
    assert num_phy >= num_log, (num_phy, num_log)
    rows = torch.arange(num_rows)
    phy2log = torch.arange(num_phy, dtype=torch.int64).repeat(num_rows, 1)  # [X, num_phy]
    logcnt = torch.ones(num_rows, num_log, dtype=torch.int64)
    for slot in range(num_log, num_phy):
        hottest = (weight / logcnt).argmax(dim=1)  # [X]
        phy2log[:, slot] = hottest
        logcnt[rows, hottest] += 1
    return phy2log, logcnt


def inverse_permutation(perm: torch.Tensor) -> torch.Tensor:
    """Row-wise inverse of permutations perm [X, n]."""
    inv = torch.empty_like(perm)
    inv.scatter_(1, perm, torch.arange(perm.shape[1]).expand_as(perm).contiguous())
    return inv
