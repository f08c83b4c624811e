"""What a dispatch and a combine return (moe/dispatch.py makes them): the handles that a caller
waits on, possibly overlapping other work meanwhile, and the running totals they add to.

Legend (kernels/__init__.py): T tokens, D hidden, K experts per token, R ranks, S_r slots on one
rank, N rows this rank's experts get.
"""

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from kernels.backend import use_cpu_kernel
from kernels.cpu.build import cpu_kernels


@dataclass(slots=True)
class CommStats:
    """Running totals of one rank's dispatches and combines, over every MoE layer of a model
    (host clocks only: no device sync). The engine reads them between steps."""

    dispatch_s: float = 0.0  # from starting a dispatch to its rows being ready, summed
    combine_s: float = 0.0  # likewise for combines (overlapped work included)
    dispatch_wait_s: float = 0.0  # time blocked waiting for them (communication left exposed)
    combine_wait_s: float = 0.0
    dispatch_bytes: int = 0  # rows this rank sent (to itself included)
    combine_bytes: int = 0
    rows: int = 0  # token-expert rows this rank's experts computed


class SlotLoad:
    """Tokens routed to each slot of one MoE layer since the last take() (a dispatcher owns one;
    the dispatchers, the fused CPU layers and the decode graphs add to it, the balancer takes it,
    the engine's reports peek at it). Kept on the counts' device: no host sync per step."""

    def __init__(self) -> None:
        self._counts: torch.Tensor | None = None  # [S_r] or [S] int64

    def add(self, counts: torch.Tensor) -> None:
        """counts [S_r] (or [S]) int64 added to the running counts."""
        self._counts = counts if self._counts is None else self._counts + counts

    def take(self) -> torch.Tensor | None:
        """The counts since the last take (None: nothing counted), starting over."""
        counts, self._counts = self._counts, None
        return counts

    def peek(self) -> torch.Tensor | None:
        """The counts since the last take, left in place."""
        return self._counts


@dataclass
class DispatchHandle:
    """A dispatch in progress, and what combine needs to send the rows back.

    All-to-all dispatches run in two phases that a caller can overlap with other work: the count
    exchange is in flight after dispatch(); launch_rows() waits for it and sends the rows;
    wait() makes recv_x / recv_counts ready (launching the rows first if needed). A local
    dispatch is ready at once.
    """

    topk_weights: torch.Tensor  # [T, K] fp32
    send_order: torch.Tensor  # [T * K]: the (token * K + k) index of each sent row
    send_x: torch.Tensor  # [T * K, D] rows in send order
    recv_x: torch.Tensor | None = field(default=None, repr=False)  # [N, D] grouped by slot
    # [S_r] rows per local slot (a LocalDispatcher on a GPU: a device tensor, never read back)
    recv_counts: list[int] | torch.Tensor = field(default_factory=list)
    # all-to-all only:
    group: dist.ProcessGroup | None = None
    num_ranks: int = 1
    send_counts: torch.Tensor | None = None  # [R * S_r] rows to each (destination rank, slot)
    recv_counts_buf: torch.Tensor | None = None  # [R * S_r] rows from each (source, my slot)
    counts_work: dist.Work | None = None
    send_splits: list[int] = field(default_factory=list)  # [R] rows sent to each rank
    recv_splits: list[int] = field(default_factory=list)  # [R] rows received from each rank
    recv_perm: torch.Tensor | None = None  # [N]: recv_x[i] = arrival row recv_perm[i]
    recv_buf: torch.Tensor | None = None  # [N, D] rows in arrival order: by source, then slot
    work: dist.Work | None = None
    stats: CommStats | None = None
    started: float = 0.0  # time.perf_counter() at dispatch

    @property
    def bytes_sent(self) -> int:
        """Rows times row size: what this rank puts on the wire (rows to itself included)."""
        return self.send_x.numel() * self.send_x.element_size()

    def launch_rows(self, async_op: bool = True) -> "DispatchHandle":
        if self.recv_x is not None or self.recv_buf is not None:
            return self
        if self.counts_work is not None:
            self.counts_work.wait()
        num_ranks = self.num_ranks
        recv_matrix = self.recv_counts_buf.view(num_ranks, -1)  # [R, S_r]
        self.send_splits = self.send_counts.view(num_ranks, -1).sum(dim=1).tolist()
        self.recv_splits = recv_matrix.sum(dim=1).tolist()
        self.recv_perm = _slot_major_perm(recv_matrix)
        self.recv_counts = recv_matrix.sum(dim=0).tolist()
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
            blocked = time.perf_counter()
            self.launch_rows(async_op=False)
            if self.work is not None:
                self.work.wait()
            self.recv_x = self.recv_buf[self.recv_perm]  # [N, D]
            if self.stats is not None:
                done = time.perf_counter()
                self.stats.dispatch_wait_s += done - blocked
                self.stats.dispatch_s += done - self.started
                self.stats.rows += self.recv_x.shape[0]
        return self


@dataclass
class CombineHandle:
    dispatch: DispatchHandle
    rows: torch.Tensor  # [T * K, D] expert outputs, in dispatch's send order
    work: dist.Work | None = None
    started: float = 0.0  # time.perf_counter() at combine

    def wait(self) -> "CombineHandle":
        if self.work is not None:
            blocked = time.perf_counter()
            self.work.wait()
            self.work = None
            stats = self.dispatch.stats
            if stats is not None:
                done = time.perf_counter()
                stats.combine_wait_s += done - blocked
                stats.combine_s += done - self.started
        return self

    def output(self) -> torch.Tensor:
        """[T, D] in the rows' dtype: sum over k of topk_weights[t, k] * expert row (t, k)."""
        self.wait()
        handle = self.dispatch
        if use_cpu_kernel(self.rows) and handle.topk_weights.dtype == torch.float32:
            return cpu_kernels().combine(
                self.rows.contiguous(), handle.send_order, handle.topk_weights.contiguous()
            )  # the same sum, in k order, in one op
        num_tokens, top_k = handle.topk_weights.shape
        hidden = self.rows.shape[1]
        # NOTE: a gather and a sum over K, not index_add_: the same order of additions on every
        # device and in every pool size (index_add_ on CUDA uses atomics).
        by_token = torch.empty(
            num_tokens * top_k, hidden, dtype=torch.float32, device=self.rows.device
        )
        by_token[handle.send_order] = self.rows.float()
        by_token = by_token.view(num_tokens, top_k, hidden)  # [T, K, D]
        weighted = by_token * handle.topk_weights.float()[:, :, None]  # [T, K, D]
        return weighted.sum(dim=1).to(self.rows.dtype)  # [T, D]


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
