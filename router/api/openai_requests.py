"""The OpenAI HTTP front end's input edge (router/api/openai_http.py): a request body, as bytes, ->
validated GenerateRequests, or HttpError (400, 404, 413) naming what to fix.

NOTE: everything here runs on a worker thread (OpenAIServer parses off the router's event loop):
the JSON parse of up to 4 MiB, the chat template, tokenizing and checking up to a million token
ids each take from milliseconds to seconds, and on the loop they stalled every gRPC and HTTP
stream and the health checks with them. So nothing here may touch the loop or the request.

JSON integers are unbounded and JSON floats may be 1e400 (inf): every number is bounded here,
before SamplingParams, so that no value can reach a tensor unchecked (a top_k of 2**63 once
overflowed the sampler's int64 tensor on a rank and re-formed its pool).
"""

import dataclasses
import json
import re
import secrets
import uuid
from typing import Any

import jinja2.sandbox

from engine.messages import GenerateRequest
from engine.sampling_params import MAX_SEED, SamplingParams
from router.api.convert import FLOAT_FIELDS, INT_BOUNDS, check_float, check_int
from router.requests import InvalidField, make_request

# A plain template for checkpoints without one (the presets): role-tagged turns, then the
# assistant's turn to continue.
DEFAULT_CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
UNSUPPORTED = {  # field: the value that means "not used"
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "logit_bias": None,
    "best_of": None,
    "echo": False,
    "suffix": None,
    "tools": None,
    "functions": None,
    "tool_choice": None,
    "response_format": None,
    "min_tokens": 0,
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "lora_request": None,
}
MAX_PROMPTS = 128  # prompts of one /v1/completions request: each is a request of its own
MAX_MESSAGES = 1024  # messages of one chat request (the template's work grows with them)
INT_FIELDS = {  # field: its bounds, checked before SamplingParams sees it
    "max_completion_tokens": INT_BOUNDS["max_tokens"],
    **{k: v for k, v in INT_BOUNDS.items() if k != "logprobs"},  # bool in chat
}
BOOL_FIELDS = ("stream", "ignore_eos")


class HttpError(Exception):
    """An answer other than 200: status, a one-line message, the offending field."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: object = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def parse_json(raw: bytes) -> dict:
    """The body as a JSON object, or 400 (not JSON, not an object, nested too deeply)."""
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError; an int of 4,300+ digits
        raise HttpError(400, f"the body is not valid JSON: {_first_line(e)}") from None
    except RecursionError:
        # NOTE: json.loads recurses once per nesting level; a 100,000-deep array was a 500.
        raise HttpError(400, "the body's JSON is nested too deeply") from None
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw) and _holds_lone_surrogate(body):
        # NOTE: JSON's "\ud800" alone is no Unicode character: the tokenizer raised TypeError
        # on such a prompt (a 500), and it cannot be written back out as UTF-8 either.
        raise HttpError(400, "the body holds a lone surrogate escape (\\ud800-\\udfff): not text")
    return body


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _holds_lone_surrogate(value: object) -> bool:
    """Whether any string (or key) in a parsed JSON value is not encodable as UTF-8."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
    return False


def _short(value: object) -> str:
    """A value for an error message: its repr cut to 40 characters (bodies may be 4 MiB)."""
    try:
        text = repr(value)
    except (RecursionError, ValueError):  # a deep list; an int over repr's 4,300 digits
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 40 else text[:37] + "..."


