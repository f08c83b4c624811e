"""One HTTP endpoint per process for Prometheus: GET /metrics (prometheus-client's exposition of
a registry), plus any JSON routes a process adds (the router serves Prometheus HTTP service
discovery at /sd/targets). A threaded WSGI server on a daemon thread: scrapes never run on an
engine thread or an event loop."""

import json
import threading
from collections.abc import Callable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

JsonRoute = Callable[[], Any]


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # scrapes every few seconds
        pass


class MetricsServer:
    """Serves `registry` at http://host:port/metrics (port 0: a free one; see .port)."""

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        routes: dict[str, JsonRoute] | None = None,
    ) -> None:
        metrics_app = make_wsgi_app(registry)
        self.routes = routes = dict(routes or {})  # later additions are served too

        def app(environ: dict, start_response: Callable) -> list[bytes]:
            path = environ.get("PATH_INFO", "")
            if path in routes:
                body = json.dumps(routes[path]()).encode()
                start_response("200 OK", [("Content-Type", "application/json")])
                return [body]
            if path in ("/metrics", "/"):
                return metrics_app(environ, start_response)
            start_response("404 Not Found", [("Content-Type", "text/plain")])
            return [f"no {path}: try /metrics{''.join(' or ' + r for r in routes)}\n".encode()]

        self._server = make_server(host, port, app, ThreadingWSGIServer, handler_class=_Quiet)
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
) -> MetricsServer:
    """The first of `ports` that is free (several ranks on one node take consecutive ones);
    [0] picks any free port."""
    error: OSError | None = None
    for port in ports:
        try:
            return MetricsServer(registry, host, port, routes)
        except OSError as e:
            error = e
    raise OSError(f"no free metrics port among {ports[0]}..{ports[-1]} on {host}: {error}")
