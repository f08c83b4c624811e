"""vLLM's engine gRPC protocol on the router (router/api/vllm_grpc.py), through smg-grpc-proto's own
stubs: Generate streamed and not gives epcluster.v1's tokens; the management RPCs answer; what
epcluster cannot honour is refused (UNIMPLEMENTED), bad values are INVALID_ARGUMENT; health has
the engine service's name; a cancelled stream frees its blocks."""

import asyncio
import hashlib
import io
import time
import zipfile

import grpc
import pytest
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vgrpc

from engine import SamplingParams
from moe import resolve_model_path
from router.api import vllm_grpc
from router.api.vllm_grpc import tokenizer_zip
from router.client import InferenceClient
from router.server import RouterServer
from tests.router.conftest import wait_idle

MODEL = "tiny-random"


@pytest.fixture(scope="module")
def server(backend):
    server = RouterServer(backend, port=0).serve_vllm(MODEL, resolve_model_path(MODEL)).start()
    assert server.wait_ready(10)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stub(server):
    channel = grpc.insecure_channel(server.address)
    yield vgrpc.VllmEngineStub(channel)
    channel.close()


@pytest.fixture(autouse=True)
def leaves_nothing_behind(backend):
    yield
    assert wait_idle(backend) == (False, 0)


def generate(ids, stream: bool, **sampling) -> vpb.GenerateRequest:
    return vpb.GenerateRequest(
        request_id=f"r-{stream}-{len(ids)}", tokenized=vpb.TokenizedInput(input_ids=ids),
        sampling_params=vpb.SamplingParams(**sampling), stream=stream,
    )  # fmt: skip


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0, "max_tokens": 7},
        {"temperature": 0.8, "seed": 5, "max_tokens": 9, "top_k": 40},
    ],
)
def test_generate_equals_epcluster_v1(server, stub, sampling):
    with InferenceClient(server.address, timeout=60) as v1:
        params = SamplingParams(**{k: v for k, v in sampling.items()})
        want = v1.complete([5, 6, 7, 8], params)
    streamed = list(stub.Generate(generate([5, 6, 7, 8], True, **sampling)))
    assert [r.WhichOneof("response") for r in streamed[:-1]] == ["chunk"] * (len(streamed) - 1)
    done = streamed[-1].complete
    assert [t for r in streamed[:-1] for t in r.chunk.token_ids] == want.token_ids
    assert done.finish_reason == want.finish_reason and done.completion_tokens == len(
        want.token_ids
    )
    (whole,) = stub.Generate(generate([5, 6, 7, 8], False, **sampling))
    assert list(whole.complete.output_ids) == want.token_ids
    assert whole.complete.prompt_tokens == 4


def test_logprobs_and_text_input(stub):
    request = vpb.GenerateRequest(request_id="t", text="Hello",
                                  sampling_params=vpb.SamplingParams(temperature=0, max_tokens=3,
                                                                     logprobs=2))  # fmt: skip
    (whole,) = stub.Generate(request)
    lp = whole.complete.output_logprobs
    assert list(lp.token_ids) == list(whole.complete.output_ids)
    assert len(lp.top_logprobs) == 3 and all(len(t.values) == 2 for t in lp.top_logprobs)


@pytest.mark.parametrize(
    ("sampling", "code", "fragment"),
    [
        ({"presence_penalty": 0.5}, grpc.StatusCode.UNIMPLEMENTED, "presence_penalty"),
        ({"n": 2}, grpc.StatusCode.UNIMPLEMENTED, "sampling_params.n"),
        ({"min_tokens": 3}, grpc.StatusCode.UNIMPLEMENTED, "min_tokens"),
        ({"regex": "a+"}, grpc.StatusCode.UNIMPLEMENTED, "constraint"),
        ({"logit_bias": {5: 1.0}}, grpc.StatusCode.UNIMPLEMENTED, "logit_bias"),
        ({"temperature": -1}, grpc.StatusCode.INVALID_ARGUMENT, "temperature must be in [0,"),
        ({"stop_token_ids": [512]}, grpc.StatusCode.INVALID_ARGUMENT, "must be in [0, 512)"),
        # uint32 on vLLM's wire: past int32, the bound every front end shares
        ({"top_k": 2**32 - 1}, grpc.StatusCode.INVALID_ARGUMENT, "top_k must be an integer in"),
        ({"max_tokens": 2**31}, grpc.StatusCode.INVALID_ARGUMENT, "max_tokens must be an"),
        ({"seed": -1}, grpc.StatusCode.INVALID_ARGUMENT, "seed must be"),
        ({"temperature": float("nan")}, grpc.StatusCode.INVALID_ARGUMENT, "must be finite"),
    ],
)
def test_what_cannot_be_honoured_is_refused(stub, sampling, code, fragment):
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(generate([5, 6], False, **sampling)))
    assert err.value.code() == code and fragment in err.value.details()


