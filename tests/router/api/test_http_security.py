"""The OpenAI HTTP port under the gRPC port's security (router/api/http_auth.py), with certificates
from a throwaway CA (trustme), seen through raw requests (http.client over ssl sockets, and the curl
binary), and through the openai SDK: a missing or wrong token is 401 on every route but /health
(/metrics and /openapi.json included; the docs pages are off); the scheme's case is free; the
admin token is a client token too; plaintext to a TLS port and a client that trusts another CA
get no response; under mutual TLS, no certificate or one from another CA is refused in the
handshake. The router's metrics port (engine/metrics/server.py) with TLS and a token the same."""

import http.client
import json
import logging
import shutil
import ssl
import subprocess

import openai
import pytest
from prometheus_client import CollectorRegistry, Counter

from engine import SamplingParams
from engine.metrics.server import MetricsServer
from router.auth import ServerSecurity
from router.client import InferenceClient
from router.server import serve
from tests.router.test_security import ADMIN_TOKEN, TOKEN, write_pki

MODEL = "tiny-random"
BODY = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0}
NO_RESPONSE = (OSError, http.client.HTTPException)  # ssl.SSLError is an OSError


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    return write_pki(tmp_path_factory.mktemp("pki"))


def start(backend, security: ServerSecurity):
    server = serve(backend, port=0, security=security)
    assert server.wait_ready(10)
    server.serve_http(0, MODEL, CollectorRegistry())
    return server


def context(pki, ca: str = "ca", cert: str | None = None) -> ssl.SSLContext:
    """A client's TLS context trusting `ca`, presenting the `cert` pair if given."""
    ctx = ssl.create_default_context(cafile=pki[ca])
    if cert is not None:
        ctx.load_cert_chain(pki[f"{cert}_cert"], pki[f"{cert}_key"])
    return ctx


def raw(port: int, path: str, auth: str | None, tls: ssl.SSLContext | None = None):
    """One request, as curl would send it -> (status, headers, body bytes)."""
    if tls is None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    else:
        conn = http.client.HTTPSConnection("127.0.0.1", port, timeout=30, context=tls)
    headers = {"Content-Type": "application/json"} | (
        {} if auth is None else {"Authorization": auth}
    )
    body = json.dumps(BODY) if path == "/v1/completions" else None
    try:
        conn.request("POST" if body else "GET", path, body, headers)
        reply = conn.getresponse()
        return reply.status, dict(reply.getheaders()), reply.read()
    finally:
        conn.close()


def sdk(port: int, api_key: str, scheme: str = "http", **http_client) -> str:
    """The completion's text through the openai SDK (its client closed after: an idle TLS
    keep-alive connection holds a stopping uvicorn for asyncio's 30 s TLS shutdown)."""
    client = openai.DefaultHttpxClient(**http_client) if http_client else None
    with openai.OpenAI(
        base_url=f"{scheme}://127.0.0.1:{port}/v1", api_key=api_key, max_retries=0,
        http_client=client,
    ) as oa:  # fmt: skip
        return oa.completions.create(**BODY).choices[0].text


@pytest.fixture(scope="module")
def want(backend) -> str:
    """The completion's text through epcluster.v1 on an open router: the oracle."""
    server = serve(backend, port=0)
    try:
        assert server.wait_ready(10)
        with InferenceClient(server.address, timeout=60) as v1:
            return v1.complete([5, 6, 7, 8], SamplingParams(max_tokens=6, temperature=0)).text
    finally:
        server.stop()


