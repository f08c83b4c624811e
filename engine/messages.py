"""Messages that cross processes (router <-> prefill and decode ranks), as plain dataclasses.
Protobuf lives only at the gRPC edge (router/proto)."""

from dataclasses import dataclass, field

from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class GenerateRequest:
    """A validated, tokenized request as the router hands it to the pools."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # resolved: the router draws one when the client gives none
    deadline: float | None = None  # time.time() after which the request is aborted


@dataclass(slots=True)
class RankStatus:
    pool: str  # "prefill" | "decode" | "local"
    rank: int
    ready: bool
    num_running: int
    num_waiting: int
    kv_used_blocks: int
    kv_total_blocks: int
    kv_cached_blocks: int = 0
    num_reserved: int = 0  # decode: requests holding blocks while their KV is on the way
    block_size: int = 16
    expert_ids: dict[int, list[int]] = field(default_factory=dict)  # MoE layer -> logical ids

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / max(self.kv_total_blocks, 1)

    @property
    def kv_free_blocks(self) -> int:
        return self.kv_total_blocks - self.kv_used_blocks


@dataclass(slots=True)
class ModelInfo:
    model: str
    model_type: str
    vocab_size: int
    max_model_len: int
    num_layers: int
    num_routed_experts: int
    experts_per_token: int
    eos_token_id: int | None
    kv_bytes_per_token: int  # MLA: layers x (kv_lora_rank + qk_rope_head_dim) x dtype size


@dataclass(slots=True)
class PoolStatus:
    name: str  # "prefill" | "decode" | "local"
    ranks: list[RankStatus]


@dataclass(slots=True)
class ClusterStatus:
    """What the router reports about the pools (GetClusterStatus).

    A backend fills pools and num_in_flight; the router adds its admission counters."""

    pools: list[PoolStatus]
    num_in_flight: int  # requests the backend is generating for
    num_queued: int = 0  # requests admitted by the router and not finished
    num_queued_tokens: int = 0  # their prompt tokens
