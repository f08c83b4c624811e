"""The one request builder every protocol calls (epcluster.v1, OpenAI HTTP, vLLM's engine
gRPC): a protocol maps its own wire fields to a prompt's token ids and SamplingParams, and
make_request does the rest the same way for all of them: the request id (checked, or a random
one), the prompt against the limits, the stop token ids against the vocabulary, the seed (a
random one when unset, so the request is reproducible downstream), the deadline."""

import dataclasses
import secrets
import uuid

from engine.messages import GenerateRequest
from engine.model_info import PromptLimits, check_prompt, check_stop_token_ids
from engine.sampling_params import MAX_SEED, SamplingParams

MAX_REQUEST_ID_LEN = 256


class InvalidField(ValueError):
    """A request's field that make_request refused: `field` is "request_id", "prompt" or
    "stop_token_ids" (each protocol names it in its own terms), the message says what to fix."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_request_id(request_id: str, name: str = "request_id") -> str:
    """-> request_id, or ValueError: empty, over MAX_REQUEST_ID_LEN characters, or holding a
    character that does not print (every front end's rule)."""
    if not request_id:
        raise ValueError(f"{name} is empty: leave it unset and the router picks one")
    if len(request_id) > MAX_REQUEST_ID_LEN:
        raise ValueError(
            f"{name} has {len(request_id)} characters: use at most {MAX_REQUEST_ID_LEN}"
        )
    if not request_id.isprintable():
        # NOTE: the id goes into the router's log lines: a newline would forge one.
        raise ValueError(
            f"{name} {request_id[:40]!r} holds a character that does not print (a "
            "control, format, private-use or unassigned one, or a space other than ' '): "
            "use printable characters"
        )
    return request_id


def make_request(
    request_id: str | None,
    prompt_ids: list[int],
    params: SamplingParams,
    limits: PromptLimits,
    deadline: float | None = None,
    id_name: str = "request_id",
) -> GenerateRequest:
    """-> the GenerateRequest the backends take, or InvalidField. `request_id` None: a random
    one; `id_name`: how the protocol calls the id in its messages; `deadline`: time.time() after
    which the request is aborted (None: none). `params` is not changed: the seed is filled in a
    copy (dataclasses.replace runs SamplingParams' checks again)."""
    if request_id is None:
        request_id = uuid.uuid4().hex
    try:
        check_request_id(request_id, id_name)
    except ValueError as e:
        raise InvalidField("request_id", str(e)) from None
    try:
        prompt_ids = check_prompt(prompt_ids, limits)
    except ValueError as e:
        raise InvalidField("prompt", str(e)) from None
    try:
        check_stop_token_ids(params.stop_token_ids, limits)
    except ValueError as e:
        raise InvalidField("stop_token_ids", str(e)) from None
    if params.seed is None:
        params = dataclasses.replace(params, seed=secrets.randbelow(MAX_SEED))
    return GenerateRequest(request_id, prompt_ids, params, params.seed, deadline)
