"""Security for the router's ports: TLS (a server certificate, and mutual TLS when a client CA is
given) and bearer tokens (`authorization: Bearer <token>`, the scheme case-insensitive, the token
compared in constant time), on the server and in the clients. One ServerSecurity serves the gRPC
port, the OpenAI HTTP port (router/api/http_auth.py) and the router's metrics port. All off by
default; the default router listens on loopback only, and the cluster config refuses another host
without a token or mutual TLS (allow_insecure_bind).

Two tokens: the client token lets a caller generate and read status; the admin token (which is
also a client token) is needed for the calls that change the cluster for everyone (ADMIN_METHODS:
Rebalance; and vLLM Abort of a request another caller started, router/api/vllm_grpc.py). When a
client token is set and no admin token, admin calls are refused. A router with no token at all
trusts every caller it accepts (loopback, or the holders of a certificate the client CA signed).

The health service answers without a token: Kubernetes' gRPC probes cannot send one, and health
says nothing a client could misuse.
"""

import hmac
import ipaddress
import logging
import ssl
import tempfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

log = logging.getLogger(__name__)

Metadata = tuple[tuple[str, str], ...]
Continuation = Callable[..., Any]  # a client interceptor's next step: (details, request) -> call

HEALTH_METHODS = ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")
# Calls that change the cluster for every client. Read-only calls (GetClusterStatus,
# GetExpertLoad, vLLM GetLoads) stay on the client token: gateways and dashboards poll them.
ADMIN_METHODS = frozenset(
    {
        "/epcluster.v1.Inference/Rebalance",
        "/vllm.grpc.engine.VllmEngine/FlushCache",
        "/vllm.grpc.engine.VllmEngine/StartProfile",
        "/vllm.grpc.engine.VllmEngine/StopProfile",
    }
)
ADMIN, CLIENT = "admin", "client"


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def read_token(path: str) -> str:
    """The token in a file (surrounding whitespace dropped); ValueError when it is empty."""
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"the token file {path} is empty")
    return token


def bearer(header: str | bytes | None) -> bytes:
    """The credential of an `Authorization: Bearer <token>` value (the scheme is
    case-insensitive, RFC 7235); b"" for anything else."""
    if isinstance(header, str):
        header = header.encode("utf-8", "replace")
    scheme, _, credential = (header or b"").strip().partition(b" ")
    return credential.strip() if scheme.lower() == b"bearer" else b""


def token_matches(sent: bytes, token: str | None) -> bool:
    """Constant time whatever `sent` is: no timing oracle on the token."""
    return token is not None and hmac.compare_digest(sent, token.encode())


def is_loopback(host: str) -> bool:
    """Only this machine can reach `host` (an empty host or 0.0.0.0 is every interface)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass(frozen=True, slots=True)
class ServerSecurity:
    """What the router's ports require. PEM bytes, as read from the config's files (and the
    files' paths, which uvicorn and ssl.SSLContext want)."""

    token: str | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    client_ca: bytes | None = None  # set: mutual TLS, clients must present a cert it signed
    admin_token: str | None = None  # set: Rebalance & co. need it (see the module docstring)
    files: tuple[str, str, str | None] | None = None  # (cert, key, client CA) paths, if read

    @classmethod
    def from_files(
        cls,
        token_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        client_ca_file: str | None = None,
        admin_token_file: str | None = None,
    ) -> "ServerSecurity":
        return cls(
            token=None if token_file is None else read_token(token_file),
            tls_cert=_read(cert_file),
            tls_key=_read(key_file),
            client_ca=_read(client_ca_file),
            admin_token=None if admin_token_file is None else read_token(admin_token_file),
            files=None if cert_file is None else (cert_file, key_file, client_ca_file),
        )

    @property
    def has_tokens(self) -> bool:
        return self.token is not None or self.admin_token is not None

    def role(self, authorization: str | bytes | None) -> str | None:
        """ADMIN, CLIENT or None (refused) for a call carrying this Authorization value."""
        if not self.has_tokens:
            return ADMIN  # no token configured: every caller the transport accepts
        sent = bearer(authorization)
        if token_matches(sent, self.admin_token):
            return ADMIN
        if self.token is None or token_matches(sent, self.token):
            return CLIENT
        return None

    def warn_if_cleartext(self, where: str, host: str) -> None:
        """A token without TLS travels in cleartext: anyone on the path can replay it (on
        loopback, nobody is on the path)."""
        if self.has_tokens and self.tls_cert is None and not is_loopback(host):
            log.warning(
                "%s: a bearer token is required but TLS is off, so clients send it in "
                "cleartext; set tls_cert_file and tls_key_file",
                where,
            )

    def credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials for the gRPC port, or None for a plaintext port."""
        if self.tls_cert is None:
            return None
        return grpc.ssl_server_credentials(
            [(self.tls_key, self.tls_cert)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [TokenCheck(self)] if self.has_tokens else []

    def pem_files(self) -> tuple[str, str, str | None]:
        """Paths of the certificate, key and client CA (written to a private temporary folder
        when this was built from bytes): uvicorn and ssl.SSLContext read files."""
        assert self.tls_cert is not None, "TLS is off"
        if self.files is not None:
            return self.files
        folder = Path(tempfile.mkdtemp(prefix="epcluster-tls-"))  # mode 0700
        paths = []
        for name, blob in (("cert", self.tls_cert), ("key", self.tls_key), ("ca", self.client_ca)):
            if blob is not None:
                (folder / f"{name}.pem").write_bytes(blob)
            paths.append(None if blob is None else str(folder / f"{name}.pem"))
        object.__setattr__(self, "files", tuple(paths))  # NOTE: a cache; frozen otherwise
        return self.files

    def ssl_context(self, client_auth: bool = True) -> ssl.SSLContext | None:
        """A server-side TLS context (mutual when a client CA is set and client_auth), or None."""
        if self.tls_cert is None:
            return None
        cert, key, ca = self.pem_files()
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(cert, key)
        if client_auth and ca is not None:
            context.load_verify_locations(ca)
            context.verify_mode = ssl.CERT_REQUIRED
        return context


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks without a token, and ADMIN_METHODS without the
    admin token (PERMISSION_DENIED for a valid client token, UNAUTHENTICATED otherwise)."""

    def __init__(self, security: ServerSecurity) -> None:
        self.security = security

    def _refusal(self, details: grpc.HandlerCallDetails) -> tuple[grpc.StatusCode, str] | None:
        if details.method in HEALTH_METHODS:
            return None
        sent = dict(details.invocation_metadata or ()).get("authorization")
        role = self.security.role(sent)
        if role is None:
            return (
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong bearer token: send the metadata `authorization: Bearer "
                "<token>` (epcluster CLI: --token-file)",
            )
        if details.method in ADMIN_METHODS and role != ADMIN:
            name = details.method.rsplit("/", 1)[-1]
            if self.security.admin_token is None:
                why = "this router has no admin token (set admin_token_file in its config)"
            else:
                why = "send the admin token as the bearer token (epcluster CLI: --admin-token-file)"
            return grpc.StatusCode.PERMISSION_DENIED, f"{name} is an admin call: {why}"
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler | None]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler | None:
        handler = await continuation(details)
        refusal = None if handler is None else self._refusal(details)
        if refusal is None:
            return handler

        async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(*refusal)

        make = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(handler.request_streaming, handler.response_streaming)]
        return make(refuse, handler.request_deserializer, handler.response_serializer)