def test_bad_inputs(stub):
    for request, fragment in [
        (vpb.GenerateRequest(request_id="x"), "no input"),
        (generate([], False), "prompt is empty"),
        (generate([9999], False), "out of range"),
        (vpb.GenerateRequest(request_id="a\nb", tokenized=vpb.TokenizedInput(input_ids=[5])),
         "does not print"),
        (vpb.GenerateRequest(request_id="r" * 257, tokenized=vpb.TokenizedInput(input_ids=[5])),
         "use at most 256"),
    ]:  # fmt: skip
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Generate(request))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert fragment in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        stub.Embed(vpb.EmbedRequest(request_id="e"))
    assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_management_rpcs(server, stub, monkeypatch):
    zipped = []  # per call: whether it ran off the event loop

    def counted(checkpoint):
        try:
            asyncio.get_running_loop()
            zipped.append(False)
        except RuntimeError:
            zipped.append(True)
        return tokenizer_zip(checkpoint)

    monkeypatch.setattr(vllm_grpc, "tokenizer_zip", counted)
    assert stub.HealthCheck(vpb.HealthCheckRequest()).healthy
    info = stub.GetModelInfo(vpb.GetModelInfoRequest())
    assert (info.served_model_name, info.vocab_size, info.max_context_length) == (MODEL, 512, 2048)
    # the model's name, never the router's checkpoint directory (an absolute path on its host)
    assert info.model_path == info.tokenizer_path == MODEL
    server_info = stub.GetServerInfo(vpb.GetServerInfoRequest())
    assert server_info.server_type == "vllm-grpc" and server_info.active_requests == 0
    loads = stub.GetLoads(vpb.GetLoadsRequest())
    assert loads.dp_rank_count == 1 and loads.loads[0].max_total_num_tokens > 0
    chunks = list(stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert "tokenizer.json" in names and "config.json" in names
    # built once per router (the first call, above), off the loop: later calls get its bytes
    again = b"".join(c.data for c in stub.GetTokenizer(common_pb2.GetTokenizerRequest()))
    assert again == data and zipped == [True]
    with InferenceClient(server.address, timeout=10) as client:
        assert client.health("vllm.grpc.engine.VllmEngine") == "SERVING"


def test_a_cancelled_stream_and_abort_free_the_blocks(server, stub, backend):
    call = stub.Generate(generate([5, 6, 7], True, max_tokens=1500, ignore_eos=True))
    next(call)
    call.cancel()
    assert wait_idle(backend, timeout=10) == (False, 0)
    call = stub.Generate(generate([7, 8], True, max_tokens=1500, ignore_eos=True))
    next(call)
    stub.Abort(vpb.AbortRequest(request_ids=["r-True-2"]))
    rest = list(call)
    assert rest[-1].complete.finish_reason == "abort"


def test_a_short_deadline_reaches_the_request_and_ends_deadline_exceeded(
    stub, backend, monkeypatch
):
    """The client's deadline travels into the request as epcluster.v1's does (it once was
    dropped: the ranks ran such a request to its end), and nothing is held after it."""
    seen = []
    generate_on_backend = backend.generate

    def spy(request):
        seen.append(request)
        return generate_on_backend(request)

    monkeypatch.setattr(backend, "generate", spy)
    before = time.time()
    long = generate(list(range(5, 12)), True, max_tokens=1500, ignore_eos=True, temperature=0)
    with pytest.raises(grpc.RpcError) as err:
        list(stub.Generate(long, timeout=0.4))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    (request,) = seen
    assert request.deadline is not None and before < request.deadline < before + 1.0
    assert wait_idle(backend) == (False, 0)
