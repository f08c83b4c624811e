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
import hmac
import time
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from router.api import http_auth
from router.api.openai_requests import DEFAULT_CHAT_TEMPLATE, HttpError, RequestParser
from router.api.openai_views import HTTP_STATUS, OpenAIView, error_body, gather_or_disconnect
from router.auth import ServerSecurity
from router.frontend import Frontend, Refused

__all__ = ["DEFAULT_CHAT_TEMPLATE", "HttpError", "OpenAIServer", "start"]

MAX_BODY_BYTES = 4 << 20  # a request body larger than this is refused with 413
DISCONNECT_POLL_S = 0.5  # how often a non-streaming request looks for its client


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
        max_body_bytes: int = MAX_BODY_BYTES,
    ) -> None:
        self.frontend, self.backend = frontend, frontend.backend
        self.model_name = model_name
        self.registry = registry
        self.token = None if token is None else f"Bearer {token}".encode()
        self.parser = RequestParser(self.backend, model_name, chat_template)
        self.max_body_bytes = max_body_bytes
        self.app = self._build()

    # ---- the app ----

    def _build(self) -> FastAPI:
        app = FastAPI(title="epcluster", docs_url=None, redoc_url=None)

        @app.middleware("http")
        async def auth_and_request_id(
            request: Request, call_next: Callable[[Request], Awaitable[Response]]
        ) -> Response:
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
        async def http_error(_: Request, e: HttpError) -> JSONResponse:
            return JSONResponse(error_body(e.status, e.message, e.param, e.code), e.status)

        @app.exception_handler(Refused)
        async def refused(_: Request, e: Refused) -> JSONResponse:
            return _refused_response(e)

        @app.get("/health")
        async def health() -> Response:
            ok = self.backend.ready() and not self.frontend.draining
            return Response(status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics() -> Response:
            if self.registry is None:
                raise HttpError(404, "metrics are off on this router (metrics_port: null)")
            return Response(generate_latest(self.registry), media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models() -> dict[str, Any]:
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
        async def completions(request: Request) -> Response:
            return await self._respond(request, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(request: Request) -> Response:
            return await self._respond(request, chat=True)

        return app

    # ---- responses out ----

    async def _respond(self, request: Request, chat: bool) -> Response:
        """Read, parse and check the body, run its requests, answer (JSON or SSE)."""
        raw = await read_body(request, self.max_body_bytes)
        # NOTE: off the loop, always: parsing 4 MiB of JSON, rendering a chat template, checking
        # a million token ids stalled every stream and health check when done here.
        body, reqs = await asyncio.to_thread(
            self.parser.parse, raw, chat, request.headers.get("x-request-id")
        )
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
            outs = await gather_or_disconnect(request, firsts, streams, DISCONNECT_POLL_S)
            if outs is None:  # the client went away: its requests were aborted
                return Response(status_code=499)
            return JSONResponse(view.whole(outs))
        usage = bool((body.get("stream_options") or {}).get("include_usage"))
        return StreamingResponse(
            view.sse(firsts, streams, usage),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )


async def start(
    app: FastAPI, host: str, port: int, security: ServerSecurity | None = None
) -> tuple[uvicorn.Server, asyncio.Task, int]:
    """Serve `app` on host:port (0: a free one) on the running loop, under `security` (TLS,
    mutual TLS, the token: router/api/http_auth.py); -> the server, its task, the bound port."""
    security = security or ServerSecurity()
    server = http_auth.Server(  # NOTE: uvicorn.Server, stopping idle TLS connections at once
        uvicorn.Config(
            http_auth.guard(app, security),
            host=host,
            port=port,
            log_level="warning",
            lifespan="off",
            access_log=False,
            **http_auth.uvicorn_ssl(security),
        )
    )
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():  # it failed to bind: its exception says why
            task.result()
            raise RuntimeError(f"the HTTP server on {host}:{port} stopped at start")
        await asyncio.sleep(0.02)
    return server, task, server.servers[0].sockets[0].getsockname()[1]


async def read_body(request: Request, limit: int) -> bytes:
    """The body, or 413 past `limit` bytes: by its Content-Length before reading, and while
    reading (a chunked body has none). NOTE: unbounded, one client's 1 GB body was held in the
    router's memory and parsed on its event loop."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise HttpError(413, _too_large(limit), code="body_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HttpError(413, _too_large(limit), code="body_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> str:
    return f"the request body is larger than {limit} bytes: send a smaller prompt"
