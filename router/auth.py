"""gRPC security for the router: TLS (a server certificate, and mutual TLS when a client CA is
given) and a bearer token (`authorization: Bearer <token>`, compared in constant time), on the
server and in the clients. Both are off by default; the default router listens on loopback only.

The health service answers without a token: Kubernetes' gRPC probes cannot send one, and health
says nothing a client could misuse. Everything else (Generate, the admin RPCs, reflection) needs
the token when one is configured.
"""

import hmac
from dataclasses import dataclass
from pathlib import Path

import grpc

HEALTH_METHODS = ("/grpc.health.v1.Health/Check", "/grpc.health.v1.Health/Watch")


def _read(path: str | None) -> bytes | None:
    return None if path is None else Path(path).read_bytes()


def read_token(path: str) -> str:
    """The token in a file (surrounding whitespace dropped); ValueError when it is empty."""
    token = Path(path).read_text().strip()
    if not token:
        raise ValueError(f"the token file {path} is empty")
    return token


@dataclass(frozen=True, slots=True)
class ServerSecurity:
    """What the router's gRPC port requires. PEM bytes, as read from the config's files."""

    token: str | None = None
    tls_cert: bytes | None = None
    tls_key: bytes | None = None
    client_ca: bytes | None = None  # set: mutual TLS, clients must present a cert it signed

    @classmethod
    def from_files(
        cls,
        token_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        client_ca_file: str | None = None,
    ) -> "ServerSecurity":
        return cls(
            token=None if token_file is None else read_token(token_file),
            tls_cert=_read(cert_file),
            tls_key=_read(key_file),
            client_ca=_read(client_ca_file),
        )

    def credentials(self) -> grpc.ServerCredentials | None:
        """TLS credentials for the port, or None for a plaintext port."""
        if self.tls_cert is None:
            return None
        return grpc.ssl_server_credentials(
            [(self.tls_key, self.tls_cert)],
            root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None,
        )

    def interceptors(self) -> list[grpc.aio.ServerInterceptor]:
        return [] if self.token is None else [TokenCheck(self.token)]


class TokenCheck(grpc.aio.ServerInterceptor):
    """Refuses every call but health checks without `authorization: Bearer <token>`."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def _allowed(self, details: grpc.HandlerCallDetails) -> bool:
        if details.method in HEALTH_METHODS:
            return True
        sent = dict(details.invocation_metadata or ()).get("authorization", "")
        sent = sent.encode() if isinstance(sent, str) else sent
        return hmac.compare_digest(sent, self._expected)  # constant time: no timing oracle

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        handler = await continuation(details)
        if handler is None or self._allowed(details):
            return handler

        async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                "missing or wrong bearer token: send the metadata `authorization: Bearer "
                "<token>` (epcluster CLI: --token-file)",
            )

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


def channel(target: str, security: ClientSecurity | None) -> grpc.Channel:
    """A blocking channel to the router: TLS if asked, the token on every call."""
    if security is None:
        return grpc.insecure_channel(target)
    if security.tls:
        ch = grpc.secure_channel(target, security.channel_credentials(), security.options())
    else:
        ch = grpc.insecure_channel(target)
    return grpc.intercept_channel(ch, _AddToken(security.metadata())) if security.token else ch


def aio_channel(target: str, security: ClientSecurity | None) -> grpc.aio.Channel:
    """The asyncio twin of channel()."""
    if security is None:
        return grpc.aio.insecure_channel(target)
    md = security.metadata()
    interceptors = [_AioUnaryToken(md), _AioStreamToken(md)] if security.token else None
    if security.tls:
        return grpc.aio.secure_channel(
            target, security.channel_credentials(), security.options(), interceptors=interceptors
        )
    return grpc.aio.insecure_channel(target, interceptors=interceptors)


def _with(details, metadata):
    return details._replace(metadata=tuple(details.metadata or ()) + metadata)


class _AddToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(_with(details, self.metadata), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(_with(details, self.metadata), request)


class _AioTokenMixin:
    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self.metadata = metadata

    def _with(self, details):
        # NOTE: grpc.aio wants a Metadata object here.
        pairs = tuple(details.metadata or ()) + self.metadata
        return details._replace(metadata=grpc.aio.Metadata(*pairs))


# NOTE: one class per call kind: a grpc.aio channel files an interceptor under the first kind
# it is an instance of, so one class of both kinds would never see streaming calls.
class _AioUnaryToken(_AioTokenMixin, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, details, request):
        return await continuation(self._with(details), request)


class _AioStreamToken(_AioTokenMixin, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, details, request):
        return await continuation(self._with(details), request)