class RequestParser:
    """Bodies -> GenerateRequests for one model, with the backend's limits and tokenizer."""

    def __init__(self, backend: Any, model_name: str, chat_template: str | None) -> None:
        self.backend, self.model_name = backend, model_name
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.chat_template = env.from_string(chat_template or DEFAULT_CHAT_TEMPLATE)

    def parse(self, raw: bytes, chat: bool, request_id: str | None) -> tuple[dict, list]:
        """-> (the body, its GenerateRequests), or HttpError. On a worker thread."""
        body = parse_json(raw)
        self._check_common(body, chat)
        if chat:
            prompts: list[str | list[int]] = [self._render_chat(body)]
        else:
            prompts = completion_prompts(body.get("prompt"))
        return body, self._requests(request_id, body, prompts, chat)

    def _check_common(self, body: dict, chat: bool) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise HttpError(
                404,
                f"model {_short(model)} is not served here: this router "
                f"serves {self.model_name!r} (GET /v1/models)",
                "model",
                "model_not_found",
            )
        if body.get("n") is not None and (not _is_int(body["n"]) or body["n"] != 1):
            raise HttpError(400, "n must be 1 (one choice per prompt): send more requests", "n")
        for field, (lo, hi) in INT_FIELDS.items():
            if body.get(field) is not None:
                _edge(check_int, field, body[field], lo, hi)
        for field in FLOAT_FIELDS:
            if body.get(field) is not None:
                _edge(check_float, field, body[field])
        for field in BOOL_FIELDS:
            if body.get(field) is not None and not isinstance(body[field], bool):
                raise HttpError(400, f"{field} must be true or false", field)
        options = body.get("stream_options")
        if options is not None and (
            not isinstance(options, dict)
            or not isinstance(options.get("include_usage", False), bool)
        ):
            raise HttpError(
                400, 'stream_options must be {"include_usage": true|false}', "stream_options"
            )
        if chat:
            if body.get("logprobs") is not None and not isinstance(body["logprobs"], bool):
                raise HttpError(400, "logprobs must be true or false in chat", "logprobs")
            if body.get("top_logprobs") is not None:
                _edge(check_int, "top_logprobs", body["top_logprobs"], *INT_BOUNDS["logprobs"])
        elif body.get("logprobs") is not None:
            _edge(check_int, "logprobs", body["logprobs"], *INT_BOUNDS["logprobs"])
        for field, off in UNSUPPORTED.items():
            if body.get(field, off) not in (off, None):
                raise HttpError(
                    400, f"{field} is not supported by epcluster: leave it unset", field
                )

    def _render_chat(self, body: dict) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HttpError(400, "messages must be a non-empty list", "messages")
        if len(messages) > MAX_MESSAGES:
            raise HttpError(
                400, f"messages holds {len(messages)}: at most {MAX_MESSAGES}", "messages"
            )
        flat = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
                raise HttpError(
                    400, f"messages[{i}] needs a role of system, user or assistant", "messages"
                )
            content = m.get("content")
            if isinstance(content, list):  # parts: text only
                if any(
                    not isinstance(p, dict)
                    or p.get("type") != "text"
                    or not isinstance(p.get("text", ""), str)
                    for p in content
                ):
                    raise HttpError(
                        400,
                        f"messages[{i}]: only text content parts (a string `text`) are supported",
                        "messages",
                    )
                content = "".join(p.get("text", "") for p in content)
            if not isinstance(content, str):
                raise HttpError(
                    400, f"messages[{i}].content must be a string or text parts", "messages"
                )
            flat.append({"role": m["role"], "content": content})
        try:
            return self.chat_template.render(
                messages=flat, add_generation_prompt=True, bos_token="", eos_token=""
            )
        except Exception as e:  # the checkpoint's template: any error is the input's
            # NOTE: a template may raise TypeError, ValueError or its own raise_exception(): each
            # is this request's problem (400), never the router's (it was a 500).
            first = str(e).splitlines()[0][:200] if str(e) else ""
            raise HttpError(
                400,
                f"the chat template failed on these messages: {type(e).__name__}: {first}",
                "messages",
            ) from None

    def _params(self, body: dict, chat: bool) -> SamplingParams:
        fields = {
            k: body[k]
            for k in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "seed",
                "ignore_eos",
                "stop_token_ids",
            )
            if body.get(k) is not None
        }
        if body.get("stop") is not None:
            fields["stop"] = body["stop"]
        max_tokens = (
            body.get("max_completion_tokens", body.get("max_tokens"))
            if chat
            else (body.get("max_tokens", 16))
        )
        if max_tokens is not None:
            fields["max_tokens"] = max_tokens
        elif chat:  # unset in chat: up to the context
            fields["max_tokens"] = self.backend.model_info().max_model_len
        if chat and body.get("logprobs"):
            fields["logprobs"] = body.get("top_logprobs") or 0
        elif not chat and body.get("logprobs") is not None:
            fields["logprobs"] = body["logprobs"]
        try:
            return SamplingParams(**fields)
        except (ValueError, TypeError, OverflowError, RecursionError) as e:
            raise HttpError(400, _first_line(e), str(e).split(" ", 1)[0]) from None

    def _requests(
        self, request_id: str | None, body: dict, prompts: list, chat: bool
    ) -> list[GenerateRequest]:
        params = self._params(body, chat)
        limits = self.backend.prompt_limits()
        # one seed for the prompts of one body, as before the builder drew them
        if params.seed is None:
            params = dataclasses.replace(params, seed=secrets.randbelow(MAX_SEED))
        base = request_id or uuid.uuid4().hex
        fields = {"request_id": "X-Request-Id", "prompt": "messages" if chat else "prompt"}
        out = []
        for i, prompt in enumerate(prompts):
            ids = self.backend.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            rid = base if len(prompts) == 1 else f"{base}-{i}"
            try:
                request = make_request(
                    rid, ids, dataclasses.replace(params), limits, id_name="X-Request-Id"
                )
            except InvalidField as e:
                raise HttpError(400, str(e), fields.get(e.field, e.field)) from None
            out.append(request)
        return out


def completion_prompts(prompt: Any) -> list[str | list[int]]:
    """/v1/completions' `prompt` -> a list of text or token-id prompts, or 400."""
    if isinstance(prompt, list) and len(prompt) > MAX_PROMPTS and not all(map(_is_int, prompt)):
        raise HttpError(
            400, f"prompt holds {len(prompt)} prompts: at most {MAX_PROMPTS} a request", "prompt"
        )
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
        return [list(prompt)]
    if (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in prompt)
    ):
        return [list(p) for p in prompt]
    raise HttpError(
        400,
        "prompt must be a string, a list of strings, a list of token ids "
        "or a list of such lists, none empty",
        "prompt",
    )


def _edge(check: Any, field: str, value: object, *bounds: int) -> None:
    try:
        check(field, value, *bounds)
    except ValueError as e:
        raise HttpError(400, str(e), field) from None


def _first_line(e: BaseException) -> str:
    text = str(e).splitlines()[0] if str(e) else type(e).__name__
    return text[:300]


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
