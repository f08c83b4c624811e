"""gRPC security on the router, with certificates from a throwaway CA (trustme): TLS, mutual TLS
and a bearer token. A missing or wrong token gets UNAUTHENTICATED (health needs none: probes);
a plaintext or unverified client cannot talk to a TLS router; under mutual TLS a client without
a certificate the CA signed is refused; the right credentials get the in-process engine's
tokens (admin calls: test_admin_security.py; HTTP: test_http_security.py)."""

import asyncio
import logging
from pathlib import Path

import grpc
import pytest
import trustme

from engine import SamplingParams
from router.auth import ClientSecurity, ServerSecurity, TokenCheck
from router.client import AsyncInferenceClient, InferenceClient
from router.server import serve

TOKEN = "s3cret-token-of-some-length"
ADMIN_TOKEN = "adm1n-token-of-another-length"
PARAMS = SamplingParams(max_tokens=6, temperature=0.0)
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return write_pki(tmp_path_factory.mktemp("pki"))


def write_pki(d: Path) -> dict[str, str]:
    """A CA, the router's certificate (for 127.0.0.1 and localhost), a client certificate signed
    by the CA, and one from another CA, as PEM files in `d`; the tokens' files; -> their paths."""
    ca, other = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client, stranger = ca.issue_cert("client@epcluster"), other.issue_cert("client@elsewhere")
    files = {"ca": ca.cert_pem, "other_ca": other.cert_pem}
    for name, cert in (("server", server), ("client", client), ("stranger", stranger)):
        files[f"{name}_key"] = cert.private_key_pem
        files[f"{name}_cert"] = cert.cert_chain_pems[0]
    paths = {}
    for name, blob in files.items():
        paths[name] = str(d / f"{name}.pem")
        blob.write_to_path(paths[name])
    (d / "token").write_text(TOKEN + "\n")
    paths["token"] = str(d / "token")
    (d / "admin_token").write_text(ADMIN_TOKEN)
    paths["admin_token"] = str(d / "admin_token")
    return paths


def start(backend, security: ServerSecurity):
    server = serve(backend, port=0, security=security)
    assert server.wait_ready(10)
    return server


def tokens(address: str, security: ClientSecurity | None) -> list[int]:
    with InferenceClient(address, timeout=30, security=security) as client:
        return client.complete(PROMPT, PARAMS).token_ids


def code_of(address: str, security: ClientSecurity | None) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        tokens(address, security)
    return err.value.code()


def test_bearer_token(backend, oracle, pki):
    want = oracle.generate([PROMPT], PARAMS)[0].token_ids
    server = start(backend, ServerSecurity.from_files(token_file=pki["token"]))
    try:
        assert code_of(server.address, None) == grpc.StatusCode.UNAUTHENTICATED
        assert code_of(server.address, ClientSecurity(token="wrong")) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
        assert code_of(server.address, ClientSecurity(token=TOKEN[:-1])) == (
            grpc.StatusCode.UNAUTHENTICATED
        )
        with InferenceClient(server.address, timeout=10) as anonymous:
            assert anonymous.health() == "SERVING"  # probes need no token
            with pytest.raises(grpc.RpcError) as err:
                anonymous.cluster_status()
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "authorization: Bearer" in err.value.details()
        good = ClientSecurity.from_files(token_file=pki["token"])
        assert tokens(server.address, good) == want

        async def streamed() -> list[int]:
            async with AsyncInferenceClient(server.address, timeout=30, security=good) as c:
                return (await c.complete(PROMPT, PARAMS)).token_ids

        assert asyncio.run(streamed()) == want
    finally:
        server.stop()


def test_tls(backend, oracle, pki):
    want = oracle.generate([PROMPT], PARAMS)[0].token_ids
    security = ServerSecurity.from_files(cert_file=pki["server_cert"], key_file=pki["server_key"])
    server = start(backend, security)
    try:
        assert tokens(server.address, ClientSecurity(ca_file=pki["ca"])) == want
        # plaintext to a TLS port, and a client that trusts another CA: no connection
        assert code_of(server.address, None) == grpc.StatusCode.UNAVAILABLE
        assert code_of(server.address, ClientSecurity(ca_file=pki["other_ca"])) == (
            grpc.StatusCode.UNAVAILABLE
        )
    finally:
        server.stop()


