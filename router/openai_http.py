"""OpenAI-compatible HTTP on the router (FastAPI): /v1/models, /v1/completions,
/v1/chat/completions (streaming as server-sent events ending in `data: [DONE]`), /health and
/metrics. Every request goes through router/frontend.py, the path gRPC uses: the same
validation, admission, readiness wait, metrics and aborts (a client that disconnects mid-stream
aborts its request and frees its blocks).

Errors use OpenAI's envelope `{"error": {"message", "type", "param", "code"}}`: 400 bad input,
401 a missing or wrong bearer token, 404 an unknown model, 429 admission refused, 503 not ready
or draining (with Retry-After), 504 deadline, 500 internal. Sampling fields beyond OpenAI's are
vLLM's (`top_k`, `min_p`, `ignore_eos`, `stop_token_ids`, `seed`); fields epcluster cannot honour
(n > 1, penalties, logit_bias, tools, echo, ...) are refused with 400, never ignored.
"""

import asyncio
import dataclasses
import hmac
import json
import secrets
import time
import uuid
from typing import Any

import jinja2.sandbox
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from engine.messages import GenerateRequest
from engine.model_info import check_prompt, check_stop_token_ids
from engine.sampling_params import MAX_SEED, SamplingParams
from router.convert import check_request_id
from router.frontend import Frontend, Refused, off_loop
from router.openai_views import HTTP_STATUS, OpenAIView, error_body, gather

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


class HttpError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code


def _refused_response(e: Refused) -> JSONResponse:
    status = HTTP_STATUS.get(e.status, 500)
    headers = (
        {} if e.retry_after_s is None else {"Retry-After": str(max(1, round(e.retry_after_s)))}
    )
    return JSONResponse(error_body(status, e.message, code=e.status), status, headers=headers)


