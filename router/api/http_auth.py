"""The OpenAI HTTP port under the router's one ServerSecurity (router/auth.py): TLS and mutual TLS
in uvicorn, and the bearer token on every route but /health, including /metrics and FastAPI's
/openapi.json (the docs pages are off). /health stays open for load balancers and probes and
answers a bare status code.

The guard is plain ASGI around the whole app, so a route added later is covered too.
"""

import json
import ssl
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn

from router.auth import ServerSecurity

OPEN_PATHS = frozenset({"/health"})
Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict]]
Send = Callable[[dict], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

_REFUSAL = json.dumps(
    {
        "error": {
            "message": "missing or wrong bearer token: send the header "
            "`Authorization: Bearer <token>` (OpenAI clients: api_key)",
            "type": "authentication_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }
).encode()


class TokenGuard:
    """ASGI middleware: 401 (OpenAI's error envelope, `WWW-Authenticate: Bearer`) for a request
    without the client or admin token, before the app reads its body."""

    def __init__(self, app: ASGIApp, security: ServerSecurity) -> None:
        self.app, self.security = app, security

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket") or scope["path"] in OPEN_PATHS:
            return await self.app(scope, receive, send)
        sent = dict(scope.get("headers") or ()).get(b"authorization")
        if self.security.role(sent) is not None:
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(_REFUSAL)).encode()),
            (b"www-authenticate", b'Bearer realm="epcluster"'),
        ]
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": _REFUSAL})


def guard(app: ASGIApp, security: ServerSecurity) -> ASGIApp:
    """`app` behind the token when one is configured (as is, otherwise)."""
    return TokenGuard(app, security) if security.has_tokens else app


def uvicorn_ssl(security: ServerSecurity) -> dict[str, Any]:
    """uvicorn.Config's TLS options: the gRPC port's certificate, and CERT_REQUIRED with the
    client CA under mutual TLS (a client without a certificate the CA signed fails the
    handshake); {} when TLS is off."""
    if security.tls_cert is None:
        return {}
    cert, key, ca = security.pem_files()
    options: dict[str, Any] = {"ssl_certfile": cert, "ssl_keyfile": key}
    if ca is not None:
        options.update(ssl_ca_certs=ca, ssl_cert_reqs=ssl.CERT_REQUIRED)
    return options


class Server(uvicorn.Server):
    """uvicorn's server, stopping without asyncio's 30 s TLS shutdown wait on idle connections.

    NOTE: closing a TLS connection waits for the peer's close_notify (ssl_shutdown_timeout, 30 s,
    which uvicorn does not set); a client's idle keep-alive connection never answers it, so a
    stopping router hung for 30 s per stop. Idle TLS connections are dropped instead; those with
    a response in flight finish as uvicorn lets them."""

    async def shutdown(self, sockets: list | None = None) -> None:
        if self.config.is_ssl:
            for conn in list(self.server_state.connections):
                cycle = getattr(conn, "cycle", None)
                if getattr(conn, "transport", None) is not None and (
                    cycle is None or cycle.response_complete
                ):
                    conn.transport.abort()
        await super().shutdown(sockets)
