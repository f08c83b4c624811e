"""Admin calls behind the admin token (router/auth.py ADMIN_METHODS, router/api/abort_scope.py):
Rebalance gets PERMISSION_DENIED with the client token, UNAUTHENTICATED with none, and is refused
when the router has no admin token; read-only status stays on the client token; the CLI sends
the admin token (flag or environment). vLLM Abort of a request another caller started (another
connection, or another front end) needs the admin token; its own caller may. A rank failure
during an admin call answers UNAVAILABLE in one line, never UNKNOWN (audit L5)."""

import asyncio

import grpc
import pytest
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vgrpc

from engine import SamplingParams
from moe import resolve_model_path
from router.api import convert
from router.auth import ClientSecurity, ServerSecurity
from router.backend import Unavailable
from router.backends.cluster_admin import ClusterAdmin
from router.backends.pools import RankCallFailed, RankFailed
from router.backends.route_table import RouteTable
from router.backends.routing import RoutingConfig
from router.client import InferenceClient
from router.proto import epcluster_pb2 as pb
from router.proto import epcluster_pb2_grpc as pb_grpc
from router.server import RouterServer
from tests.router.backends.test_cluster_backend import INFO
from tests.router.conftest import wait_idle
from tests.router.test_security import ADMIN_TOKEN, TOKEN, start, tokens, write_pki


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    return write_pki(tmp_path_factory.mktemp("pki"))


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
    server = RouterServer(backend, port=0, security=security)
    server.serve_vllm("tiny-random", resolve_model_path("tiny-random")).start()
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


# ---- a rank failure in an admin call: UNAVAILABLE in one line (audit L5) ----


class _Rank:
    def __init__(self, fail: Exception | None) -> None:
        self.fail = fail

    async def status(self):
        raise self.fail

    async def expert_load(self):
        raise self.fail


class _Pool:
    def __init__(self, ranks: list) -> None:
        self.ranks = ranks


def _admin(fail: Exception):
    """A ClusterAdmin whose decode rank 1 fails every call with `fail`."""
    pools = {"prefill": _Pool([_Rank(fail)]), "decode": _Pool([_Rank(fail), _Rank(fail)])}
    return ClusterAdmin(pools, RoutingConfig(), INFO, RouteTable(1, 2, 4, 8))


@pytest.mark.parametrize("error", [RankFailed, RankCallFailed])
def test_a_rank_failure_in_an_admin_call_is_unavailable(error):
    admin = _admin(error("decode", 1, "actor died\nTraceback (most recent ...)"))
    for call in (admin.expert_load(), admin.rebalance("decode")):
        with pytest.raises(Unavailable) as err:
            asyncio.run(call)
        assert "decode rank 1" in str(err.value) and "actor died" in str(err.value)
        assert "\n" not in str(err.value) and "Traceback" not in str(err.value)


def test_the_server_answers_unavailable_not_unknown(backend, monkeypatch):
    async def fail(*args: object) -> None:
        raise Unavailable("decode rank 1 failed (gone): retry\nsecond line")

    for name in ("expert_load", "status", "rebalance"):
        monkeypatch.setattr(backend, name, fail)
    server = start(backend, ServerSecurity())
    try:
        with InferenceClient(server.address, timeout=10) as client:
            for call in (client.expert_load, client.cluster_status, client.rebalance):
                with pytest.raises(grpc.RpcError) as err:
                    call()
                assert err.value.code() == grpc.StatusCode.UNAVAILABLE
                assert err.value.details() == "decode rank 1 failed (gone): retry"
    finally:
        monkeypatch.undo()  # the backend's own status, for the server's stop
        server.stop()
