"""EngineConfig: everything one rank's engine needs, checked once."""

from collections.abc import Callable
from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DRAFT_HEADS = ("auto", "int8", "exact")  # SpeculativeConfig.draft_head
GREEDY_HEADS = ("auto", "screened", "exact")  # EngineConfig.greedy_head


@dataclass(frozen=True, slots=True)
class KVTiersConfig:
    """The tiers below the paged cache (engine/kv_tiers/, docs/kv_tiers.md): a host-memory
    budget and a disk directory with its budget (0 bytes: that tier is off)."""

    host_bytes: int = 0
    disk_path: str | None = None
    disk_bytes: int = 0


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (engine/speculative.py, docs/mtp.md): the checkpoint's MTP layer
    drafts num_draft_tokens tokens a step, the main model verifies them in one step."""

    method: str = "mtp"
    num_draft_tokens: int = 1
    # speculate only in steps that start with at most this many running requests (None:
    # always): a large batch already reads each weight once for many tokens, and verifying
    # drafts there costs compute that plain decoding would spend on tokens (vLLM's
    # speculative_disable_by_batch_size)
    max_batch_size: int | None = None
    # the head the drafts' logits take (the verify always takes the model's own): "int8" a copy
    # quantized per row once at start (kernels/quantized.py; a quarter of the bytes, and a draft
    # never changes a token, only how many a step keeps), "exact" the model's own head, "auto"
    # int8 where the compiled CPU kernels serve the model (fp32 on a CPU), else exact
    draft_head: str = "auto"

    def __post_init__(self) -> None:
        # NOTE: named by the field alone: the cluster's config names it speculative.<field>
        if self.method != "mtp":
            raise EngineConfigError("method", "must be mtp", self.method)
        k = self.num_draft_tokens
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= 3:
            raise EngineConfigError("num_draft_tokens", "must be 1, 2 or 3", k)
        m = self.max_batch_size
        if m is not None and (not isinstance(m, int) or isinstance(m, bool) or m < 1):
            raise EngineConfigError("max_batch_size", "must be a whole number >= 1 or null", m)
        if self.draft_head not in DRAFT_HEADS:
            raise EngineConfigError("draft_head", "must be auto, int8 or exact", self.draft_head)


class EngineConfigError(ValueError):
    """A bad engine option; `field` names it, so a config that holds an EngineConfig (the
    cluster's) can name it by its own path."""

    def __init__(self, field: str, why: str, value: object) -> None:
        super().__init__(f"engine option {field}: {why} (got {value!r})")
        self.field, self.why, self.value = field, why, value


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str = "tiny"  # preset name or checkpoint directory
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16  # 64 on GPUs (FlashMLA); small blocks waste less on a CPU
    kv_cache_bytes: int = 256 * 2**20  # memory budget for the paged latent cache
    max_num_seqs: int = 64  # running requests per step
    max_num_batched_tokens: int = 2048  # tokens per step: prefill chunks + decodes
    max_model_len: int | None = None  # defaults to the model's max_position_embeddings
    enable_prefix_caching: bool = True
    mla_absorb: bool = True  # decode in the latent space (weight absorption)
    seed: int = 0  # draws the seeds of requests that bring none
    # FP8 block-quantized routed experts (DeepSeek-V3's checkpoints): "keep" holds them in FP8
    # with their scales (the Triton FP8 grouped GEMM on GPUs; a CPU dequantizes them per use),
    # "dequantize" converts them to dtype on load, "auto" keeps them on CUDA and dequantizes on
    # a CPU. Other checkpoints load the same under every choice.
    fp8_experts: str = "auto"
    # Two-batch overlap in expert-parallel pools: "on", "off", or "auto" (when the largest batch
    # in the pool has at least tbo_min_tokens: below that the split costs more than it hides).
    two_batch_overlap: str = "auto"
    tbo_min_tokens: int = 32
    metrics: bool = True  # count what the rank's /metrics exports (bench/metrics_overhead.py)
    # Decode steps replayed from CUDA graphs (engine/decode_graphs.py), one per batch-size
    # bucket up to cuda_graph_max_batch, captured when the engine starts: CUDA devices, no
    # expert parallelism.
    cuda_graph: bool = False
    cuda_graph_max_batch: int = 32
    # Live expert load balancing (engine/balancer.py), in expert-parallel pools:
    eplb_min_gain: float = 0.05  # skip a rebalance that lowers the max rank load by less
    eplb_max_moves: int = 0  # slots per layer one rebalance may change (0: any)
    eplb_layers_per_round: int = 1  # layers moved and switched per round (0: all at once)
    eplb_decay: float = 0.5  # the share of the old load window kept at each rebalance
    kv_tiers: KVTiersConfig | None = None  # None: no tiers below the paged cache
    # None: off; with a checkpoint without MTP layers the engine turns it off (one warning)
    speculative: SpeculativeConfig | None = None
    # The head's argmax for greedy rows that need nothing else of the logits (no logprobs):
    # "screened" takes the int8 logits of an int8 copy of lm_head (the drafts' own when they
    # quantize the same weight), then the exact logits of the candidates within the int8
    # error bound of the maximum only (engine/greedy_head.py: the same token, bit for bit, a
    # quarter of the head's bytes); "exact" the full fp32 head; "auto" screened where the
    # compiled CPU kernels serve the model (fp32 on a CPU) and the head has a million weights
    # or more (a smaller one reads faster than the screen runs), else exact.
    greedy_head: str = "auto"

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise EngineConfigError(name, why, getattr(self, name))

        need(self.dtype in DTYPES, "dtype", f"must be one of {sorted(DTYPES)}")
        need(self.block_size >= 1, "block_size", "must be >= 1")
        need(self.kv_cache_bytes > 0, "kv_cache_bytes", "must be > 0")
        need(self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1")
        need(self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1")
        need(
            self.two_batch_overlap in ("on", "off", "auto"),
            "two_batch_overlap",
            "must be on, off or auto",
        )
        need(
            self.fp8_experts in ("keep", "dequantize", "auto"),
            "fp8_experts",
            "must be keep, dequantize or auto",
        )
        need(self.tbo_min_tokens >= 2, "tbo_min_tokens", "must be >= 2")
        need(self.max_model_len is None or self.max_model_len >= 2, "max_model_len", "must be >= 2")
        need(self.eplb_min_gain >= 0, "eplb_min_gain", "must be >= 0")
        need(self.eplb_max_moves >= 0, "eplb_max_moves", "must be >= 0")
        need(self.eplb_layers_per_round >= 0, "eplb_layers_per_round", "must be >= 0")
        need(0 <= self.eplb_decay <= 1, "eplb_decay", "must be in [0, 1]")
        need(
            not self.cuda_graph or self.device.startswith("cuda"),
            "cuda_graph",
            f"CUDA graphs need device cuda, this engine runs on {self.device!r}: set cuda_graph "
            "false",
        )
        need(self.cuda_graph_max_batch >= 1, "cuda_graph_max_batch", "must be >= 1")
        need(self.greedy_head in GREEDY_HEADS, "greedy_head", "must be auto, screened or exact")
        need(
            self.greedy_head != "screened"
            or (torch.device(self.device).type == "cpu" and self.dtype == "float32"),
            "greedy_head",
            f"screened needs the compiled CPU kernels (device cpu, dtype float32), this engine "
            f"runs {self.dtype} on {self.device!r}: set auto or exact",
        )
        self._check_kv_tiers(need)
        need(
            self.speculative is None or isinstance(self.speculative, SpeculativeConfig),
            "speculative",
            "must be a SpeculativeConfig or None",
        )

    def _check_kv_tiers(self, need: Callable[[bool, str, str], None]) -> None:
        t = self.kv_tiers
        if t is None:
            return
        need(isinstance(t, KVTiersConfig), "kv_tiers", "must be a KVTiersConfig or None")
        need(t.host_bytes >= 0 and t.disk_bytes >= 0, "kv_tiers", "budgets must be >= 0")
        need(
            (t.disk_path is None) == (t.disk_bytes == 0),
            "kv_tiers",
            "disk_path and disk_bytes go together (both set, or neither)",
        )
        need(t.host_bytes > 0 or t.disk_bytes > 0, "kv_tiers", "needs a host or a disk budget")
        need(self.enable_prefix_caching, "kv_tiers", "needs enable_prefix_caching")

    @property
    def num_draft_tokens(self) -> int:
        """Draft tokens per step (0: speculation off)."""
        return 0 if self.speculative is None else self.speculative.num_draft_tokens

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def keep_fp8_experts(self) -> bool:
        """Whether the loader keeps FP8 experts in FP8 (moe.loader.load_model)."""
        auto = self.fp8_experts == "auto" and self.device.startswith("cuda")
        return self.fp8_experts == "keep" or auto
