"""Protobuf <-> engine dataclasses, and the validation of a Generate request on the way in.

Every check raises ValueError with a message that says what to fix; the server answers it as
INVALID_ARGUMENT. Nothing here does I/O.
"""

import math

from google.protobuf.message import Message
from google.protobuf.unknown_fields import UnknownFieldSet

from engine.messages import (
    GenerateRequest,
    RequestOutput,
    TokenLogprobs,
)
from engine.model_info import PromptLimits
from engine.sampling_params import MAX_SEED, SamplingParams
from engine.tokenizer import Tokenizer
from router.proto import epcluster_pb2 as pb
from router.requests import InvalidField, make_request

MAX_INT32 = 2**31 - 1
# Every front end's bounds on SamplingParams' numbers, checked before SamplingParams: each must
# fit the signed wire field it travels in between router and ranks (int32; int64 for seed), and a
# float must be finite. JSON integers are unbounded: a top_k of 2**63 from HTTP once overflowed
# the sampler's int64 tensor on a rank and re-formed its pool. The ranges (max_tokens >= 1,
# logprobs <= 20, ...) are SamplingParams' own, with its messages.
INT_BOUNDS = {
    "max_tokens": (-(2**31), MAX_INT32),
    "top_k": (-(2**31), MAX_INT32),
    "logprobs": (-(2**31), MAX_INT32),
    "seed": (-(2**63), MAX_SEED - 1),
}
FLOAT_FIELDS = ("temperature", "top_p", "min_p")

FINISH_TO_PROTO = {
    None: pb.FINISH_REASON_UNSPECIFIED,
    "stop": pb.FINISH_REASON_STOP,
    "length": pb.FINISH_REASON_LENGTH,
    "abort": pb.FINISH_REASON_ABORT,
}
FINISH_FROM_PROTO = {v: k for k, v in FINISH_TO_PROTO.items()}