class OpenAIServer:
    """The app's request handling over a Frontend; `app` is the FastAPI application."""

    def __init__(
        self,
        frontend: Frontend,
        model_name: str,
        registry: CollectorRegistry | None = None,
        chat_template: str | None = None,
        token: str | None = None,
    ) -> None:
        self.frontend, self.backend = frontend, frontend.backend
        self.model_name = model_name
        self.registry = registry
        self.token = None if token is None else f"Bearer {token}".encode()
        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self.chat_template = env.from_string(chat_template or DEFAULT_CHAT_TEMPLATE)
        self.app = self._build()

    # ---- the app ----

    def _build(self) -> FastAPI:
        app = FastAPI(title="epcluster", docs_url=None, redoc_url=None)

        @app.middleware("http")
        async def auth_and_request_id(request: Request, call_next):
            if self.token is not None and request.url.path.startswith("/v1/"):
                sent = request.headers.get("authorization", "").encode()
                if not hmac.compare_digest(sent, self.token):
                    return JSONResponse(
                        error_body(
                            401,
                            "missing or wrong bearer token: send the header "
                            "`Authorization: Bearer <token>`",
                        ),
                        401,
                    )
            response = await call_next(request)
            if "x-request-id" in request.headers:
                response.headers["X-Request-Id"] = request.headers["x-request-id"]
            return response

        @app.exception_handler(HttpError)
        async def http_error(_: Request, e: HttpError):
            return JSONResponse(error_body(e.status, e.message, e.param, e.code), e.status)

        @app.exception_handler(Refused)
        async def refused(_: Request, e: Refused):
            return _refused_response(e)

        @app.get("/health")
        async def health():
            ok = self.backend.ready() and not self.frontend.draining
            return Response(status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics():
            if self.registry is None:
                raise HttpError(404, "metrics are off on this router (metrics_port: null)")
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models():
            info = self.backend.model_info()
            return {
                "object": "list",
                "data": [
                    {
                        "id": self.model_name,
                        "object": "model",
                        "created": 0,
                        "owned_by": "epcluster",
                        "root": info.model,
                        "max_model_len": info.max_model_len,
                    }
                ],
            }

        @app.post("/v1/completions")
        async def completions(request: Request):
            body = await _json(request)
            prompts = self._completion_prompts(body.get("prompt"))
            return await self._respond(request, body, prompts, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request):
            body = await _json(request)
            return await self._respond(request, body, [self._render_chat(body)], chat=True)

        return app

    # ---- requests in ----

    def _check_common(self, body: dict) -> None:
        if body.get("model") not in (None, self.model_name):
            raise HttpError(
                404,
                f"model {body.get('model')!r} is not served here: this router "
                f"serves {self.model_name!r} (GET /v1/models)",
                "model",
                "model_not_found",
            )
        if body.get("n", 1) != 1:
            raise HttpError(400, "n must be 1 (one choice per prompt): send more requests", "n")
        for field, off in UNSUPPORTED.items():
            if body.get(field, off) not in (off, None):
                raise HttpError(
                    400, f"{field} is not supported by epcluster: leave it unset", field
                )

    def _completion_prompts(self, prompt: Any) -> list[str | list[int]]:
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

    def _render_chat(self, body: dict) -> str:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise HttpError(400, "messages must be a non-empty list", "messages")
        flat = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant"):
                raise HttpError(
                    400, f"messages[{i}] needs a role of system, user or assistant", "messages"
                )
            content = m.get("content")
            if isinstance(content, list):  # parts: text only
                if any(not isinstance(p, dict) or p.get("type") != "text" for p in content):
                    raise HttpError(
                        400, f"messages[{i}]: only text content parts are supported", "messages"
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
        except jinja2.TemplateError as e:
            raise HttpError(
                400, f"the chat template failed on these messages: {e}", "messages"
            ) from e

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
        if chat and body.get("logprobs"):
            fields["logprobs"] = body.get("top_logprobs") or 0
        elif not chat and body.get("logprobs") is not None:
            fields["logprobs"] = body["logprobs"]
        try:
            params = SamplingParams(**fields)
        except ValueError as e:
            raise HttpError(400, str(e), str(e).split(" ", 1)[0]) from None
        if chat and "max_tokens" not in fields:  # unset in chat: up to the context
            params.max_tokens = self.backend.model_info().max_model_len
        if params.seed is None:
            params.seed = secrets.randbelow(MAX_SEED)
        try:
            check_stop_token_ids(params.stop_token_ids, self.backend.prompt_limits())
        except ValueError as e:
            raise HttpError(400, str(e), "stop_token_ids") from None
        return params

    def _requests(self, request: Request, body: dict, prompts: list, chat: bool):
        self._check_common(body)
        params = self._params(body, chat)
        limits = self.backend.prompt_limits()
        base = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            check_request_id(base, "X-Request-Id")
        except ValueError as e:
            raise HttpError(400, str(e), "X-Request-Id") from None
        out = []
        for i, prompt in enumerate(prompts):
            ids = self.backend.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
            try:
                ids = check_prompt(ids, limits)
            except ValueError as e:
                raise HttpError(400, str(e), "messages" if chat else "prompt") from None
            rid = base if len(prompts) == 1 else f"{base}-{i}"
            p = dataclasses.replace(params)
            out.append(GenerateRequest(rid, ids, p, p.seed))
        return out

    # ---- responses out ----

    async def _respond(self, request: Request, body: dict, prompts: list, chat: bool):
        text = sum(len(p) for p in prompts if isinstance(p, str))
        reqs = await off_loop(text, self._requests, request, body, prompts, chat)
        start = time.monotonic()
        ident = f"{'chatcmpl' if chat else 'cmpl'}-{reqs[0].request_id}"
        created = int(time.time())
        streams = [self.frontend.generate(r, start) for r in reqs]
        # the first delta of each: a refusal is an HTTP error, not a broken stream
        firsts = []
        try:
            for s in streams:
                firsts.append(await anext(s))
        except Refused:
            for s in streams:
                await s.aclose()
            raise
        view = OpenAIView(self.model_name, self.backend.tokenizer, ident, created, chat, body)
        if not body.get("stream"):
            try:
                outs = await asyncio.gather(*(gather(f, s) for f, s in zip(firsts, streams)))
            finally:
                for s in streams:
                    await s.aclose()
            return JSONResponse(view.whole(outs))
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(
            view.sse(firsts, streams, usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )


async def start(app: FastAPI, host: str, port: int) -> tuple[uvicorn.Server, asyncio.Task, int]:
    """Serve `app` on host:port (0: a free one) on the running loop; -> the server, its task,
    the bound port."""
    server = uvicorn.Server(
        uvicorn.Config(
            app, host=host, port=port, log_level="warning", lifespan="off", access_log=False
        )
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():  # it failed to bind: its exception says why
            task.result()
            raise RuntimeError(f"the HTTP server on {host}:{port} stopped at start")
        await asyncio.sleep(0.02)
    return server, task, server.servers[0].sockets[0].getsockname()[1]


async def _json(request: Request) -> dict:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise HttpError(400, f"the body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise HttpError(400, "the body must be a JSON object")
    return body


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)
