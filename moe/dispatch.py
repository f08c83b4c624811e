"""Expert-parallel dispatch and combine over torch.distributed all_to_all_single.

Legend: T local tokens, H hidden, K experts per token, R ranks, S physical slots in the pool,
S_r = S / R slots per rank, N rows this rank receives (its share of all ranks' T * K).

dispatch: each (token, k) picks one physical slot (Placement.select_slots); the rows are sorted by
(destination rank, destination slot) and exchanged with uneven splits. The receiver regroups them
by local slot for Experts.forward_sorted. combine sends the expert outputs back by the reverse
all-to-all and sums each token's K rows weighted by topk_weights.

Works on any process group backend that has all_to_all_single with uneven splits: gloo for CPU
tensors, NCCL for CUDA tensors. Every rank must call every collective, in the same order, even
with T == 0.
"""

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from moe.layers import Experts, MoE, SharedFn
from moe.placement import Placement


@dataclass
class DispatchHandle:
    """What combine needs to send the rows back.

    Two phases, so that a caller can overlap both with other work: the count exchange is in
    flight after dispatch(); launch_rows() waits for it and sends the rows; wait() makes
    recv_x / recv_counts ready (launching the rows first if needed).
    """

    topk_weights: torch.Tensor  # [T, K] fp32
    send_order: torch.Tensor  # [T * K]: the (token * K + k) index of each sent row
    send_counts: torch.Tensor  # [R * S_r] rows to each (destination rank, slot)
    recv_counts_buf: torch.Tensor  # [R * S_r] rows from each (source rank, my slot)
    send_x: torch.Tensor  # [T * K, H] rows in send order
    group: dist.ProcessGroup | None
    num_ranks: int
    counts_work: dist.Work | None = None
    send_splits: list[int] = field(default_factory=list)  # [R] rows sent to each rank
    recv_splits: list[int] = field(default_factory=list)  # [R] rows received from each rank
    recv_perm: torch.Tensor | None = None  # [N]: recv_x[i] = arrival row recv_perm[i]
    recv_counts: list[int] = field(default_factory=list)  # [S_r] rows per local slot
    bytes_sent: int = 0  # rows * H * element size, rows to this rank itself included
    recv_buf: torch.Tensor | None = None  # [N, H] rows in arrival order: by source, then slot
    work: dist.Work | None = None
    recv_x: torch.Tensor | None = field(default=None, repr=False)  # [N, H] grouped by local slot

    def launch_rows(self, async_op: bool = True) -> "DispatchHandle":
        if self.recv_buf is not None:
            return self
        if self.counts_work is not None:
            self.counts_work.wait()
        num_ranks = self.num_ranks
        recv_matrix = self.recv_counts_buf.view(num_ranks, -1)  # [R, S_r]
        self.send_splits = self.send_counts.view(num_ranks, -1).sum(dim=1).tolist()
        self.recv_splits = recv_matrix.sum(dim=1).tolist()
        self.recv_perm = _slot_major_perm(recv_matrix)
        self.recv_counts = recv_matrix.sum(dim=0).tolist()
        self.bytes_sent = self.send_x.numel() * self.send_x.element_size()
        self.recv_buf = self.send_x.new_empty(sum(self.recv_splits), self.send_x.shape[1])
        work = dist.all_to_all_single(
            self.recv_buf,
            self.send_x,
            self.recv_splits,
            self.send_splits,
            group=self.group,
            async_op=async_op,
        )
        self.work = work if async_op else None
        return self

    def wait(self) -> "DispatchHandle":
        if self.recv_x is None:
            self.launch_rows(async_op=False)
            if self.work is not None:
                self.work.wait()
            self.recv_x = self.recv_buf[self.recv_perm]  # [N, H]
        return self