@dataclass(frozen=True, slots=True)
class ClientSecurity:
    """How a client reaches a router that requires TLS and/or a token. Paths to PEM files."""

    token: str | None = None
    ca_file: str | None = None  # set: TLS, the server's certificate must chain to this CA
    cert_file: str | None = None  # with key_file: the client's certificate (mutual TLS)
    key_file: str | None = None
    server_name: str | None = None  # the name to check the server's certificate against

    @classmethod
    def from_files(
        cls,
        token_file: str | None = None,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        server_name: str | None = None,
    ) -> "ClientSecurity":
        token = None if token_file is None else read_token(token_file)
        return cls(token, ca_file, cert_file, key_file, server_name)

    @property
    def tls(self) -> bool:
        return self.ca_file is not None

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca_file),
            private_key=_read(self.key_file),
            certificate_chain=_read(self.cert_file),
        )

    def options(self) -> list[tuple[str, str]]:
        return (
            []
            if self.server_name is None
            else [("grpc.ssl_target_name_override", self.server_name)]
        )

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return () if self.token is None else (("authorization", f"Bearer {self.token}"),)


def _warn_if_cleartext(target: str, security: ClientSecurity) -> None:
    host = target.rsplit(":", 1)[0] if target.count(":") == 1 or "]" in target else target
    if security.token and not security.tls and not is_loopback(host):
        log.warning(
            "sending the bearer token to %s in cleartext (no TLS): anyone on the path can "
            "replay it; give the router's CA (--tls-ca-file) to use TLS",
            target,
        )


def channel(target: str, security: ClientSecurity | None) -> grpc.Channel:
    """A blocking channel to the router: TLS if asked, the token on every call."""
    if security is None:
        return grpc.insecure_channel(target)
    _warn_if_cleartext(target, security)
    if security.tls:
        ch = grpc.secure_channel(target, security.channel_credentials(), security.options())
    else:
        ch = grpc.insecure_channel(target)
    return grpc.intercept_channel(ch, _AddToken(security.metadata())) if security.token else ch


def aio_channel(target: str, security: ClientSecurity | None) -> grpc.aio.Channel:
    """The asyncio twin of channel()."""
    if security is None:
        return grpc.aio.insecure_channel(target)
    _warn_if_cleartext(target, security)
    md = security.metadata()
    interceptors = [_AioUnaryToken(md), _AioStreamToken(md)] if security.token else None
    if security.tls:
        return grpc.aio.secure_channel(
            target, security.channel_credentials(), security.options(), interceptors=interceptors
        )
    return grpc.aio.insecure_channel(target, interceptors=interceptors)


def _with(details: grpc.ClientCallDetails, metadata: Metadata) -> grpc.ClientCallDetails:
    return details._replace(metadata=tuple(details.metadata or ()) + metadata)


class _AddToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def intercept_unary_unary(
        self, continuation: Continuation, details: grpc.ClientCallDetails, request: Any
    ) -> Any:
        return continuation(_with(details, self.metadata), request)

    def intercept_unary_stream(
        self, continuation: Continuation, details: grpc.ClientCallDetails, request: Any
    ) -> Any:
        return continuation(_with(details, self.metadata), request)


class _AioTokenMixin:
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def _with(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        # NOTE: grpc.aio wants a Metadata object here.
        pairs = tuple(details.metadata or ()) + self.metadata
        return details._replace(metadata=grpc.aio.Metadata(*pairs))


# NOTE: one class per call kind: a grpc.aio channel files an interceptor under the first kind
# it is an instance of, so one class of both kinds would never see streaming calls.
class _AioUnaryToken(_AioTokenMixin, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Continuation, details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self._with(details), request)


class _AioStreamToken(_AioTokenMixin, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Continuation, details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(self._with(details), request)
