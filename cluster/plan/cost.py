"""The cost of one step of one rank of an EP pool, from first principles.

Per phase (attention, dense MLP, MoE experts, lm_head) a step reads bytes (weights, the KV cache)
and does FLOPs; its time is max(bytes / read bandwidth, FLOPs / peak) (a roofline per phase).
Every MoE layer moves the step's tokens to their experts and back (dispatch in fp8, combine in
bf16, as DeepSeek does) over NVLink inside a node and RDMA between nodes; with two-batch overlap
that communication hides behind computation: step = compute + comm - min(comm, compute).
A fixed per-step overhead (launch, scheduling, the step's agreement) is added; on a CPU also a
per-sequence overhead (the engine's Python bookkeeping and sampling per request, measured), a
fixed latency per exchange of each MoE layer's dispatch and combine (gloo's round trip between
processes, measured: at decode's few rows it, not the bandwidth, is the all-to-all's cost; the
cluster's dispatcher makes three a layer, exchanges_per_step), what an expert-parallel rank
adds per step and per sequence (measured on an EP2 pair) and what a prefill adds per new
position (measured on one engine).

Ranks of a pool step in lockstep with equal batches (the router balances them; attention is data
parallel), so one rank's step is the pool's step; the EPLB imbalance (max / mean tokens per rank
after balancing) scales the expert work and traffic of the busiest rank.

Legend: T tokens computed per rank per step, K top-k, E routed experts, R ranks (EP size),
g GPUs per node, H hidden, C context (positions attended), L layers.
"""

from dataclasses import dataclass

from cluster.plan.hardware import DTYPE_BYTES, Hardware
from cluster.plan.models import PlanModel

FP8_SCALE_BYTES = 4 / 128  # one fp32 scale per 128 values (DeepSeek's fine-grained FP8)


@dataclass(frozen=True, slots=True)
class Unit:
    """One EP pool (DeepSeek's "unit"): R ranks over R / g nodes, and how it runs."""

    ranks: int
    gpus_per_node: int = 8
    redundant_experts: int = 0
    weight_dtype: str = "fp8"  # linear layers and experts (lm_head stays bf16 under fp8)
    kv_dtype: str = "bf16"
    dispatch_dtype: str = "fp8"
    combine_dtype: str = "bf16"
    imbalance: float = 1.05  # assumption: EPLB's max / mean rank load after balancing
    two_batch_overlap: bool = True
    step_overhead_s: float = 0.5e-3  # assumption: CUDA graph launch + scheduling per step
    sequence_overhead_s: float = 0.0  # per sequence in the step (CPU: measured)
    exchange_latency_s: float = 0.0  # per dispatch or combine, beside its bytes (CPU: measured)
    # CPU, measured: what an expert-parallel rank's step costs beyond a lone engine's (the
    # dispatcher's index work and the MoE block in Python), per step and per sequence; and
    # what a prefill step costs per new position beyond its roofline
    ep_step_overhead_s: float = 0.0
    ep_sequence_overhead_s: float = 0.0
    prefill_token_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.ranks < 1 or self.gpus_per_node < 1:
            raise ValueError("ranks and gpus_per_node must be >= 1")
        if self.ranks > self.gpus_per_node and self.ranks % self.gpus_per_node:
            raise ValueError(f"{self.ranks} ranks do not fill nodes of {self.gpus_per_node}")
        for name in ("weight_dtype", "kv_dtype", "dispatch_dtype", "combine_dtype"):
            if getattr(self, name) not in DTYPE_BYTES:
                raise ValueError(f"{name} must be one of {sorted(DTYPE_BYTES)}")
        if self.redundant_experts < 0 or self.imbalance < 1 or self.step_overhead_s < 0:
            raise ValueError("redundant_experts >= 0, imbalance >= 1, step_overhead_s >= 0")
        extra = (self.sequence_overhead_s, self.exchange_latency_s, self.ep_step_overhead_s,
                 self.ep_sequence_overhead_s, self.prefill_token_overhead_s)  # fmt: skip
        if min(extra) < 0:
            raise ValueError(
                "the per-sequence, per-exchange, EP and prefill overheads must be >= 0"
            )

    @property
    def nodes(self) -> int:
        return max(1, self.ranks // self.gpus_per_node)

    def slots_per_rank(self, model: PlanModel) -> float:
        return (model.config.n_routed_experts + self.redundant_experts) / self.ranks

    @property
    def head_dtype(self) -> str:
        return "bf16" if self.weight_dtype == "fp8" else self.weight_dtype

    @property
    def attn_dtype(self) -> str:
        """The attention core's math (FlashMLA: bf16 even over an fp8 cache)."""
        return "fp32" if self.weight_dtype == "fp32" else "bf16"


@dataclass(frozen=True, slots=True)
class Phase:
    bytes: float
    flops: float
    memory_s: float
    compute_s: float

    @property
    def time_s(self) -> float:
        return max(self.memory_s, self.compute_s)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_s >= self.compute_s else "compute"


@dataclass(frozen=True, slots=True)
class StepCost:
    """One rank's step: its phases, the all-to-all, the overlap and the total."""

    tokens: int
    phases: dict[str, Phase]
    comm_s: float
    overhead_s: float
    overlap: bool

    @property
    def compute_s(self) -> float:
        return sum(p.time_s for p in self.phases.values())

    @property
    def hidden_comm_s(self) -> float:
        return min(self.comm_s, self.compute_s) if self.overlap else 0.0

    @property
    def time_s(self) -> float:
        return self.compute_s + self.comm_s - self.hidden_comm_s + self.overhead_s


def expected_touched(slots: float, rows: float) -> float:
    """Expected distinct slots that `rows` uniformly routed rows touch among `slots`."""
    if rows <= 0 or slots <= 0:
        return 0.0
    if slots <= 1:
        return slots
    return slots * (1 - (1 - 1 / slots) ** rows)


def _phase(hw: Hardware, nbytes: float, parts: list[tuple[float, str]]) -> Phase:
    """`parts`: (FLOPs, dtype) pairs, each at its dtype's peak."""
    flops = sum(f for f, _ in parts)
    compute = sum(f / hw.peak(d) for f, d in parts)
    return Phase(nbytes, flops, nbytes / hw.read_bw, compute)


def step_cost(
    model: PlanModel,
    hw: Hardware,
    unit: Unit,
    tokens: int,
    head_rows: int,
    attn_core_flops: float,
    kv_read_bytes: float,
    dedup_nodes: bool,
    prefill: bool = False,
) -> StepCost:
    """One rank's step computing `tokens` (T) positions, `head_rows` of them through lm_head
    (`prefill`: T new prompt positions, else T decode rows)."""
    c, m = model.config, model
    w = DTYPE_BYTES[unit.weight_dtype]
    k, layers, moe_layers = c.num_experts_per_tok, c.num_hidden_layers, m.num_moe_layers
    linear = unit.weight_dtype
    attn = _phase(
        hw,
        layers * m.attention_params * w + kv_read_bytes,
        [(2 * tokens * layers * m.attention_params, linear), (attn_core_flops, unit.attn_dtype)],
    )
    dense_params = m.num_dense_layers * m.dense_mlp_params
    dense = _phase(hw, dense_params * w, [(2 * tokens * dense_params, linear)])
    # Step 1: the rows that reach this rank's experts and the slots they touch
    rows = tokens * k * unit.imbalance  # [T * K] rows per rank on average, busiest rank
    touched = expected_touched(unit.slots_per_rank(m), rows)
    per_layer = m.gate_params + c.n_shared_experts * m.expert_params
    moe = _phase(
        hw,
        moe_layers * (per_layer + touched * m.expert_params) * w,
        [(2 * moe_layers * (tokens * per_layer + rows * m.expert_params), linear)],
    )
    head = _phase(
        hw,
        m.embed_params * DTYPE_BYTES[unit.head_dtype],
        [(2 * head_rows * m.embed_params, unit.head_dtype)],
    )
    # Step 2: dispatch + combine per MoE layer, NVLink and RDMA in parallel
    comm = moe_layers * all_to_all_s(model, hw, unit, tokens, dedup_nodes)
    overlap = unit.two_batch_overlap and tokens >= 2
    phases = {"attention": attn, "dense_mlp": dense, "experts": moe, "lm_head": head}
    # Step 3: what the roofline does not see: per step, per sequence, per exchange (round trips
    # that two-batch overlap cannot hide), an EP rank's extra work, a prefill's per position
    exchanges = exchanges_per_step(model, unit.ranks)
    seqs = max(head_rows, 1)
    overhead = (
        unit.step_overhead_s
        + unit.sequence_overhead_s * seqs
        + unit.exchange_latency_s * exchanges
        + (unit.prefill_token_overhead_s * tokens if prefill else 0.0)
    )
    if unit.ranks > 1:
        overhead += unit.ep_step_overhead_s + unit.ep_sequence_overhead_s * seqs
    return StepCost(tokens, phases, comm, overhead, overlap)


def exchanges_per_step(model: PlanModel, ranks: int) -> int:
    """Collective round trips of one step of an EP pool, as moe/dispatch.py's AllToAllDispatcher
    runs them: per MoE layer the split sizes, the rows and the combine (3), and the step's
    agreement among the ranks (one all_reduce, engine/llm_engine.py); none without EP."""
    return 3 * model.num_moe_layers + 1 if ranks > 1 else 0


def all_to_all_s(model: PlanModel, hw: Hardware, unit: Unit, tokens: int, dedup: bool) -> float:
    """Seconds of one MoE layer's dispatch + combine for a rank sending `tokens` tokens.

    Of a token's K rows, a fraction (g-1)/R goes to the rank's node and (R-g)/R to other nodes.
    `dedup` (DeepEP's normal kernels, prefill): a token crosses to each remote node it touches
    once, (n-1)(1 - (1-1/n)^K) nodes of n; the low-latency kernels (decode) send every row.
    """
    r, g, k, h = (
        unit.ranks,
        min(unit.gpus_per_node, unit.ranks),
        model.config.num_experts_per_tok,
        model.config.hidden_size,
    )
    if r == 1 or tokens == 0:
        return 0.0
    intra_rows = tokens * k * (g - 1) / r
    if dedup and r > g:
        n = r / g
        inter_rows = tokens * (n - 1) * (1 - (1 - 1 / n) ** k)
    else:
        inter_rows = tokens * k * (r - g) / r
    dispatch = h * (
        DTYPE_BYTES[unit.dispatch_dtype] + (FP8_SCALE_BYTES if unit.dispatch_dtype == "fp8" else 0)
    )
    row = (dispatch + h * DTYPE_BYTES[unit.combine_dtype]) * unit.imbalance
    link = hw.efficiency.link
    return max(
        intra_rows * row / (hw.intra_node_bw * link), inter_rows * row / (hw.inter_node_bw * link)
    )


def decode_step(model: PlanModel, hw: Hardware, unit: Unit, batch: int, context: float) -> StepCost:
    """A decode step of `batch` requests per rank, each attending `context` cached positions.

    MLA decode with weight absorption reads the latent cache ((kv_lora + rope) x L per position)
    and does, per head per position, a (kv_lora + rope) dot for the score and a kv_lora axpy.
    """
    c = model.config
    kv = batch * context * model.kv_bytes_per_token(DTYPE_BYTES[unit.kv_dtype])
    core = (
        2
        * batch
        * context
        * c.num_hidden_layers
        * c.num_attention_heads
        * (c.kv_cache_width + c.kv_lora_rank)
    )
    return step_cost(model, hw, unit, batch, batch, core, kv, dedup_nodes=False)


def prefill_step(
    model: PlanModel, hw: Hardware, unit: Unit, tokens: int, sequences: int, cached: float = 0.0
) -> StepCost:
    """A prefill step computing `tokens` new positions of `sequences` prompts per rank, after
    `cached` prefix positions per prompt that come from the cache (read, not computed).

    Attention (MHA form, causal): per head per position, a qk_head dot and a v_head axpy over the
    positions before it, on average cached + (new per prompt + 1) / 2.
    """
    c = model.config
    seqs = max(sequences, 1)
    mean_context = cached + (tokens / seqs + 1) / 2
    core = (
        2
        * tokens
        * mean_context
        * c.num_hidden_layers
        * c.num_attention_heads
        * (c.qk_head_dim + c.v_head_dim)
    )
    kv = seqs * cached * model.kv_bytes_per_token(DTYPE_BYTES[unit.kv_dtype])
    return step_cost(model, hw, unit, tokens, sequences, core, kv, dedup_nodes=True, prefill=True)


def kv_transfer_s(model: PlanModel, hw: Hardware, unit: Unit, positions: float) -> float:
    """Seconds to ship a prompt's latent cache from its prefill rank to its decode rank (RDMA)."""
    nbytes = positions * model.kv_bytes_per_token(DTYPE_BYTES[unit.kv_dtype])
    return nbytes / (hw.inter_node_bw * hw.efficiency.link)
