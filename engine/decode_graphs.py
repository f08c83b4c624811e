"""Decode steps replayed from CUDA graphs (EngineConfig.cuda_graph), as vLLM and SGLang do: at
batch sizes of a few sequences a GPU decode step is mostly kernel launches, and a graph replays
the step's ~100 launches as one.

A graph has static shapes and reads static memory, so the step's inputs live in buffers sized
for the largest bucket (ids, positions, cache slots, block tables, context lengths), and a batch
of B decode tokens runs as the smallest bucket of at least B (1, 2, 4, 8, then multiples of 16 up
to cuda_graph_max_batch). The padding rows are real rows of the model: token 0 at position 0,
writing and reading one extra cache block that no request owns (ModelRunner allocates it). Their
outputs are dropped, and the experts' load is counted from the real rows' routing after each
replay (the forward runs with topk_out: the dispatchers count nothing themselves). The Python
layers run here (fused=None): the CPU's fused layers are ModelRunner's other choice.

Capturable means nothing in the step waits for the device or copies host data to it (checked
on the CPU, op by op, by engine/capture_check.py over every bucket: tests/engine/
test_capture_check.py): the dispatch of a rank holding every expert keeps its counts on the
device and the Triton grouped GEMM reads them there (moe/dispatch.py, kernels/moe_mlp.py), the
dense and shared MLPs build their one count on the device, the attention reads its lengths on
the device, and the block tables are as wide as max_model_len allows. Steps with prefill tokens,
larger batches, expert-parallel pools (whose all-to-all exchanges counts on the host) and the
torch references (whose routed experts walk their counts on the host) run eagerly.

With capture=False (tests on CPU) the same buffers, padding and accounting run, each step eagerly.
"""

import logging

import torch

from engine.request import Request
from kernels.backend import ENV_VAR, kernel_mode, use_triton
from kernels.mla_attention import cache_slot
from moe.attention import PagedKV
from moe.dispatch import LocalDispatcher, slot_counts
from moe.model import DeepseekForCausalLM

log = logging.getLogger(__name__)


def batch_buckets(max_batch: int) -> list[int]:
    """The captured batch sizes: 1, 2, 4, 8, then multiples of 16, and max_batch itself."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch]
    return sizes + list(range(16, max_batch, 16)) + [max_batch]


class DecodeGraphs:
    def __init__(
        self,
        model: DeepseekForCausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_blocks: int,
        max_batch: int,
        capture: bool,
    ) -> None:
        """kv_caches: per layer [NB + 1, BS, C], the last block for the padding rows."""
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.buckets = batch_buckets(max_batch)
        self.pad_block = kv_caches[0].shape[0] - 1
        device, n = kv_caches[0].device, self.buckets[-1]
        self.ids = torch.zeros(n, dtype=torch.long, device=device)
        if capture and not use_triton(self.ids):
            why = f"{ENV_VAR}=reference" if kernel_mode() == "reference" else "no triton"
            log.warning(
                "cuda_graph: the kernels here are the torch references (%s), whose routed "
                "experts read their counts on the host, which a CUDA graph cannot hold: decode "
                "steps run eagerly",
                why,
            )
            capture = False
        self.capture = capture
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), self.pad_block * block_size, dtype=torch.long, device=device)
        self.tables = torch.full((n, max_blocks), self.pad_block, dtype=torch.long, device=device)
        self.lens = torch.ones(n, dtype=torch.long, device=device)
        self.moes = model.moe_layers()
        # bucket -> (graph or None, hidden [bucket, D], each MoE layer's topk_idx [bucket, K])
        self.graphs: dict[int, tuple] = {}
        self._pool = None
        self.num_replays = 0  # steps run here
        self.num_padding_rows = 0

    def serves(self, requests: list[Request], num_new: list[int]) -> bool:
        """Whether this step runs here: decode tokens only, at most the largest bucket, and
        every MoE layer's experts on this rank."""
        return (
            0 < len(requests) <= self.buckets[-1]
            and all(n == 1 for n in num_new)
            and self.experts_local()
        )

    def experts_local(self) -> bool:
        """Every MoE layer's experts on this rank (no all-to-all)."""
        return all(type(m.dispatcher) is LocalDispatcher for m in self.moes)

    def _forward(self, bucket: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
        kv = PagedKV.decode(
            self.kv_caches, self.slots[:bucket], self.tables[:bucket], self.lens[:bucket]
        )
        topk: list[torch.Tensor] = []  # each MoE layer's topk_idx [bucket, K]
        hidden = self.model.forward_tokens(
            self.ids[:bucket], self.positions[:bucket], kv=kv, fused=None, topk_out=topk
        )
        return hidden, topk

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture a graph for every bucket (at engine start: each costs a forward to warm up
        and one to capture), largest first, sharing one memory pool."""
        if not self.capture or not self.experts_local():
            return
        for bucket in reversed(self.buckets):
            self._capture(bucket)
        log.info("captured decode CUDA graphs for batch sizes %s", self.buckets)

    def _capture(self, bucket: int) -> None:
        # NOTE: a warm-up run on a side stream first: Triton compiles its kernels and the
        # allocator settles, neither of which may happen during capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self._forward(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            hidden, topk = self._forward(bucket)
        self._pool = graph.pool()
        self.graphs[bucket] = (graph, hidden, topk)

    @torch.inference_mode()
    def run(self, requests: list[Request]) -> torch.Tensor:
        """One decode token per request -> hidden [B, D] (final norm applied), in order."""
        num = len(requests)
        bucket = next(b for b in self.buckets if b >= num)
        bs, width = self.block_size, self.tables.shape[1]
        ids, positions, slots, lens, tables = [], [], [], [], []
        for req in requests:
            p = req.num_computed_tokens
            table = req.block_table
            ids.append(req.all_token_ids[p])
            positions.append(p)
            slots.append(cache_slot(table, p, bs))
            lens.append(p + 1)
            tables.append(table + [self.pad_block] * (width - len(table)))
        pad = bucket - num
        ids += [0] * pad
        positions += [0] * pad
        slots += [self.pad_block * bs] * pad
        lens += [1] * pad
        tables += [[self.pad_block] * width] * pad
        for buf, values in zip(
            (self.ids, self.positions, self.slots, self.lens), (ids, positions, slots, lens)
        ):
            buf[:bucket].copy_(torch.tensor(values, dtype=torch.long))
        self.tables[:bucket].copy_(torch.tensor(tables, dtype=torch.long))
        if self.capture:
            if bucket not in self.graphs:
                self._capture(bucket)
            graph, hidden, topk = self.graphs[bucket]
            graph.replay()
        else:
            hidden, topk = self._forward(bucket)
        self.num_replays += 1
        self.num_padding_rows += pad
        for m, idx in zip(self.moes, topk):  # the real rows' load, as the dispatcher counts it
            d = m.dispatcher
            d.load.add(slot_counts(d.log2slot[idx[:num].reshape(-1)], len(d.expert_ids)))
            d.stats.rows += idx[:num].numel()
        return hidden[:num].clone()