def test_mutual_tls_and_token(backend, oracle, pki):
    want = oracle.generate([PROMPT], PARAMS)[0].token_ids
    security = ServerSecurity.from_files(
        token_file=pki["token"],
        cert_file=pki["server_cert"],
        key_file=pki["server_key"],
        client_ca_file=pki["ca"],
    )
    server = start(backend, security)
    try:
        full = ClientSecurity(
            token=TOKEN, ca_file=pki["ca"], cert_file=pki["client_cert"], key_file=pki["client_key"]
        )
        assert tokens(server.address, full) == want
        no_cert = ClientSecurity(token=TOKEN, ca_file=pki["ca"])
        assert code_of(server.address, no_cert) == grpc.StatusCode.UNAVAILABLE
        stranger = ClientSecurity(
            token=TOKEN,
            ca_file=pki["ca"],
            cert_file=pki["stranger_cert"],
            key_file=pki["stranger_key"],
        )
        assert code_of(server.address, stranger) == grpc.StatusCode.UNAVAILABLE
        no_token = ClientSecurity(
            ca_file=pki["ca"], cert_file=pki["client_cert"], key_file=pki["client_key"]
        )
        assert code_of(server.address, no_token) == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop()


def test_the_token_is_compared_in_constant_time(monkeypatch):
    """The check goes through hmac.compare_digest, whatever the sent value."""
    seen = []
    real = __import__("hmac").compare_digest

    def spy(a, b):
        seen.append((a, b))
        return real(a, b)

    monkeypatch.setattr("router.auth.hmac.compare_digest", spy)
    check = TokenCheck(ServerSecurity(token=TOKEN, admin_token=ADMIN_TOKEN))

    class Details:
        method = "/epcluster.v1.Inference/Generate"
        invocation_metadata = (("authorization", "Bearer nope"),)

    code, _ = check._refusal(Details())
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert seen == [(b"nope", ADMIN_TOKEN.encode()), (b"nope", TOKEN.encode())]


def test_an_empty_token_file_is_refused(tmp_path):
    path = tmp_path / "token"
    path.write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        ServerSecurity.from_files(token_file=str(path))


def test_the_cli_reaches_a_secured_router(backend, pki, capsys):
    from cluster.cli import main

    security = ServerSecurity.from_files(
        token_file=pki["token"], cert_file=pki["server_cert"], key_file=pki["server_key"]
    )
    server = start(backend, security)
    try:
        flags = ["--target", server.address, "--tls-ca-file", pki["ca"]]
        assert main(["status", *flags, "--token-file", pki["token"]]) == 0
        assert "health SERVING" in capsys.readouterr().out
        assert main(["status", *flags]) == 1
        assert "UNAUTHENTICATED" in capsys.readouterr().err
    finally:
        server.stop()


def test_a_token_without_tls_off_loopback_is_warned(caplog):
    """Server and client say so when a token would travel in cleartext where others can see
    it (loopback and TLS are quiet)."""
    from router import auth

    with caplog.at_level(logging.WARNING, "router.auth"):
        ServerSecurity(token="x").warn_if_cleartext("gRPC on 0.0.0.0:1", "0.0.0.0")
        ServerSecurity(token="x").warn_if_cleartext("gRPC on 127.0.0.1:1", "127.0.0.1")
        tls = ServerSecurity(token="x", tls_cert=b"cert", tls_key=b"key")
        tls.warn_if_cleartext("gRPC on 0.0.0.0:2", "0.0.0.0")
        for target in ("10.1.2.3:50051", "127.0.0.1:50051", "[::1]:50051"):
            auth.channel(target, ClientSecurity(token="x")).close()
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert messages[0].startswith("gRPC on 0.0.0.0:1: a bearer token is required but TLS is off")
    assert messages[1].startswith("sending the bearer token to 10.1.2.3:50051 in cleartext")
