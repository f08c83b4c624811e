"""gRPC security on the router, with certificates from a throwaway CA (trustme): TLS, mutual TLS
and a bearer token. A missing or wrong token gets UNAUTHENTICATED (health needs none: probes);
a plaintext or unverified client cannot talk to a TLS router; under mutual TLS a client without
a certificate the CA signed is refused; the right credentials get the in-process engine's
tokens. Admin calls (Rebalance) need the admin token: PERMISSION_DENIED with the client token,
UNAUTHENTICATED with none, refused when the router has no admin token; read-only status stays
on the client token."""

import asyncio
from pathlib import Path

import grpc
import pytest
import trustme
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vgrpc

from engine import SamplingParams
from moe import resolve_model_path
from router import convert
from router.auth import ClientSecurity, ServerSecurity, TokenCheck
from router.client import AsyncInferenceClient, InferenceClient
from router.proto import epcluster_pb2 as pb
from router.proto import epcluster_pb2_grpc as pb_grpc
from router.server import serve
from tests.router.conftest import wait_idle

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


# ---- admin calls (router/auth.py ADMIN_METHODS, router/abort_scope.py) ----


def _call(address: str, token: str | None, fn, scheme: str = "Bearer", **channel_options):
    """fn(channel, metadata) on a plaintext channel of its own (its own connection)."""
    options = [("grpc.use_local_subchannel_pool", 1), *channel_options.items()]
    md = () if token is None else (("authorization", f"{scheme} {token}"),)
    with grpc.insecure_channel(address, options=options) as ch:
        return fn(ch, md)


def _rebalance(ch, md):
    return pb_grpc.InferenceStub(ch).Rebalance(pb.RebalanceRequest(), metadata=md, timeout=10)


def _status(ch, md):
    return pb_grpc.InferenceStub(ch).GetClusterStatus(
        pb.GetClusterStatusRequest(), metadata=md, timeout=10
    )


def _refused(address, token, fn, **kw) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        _call(address, token, fn, **kw)
    return err.value.code(), err.value.details()


@pytest.fixture
def counted_rebalance(backend, monkeypatch):
    """The backend's rebalance replaced by one that counts its calls (one engine has nothing
    to balance: the real one refuses)."""
    calls = []

    async def rebalance(pool=None):
        calls.append(pool)
        return []

    monkeypatch.setattr(backend, "rebalance", rebalance)
    return calls


def test_rebalance_needs_the_admin_token(backend, pki, counted_rebalance):
    security = ServerSecurity.from_files(
        token_file=pki["token"], admin_token_file=pki["admin_token"]
    )
    server = start(backend, security)
    try:
        code, details = _refused(server.address, None, _rebalance)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code, details = _refused(server.address, "wrong", _rebalance)
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code, details = _refused(server.address, TOKEN, _rebalance)
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert details.startswith("Rebalance is an admin call") and "admin token" in details
        assert counted_rebalance == []  # none of them reached the backend
        _call(server.address, ADMIN_TOKEN, _rebalance)
        _call(server.address, ADMIN_TOKEN, _rebalance, scheme="bEaReR")  # any case (RFC 7235)
        assert counted_rebalance == [None, None]
        # read-only status stays on the client token; the admin token is a client token too
        assert [p.name for p in _call(server.address, TOKEN, _status).pools] == ["local"]
        assert [p.name for p in _call(server.address, ADMIN_TOKEN, _status).pools] == ["local"]
        assert _refused(server.address, ADMIN_TOKEN[:-1], _status)[0] == (
            grpc.StatusCode.UNAUTHENTICATED
        )
        admin = ClientSecurity(token=ADMIN_TOKEN)
        assert tokens(server.address, admin) == tokens(server.address, ClientSecurity(token=TOKEN))
    finally:
        server.stop()


def test_without_an_admin_token_admin_calls_are_refused(backend, pki, counted_rebalance):
    server = start(backend, ServerSecurity.from_files(token_file=pki["token"]))
    try:
        code, details = _refused(server.address, TOKEN, _rebalance)
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert "has no admin token (set admin_token_file" in details
        assert counted_rebalance == []
    finally:
        server.stop()


def test_the_cli_sends_the_admin_token(backend, pki, capsys, monkeypatch, counted_rebalance):
    from cluster.cli import main

    security = ServerSecurity.from_files(
        token_file=pki["token"], admin_token_file=pki["admin_token"]
    )
    server = start(backend, security)
    try:
        assert main(["rebalance", "--target", server.address, "--token-file", pki["token"]]) == 1
        assert "PERMISSION_DENIED" in capsys.readouterr().err
        flags = ["--target", server.address, "--admin-token-file", pki["admin_token"]]
        assert main(["rebalance", *flags]) == 0
        monkeypatch.setenv("EPCLUSTER_ADMIN_TOKEN_FILE", pki["admin_token"])
        assert main(["rebalance", "--target", server.address]) == 0
        assert counted_rebalance == [None, None]
    finally:
        server.stop()


def _vllm_abort(*ids):
    def call(ch, md):
        return vgrpc.VllmEngineStub(ch).Abort(vpb.AbortRequest(request_ids=ids), metadata=md)

    return call


def test_vllm_abort_of_another_callers_request_needs_the_admin_token(backend, pki):
    security = ServerSecurity.from_files(
        token_file=pki["token"], admin_token_file=pki["admin_token"]
    )
    server = serve(
        backend, port=0, security=security, model_name="tiny-random",
        checkpoint=resolve_model_path("tiny-random"),
    )  # fmt: skip
    assert server.wait_ready(10)
    md = (("authorization", f"Bearer {TOKEN}"),)
    options = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own
    owner = grpc.insecure_channel(server.address, options=options)
    v1 = InferenceClient(server.address, timeout=60, security=ClientSecurity(token=TOKEN))

    def start_long(rid: str):
        sampling = vpb.SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0)
        request = vpb.GenerateRequest(
            request_id=rid, tokenized=vpb.TokenizedInput(input_ids=[5, 6, 7]),
            sampling_params=sampling, stream=True,
        )  # fmt: skip
        stream = vgrpc.VllmEngineStub(owner).Generate(request, metadata=md, timeout=60)
        assert next(stream).WhichOneof("response") == "chunk"
        return stream

    try:
        stream = start_long("victim")
        code, details = _refused(server.address, TOKEN, _vllm_abort("victim"))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        assert "started by another caller" in details and "admin token" in details
        _call(server.address, TOKEN, _vllm_abort("no-such-request"))  # nothing to abort: OK
        assert next(stream).WhichOneof("response") == "chunk"  # still generating
        _vllm_abort("victim")(owner, md)  # its own caller may
        assert list(stream)[-1].complete.finish_reason == "abort"

        stream = start_long("victim-2")
        _call(server.address, ADMIN_TOKEN, _vllm_abort("victim-2"))  # the admin may
        assert list(stream)[-1].complete.finish_reason == "abort"

        # a request started over epcluster.v1 has no vLLM owner: only the admin aborts it
        params = SamplingParams(max_tokens=2000, ignore_eos=True, temperature=0.0)
        v1_stream = v1.generate([5, 6, 7], params, request_id="over-v1")
        next(v1_stream)
        code, _ = _refused(server.address, TOKEN, _vllm_abort("over-v1"))
        assert code == grpc.StatusCode.PERMISSION_DENIED
        _call(server.address, ADMIN_TOKEN, _vllm_abort("over-v1"))
        assert convert.output_from_proto(list(v1_stream)[-1]).finish_reason == "abort"
        assert wait_idle(backend, timeout=10) == (False, 0)
    finally:
        owner.close()
        v1.close()
        server.stop()