def test_the_token_guards_every_route_but_health(backend, pki, want):
    security = ServerSecurity.from_files(
        token_file=pki["token"], admin_token_file=pki["admin_token"]
    )
    server = start(backend, security)
    port = server.http_port
    try:
        status, _, body = raw(port, "/health", None)
        assert (status, body) == (200, b"")  # open, and says nothing
        for path in ("/v1/completions", "/v1/models", "/metrics", "/openapi.json", "/docs"):
            for auth in (None, "Bearer wrong", f"Bearer {TOKEN[:-1]}", f"Basic {TOKEN}", TOKEN):
                status, headers, body = raw(port, path, auth)
                assert status == 401, (path, auth)
                assert headers["www-authenticate"].startswith("Bearer")
                assert json.loads(body)["error"]["code"] == "invalid_api_key"
        for auth in (
            f"Bearer {TOKEN}",
            f"bearer {TOKEN}",
            f"BEARER  {TOKEN}",
            f"Bearer {ADMIN_TOKEN}",
        ):
            status, _, body = raw(port, "/v1/completions", auth)
            assert status == 200 and json.loads(body)["choices"][0]["text"] == want
        assert raw(port, "/metrics", f"Bearer {TOKEN}")[0] == 200
        assert raw(port, "/openapi.json", f"Bearer {TOKEN}")[0] == 200
        assert raw(port, "/docs", f"Bearer {TOKEN}")[0] == 404  # off
        with pytest.raises(openai.AuthenticationError):
            sdk(port, "wrong")
        assert sdk(port, TOKEN) == want
    finally:
        server.stop()


def test_tls(backend, pki, want):
    security = ServerSecurity.from_files(
        token_file=pki["token"], cert_file=pki["server_cert"], key_file=pki["server_key"]
    )
    server = start(backend, security)
    port = server.http_port
    try:
        ok = context(pki)
        status, _, body = raw(port, "/v1/completions", f"Bearer {TOKEN}", ok)
        assert status == 200 and json.loads(body)["choices"][0]["text"] == want
        assert raw(port, "/v1/completions", None, ok)[0] == 401
        assert raw(port, "/v1/completions", "Bearer wrong", ok)[0] == 401
        with pytest.raises(NO_RESPONSE):  # plaintext to the TLS port: no HTTP answer
            raw(port, "/v1/completions", f"Bearer {TOKEN}")
        with pytest.raises(ssl.SSLCertVerificationError):  # the client trusts another CA
            raw(port, "/v1/completions", f"Bearer {TOKEN}", context(pki, "other_ca"))
        assert sdk(port, TOKEN, "https", verify=context(pki)) == want
        with pytest.raises(openai.AuthenticationError):
            sdk(port, "wrong", "https", verify=context(pki))
        with pytest.raises(openai.APIConnectionError):  # plaintext
            sdk(port, TOKEN)
        with pytest.raises(openai.APIConnectionError):  # the system's CAs: not ours
            sdk(port, TOKEN, "https")
    finally:
        server.stop()


def test_mutual_tls(backend, pki, want):
    security = ServerSecurity.from_files(
        token_file=pki["token"], cert_file=pki["server_cert"], key_file=pki["server_key"],
        client_ca_file=pki["ca"],
    )  # fmt: skip
    server = start(backend, security)
    port = server.http_port
    auth = f"Bearer {TOKEN}"
    try:
        status, _, body = raw(port, "/v1/completions", auth, context(pki, cert="client"))
        assert status == 200 and json.loads(body)["choices"][0]["text"] == want
        assert raw(port, "/v1/completions", None, context(pki, cert="client"))[0] == 401
        for tls in (context(pki), context(pki, cert="stranger")):  # no cert, another CA's
            with pytest.raises(NO_RESPONSE):
                raw(port, "/v1/completions", auth, tls)
        with pytest.raises(NO_RESPONSE):
            raw(port, "/health", None, context(pki))  # even /health needs the certificate
        with pytest.raises(NO_RESPONSE):
            raw(port, "/v1/completions", auth)  # plaintext
        assert sdk(port, TOKEN, "https", verify=context(pki, cert="client")) == want
        with pytest.raises(openai.APIConnectionError):
            sdk(port, TOKEN, "https", verify=context(pki))
    finally:
        server.stop()


@pytest.mark.skipif(shutil.which("curl") is None, reason="no curl binary")
def test_curl(backend, pki, want):
    security = ServerSecurity.from_files(
        token_file=pki["token"], cert_file=pki["server_cert"], key_file=pki["server_key"],
        client_ca_file=pki["ca"],
    )  # fmt: skip
    server = start(backend, security)
    url = f"https://127.0.0.1:{server.http_port}/v1/completions"
    tls = ["--cacert", pki["ca"], "--cert", pki["client_cert"], "--key", pki["client_key"]]

    def curl(*args: str) -> subprocess.CompletedProcess:
        cmd = ["curl", "-sS", "--max-time", "60", "-w", "\n%{http_code}", *args]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=90)

    try:
        data = ["-H", "Content-Type: application/json", "-d", json.dumps(BODY)]
        done = curl(*tls, "-H", f"Authorization: Bearer {TOKEN}", *data, url)
        body, code = done.stdout.rsplit("\n", 1)
        assert code == "200" and json.loads(body)["choices"][0]["text"] == want
        assert curl(*tls, *data, url).stdout.endswith("\n401")
        assert curl(*tls, "-H", "Authorization: Bearer wrong", *data, url).stdout.endswith("\n401")
        no_cert = curl("--cacert", pki["ca"], "-H", f"Authorization: Bearer {TOKEN}", *data, url)
        assert no_cert.returncode != 0 and no_cert.stdout.endswith("\n000")
        plain = curl("-H", f"Authorization: Bearer {TOKEN}", *data, url.replace("https", "http"))
        assert plain.returncode != 0 and plain.stdout.endswith("\n000")
    finally:
        server.stop()


def test_the_metrics_port_with_tls_and_a_token(pki):
    registry = CollectorRegistry()
    Counter("epcluster_test_scrapes", "a metric to find", registry=registry).inc(3)
    tls = ServerSecurity.from_files(
        cert_file=pki["server_cert"], key_file=pki["server_key"]
    ).ssl_context()
    server = MetricsServer(registry, "127.0.0.1", 0, {"/sd/targets": lambda: []}, tls, TOKEN)
    try:
        status, _, body = raw(server.port, "/metrics", f"Bearer {TOKEN}", context(pki))
        assert status == 200 and b"epcluster_test_scrapes_total 3.0" in body
        assert raw(server.port, "/sd/targets", f"bearer {TOKEN}", context(pki))[:3:2] == (
            200,
            b"[]",
        )
        for path in ("/metrics", "/sd/targets"):
            for auth in (None, "Bearer wrong"):
                assert raw(server.port, path, auth, context(pki))[0] == 401
        with pytest.raises(NO_RESPONSE):
            raw(server.port, "/metrics", f"Bearer {TOKEN}")  # plaintext
        # the server still answers after the failed handshake (it ran on its own thread)
        assert raw(server.port, "/metrics", f"Bearer {TOKEN}", context(pki))[0] == 200
    finally:
        server.close()


def test_an_idle_tls_client_does_not_hold_the_stop(backend, pki, want, caplog):
    """A client's idle keep-alive TLS connection never answers the server's close_notify: the
    stop drops it (router/api/http_auth.py Server) instead of waiting out asyncio's TLS shutdown
    and being cancelled by RouterServer.stop."""
    security = ServerSecurity.from_files(cert_file=pki["server_cert"], key_file=pki["server_key"])
    server = start(backend, security)
    http_client = openai.DefaultHttpxClient(verify=context(pki))
    oa = openai.OpenAI(
        base_url=f"https://127.0.0.1:{server.http_port}/v1", api_key="unused", max_retries=0,
        http_client=http_client,
    )  # fmt: skip
    try:
        assert oa.completions.create(**BODY).choices[0].text == want  # its connection stays
        with caplog.at_level(logging.WARNING, "router.server"):
            server.stop()
        assert not [r for r in caplog.records if "did not stop" in r.getMessage()]
        assert server._http_task.done() and not server._http_task.cancelled()
    finally:
        oa.close()
        server.stop()
