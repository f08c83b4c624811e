# ruff: noqa
# fmt: off
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos", "logprobs")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    logprobs: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., logprobs: _Optional[int] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "token_ids", "sampling_params")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    token_ids: TokenIds
    sampling_params: SamplingParams
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token_id", "logprob")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "top")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    top: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("request_id", "token_ids", "text", "finish_reason", "usage", "time_to_first_token_s", "logprobs")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    finish_reason: FinishReason
    usage: Usage
    time_to_first_token_s: float
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., time_to_first_token_s: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class GetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModelInfo(_message.Message):
    __slots__ = ("model", "model_type", "vocab_size", "max_model_len", "num_layers", "num_routed_experts", "experts_per_token", "eos_token_id", "kv_bytes_per_token", "kernels")
    MODEL_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_ROUTED_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    EXPERTS_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_PER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    model: str
    model_type: str
    vocab_size: int
    max_model_len: int
    num_layers: int
    num_routed_experts: int
    experts_per_token: int
    eos_token_id: int
    kv_bytes_per_token: int
    kernels: str
    def __init__(self, model: _Optional[str] = ..., model_type: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_layers: _Optional[int] = ..., num_routed_experts: _Optional[int] = ..., experts_per_token: _Optional[int] = ..., eos_token_id: _Optional[int] = ..., kv_bytes_per_token: _Optional[int] = ..., kernels: _Optional[str] = ...) -> None: ...

class GetClusterStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RankStatus(_message.Message):
    __slots__ = ("rank", "ready", "num_running", "num_waiting", "kv_used_blocks", "kv_total_blocks", "kv_cached_blocks", "kv_usage", "num_reserved", "block_size", "max_model_len", "num_steps", "stalled_s", "num_pending", "metrics_endpoint", "rebalance", "spec_verifies", "spec_draft_tokens", "spec_accepted_tokens")
    RANK_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    NUM_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FIELD_NUMBER: _ClassVar[int]
    KV_USED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_USAGE_FIELD_NUMBER: _ClassVar[int]
    NUM_RESERVED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_MODEL_LEN_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    STALLED_S_FIELD_NUMBER: _ClassVar[int]
    NUM_PENDING_FIELD_NUMBER: _ClassVar[int]
    METRICS_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    REBALANCE_FIELD_NUMBER: _ClassVar[int]
    SPEC_VERIFIES_FIELD_NUMBER: _ClassVar[int]
    SPEC_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPEC_ACCEPTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    ready: bool
    num_running: int
    num_waiting: int
    kv_used_blocks: int
    kv_total_blocks: int
    kv_cached_blocks: int
    kv_usage: float
    num_reserved: int
    block_size: int
    max_model_len: int
    num_steps: int
    stalled_s: float
    num_pending: int
    metrics_endpoint: str
    rebalance: RebalanceStatus
    spec_verifies: int
    spec_draft_tokens: int
    spec_accepted_tokens: int
    def __init__(self, rank: _Optional[int] = ..., ready: _Optional[bool] = ..., num_running: _Optional[int] = ..., num_waiting: _Optional[int] = ..., kv_used_blocks: _Optional[int] = ..., kv_total_blocks: _Optional[int] = ..., kv_cached_blocks: _Optional[int] = ..., kv_usage: _Optional[float] = ..., num_reserved: _Optional[int] = ..., block_size: _Optional[int] = ..., max_model_len: _Optional[int] = ..., num_steps: _Optional[int] = ..., stalled_s: _Optional[float] = ..., num_pending: _Optional[int] = ..., metrics_endpoint: _Optional[str] = ..., rebalance: _Optional[_Union[RebalanceStatus, _Mapping]] = ..., spec_verifies: _Optional[int] = ..., spec_draft_tokens: _Optional[int] = ..., spec_accepted_tokens: _Optional[int] = ...) -> None: ...

