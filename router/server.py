"""The router's host: one process serving the protocols of router/api/ over one request path
(router/frontend.py). gRPC (grpc.aio) carries epcluster.v1 (router/api/v1_grpc.py), vLLM's
engine protocol when mounted (serve_vllm), the standard health service and server reflection;
OpenAI HTTP runs beside it (serve_http). Health answers two questions: service "" and the
served services are readiness (NOT_SERVING until the backend can take work, and while a pool
re-forms); service LIVENESS_SERVICE is the process (SERVING from the start until shutdown: a
probe that restarts the router watches it, so a re-form never restarts the router).
"""

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from google.protobuf.descriptor import ServiceDescriptor
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from router.admission import Admission, AdmissionConfig
from router.api import openai_http
from router.api.abort_scope import AbortScope
from router.api.grpc_service import add_service
from router.api.v1_grpc import SERVICE as V1_SERVICE
from router.api.v1_grpc import InferenceServicer
from router.api.vllm_grpc import SERVICE as VLLM_SERVICE
from router.api.vllm_grpc import VllmEngineServicer
from router.auth import ServerSecurity
from router.backend import Backend
from router.frontend import Frontend
from router.metrics import RouterMetrics

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger(__name__)

LIVENESS_SERVICE = "liveness"  # health service: SERVING while the router's loop answers
_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class RouterServer:
    """A router: the grpc.aio server on its own event loop in a background thread, so that sync
    code (tests, a CLI) and async code can both start and stop it. epcluster.v1 is always
    served; vLLM's engine protocol is mounted with serve_vllm() before start(), OpenAI HTTP
    with serve_http() after it."""

    def __init__(
        self,
        backend: Backend,
        host: str = "127.0.0.1",
        port: int = 50051,
        *,
        admission: AdmissionConfig | None = None,
        ready_poll_s: float = 0.1,
        ready_wait_s: float = 30.0,
        metrics: RouterMetrics | None = None,
        security: ServerSecurity | None = None,
    ) -> None:
        self.backend = backend
        self.security = security or ServerSecurity()
        self._http = self._http_task = None  # OpenAI HTTP, when serve_http() started it
        self.http_port: int | None = None
        self.host, self._asked_port = host, port
        self.port: int | None = None  # bound by start()
        self.ready_poll_s = ready_poll_s
        admission = admission or AdmissionConfig()
        self.frontend = Frontend(backend, Admission(admission), ready_wait_s, metrics)
        self.servicer = InferenceServicer(self.frontend)
        self.vllm: VllmEngineServicer | None = None  # serve_vllm() mounts it
        self._services: list[tuple[object, ServiceDescriptor]] = [(self.servicer, V1_SERVICE)]
        self._serving = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def serve_vllm(self, model_name: str, checkpoint: Path | None) -> "RouterServer":
        """Also serve vLLM's engine gRPC protocol (router/api/vllm_grpc.py) for gateways, on
        the gRPC port; `checkpoint`: the directory GetTokenizer zips. Before start()."""
        if self.port is not None:
            raise RuntimeError("serve_vllm() mounts a gRPC service: call it before start()")
        self.vllm = VllmEngineServicer(self.frontend, model_name, checkpoint)
        self.vllm.aborts = AbortScope(self.frontend, self.security)  # who may Abort what
        self._services.append((self.vllm, VLLM_SERVICE))
        return self

    @property
    def services(self) -> list[str]:
        """The full names of the gRPC services mounted (their health mirrors readiness)."""
        return [descriptor.full_name for _, descriptor in self._services]

    def start(self) -> "RouterServer":
        """Bind host:port (0 picks a free port: see .port) and serve."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="router", daemon=True)
        self._thread.start()
        try:
            self.port = self._run(self._start(self.host, self._asked_port))
        except BaseException:
            self._close_loop()
            raise
        return self

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
        if self._loop is None or self._loop.is_closed():
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
        """Also serve OpenAI-compatible HTTP on this router's host (router/api/openai_http.py), over
        the same request path and under the same security as gRPC (TLS, mutual TLS, the token
        on every route but /health); -> the bound port (0 picks a free one)."""

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
        for servicer, descriptor in self._services:
            add_service(self._server, servicer, descriptor)
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
        assert self._loop is not None and self._thread is not None
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
) -> RouterServer:
    """Start a router serving epcluster.v1 on host:port (0 picks a free port: see .port) and
    return it. Health is NOT_SERVING until backend.ready(); `wait_ready()` blocks until then.
    `security`: TLS and a bearer token (router/auth.py); plaintext and open by default. For
    vLLM's protocol too: RouterServer(...).serve_vllm(model_name, checkpoint).start()."""
    return RouterServer(
        backend,
        host,
        port,
        admission=admission,
        ready_poll_s=ready_poll_s,
        ready_wait_s=ready_wait_s,
        metrics=metrics,
        security=security,
    ).start()
