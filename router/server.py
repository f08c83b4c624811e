"""The router's gRPC edge: the epcluster.v1.Inference service on grpc.aio, plus the standard
health service and server reflection. Health answers two questions: service "" and the served
services are readiness (NOT_SERVING until the backend can take work, and while a pool
re-forms); service LIVENESS_SERVICE is the process (SERVING from the start until shutdown: a
probe that restarts the router watches it, so a re-form never restarts the router).

Generate: validate (INVALID_ARGUMENT), then router/frontend.py's request path (admission,
readiness, streaming, aborts on early ends), its refusals as gRPC statuses.
"""

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from router import convert
from router.abort_scope import AbortScope
from router.admission import Admission, AdmissionConfig
from router.auth import ServerSecurity
from router.backend import Backend, Unavailable
from router.frontend import Frontend, Refused, off_loop
from router.grpc_service import add_service
from router.metrics import RouterMetrics
from router.proto import epcluster_pb2 as pb
from router.proto import epcluster_pb2_grpc as pb_grpc

if TYPE_CHECKING:
    from pathlib import Path

    from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Inference"].full_name  # "epcluster.v1.Inference"
VLLM_SERVICE_NAME = "vllm.grpc.engine.VllmEngine"  # router/vllm_grpc.py
LIVENESS_SERVICE = "liveness"  # health service: SERVING while the router's loop answers
_INVALID = grpc.StatusCode.INVALID_ARGUMENT
RETRY_PUSHBACK = "grpc-retry-pushback-ms"  # how long a client should wait before a retry
Status = tuple[grpc.StatusCode, str]
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class InferenceServicer(pb_grpc.InferenceServicer):
    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.backend = frontend.backend

    async def Generate(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> None:
        start = time.monotonic()
        if self.frontend.draining:  # before parsing: a router that stops answers at once
            await _abort(context, self.frontend.refuse(
                "UNAVAILABLE", "this router is shutting down: retry (on another router)",
                "draining", retry=1.0,
            ))  # fmt: skip
        remaining = context.time_remaining()
        deadline = time.time() + remaining if remaining is not None else None
        try:
            text = convert.conversion_cost(request)  # text chars or token ids (checked each)
            req = await off_loop(
                text, convert.generate_request_from_proto, request, self.backend.tokenizer,
                self.backend.prompt_limits(), deadline,
            )  # fmt: skip
        except ValueError as e:
            await _abort(context, self.frontend.refuse("INVALID_ARGUMENT", str(e)))
        sent = False
        try:
            async with contextlib.aclosing(self.frontend.generate(req, start)) as deltas:
                async for out in deltas:
                    ttft = None
                    if out.token_ids and not sent:
                        ttft, sent = time.monotonic() - start, True
                    await context.write(convert.output_to_proto(out, ttft))
        except Refused as e:
            await _abort(context, e)

    async def GetModelInfo(
        self, request: pb.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> pb.ModelInfo:
        await _reject_unknown_fields(request, context)
        return convert.model_info_to_proto(self.backend.model_info())

    async def GetExpertLoad(
        self, request: pb.GetExpertLoadRequest, context: grpc.aio.ServicerContext
    ) -> pb.ExpertLoad:
        await _reject_unknown_fields(request, context)
        try:
            return convert.expert_load_to_proto(await self.backend.expert_load())
        except Unavailable as e:  # a rank failed: the pool re-forms (not UNKNOWN)
            await context.abort(grpc.StatusCode.UNAVAILABLE, _one_line(e))

    async def Rebalance(
        self, request: pb.RebalanceRequest, context: grpc.aio.ServicerContext
    ) -> pb.RebalanceResponse:
        await _reject_unknown_fields(request, context)
        pool = request.pool if request.HasField("pool") else None
        if pool not in (None, "prefill", "decode"):
            await context.abort(_INVALID, f"pool must be prefill or decode, got {pool!r}")
        try:
            results = await self.backend.rebalance(pool)
        except ValueError as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except Unavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _one_line(e))
        return convert.rebalance_response_to_proto(results)

    async def GetClusterStatus(
        self, request: pb.GetClusterStatusRequest, context: grpc.aio.ServicerContext
    ) -> pb.ClusterStatus:
        await _reject_unknown_fields(request, context)
        try:
            status = await self.backend.status()
        except Unavailable as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, _one_line(e))
        status.num_queued = self.frontend.admission.num_requests
        status.num_queued_tokens = self.frontend.admission.num_tokens
        return convert.cluster_status_to_proto(status)