# Optional scalars of pb.SamplingParams; unset ones keep engine.SamplingParams' defaults.
_OPTIONAL_PARAMS = ("max_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "ignore_eos")


# ---- Generate: request in ----


def unknown_fields(msg: Message, path: str = "") -> list[str]:
    """Paths of the fields in msg (and its set sub-messages) that this schema cannot read, e.g.
    ["sampling_params.#42"]. Parsing keeps them; a client built from another version of
    epcluster.proto would otherwise have them silently ignored. A known field number that
    arrives with another wire type (a double for top_k) is kept the same way: it is named, as
    "sampling_params.top_k (#3) with the wrong wire type"."""
    by_number = msg.DESCRIPTOR.fields_by_number
    found = []
    for f in UnknownFieldSet(msg):
        known = by_number.get(f.field_number)
        if known is None:
            found.append(f"{path}#{f.field_number}")
        else:
            found.append(f"{path}{known.name} (#{f.field_number}) with the wrong wire type")
    for field, value in msg.ListFields():
        if field.message_type is None:
            continue
        children = value if field.is_repeated else [value]
        for i, child in enumerate(children):
            index = f"[{i}]" if field.is_repeated else ""
            found += unknown_fields(child, f"{path}{field.name}{index}.")
    return found


def check_int(name: str, value: object, lo: int, hi: int) -> int:
    """-> value, or ValueError naming the field: not an int (bool is not one), or outside
    [lo, hi]."""
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {type(value).__name__}")
    if not lo <= value <= hi:
        shown = str(value) if value.bit_length() <= 128 else f"a {value.bit_length()}-bit integer"
        raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {shown}")
    return value


def check_float(name: str, value: object) -> float:
    """-> value as a float, or ValueError naming the field: not a number, too large for a float
    (a JSON integer of 400 digits), or not finite."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    try:
        number = float(value)
    except OverflowError:
        raise ValueError(f"{name} must be finite, got a number too large for a float") from None
    if not math.isfinite(number):
        raise ValueError(f"{name} must be finite, got {number}")
    return number


def check_bounds(fields: dict[str, object]) -> None:
    """ValueError naming the first number of `fields` (SamplingParams' keyword arguments)
    outside the edge bounds (INT_BOUNDS, finite floats); their ranges are SamplingParams'."""
    for name, value in fields.items():
        if name in INT_BOUNDS and value is not None:
            check_int(name, value, *INT_BOUNDS[name])
        elif name in FLOAT_FIELDS:
            check_float(name, value)


def sampling_params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    """-> engine SamplingParams (unset fields take the engine defaults), or ValueError."""
    kwargs: dict[str, object] = {k: getattr(msg, k) for k in _OPTIONAL_PARAMS if msg.HasField(k)}
    if msg.HasField("logprobs"):
        kwargs["logprobs"] = msg.logprobs
    check_bounds(kwargs)
    return SamplingParams(stop=list(msg.stop), stop_token_ids=list(msg.stop_token_ids), **kwargs)


def conversion_cost(msg: Message) -> int:
    """How much a Generate request's conversion tokenizes or checks, in characters of text or
    token ids, for off_loop: a 4 MiB message holds ~1M token ids, each checked in Python."""
    for field in ("text", "token_ids", "tokenized"):
        if field in msg.DESCRIPTOR.fields_by_name and msg.HasField(field):
            value = getattr(msg, field)
            if isinstance(value, str):
                return len(value)
            return len(value.ids if field == "token_ids" else value.input_ids)
    return 0


def sampling_params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    msg = pb.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_k=params.top_k,
        top_p=params.top_p,
        min_p=params.min_p,
        stop=params.stop,
        stop_token_ids=params.stop_token_ids,
        ignore_eos=params.ignore_eos,
    )
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    return msg


def generate_request_to_proto(
    prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
) -> pb.GenerateRequest:
    """The client side: a text or token-id prompt and engine SamplingParams as a request."""
    msg = pb.GenerateRequest(sampling_params=sampling_params_to_proto(params or SamplingParams()))
    if isinstance(prompt, str):
        msg.text = prompt
    else:
        msg.token_ids.ids.extend(prompt)
        msg.token_ids.SetInParent()  # an empty list is still a token-id prompt (and refused)
    if request_id is not None:
        msg.request_id = request_id
    return msg


def prompt_token_ids(msg: pb.GenerateRequest, tokenizer: Tokenizer) -> list[int]:
    """The request's prompt as token ids (make_request checks them against the limits)."""
    kind = msg.WhichOneof("prompt")
    if kind is None:
        raise ValueError("no prompt: set `text` or `token_ids`")
    if kind == "text":
        if not msg.text:
            raise ValueError("prompt text is empty: give at least one character")
        ids = tokenizer.encode(msg.text)
        if not ids:
            raise ValueError(f"prompt text {msg.text[:40]!r} encodes to no tokens")
    else:
        ids = list(msg.token_ids.ids)
        if not ids:
            raise ValueError("token_ids is empty: give at least one token id")
    return ids


def generate_request_from_proto(
    msg: pb.GenerateRequest,
    tokenizer: Tokenizer,
    limits: PromptLimits,
    deadline: float | None = None,
) -> GenerateRequest:
    """Validate and tokenize a Generate request: its own fields here, the rest (the id, random
    when unset; the prompt's limits; the stop ids; the seed, random when unset) in
    router/requests.py's make_request, as every protocol does."""
    unknown = unknown_fields(msg)
    if unknown:
        raise ValueError(
            f"request has fields this server does not know: {', '.join(unknown)} "
            "(client and server must use the same epcluster.proto)"
        )
    ids = prompt_token_ids(msg, tokenizer)
    try:
        params = sampling_params_from_proto(msg.sampling_params)
    except ValueError as e:
        raise ValueError(f"sampling_params: {e}") from None
    request_id = msg.request_id if msg.HasField("request_id") else None
    try:
        return make_request(request_id, ids, params, limits, deadline)
    except InvalidField as e:
        if e.field == "stop_token_ids":
            raise ValueError(f"sampling_params: {e}") from None
        raise


# ---- Generate: responses out ----


def output_to_proto(out: RequestOutput, ttft_s: float | None = None) -> pb.GenerateResponse:
    msg = pb.GenerateResponse(
        request_id=out.request_id,
        token_ids=out.token_ids,
        text=out.text,
        finish_reason=FINISH_TO_PROTO[out.finish_reason],
        usage=pb.Usage(
            prompt_tokens=out.num_prompt_tokens,
            completion_tokens=out.num_completion_tokens,
            cached_tokens=out.num_cached_tokens,
        ),
    )
    if ttft_s is not None:
        msg.time_to_first_token_s = ttft_s
    for lp in out.logprobs or []:
        msg.logprobs.add(
            token_id=lp.token_id,
            logprob=lp.logprob,
            top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in lp.top],
        )
    return msg


def output_from_proto(msg: pb.GenerateResponse) -> RequestOutput:
    """A delta as the engine would have reported it (logprobs None when none came)."""
    logprobs = [
        TokenLogprobs(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
        for lp in msg.logprobs
    ]
    return RequestOutput(
        request_id=msg.request_id,
        token_ids=list(msg.token_ids),
        text=msg.text,
        finish_reason=FINISH_FROM_PROTO[msg.finish_reason],
        num_prompt_tokens=msg.usage.prompt_tokens,
        num_completion_tokens=msg.usage.completion_tokens,
        num_cached_tokens=msg.usage.cached_tokens,
        logprobs=logprobs or None,
    )
