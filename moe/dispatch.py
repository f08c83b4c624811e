"""Dispatch and combine: how an MoE layer's token rows reach its routed experts and come back.

Legend (kernels/__init__.py): T tokens, D hidden, K experts per token, E logical experts,
R ranks, S physical slots of the pool, S_r slots on one rank, N rows this rank's experts get.

Every MoE layer has one dispatcher (MoE.dispatcher), of one of two kinds with one interface:
- LocalDispatcher: every routed expert is on this rank (EP = 1). dispatch sorts the (token, k)
  rows by local slot; nothing travels.
- AllToAllDispatcher: the experts are sharded over the pool's ranks (EP > 1). Each (token, k)
  picks one physical slot (Placement.select_slots); the rows, sorted by (destination rank, slot),
  go out by all_to_all_single with uneven splits, and the receiver regroups them by local slot.
  Works on any backend with uneven all_to_all_single (gloo for CPU tensors, NCCL for CUDA).
  Every rank must call every collective, in the same order, even with T == 0.

dispatch returns a DispatchHandle whose recv_x / recv_counts feed Experts; combine takes the
expert outputs in the same order and returns a CombineHandle whose output() weights each token's
K rows by topk_weights and sums them, by the same arithmetic for both kinds (so EP = 1 and EP > 1
agree bit for bit on a token's sum). The handles and CommStats live in moe/dispatch_handles.py
(imported from here too).
"""

import time

import torch
import torch.distributed as dist

from kernels.backend import use_cpu_kernel, use_triton
from kernels.cpu.build import cpu_kernels
from moe.dispatch_handles import CombineHandle, CommStats, DispatchHandle, SlotLoad
from moe.placement import Placement