class RebalanceStatus(_message.Message):
    __slots__ = ("number", "outcome", "moving", "balancedness_before", "balancedness_after", "slots_moved", "layers_moved", "duration_s", "longest_pause_s", "from_checkpoint")
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    MOVING_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_BEFORE_FIELD_NUMBER: _ClassVar[int]
    BALANCEDNESS_AFTER_FIELD_NUMBER: _ClassVar[int]
    SLOTS_MOVED_FIELD_NUMBER: _ClassVar[int]
    LAYERS_MOVED_FIELD_NUMBER: _ClassVar[int]
    DURATION_S_FIELD_NUMBER: _ClassVar[int]
    LONGEST_PAUSE_S_FIELD_NUMBER: _ClassVar[int]
    FROM_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    number: int
    outcome: str
    moving: bool
    balancedness_before: float
    balancedness_after: float
    slots_moved: int
    layers_moved: int
    duration_s: float
    longest_pause_s: float
    from_checkpoint: int
    def __init__(self, number: _Optional[int] = ..., outcome: _Optional[str] = ..., moving: _Optional[bool] = ..., balancedness_before: _Optional[float] = ..., balancedness_after: _Optional[float] = ..., slots_moved: _Optional[int] = ..., layers_moved: _Optional[int] = ..., duration_s: _Optional[float] = ..., longest_pause_s: _Optional[float] = ..., from_checkpoint: _Optional[int] = ...) -> None: ...

class RebalanceRequest(_message.Message):
    __slots__ = ("pool",)
    POOL_FIELD_NUMBER: _ClassVar[int]
    pool: str
    def __init__(self, pool: _Optional[str] = ...) -> None: ...

class PoolRebalance(_message.Message):
    __slots__ = ("pool", "status")
    POOL_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    status: RebalanceStatus
    def __init__(self, pool: _Optional[str] = ..., status: _Optional[_Union[RebalanceStatus, _Mapping]] = ...) -> None: ...

class RebalanceResponse(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolRebalance]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolRebalance, _Mapping]]] = ...) -> None: ...

class PoolStatus(_message.Message):
    __slots__ = ("name", "ranks")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    name: str
    ranks: _containers.RepeatedCompositeFieldContainer[RankStatus]
    def __init__(self, name: _Optional[str] = ..., ranks: _Optional[_Iterable[_Union[RankStatus, _Mapping]]] = ...) -> None: ...

class RankExperts(_message.Message):
    __slots__ = ("rank", "num_slots", "expert_ids")
    RANK_FIELD_NUMBER: _ClassVar[int]
    NUM_SLOTS_FIELD_NUMBER: _ClassVar[int]
    EXPERT_IDS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    num_slots: int
    expert_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, rank: _Optional[int] = ..., num_slots: _Optional[int] = ..., expert_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PoolPlacement(_message.Message):
    __slots__ = ("pool", "layer", "ranks")
    POOL_FIELD_NUMBER: _ClassVar[int]
    LAYER_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    layer: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankExperts]
    def __init__(self, pool: _Optional[str] = ..., layer: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankExperts, _Mapping]]] = ...) -> None: ...

class ClusterStatus(_message.Message):
    __slots__ = ("pools", "queue_depth", "queued_prompt_tokens", "in_flight", "placement")
    POOLS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_DEPTH_FIELD_NUMBER: _ClassVar[int]
    QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolStatus]
    queue_depth: int
    queued_prompt_tokens: int
    in_flight: int
    placement: _containers.RepeatedCompositeFieldContainer[PoolPlacement]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolStatus, _Mapping]]] = ..., queue_depth: _Optional[int] = ..., queued_prompt_tokens: _Optional[int] = ..., in_flight: _Optional[int] = ..., placement: _Optional[_Iterable[_Union[PoolPlacement, _Mapping]]] = ...) -> None: ...

class GetExpertLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class LayerLoad(_message.Message):
    __slots__ = ("layer", "slot_tokens", "slot_experts")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SLOT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SLOT_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    slot_tokens: _containers.RepeatedScalarFieldContainer[int]
    slot_experts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., slot_tokens: _Optional[_Iterable[int]] = ..., slot_experts: _Optional[_Iterable[int]] = ...) -> None: ...

class PoolLoad(_message.Message):
    __slots__ = ("pool", "num_ranks", "num_experts", "layers")
    POOL_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    pool: str
    num_ranks: int
    num_experts: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerLoad]
    def __init__(self, pool: _Optional[str] = ..., num_ranks: _Optional[int] = ..., num_experts: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerLoad, _Mapping]]] = ...) -> None: ...

class ExpertLoad(_message.Message):
    __slots__ = ("pools",)
    POOLS_FIELD_NUMBER: _ClassVar[int]
    pools: _containers.RepeatedCompositeFieldContainer[PoolLoad]
    def __init__(self, pools: _Optional[_Iterable[_Union[PoolLoad, _Mapping]]] = ...) -> None: ...