@dataclass
class CombineHandle:
    dispatch: DispatchHandle
    rows: torch.Tensor  # [T * K, H] expert outputs, in dispatch's send order
    work: dist.Work | None = None

    def wait(self) -> "CombineHandle":
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self

    def output(self) -> torch.Tensor:
        """[T, H] in the rows' dtype: sum over k of topk_weights[t, k] * expert row (t, k)."""
        self.wait()
        handle = self.dispatch
        num_tokens, top_k = handle.topk_weights.shape
        hidden = self.rows.shape[1]
        # NOTE: a gather and a sum over K, not index_add_: the same order of additions on every
        # device (index_add_ on CUDA uses atomics).
        by_token = torch.empty(
            num_tokens * top_k, hidden, dtype=torch.float32, device=self.rows.device
        )
        by_token[handle.send_order] = self.rows.float()
        by_token = by_token.view(num_tokens, top_k, hidden)  # [T, K, H]
        weighted = by_token * handle.topk_weights.float()[:, :, None]  # [T, K, H]
        return weighted.sum(dim=1).to(self.rows.dtype)  # [T, H]


class AllToAllDispatcher:
    """Dispatch and combine for one MoE layer on one rank of the pool `group`."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        placement: Placement,
        layer_pos: int,
        rank: int,
        async_op: bool = True,
        counts_group: dist.ProcessGroup | None = None,
    ) -> None:
        assert 0 <= layer_pos < placement.num_layers, (layer_pos, placement.num_layers)
        assert 0 <= rank < placement.num_ranks, (rank, placement.num_ranks)
        if dist.is_initialized():
            assert dist.get_world_size(group) == placement.num_ranks, (
                dist.get_world_size(group),
                placement.num_ranks,
            )
            assert dist.get_rank(group) == rank, (dist.get_rank(group), rank)
        self.group = group
        # NOTE: the small count exchange gets its own group, so that it does not queue behind
        # another micro-batch's rows in flight on `group` (two-batch overlap).
        self.counts_group = counts_group if counts_group is not None else group
        self.placement = placement
        self._device_placement = placement  # a copy on the device of the last batch
        self.layer_pos = layer_pos
        self.rank = rank
        self.async_op = async_op  # routed_fn: overlap the shared expert with the dispatch
        # Rows this rank sent to each physical slot since the last reset: the load statistics
        # that eplb.rebalance_experts consumes (summed over the pool).
        self.tokens_per_slot = torch.zeros(placement.num_slots, dtype=torch.int64)

    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        async_op: bool = False,
    ) -> DispatchHandle:
        """Send each token's row to the K slots it is routed to.

        x [T, H]; topk_idx [T, K] int64 logical experts; topk_weights [T, K] fp32.
        With async_op the count exchange is in flight on return: call handle.launch_rows() to
        send the rows (async), and handle.wait() before reading recv_x.
        """
        assert x.dim() == 2 and topk_idx.dim() == 2, (x.shape, topk_idx.shape)
        assert topk_idx.dtype == torch.int64, topk_idx.dtype
        assert topk_weights.shape == topk_idx.shape, (topk_weights.shape, topk_idx.shape)
        assert topk_idx.shape[0] == x.shape[0], (topk_idx.shape, x.shape)
        placement = self._placement_on(x.device)
        num_ranks = placement.num_ranks
        top_k = topk_idx.shape[1]
        x = x.contiguous()

        phy = placement.select_slots(self.layer_pos, topk_idx, offset=self.rank)  # [T, K]
        phy = phy.reshape(-1)  # [T * K]
        # Slot ids are rank-major, so sorting by slot sorts by (destination rank, slot).
        send_order = torch.argsort(phy, stable=True)  # [T * K]
        send_counts = torch.bincount(phy, minlength=placement.num_slots)  # [S] = [R * S_r]
        if self.tokens_per_slot.device != phy.device:
            self.tokens_per_slot = self.tokens_per_slot.to(phy.device)
        self.tokens_per_slot += send_counts
        recv_counts = torch.empty_like(send_counts)  # [R * S_r]: from (source rank, my slot)
        counts_work = dist.all_to_all_single(
            recv_counts, send_counts, group=self.counts_group, async_op=async_op
        )
        handle = DispatchHandle(
            topk_weights=topk_weights,
            send_order=send_order,
            send_counts=send_counts,
            recv_counts_buf=recv_counts,
            send_x=x[send_order // top_k],  # [T * K, H]
            group=self.group,
            num_ranks=num_ranks,
            counts_work=counts_work if async_op else None,
        )
        return handle if async_op else handle.wait()

    def _placement_on(self, device: torch.device) -> Placement:
        if self._device_placement.phy2log.device != device:
            self._device_placement = self.placement.to(device)
        return self._device_placement

    def combine(
        self, y: torch.Tensor, handle: DispatchHandle, async_op: bool = False
    ) -> CombineHandle:
        """Send expert outputs back to the tokens' ranks.

        y [N, H]: one row per row of handle.recv_x, in the same (slot-grouped) order.
        Returns a handle whose output() is [T, H] (waits first when async_op).
        """
        assert handle.recv_x is not None, "wait() on the dispatch handle before combine"
        assert y.shape == handle.recv_x.shape, (y.shape, handle.recv_x.shape)
        arrival = torch.empty_like(y)  # [N, H] back in arrival order
        arrival[handle.recv_perm] = y
        rows = y.new_empty(len(handle.send_order), y.shape[1])  # [T * K, H]
        work = dist.all_to_all_single(
            rows,
            arrival,
            handle.send_splits,
            handle.recv_splits,
            group=self.group,
            async_op=async_op,
        )
        return CombineHandle(handle, rows, work if async_op else None)

    def routed_fn(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        experts: Experts,
        shared: SharedFn | None,
    ) -> torch.Tensor:
        """MoE.routed_fn: x [T, H] -> routed + shared [T, H]. The shared expert runs while the
        rows are in flight."""
        handle = self.dispatch(x, topk_idx, topk_weights, async_op=self.async_op)
        if self.async_op:
            handle.launch_rows(async_op=True)
        shared_out = shared(x) if shared is not None else None  # [T, H]
        handle.wait()
        assert len(handle.recv_counts) == len(experts.expert_ids), (
            len(handle.recv_counts),
            len(experts.expert_ids),
        )
        y = experts.forward_sorted(handle.recv_x, handle.recv_counts)  # [N, H]
        routed = self.combine(y, handle).output()  # [T, H]
        return routed if shared_out is None else routed + shared_out


def _slot_major_perm(recv_matrix: torch.Tensor) -> torch.Tensor:
    """recv_matrix [R, S_r] rows from each (source, slot), arriving source-major ->
    perm [N] such that arrival[perm] is slot-major (slot 0 from every source, then slot 1...)."""
    num_ranks, slots_per_rank = recv_matrix.shape
    device = recv_matrix.device
    source = torch.arange(num_ranks, device=device)[:, None]
    slot = torch.arange(slots_per_rank, device=device)[None, :]
    key = (slot * num_ranks + source).reshape(-1)  # [R * S_r] in arrival order
    row_key = torch.repeat_interleave(key, recv_matrix.reshape(-1))  # [N]
    return torch.argsort(row_key, stable=True)


def install_expert_parallel(
    model: nn.Module,
    group: dist.ProcessGroup | None,
    placement: Placement,
    rank: int,
    async_op: bool = True,
) -> dict[int, AllToAllDispatcher]:
    """Route every MoE layer of `model` (loaded with experts=placement.rank_experts(rank))
    through a dispatcher: sets `moe.routed_fn` and `moe.dispatcher`. Returns model layer ->
    dispatcher."""
    moe_layers = {
        i: layer.mlp for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, MoE)
    }
    if tuple(moe_layers) != placement.layers:
        raise ValueError(
            f"placement layers {placement.layers} != the model's MoE layers {tuple(moe_layers)}"
        )
    expected = placement.rank_experts(rank)
    counts_group = None
    if dist.is_initialized():  # every rank of the pool gets here once, in the same order
        counts_group = dist.new_group(dist.get_process_group_ranks(group or dist.group.WORLD))
    dispatchers = {}
    for pos, (layer, moe) in enumerate(moe_layers.items()):
        if moe.experts.expert_ids != expected[layer]:
            raise ValueError(
                f"layer {layer}: rank {rank} holds experts {moe.experts.expert_ids}, "
                f"the placement puts {expected[layer]} there"
            )
        dispatcher = AllToAllDispatcher(group, placement, pos, rank, async_op, counts_group)
        moe.routed_fn = dispatcher.routed_fn
        moe.dispatcher = dispatcher  # for callers that drive dispatch/combine themselves
        dispatchers[layer] = dispatcher
    return dispatchers