async def _abort(context: grpc.aio.ServicerContext, e: Refused) -> None:
    """End the call with the refusal's status (and a retry hint where it has one)."""
    hint = () if e.retry_after_s is None else ((RETRY_PUSHBACK, str(int(e.retry_after_s * 1e3))),)
    await context.abort(grpc.StatusCode[e.status], e.message, trailing_metadata=hint)


def _one_line(e: Exception) -> str:
    """An error's first line: a status message, never a traceback."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


async def _reject_unknown_fields(request: object, context: grpc.aio.ServicerContext) -> None:
    unknown = convert.unknown_fields(request)
    if unknown:
        await context.abort(_INVALID, f"request has fields this server does not know: {unknown}")


class RouterServer:
    """A running router: the grpc.aio server on its own event loop in a background thread, so
    that sync code (tests, a CLI) and async code can both start and stop it."""

    def __init__(
        self,
        backend: Backend,
        host: str,
        port: int,
        admission: AdmissionConfig,
        ready_poll_s: float,
        ready_wait_s: float,
        metrics: RouterMetrics | None = None,
        security: ServerSecurity | None = None,
        model_name: str | None = None,
        checkpoint: "Path | None" = None,
    ) -> None:
        self.backend = backend
        self.security = security or ServerSecurity()
        self._http = self._http_task = None  # OpenAI HTTP, when serve_http() started it
        self.http_port: int | None = None
        self.host = host
        self.ready_poll_s = ready_poll_s
        self.frontend = Frontend(backend, Admission(admission), ready_wait_s, metrics)
        self.servicer = InferenceServicer(self.frontend)
        self.vllm = None  # vLLM's engine protocol, when the served model is named
        if model_name is not None:
            from router.vllm_grpc import VllmEngineServicer

            self.vllm = VllmEngineServicer(self.frontend, model_name, checkpoint)
            self.vllm.aborts = AbortScope(self.frontend, self.security)  # who may Abort what
        self.services = [SERVICE_NAME] + ([VLLM_SERVICE_NAME] if self.vllm else [])
        self._serving = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="router", daemon=True)
        self._thread.start()
        try:
            self.port = self._run(self._start(host, port))
        except BaseException:
            self._close_loop()
            raise

    @property
    def address(self) -> str:
        """host:port, usable as a gRPC target."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until health reports SERVING (the backend is ready); False on timeout."""
        return self._serving.wait(timeout)

    def drain(self) -> None:
        """Refuse new requests from now on (streams in flight go on); stop() finishes."""
        self.frontend.draining = True

    def stop(self, grace: float | None = 1.0, then: Coroutine | None = None) -> None:
        """Drain and stop: health goes NOT_SERVING, new calls are refused, in-flight streams get
        `grace` seconds to finish, then are cancelled (which aborts their requests in the
        backend); then `then` runs on the server's loop (e.g. closing the backend). Idempotent."""
        if self._loop.is_closed():
            if then is not None:
                then.close()
            return
        try:
            try:
                self._run(self._stop(grace))
            finally:  # the backend closes even when the stop failed part way
                if then is not None:
                    self._run(then)
        finally:
            self._close_loop()

    def serve_http(
        self,
        port: int,
        model_name: str,
        registry: "CollectorRegistry | None" = None,
        chat_template: str | None = None,
    ) -> int:
        """Also serve OpenAI-compatible HTTP on this router's host (router/openai_http.py), over
        the same request path and under the same security as gRPC (TLS, mutual TLS, the token
        on every route but /health); -> the bound port (0 picks a free one)."""
        from router import openai_http

        # NOTE: the token, TLS and mutual TLS are applied around the whole app by start()
        app = openai_http.OpenAIServer(self.frontend, model_name, registry, chat_template)
        self.security.warn_if_cleartext(f"OpenAI HTTP on {self.host}", self.host)
        self._http, self._http_task, self.http_port = self._run(
            openai_http.start(app.app, self.host, port, self.security)
        )
        return self.http_port

    def call(self, coro: object) -> object:
        """Run a coroutine on the server's event loop (e.g. starting a backend) and wait."""
        return self._run(coro)

    def __enter__(self) -> "RouterServer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- on the server's loop ----

    async def _start(self, host: str, port: int) -> int:
        # NOTE: without so_reuseport=0, a second server on a taken port would bind silently.
        self._server = grpc.aio.server(
            interceptors=self.security.interceptors(), options=[("grpc.so_reuseport", 0)]
        )
        add_service(self._server, self.servicer, pb.DESCRIPTOR.services_by_name["Inference"])
        if self.vllm is not None:
            from router.vllm_grpc import SERVICE

            add_service(self._server, self.vllm, SERVICE)
        self._health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        names = (*self.services, health.SERVICE_NAME, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, self._server)
        for service in ("", *self.services):
            await self._health.set(service, _NOT_SERVING)
        # NOTE: answered on this loop: a wedged loop misses the probe, a re-form does not
        await self._health.set(LIVENESS_SERVICE, _SERVING)
        bracketed = f"[{host}]" if ":" in host else host
        credentials = self.security.credentials()
        self.security.warn_if_cleartext(f"gRPC on {bracketed}:{port}", host)
        if credentials is None:
            bound = self._server.add_insecure_port(f"{bracketed}:{port}")
        else:
            bound = self._server.add_secure_port(f"{bracketed}:{port}", credentials)
        if bound == 0:
            raise RuntimeError(f"cannot bind the router to {bracketed}:{port}")
        await self._server.start()
        self._poll = asyncio.create_task(self._poll_ready())
        return bound

    async def _poll_ready(self) -> None:
        """Mirror backend.ready() into the health service (both ways: a backend that dies
        goes back to NOT_SERVING)."""
        serving = False
        while True:
            ready = bool(self.backend.ready())
            if ready != serving:
                serving = ready
                status = _SERVING if ready else _NOT_SERVING
                for service in ("", *self.services):
                    await self._health.set(service, status)
                (self._serving.set if ready else self._serving.clear)()
            await asyncio.sleep(self.ready_poll_s)

    async def _stop(self, grace: float | None) -> None:
        self.frontend.draining = True
        self._poll.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._poll
        self._serving.clear()
        await self._health.enter_graceful_shutdown()
        # NOTE: the port stays open while the streams in flight finish, so that a new call gets
        # this servicer's UNAVAILABLE with a retry hint: grpc's own stop(grace) would refuse it
        # with CANCELLED, which clients do not retry.
        end = time.monotonic() + (grace or 0.0)
        while self.frontend.in_flight and time.monotonic() < end:
            await asyncio.sleep(0.05)
        await self._server.stop(0)  # what is still in flight is cancelled (and aborted)
        # NOTE: the cancelled streams get their turn to send those aborts before the loop closes:
        # a handler never resumed is closed by the garbage collector later, its abort unsent.
        await self.frontend.settle()
        if self._http is not None:
            self._http.should_exit = True
            try:  # HTTP streams that outlive the grace: cancelled with the task
                await asyncio.wait_for(self._http_task, 30)
            except TimeoutError:
                log.warning("the HTTP server did not stop in 30 s: cancelled")

    def _run(self, coro: object) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def _close_loop(self) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()


def serve(
    backend: Backend,
    host: str = "127.0.0.1",
    port: int = 50051,
    *,
    admission: AdmissionConfig | None = None,
    ready_poll_s: float = 0.1,
    ready_wait_s: float = 30.0,
    metrics: RouterMetrics | None = None,
    security: ServerSecurity | None = None,
    model_name: str | None = None,
    checkpoint: "Path | None" = None,
) -> RouterServer:
    """Start the router on host:port (0 picks a free port: see .port) and return it. Health is
    NOT_SERVING until backend.ready(); `wait_ready()` blocks until then. `security`: TLS and a
    bearer token (router/auth.py); plaintext and open by default. With `model_name` (and the
    `checkpoint` directory, for GetTokenizer), vLLM's engine protocol is served too."""
    return RouterServer(
        backend,
        host,
        port,
        admission or AdmissionConfig(),
        ready_poll_s,
        ready_wait_s,
        metrics,
        security,
        model_name,
        checkpoint,
    )
