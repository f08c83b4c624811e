"""One HTTP endpoint per process for Prometheus: GET /metrics (prometheus-client's exposition of
a registry), plus any JSON routes a process adds (the router serves Prometheus HTTP service
discovery at /sd/targets). A threaded WSGI server on a daemon thread: scrapes never run on an
engine thread or an event loop.

Optionally over TLS (an ssl.SSLContext; the handshake runs on the connection's thread, not the
accept loop) and behind a bearer token (Prometheus: `authorization.credentials_file`). Every
connection has a read timeout, so idle or slow clients cannot pile up threads.
"""

import hmac
import json
import socket
import ssl
import threading
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

JsonRoute = Callable[[], Any]
READ_TIMEOUT_S = 10.0  # a connection that sends nothing for this long is closed


class _Quiet(WSGIRequestHandler):
    timeout = READ_TIMEOUT_S  # socketserver sets it on the connection

    def log_message(self, format: str, *args: Any) -> None:  # scrapes every few seconds
        pass


class _Server(ThreadingWSGIServer):
    """prometheus-client's threaded server, with TLS wrapped on each connection's thread."""

    tls: ssl.SSLContext | None = None

    def finish_request(self, request: socket.socket, client_address: Any) -> None:
        if self.tls is None:
            return super().finish_request(request, client_address)
        request.settimeout(READ_TIMEOUT_S)
        try:
            conn = self.tls.wrap_socket(request, server_side=True)
        except OSError:  # a plaintext client, a bad or missing certificate, a timeout
            return
        try:
            super().finish_request(conn, client_address)
        finally:
            conn.close()


def _authorized(environ: dict, token: str | None) -> bool:
    """`Authorization: Bearer <token>` (the scheme in any case), compared in constant time (the
    same rule as router/auth.py, which engine code does not import)."""
    if token is None:
        return True
    scheme, _, sent = environ.get("HTTP_AUTHORIZATION", "").strip().partition(" ")
    sent = sent.strip().encode("utf-8", "replace") if scheme.lower() == "bearer" else b""
    return hmac.compare_digest(sent, token.encode())


class MetricsServer:
    """Serves `registry` at http://host:port/metrics (port 0: a free one; see .port); over TLS
    with `tls`, and only to requests bearing `token` when one is given."""

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        routes: dict[str, JsonRoute] | None = None,
        tls: ssl.SSLContext | None = None,
        token: str | None = None,
    ) -> None:
        metrics_app = make_wsgi_app(registry)
        self.routes = routes = dict(routes or {})  # later additions are served too
        self.scheme = "http" if tls is None else "https"

        def app(environ: dict, start_response: Callable) -> list[bytes]:
            path = environ.get("PATH_INFO", "")
            if not _authorized(environ, token):
                headers = [("Content-Type", "text/plain"), ("WWW-Authenticate", "Bearer")]
                start_response("401 Unauthorized", headers)
                return [b"missing or wrong bearer token: send `Authorization: Bearer <token>`\n"]
            if path in routes:
                body = json.dumps(routes[path]()).encode()
                start_response("200 OK", [("Content-Type", "application/json")])
                return [body]
            if path in ("/metrics", "/"):
                return metrics_app(environ, start_response)
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [f"no {path}: try /metrics{''.join(' or ' + r for r in routes)}\n".encode()]

        self._server = make_server(host, port, app, _Server, handler_class=_Quiet)
        self._server.tls = tls
        self.host, self.port = host, self._server.server_port
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics", daemon=True
        )
        self._thread.start()

    @property
    def endpoint(self) -> str:
        """host:port, as a Prometheus target."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def serve_metrics(
    registry: CollectorRegistry,
    host: str,
    ports: list[int],
    routes: dict[str, JsonRoute] | None = None,
    tls: ssl.SSLContext | None = None,
    token: str | None = None,
) -> MetricsServer:
    """The first of `ports` that is free (several ranks on one node take consecutive ones);
    [0] picks any free port."""
    error: OSError | None = None
    for port in ports:
        try:
            return MetricsServer(registry, host, port, routes, tls, token)
        except OSError as e:
            error = e
    raise OSError(f"no free metrics port among {ports[0]}..{ports[-1]} on {host}: {error}")