class LocalDispatcher:
    """Every routed expert on this rank: local slot s holds logical expert expert_ids[s] (an
    expert held twice uses its first slot)."""

    def __init__(self, expert_ids: list[int], num_experts: int) -> None:
        self.expert_ids = list(expert_ids)
        self.stats = CommStats()
        self.load = SlotLoad()  # [S_r] int64 tokens routed to each slot
        # NOTE: explicit cpu: factory calls under a meta-device context import torch._dynamo.
        log2slot = torch.full((num_experts,), -1, dtype=torch.long, device="cpu")  # [E]
        for slot in reversed(range(len(self.expert_ids))):
            log2slot[self.expert_ids[slot]] = slot
        self.log2slot = log2slot  # [E] the local slot of each logical expert, -1: not held
        # NOTE: holding every expert, no token can miss one: dispatch then reads nothing back
        # on the host (a device sync per layer on GPUs, and none may happen in a CUDA graph).
        self._holds_all = bool((log2slot >= 0).all())

    @property
    def slot_experts(self) -> list[int]:
        """The logical expert in each slot whose load `load` counts."""
        return self.expert_ids

    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        async_op: bool = False,
        count_load: bool = True,
    ) -> DispatchHandle:
        """x [T, D], topk_idx [T, K] int64 logical experts, topk_weights [T, K] fp32 -> a ready
        handle: recv_x [T * K, D] sorted by local slot, recv_counts [S_r]. count_load False:
        the caller counts the load (decode graphs, without their padding rows)."""
        _check_routing(x, topk_idx, topk_weights)
        if self.log2slot.device != topk_idx.device:
            self.log2slot = self.log2slot.to(topk_idx.device)
        top_k = topk_idx.shape[1]
        if use_cpu_kernel(x) and x.is_contiguous():
            send_order, rows, counts_t = cpu_kernels().local_dispatch(
                x, topk_idx.contiguous(), self.log2slot, len(self.expert_ids)
            )  # the same sort, gather and counts in one op
            if send_order.numel() == topk_idx.numel():
                return self._handle(topk_weights, send_order, rows, counts_t, count_load)
        slots = self.log2slot[topk_idx.reshape(-1)]  # [T * K]
        if not self._holds_all and not bool((slots >= 0).all()):
            missing = sorted(set(topk_idx.reshape(-1)[slots < 0].tolist()))
            raise RuntimeError(
                f"tokens were routed to experts {missing} that this rank does not hold: a model "
                "loaded with a subset of the experts needs "
                "DeepseekForCausalLM.install_expert_parallel"
            )
        send_order = torch.argsort(slots, stable=True)  # [T * K]
        rows = x[send_order // top_k]  # [T * K, D]
        counts_t = slot_counts(slots, len(self.expert_ids))  # [S_r]
        return self._handle(topk_weights, send_order, rows, counts_t, count_load)

    def _handle(
        self,
        topk_weights: torch.Tensor,
        send_order: torch.Tensor,
        rows: torch.Tensor,
        counts_t: torch.Tensor,
        count_load: bool,
    ) -> DispatchHandle:
        if count_load:
            self.load.add(counts_t)
            self.stats.rows += rows.shape[0]
        # NOTE: for the Triton grouped GEMM the counts stay a tensor: it reads them on the
        # device (no sync, and a CUDA graph can hold the step)
        counts = counts_t if use_triton(rows) else counts_t.tolist()
        return DispatchHandle(topk_weights, send_order, rows, recv_x=rows, recv_counts=counts)

    def combine(
        self, y: torch.Tensor, handle: DispatchHandle, async_op: bool = False
    ) -> CombineHandle:
        """y [T * K, D]: one row per row of handle.recv_x -> a handle whose output() is [T, D]."""
        assert y.shape == handle.recv_x.shape, (y.shape, handle.recv_x.shape)
        return CombineHandle(handle, y)


class AllToAllDispatcher:
    """Dispatch and combine for one MoE layer on one rank of the pool `group`."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        placement: Placement,
        layer_pos: int,
        rank: int,
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
        self.stats = CommStats()
        # [S] int64 tokens this rank routed to each physical slot of the pool (on the device:
        # no sync per step); the pool's load is the sum over its ranks
        self.load = SlotLoad()

    @property
    def slot_experts(self) -> list[int]:
        return self.placement.phy2log[self.layer_pos].tolist()

    def set_placement(self, placement: Placement) -> None:
        """Dispatch by `placement` from the next batch (a live re-placement, engine/balancer.py,
        between steps); the load counts start over with the new slots."""
        assert placement.num_slots == self.placement.num_slots, (placement, self.placement)
        self.placement = self._device_placement = placement
        self.load.take()

    def dispatch(
        self,
        x: torch.Tensor,
        topk_idx: torch.Tensor,
        topk_weights: torch.Tensor,
        async_op: bool = False,
        count_load: bool = True,
    ) -> DispatchHandle:
        """Send each token's row to the K slots it is routed to (count_load: as
        LocalDispatcher.dispatch).

        x [T, D]; topk_idx [T, K] int64 logical experts; topk_weights [T, K] fp32.
        With async_op the count exchange is in flight on return: call handle.launch_rows() to
        send the rows (async), and handle.wait() before reading recv_x [N, D].
        """
        _check_routing(x, topk_idx, topk_weights)
        placement = self._placement_on(x.device)
        top_k = topk_idx.shape[1]
        x = x.contiguous()

        phy = placement.select_slots(self.layer_pos, topk_idx, offset=self.rank)  # [T, K]
        phy = phy.reshape(-1)  # [T * K]
        # Slot ids are rank-major, so sorting by slot sorts by (destination rank, slot).
        send_order = torch.argsort(phy, stable=True)  # [T * K]
        send_counts = torch.bincount(phy, minlength=placement.num_slots)  # [S] = [R * S_r]
        if count_load:
            self.load.add(send_counts)
        started = time.perf_counter()
        recv_counts = torch.empty_like(send_counts)  # [R * S_r]: from (source rank, my slot)
        counts_work = dist.all_to_all_single(
            recv_counts, send_counts, group=self.counts_group, async_op=async_op
        )
        handle = DispatchHandle(
            topk_weights,
            send_order,
            x[send_order // top_k],  # [T * K, D]
            group=self.group,
            num_ranks=placement.num_ranks,
            send_counts=send_counts,
            recv_counts_buf=recv_counts,
            counts_work=counts_work if async_op else None,
            stats=self.stats,
            started=started,
        )
        self.stats.dispatch_bytes += handle.bytes_sent
        return handle if async_op else handle.wait()

    def _placement_on(self, device: torch.device) -> Placement:
        if self._device_placement.phy2log.device != device:
            self._device_placement = self.placement.to(device)
        return self._device_placement

    def combine(
        self, y: torch.Tensor, handle: DispatchHandle, async_op: bool = False
    ) -> CombineHandle:
        """Send expert outputs back to the tokens' ranks.

        y [N, D]: one row per row of handle.recv_x, in the same (slot-grouped) order.
        Returns a handle whose output() is [T, D] (waits first when async_op).
        """
        assert handle.recv_x is not None, "wait() on the dispatch handle before combine"
        assert y.shape == handle.recv_x.shape, (y.shape, handle.recv_x.shape)
        started = time.perf_counter()
        arrival = torch.empty_like(y)  # [N, D] back in arrival order
        arrival[handle.recv_perm] = y
        self.stats.combine_bytes += arrival.numel() * arrival.element_size()
        rows = y.new_empty(len(handle.send_order), y.shape[1])  # [T * K, D]
        work = dist.all_to_all_single(
            rows,
            arrival,
            handle.send_splits,
            handle.recv_splits,
            group=self.group,
            async_op=async_op,
        )
        return CombineHandle(handle, rows, work if async_op else None, started)


Dispatcher = LocalDispatcher | AllToAllDispatcher


def slot_counts(slots: torch.Tensor, num_slots: int) -> torch.Tensor:
    """slots [N] int64 in [0, num_slots) -> [num_slots] int64 rows per slot.
    NOTE: not torch.bincount, which reads the largest value back on a GPU (a sync)."""
    counts = torch.zeros(num_slots, dtype=torch.long, device=slots.device)
    return counts.index_add_(0, slots, torch.ones_like(slots))


def _check_routing(x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor) -> None:
    assert x.dim() == 2 and topk_idx.dim() == 2, (x.shape, topk_idx.shape)
    assert topk_idx.dtype == torch.int64, topk_idx.dtype
    assert topk_weights.shape == topk_idx.shape, (topk_weights.shape, topk_idx.shape)
    assert topk_idx.shape[0] == x.shape[0], (topk_idx.shape, x.shape)
