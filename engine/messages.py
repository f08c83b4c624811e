"""Everything that crosses processes (router <-> prefill and decode ranks, prefill -> decode), as
plain dataclasses: one vocabulary for the router and both pools. Protobuf lives only at the gRPC
edge (router/proto).

Legend (kernels/__init__.py): L layers, T prompt tokens, C latent width per token per layer.
"""

from dataclasses import dataclass, field

import torch

from engine.sampling_params import SamplingParams


class RankStopped(RuntimeError):
    """Raised by a rank for the requests it held when its engine stopped (a collective failed: a
    peer of its pool died), and for every call after: the rank is lost until its pool re-forms,
    and the router resumes those requests elsewhere, as for a rank that died
    (cluster/handles.py: RankFailed).

    suspects: the ids of the requests in the step whose exception stopped the engine (empty
    when it stopped between steps, or was stopped): the router resumes a request found there
    once, not twice (a poison request is recognised, not retried on everyone's time)."""

    def __init__(self, message: str, suspects: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.suspects = tuple(suspects)

    def __reduce__(self) -> tuple:  # NOTE: crosses processes (Ray pickles a rank's exception)
        return (type(self), (str(self), self.suspects))


class RequestFailed(Exception):
    """One request failed on a rank (its rows could not be prepared or sampled, or it was
    recognised as poison): that request ends with this error; the rank, its pool and the other
    requests go on. invalid: the cause was the request's own parameters (a ValueError: the
    client gets INVALID_ARGUMENT), else INTERNAL."""

    def __init__(self, message: str, invalid: bool = False) -> None:
        super().__init__(message)
        self.message, self.invalid = message, invalid

    def __reduce__(self) -> tuple:
        return (type(self), (self.message, self.invalid))

    @classmethod
    def caused_by(cls, request_id: str, stage: str, error: BaseException) -> "RequestFailed":
        """The error a request ends with when `stage` ("sampling", ...) raised `error`."""
        cause = (str(error).strip().splitlines() or [""])[0][:200]
        return cls(
            f"request {request_id} failed in {stage}: {type(error).__name__}: {cause}",
            invalid=isinstance(error, ValueError),
        )


# ---- requests and their tokens ----


@dataclass(frozen=True, slots=True)
class Resume:
    """What the client already received of a request that is being resumed (after a rank
    failed): its output tokens and text. The resumed request recomputes their KV and samples
    on from there; sampling depends only on (seed, position), so the stream goes on as if
    nothing happened."""

    token_ids: list[int]
    text: str


@dataclass(slots=True)
class GenerateRequest:
    """A validated, tokenized request as the router hands it to the pools."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # resolved: the router draws one when the client gives none
    deadline: float | None = None  # time.time() after which the request is aborted
    resume: Resume | None = None
    kv_fallback: bool = False  # a p2p KV transfer of this request failed: use the object store

    @property
    def known_token_ids(self) -> list[int]:
        """Prompt and already generated tokens: what a rank must hold KV for."""
        return self.prompt_token_ids + (self.resume.token_ids if self.resume else [])


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """Logprobs (from the raw logits) of one sampled token and of the top-n alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # (token id, logprob), best first; len = params.logprobs


@dataclass(slots=True)
class RequestOutput:
    """One request's tokens: the whole output from `LLM.generate`, or the new part of one step
    (a delta) from `LLMEngine.step` and the streaming APIs."""

    request_id: str
    token_ids: list[int]
    text: str
    finish_reason: str | None  # None while running, else "stop" | "length" | "abort" | "error"
    num_prompt_tokens: int
    num_completion_tokens: int  # so far, in the whole request
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    logprobs: list[TokenLogprobs] | None = None
    # With finish_reason "error": why. NOTE: never reaches a protocol: every backend raises it
    # instead of yielding the delta (the frontend turns it into the client's status).
    failure: RequestFailed | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, delta: "RequestOutput") -> "RequestOutput":
        """Append a later delta of the same request (in place); -> self."""
        assert delta.request_id == self.request_id, (delta.request_id, self.request_id)
        self.token_ids += delta.token_ids
        self.text += delta.text
        self.finish_reason = delta.finish_reason
        self.num_completion_tokens = delta.num_completion_tokens
        self.num_cached_tokens = delta.num_cached_tokens
        self.failure = delta.failure
        if delta.logprobs is not None:
            self.logprobs = (self.logprobs or []) + delta.logprobs
        return self


# ---- the KV handoff, prefill -> decode ----


@dataclass(slots=True)
class KVPayload:
    """A request's prompt KV cache on its way from a prefill rank to a decode rank: MLA caches
    one latent row per token per layer, so the payload is one tensor."""

    request_id: str
    data: torch.Tensor  # [L, T, C] on the CPU
    num_cached_tokens: int  # prompt tokens the prefill rank found in its prefix cache

    @property
    def num_tokens(self) -> int:
        return self.data.shape[1]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size()


@dataclass(slots=True)
class P2PHandle:
    """A KV transfer over torch.distributed point-to-point (engine.kv_p2p): what the decode rank
    needs to post the matching recv. Passed by the router, never opened there."""

    request_id: str
    src: int  # the sending rank in the transport group
    tag: int  # 31 bits, unique per (src, in-flight request)
    shape: tuple[int, ...]  # [L, T, C]
    dtype: str  # "float32", "bfloat16", ...
    num_cached_tokens: int
    seq: int = 0  # the send's number among src's sends to this dst: receives go in this order
    epoch: int = 0  # the transport group it was sent on (the group is rebuilt after a failure)


