"""Per-request sampling parameters, validated once when the request is created."""

import math
from dataclasses import dataclass, field

MAX_LOGPROBS = 20
MAX_SEED = 2**63  # exclusive; seeds travel in signed 64-bit fields between processes
# Stop conditions are checked on every step of every request on a rank: bounded, so that one
# client cannot slow down the whole EP pool (OpenAI allows 4 stop strings).
MAX_STOP = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 64
# Below this, logits / temperature overflows float32 (1e-40 makes inf - inf = nan): such a
# temperature means greedy, as in vLLM (_SAMPLING_EPS).
MIN_TEMPERATURE = 1e-5
# Upper bounds, so that every value fits the tensors and the wire fields it reaches: JSON
# integers are unbounded, and torch.tensor([2**63], dtype=torch.int64) raises inside the
# engine's step (one such request once stopped a pool's engines). 32-bit signed, as in the
# epcluster.v1 and vLLM protos; top_k is clamped to the vocabulary, so any k up to here is valid.
MAX_INT32 = 2**31 - 1
MAX_TOKENS = MAX_INT32
MAX_TOP_K = MAX_INT32
MAX_TOKEN_ID = MAX_INT32
# Above this, logits / temperature is uniform to float32 precision for any sane logit range, and
# a temperature past 3.4e38 becomes inf in float32 (every logit then 0 or nan).
MAX_TEMPERATURE = 1e6


def _is_int(value: object) -> bool:
    # NOTE: bool is a subclass of int, but True is never a sensible token count or seed.
    return isinstance(value, int) and not isinstance(value, bool)


def _as_float(name: str, value: object) -> float:
    if not (_is_int(value) or isinstance(value, float)):
        raise ValueError(f"{name} must be a float, got {type(value).__name__} {value!r}")
    try:
        value = float(value)
    except OverflowError:  # an int past float64's range (JSON integers are unbounded)
        raise ValueError(f"{name} must be finite, got {_show(value)}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _show(value: object) -> str:
    """repr for an error message, cut short: a client's 10**5-digit integer must not come back
    whole in a one-line error (nor cost a quadratic int -> str conversion)."""
    if _is_int(value) and value.bit_length() > 128:
        return f"an integer of {value.bit_length()} bits"
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(slots=True)
class SamplingParams:
    """How to pick the next tokens of one request (field meanings follow vLLM).

    temperature == 0 (or under MIN_TEMPERATURE) means greedy; top_k 0 or -1 means off; logprobs
    is the number of top alternatives returned per token (0: only the sampled token's own
    logprob; None: nothing).

    NOTE: every integer and float is bounded here (MAX_*), so that a value a client sends can
    never overflow a tensor the engine fills; the engine validates again on the rank
    (`LLMEngine.add_request` copies the params, which runs these checks), because fields may be
    set after construction. A top_p that float32 rounds to 0 keeps the top token (the sampler
    always keeps it), so any top_p in (0, 1] is valid.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self) -> None:
        # NOTE: every invalid field raises ValueError, wrong types included, so that a caller
        # (the router turning a request into an error reply) catches one exception type.
        if not _is_int(self.max_tokens) or not 1 <= self.max_tokens <= MAX_TOKENS:
            raise ValueError(
                f"max_tokens must be an int in [1, {MAX_TOKENS}], got {_show(self.max_tokens)}"
            )

        self.temperature = _as_float("temperature", self.temperature)
        if not 0 <= self.temperature <= MAX_TEMPERATURE:
            raise ValueError(
                f"temperature must be in [0, {MAX_TEMPERATURE:g}] (0 = greedy), got "
                f"{self.temperature}"
            )

        if not _is_int(self.top_k) or not (self.top_k in (0, -1) or 1 <= self.top_k <= MAX_TOP_K):
            raise ValueError(
                f"top_k must be 0 or -1 (off) or an int in [1, {MAX_TOP_K}], got "
                f"{_show(self.top_k)}"
            )

        self.top_p = _as_float("top_p", self.top_p)
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

        self.min_p = _as_float("min_p", self.min_p)
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")

        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < MAX_SEED):
            raise ValueError(f"seed must be None or an int in [0, 2**63), got {_show(self.seed)}")

        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)):
            raise ValueError(f"stop must be a str or a list of str, got {self.stop!r}")
        self.stop = list(self.stop)
        if len(self.stop) > MAX_STOP:
            raise ValueError(f"stop holds {len(self.stop)} strings: at most {MAX_STOP}")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise ValueError(f"stop must hold non-empty strings, got {s!r} in {self.stop!r}")
            if len(s) > MAX_STOP_CHARS:
                raise ValueError(
                    f"stop strings must have at most {MAX_STOP_CHARS} characters, got one of "
                    f"{len(s)}"
                )

        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise ValueError(f"stop_token_ids must be a list of int, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(
                f"stop_token_ids holds {len(self.stop_token_ids)} ids: at most {MAX_STOP_TOKEN_IDS}"
            )
        for t in self.stop_token_ids:
            if not _is_int(t) or not 0 <= t <= MAX_TOKEN_ID:
                raise ValueError(
                    f"stop_token_ids must hold ints in [0, {MAX_TOKEN_ID}], got {_show(t)}"
                )

        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

        if self.logprobs is not None and (
            not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise ValueError(
                f"logprobs must be None or an int in [0, {MAX_LOGPROBS}], got "
                f"{_show(self.logprobs)}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE
