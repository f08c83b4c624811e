"""Placement: where the routed experts of one pool live.

Legend (kernels/__init__.py): L MoE layers, E logical experts, S physical slots (S % R == 0),
R ranks, X max replicas, T tokens, K experts per token.

Each MoE layer has S physical slots; slot s lives on rank s // (S // R) as that rank's local slot
s % (S // R). A logical expert may fill several slots (replicas of a hot expert).
"""

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class Placement:
    """The expert placement of one pool of `num_ranks` ranks.

    layers: the model layer index of each MoE layer (L of them).
    phy2log [L, S] int64: the logical expert in each physical slot.
    Derived: log2phy [L, E, X] int64 (the slots of each expert in slot order, -1 padded) and
    logcnt [L, E] int64 (replicas per expert).
    """

    layers: tuple[int, ...]
    phy2log: torch.Tensor
    num_ranks: int
    num_experts: int
    log2phy: torch.Tensor = field(init=False, repr=False)
    logcnt: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        phy2log = self.phy2log
        if phy2log.dim() != 2 or phy2log.dtype != torch.int64:
            raise ValueError(
                f"phy2log must be a 2-D int64 tensor, got {phy2log.dtype} {tuple(phy2log.shape)}"
            )
        num_layers, num_slots = phy2log.shape
        if len(self.layers) != num_layers:
            raise ValueError(f"{len(self.layers)} layers but phy2log has {num_layers} rows")
        if self.num_ranks < 1 or num_slots % self.num_ranks != 0:
            raise ValueError(f"{num_slots} slots do not divide over {self.num_ranks} ranks")
        if num_slots and (phy2log.min() < 0 or phy2log.max() >= self.num_experts):
            raise ValueError(f"phy2log has expert ids outside [0, {self.num_experts})")
        log2phy, logcnt = build_log2phy(phy2log, self.num_experts)
        if bool((logcnt == 0).any()):
            layer, expert = (logcnt == 0).nonzero()[0].tolist()
            raise ValueError(f"logical expert {expert} of layer {self.layers[layer]} has no slot")
        object.__setattr__(self, "log2phy", log2phy)
        object.__setattr__(self, "logcnt", logcnt)

    @staticmethod
    def contiguous(
        layers: tuple[int, ...] | list[int],
        num_experts: int,
        num_ranks: int,
        num_slots: int | None = None,
    ) -> "Placement":
        """Slot s holds expert s % E: contiguous blocks of experts per rank, and when
        num_slots > E the extra slots repeat the experts from 0 on (replicas)."""
        num_slots = num_experts if num_slots is None else num_slots
        if num_slots < num_experts:
            raise ValueError(f"{num_slots} slots cannot hold {num_experts} experts")
        phy2log = (torch.arange(num_slots) % num_experts).repeat(len(layers), 1)  # [L, S]
        return Placement(tuple(layers), phy2log, num_ranks, num_experts)

    @staticmethod
    def from_phy2log(
        layers: tuple[int, ...] | list[int],
        phy2log: torch.Tensor,
        num_ranks: int,
        num_experts: int | None = None,
    ) -> "Placement":
        """From phy2log [L, S] (for example eplb.rebalance_experts' output); num_experts defaults
        to the largest id + 1."""
        phy2log = torch.as_tensor(phy2log, dtype=torch.int64).cpu()
        if num_experts is None:
            num_experts = int(phy2log.max()) + 1
        return Placement(tuple(layers), phy2log, num_ranks, num_experts)

    def to_dict(self) -> dict:
        return {
            "layers": list(self.layers),
            "num_ranks": self.num_ranks,
            "num_experts": self.num_experts,
            "phy2log": self.phy2log.tolist(),
        }

    @staticmethod
    def from_dict(data: dict) -> "Placement":
        """From to_dict's form (a placement file); ValueError says what is wrong."""
        try:
            phy2log = torch.tensor(data["phy2log"], dtype=torch.int64)
            return Placement(
                tuple(data["layers"]), phy2log, int(data["num_ranks"]), int(data["num_experts"])
            )
        except (KeyError, TypeError) as e:
            raise ValueError(
                f"not a placement (layers, num_ranks, num_experts, phy2log): {e}"
            ) from None

    def to(self, device: torch.device | str) -> "Placement":
        """The same placement with its tensors on `device`."""
        return Placement(self.layers, self.phy2log.to(device), self.num_ranks, self.num_experts)

    @property
    def num_layers(self) -> int:
        return self.phy2log.shape[0]

    @property
    def num_slots(self) -> int:
        return self.phy2log.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_slots // self.num_ranks

    def rank_of_slot(self, slot: int) -> int:
        return slot // self.slots_per_rank

    def rank_slots(self, rank: int) -> range:
        """The physical slots on `rank`, in local slot order."""
        assert 0 <= rank < self.num_ranks, (rank, self.num_ranks)
        return range(rank * self.slots_per_rank, (rank + 1) * self.slots_per_rank)

    def rank_experts(self, rank: int) -> dict[int, list[int]]:
        """Model layer -> the logical experts in `rank`'s slots, in local slot order (the
        `experts` argument of load_model)."""
        slots = self.rank_slots(rank)
        local = self.phy2log[:, slots.start : slots.stop].tolist()  # [L, S/R]
        return dict(zip(self.layers, local, strict=True))

    def select_slots(self, layer_pos: int, topk_idx: torch.Tensor, offset: int = 0) -> torch.Tensor:
        """Choose one replica per (token, k): topk_idx [T, K] logical int64 -> [T, K] physical.

        Replica (t + k + offset) % logcnt: consecutive tokens of an expert take turns over its
        replicas whatever position k the expert has; `offset` (the sender's rank) keeps ranks
        with tiny batches from all picking replica 0.
        """
        assert topk_idx.dim() == 2 and topk_idx.dtype == torch.int64, (
            topk_idx.shape,
            topk_idx.dtype,
        )
        assert 0 <= layer_pos < self.num_layers, (layer_pos, self.num_layers)
        num_tokens, top_k = topk_idx.shape
        log2phy = self.log2phy[layer_pos].to(topk_idx.device)  # [E, X]
        logcnt = self.logcnt[layer_pos].to(topk_idx.device)  # [E]
        turn = (
            torch.arange(num_tokens, device=topk_idx.device)[:, None]
            + torch.arange(top_k, device=topk_idx.device)[None, :]
            + offset
        )  # [T, K]
        replica = turn % logcnt[topk_idx]  # [T, K]
        return log2phy[topk_idx, replica]  # [T, K]


def build_log2phy(phy2log: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """phy2log [L, S] -> (log2phy [L, E, X]: each expert's slots ascending, -1 padded;
    logcnt [L, E])."""
    num_layers, num_slots = phy2log.shape
    device = phy2log.device
    logcnt = torch.zeros(num_layers, num_experts, dtype=torch.int64, device=device)
    logcnt.scatter_add_(1, phy2log, torch.ones_like(phy2log))  # [L, E]
    max_replicas = int(logcnt.max()) if logcnt.numel() else 0
    # The replica index of a slot: how many earlier slots of the layer hold the same expert.
    sorted_log, slot = torch.sort(phy2log, dim=1, stable=True)  # [L, S]
    first = torch.cumsum(logcnt, dim=1) - logcnt  # [L, E]: where each expert's run starts
    replica = torch.arange(num_slots, device=device) - first.gather(1, sorted_log)  # [L, S]
    log2phy = torch.full(
        (num_layers, num_experts, max_replicas), -1, dtype=torch.int64, device=device
    )
    layer = torch.arange(num_layers, device=device)[:, None].expand_as(slot)
    log2phy[layer, sorted_log, replica] = slot
    return log2phy, logcnt