@dataclass(slots=True)
class PrefillResult:
    """A prefill-only request whose prompt is done: its first token (finish_reason None: the
    decode rank carries on) and its prompt's KV."""

    first: RequestOutput
    kv: KVPayload


@dataclass(slots=True)
class StepResult:
    """What one engine step produced: the deltas of the requests that sampled, and the prefill-
    only requests it handed off (their first token travels in PrefillResult, not in outputs)."""

    outputs: list[RequestOutput] = field(default_factory=list)
    prefilled: list[PrefillResult] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.outputs or self.prefilled)


# ---- status ----


@dataclass(slots=True)
class RebalanceStatus:
    """A pool rank's expert load balancing: the last rebalance, and whether one is under way."""

    number: int = 0  # rebalances planned so far (applied or skipped)
    outcome: str = ""  # of the last: "applied" | "skipped" | "" (none yet)
    moving: bool = False  # the last one's weights are still moving (not all layers switched)
    balancedness_before: float = 1.0  # mean / max rank load on the load window, layers' mean
    balancedness_after: float = 1.0  # predicted for the placement chosen
    slots_moved: int = 0
    layers_moved: int = 0
    duration_s: float = 0.0  # from the plan to the last switch
    longest_pause_s: float = 0.0  # the longest part that held a step (the plan, a switch)
    from_checkpoint: int = 0  # experts read from the checkpoint after a failed transfer


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
    max_model_len: int = 0  # the rank's context limit (the KV cache may lower the model's)
    num_steps: int = 0  # engine steps taken (a heartbeat)
    stalled_s: float = 0.0  # seconds with work and no progress on the engine thread (hung?)
    num_pending: int = 0  # calls the rank's server side is waiting on (prefills, owners)
    metrics_endpoint: str = ""  # host:port of the rank's Prometheus /metrics
    kernels: str = ""  # which kernels serve this rank (kernels.backend.serving_kernels)
    rebalance: RebalanceStatus | None = None  # expert-parallel ranks only
    # speculative decoding, since the start (engine/speculative.py): 0 with it off
    spec_verifies: int = 0  # a request's steps that verified drafts
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0

    @classmethod
    def down(cls, pool: str, rank: int) -> "RankStatus":
        """A rank with no status to show (not ready, nothing held): unknown, or not answering."""
        return cls(pool, rank, False, 0, 0, 0, 0)

    @property
    def kv_usage(self) -> float:
        return self.kv_used_blocks / max(self.kv_total_blocks, 1)

    @property
    def kv_free_blocks(self) -> int:
        return self.kv_total_blocks - self.kv_used_blocks

    @property
    def spec_acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 before any draft)."""
        return self.spec_accepted_tokens / max(self.spec_draft_tokens, 1)

    @property
    def spec_tokens_per_verify(self) -> float:
        """Tokens a verify step keeps on average: its accepted drafts and the bonus token."""
        return 1 + self.spec_accepted_tokens / max(self.spec_verifies, 1)


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
    # which kernels serve (kernels.backend.serving_kernels: "triton", "cpu-avx512", "cpu-avx2",
    # "reference", ...); the ranks' distinct values joined by "," in a cluster; "" unknown
    kernels: str = ""


@dataclass(slots=True)
class PoolStatus:
    name: str  # "prefill" | "decode" | "local"
    ranks: list[RankStatus]


@dataclass(slots=True)
class PoolLoad:
    """Tokens routed to each physical expert slot of each MoE layer of a pool."""

    pool: str
    num_ranks: int  # slot s lives on rank s // (slots // num_ranks)
    num_experts: int
    layers: dict[int, tuple[list[int], list[int]]]  # model layer -> (tokens [S], expert [S])

    def rank_tokens(self) -> dict[int, list[int]]:
        """Model layer -> tokens routed to each rank [R]."""
        out = {}
        for layer, (tokens, _) in self.layers.items():
            per_rank = len(tokens) // self.num_ranks
            out[layer] = [
                sum(tokens[r * per_rank : (r + 1) * per_rank]) for r in range(self.num_ranks)
            ]
        return out

    def balancedness(self) -> float:
        """Mean over MoE layers of (mean rank load / max rank load): 1.0 is perfectly even."""
        ratios = [sum(r) / len(r) / max(r) for r in self.rank_tokens().values() if max(r)]
        return sum(ratios) / len(ratios) if ratios else 1.0

    def since(self, before: "PoolLoad") -> "PoolLoad":
        """The counts added after `before`, a dump of the same placement."""
        layers = {}
        for layer, (tokens, experts) in self.layers.items():
            old_tokens, old_experts = before.layers[layer]
            if experts != old_experts:
                raise ValueError(f"layer {layer}: the placement changed between the two dumps")
            layers[layer] = ([a - b for a, b in zip(tokens, old_tokens, strict=True)], experts)
        return PoolLoad(self.pool, self.num_ranks, self.num_experts, layers)

    def expert_tokens(self) -> dict[int, list[int]]:
        """Model layer -> tokens routed to each logical expert [E] (its replicas summed)."""
        out = {}
        for layer, (tokens, experts) in self.layers.items():
            totals = [0] * self.num_experts
            for n, e in zip(tokens, experts, strict=True):
                totals[e] += n
            out[layer] = totals
        return out


@dataclass(slots=True)
class ClusterStatus:
    """What the router reports about the pools (GetClusterStatus).

    A backend fills pools and num_in_flight; the router adds its admission counters."""

    pools: list[PoolStatus]
    num_in_flight: int  # requests the backend is generating for
    num_queued: int = 0  # requests admitted by the router and not finished
    num_queued_tokens: int = 0  # their prompt tokens
