"""A bad-input matrix through gRPC (types, ranges, sizes, unicode, huge stop lists, extreme
temperatures and seeds, oversized and unparsable messages), beside the INVALID_ARGUMENT cases of
test_server.py: each case gets its expected status (and, when OK, the in-process engine's tokens),
the server keeps serving, and no request, KV block or admission slot is left behind."""

import grpc
import pytest

from engine import SamplingParams
from router.client import InferenceClient
from router.proto import epcluster_pb2 as pb
from tests.router.conftest import wait_idle

# the check that the server still serves: sampled, but EOS cannot end it early (a random model
# samples its EOS now and then: a count of 1 failed CI once)
SERVES = SamplingParams(max_tokens=2, ignore_eos=True)

SP = pb.SamplingParams
IDS = pb.TokenIds(ids=[5, 6, 7])
IDS_BYTES = pb.GenerateRequest(token_ids=IDS).SerializeToString()
OK, INVALID = grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT


def ids_request(**sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(token_ids=IDS, sampling_params=SP(**sampling))


def text_request(text: str, **sampling) -> pb.GenerateRequest:
    return pb.GenerateRequest(text=text, sampling_params=SP(**sampling))


# name -> (request message or raw bytes, expected status, a part of the details, or for OK the
# SamplingParams the in-process engine runs to produce the same tokens)
CASES = {
    # sizes
    "17 stop strings": (ids_request(stop=["a"] * 17), INVALID, "stop holds 17 strings"),
    "100k stop strings": (ids_request(stop=["x"] * 100_000), INVALID, "at most 16"),
    "stop string of 257 chars": (ids_request(stop=["s" * 257]), INVALID, "at most 256 char"),
    "65 stop token ids": (ids_request(stop_token_ids=list(range(65))), INVALID, "at most 64"),
    "16 stop strings of 256 chars": (
        ids_request(max_tokens=3, temperature=0.0, stop=["q" * 256] * 16),
        OK,
        SamplingParams(max_tokens=3, temperature=0.0, stop=["q" * 256] * 16),
    ),
    "64 stop token ids": (
        ids_request(max_tokens=3, temperature=0.0, stop_token_ids=list(range(500, 512)) * 5),
        OK,
        SamplingParams(max_tokens=3, temperature=0.0, stop_token_ids=list(range(500, 512)) * 5),
    ),
    "prompt text over the context": (text_request("hello " * 20_000), INVALID, "shorten it"),
    "100k prompt token ids": (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 100_000)),
        INVALID,
        "shorten it to at most 2047",
    ),
    "a 5 MB message": (text_request("a" * 5_000_000), grpc.StatusCode.RESOURCE_EXHAUSTED, "larger"),
    "request_id of 256 chars": (
        pb.GenerateRequest(
            request_id="r" * 256, token_ids=IDS, sampling_params=SP(max_tokens=2, temperature=0.0)
        ),
        OK,
        SamplingParams(max_tokens=2, temperature=0.0),
    ),  # fmt: skip
    # unparsable bytes
    "invalid UTF-8 in text": (b"\x12\x03\xff\xfe\xfd", INVALID, "String field had bad UTF-8"),
    "truncated message": (b"\x1a\x05\x0a\x03\x05", INVALID, "not a valid"),
    "wrong wire type for max_tokens": (b"\x22\x02\x0d\x01", INVALID, "not a valid"),
    # temperatures
    "temperature 1e-40 is greedy": (
        ids_request(max_tokens=4, temperature=1e-40),
        OK,
        SamplingParams(max_tokens=4, temperature=0.0),
    ),
    "temperature 1e6 (the largest)": (
        ids_request(max_tokens=4, temperature=1e6, seed=3),
        OK,
        SamplingParams(max_tokens=4, temperature=1e6, seed=3),
    ),
    "temperature 1e300": (ids_request(temperature=1e300), INVALID, "temperature must be in [0,"),
    "temperature inf": (ids_request(temperature=float("inf")), INVALID, "must be finite"),
    "temperature -0.0": (
        ids_request(max_tokens=3, temperature=-0.0),
        OK,
        SamplingParams(max_tokens=3, temperature=0.0),
    ),
    # seeds
    "seed 2**63 - 1": (
        ids_request(max_tokens=4, temperature=1.0, seed=2**63 - 1),
        OK,
        SamplingParams(max_tokens=4, temperature=1.0, seed=2**63 - 1),
    ),
    # int64 on the wire: 2**63 and 2**64 - 1 sent as unsigned varints arrive as -2**63 and -1
    "seed 2**63 as an unsigned varint": (
        ids_request(seed=-(2**63)),
        INVALID,
        "[0, 2**63), got -9223372036854775808",
    ),
    "seed 2**64 - 1 as an unsigned varint": (
        IDS_BYTES + b"\x22\x0b\x30" + b"\xff" * 9 + b"\x01",
        INVALID,
        "[0, 2**63), got -1",
    ),
    "seed 0": (
        ids_request(max_tokens=4, temperature=0.9, seed=0),
        OK,
        SamplingParams(max_tokens=4, temperature=0.9, seed=0),
    ),
    # ranges
    "max_tokens -1": (ids_request(max_tokens=-1), INVALID, "max_tokens must be an int in [1,"),
    "top_k 10**9 is off": (
        ids_request(max_tokens=4, top_k=10**9, seed=1),
        OK,
        SamplingParams(max_tokens=4, top_k=10**9, seed=1),
    ),
    "top_k -1": (
        ids_request(max_tokens=3, top_k=-1, seed=2),
        OK,
        SamplingParams(max_tokens=3, top_k=-1, seed=2),
    ),
    "top_p 1e-300": (
        ids_request(max_tokens=3, top_p=1e-300, seed=4),
        OK,
        SamplingParams(max_tokens=3, top_p=1e-300, seed=4),
    ),
    "top_p nan": (ids_request(top_p=float("nan")), INVALID, "top_p must be finite"),
    "min_p 1.0": (
        ids_request(max_tokens=3, min_p=1.0, seed=5),
        OK,
        SamplingParams(max_tokens=3, min_p=1.0, seed=5),
    ),
    "min_p -inf": (ids_request(min_p=float("-inf")), INVALID, "min_p must be finite"),
    "logprobs -1": (ids_request(logprobs=-1), INVALID, "logprobs must be None or an int"),
    "top_k 1.5 as a double on the wire": (
        b"\x22\x09\x19" + b"\x00" * 8,
        INVALID,
        "sampling_params.top_k (#3) with the wrong wire type",
    ),
    "sampling_params as a varint": (
        IDS_BYTES + b"\x20\x01",
        INVALID,
        "does not know: sampling_params (#4) with the wrong wire type",
    ),
    # both prompts on the wire: the oneof keeps the last one parsed
    "text, then token_ids": (
        pb.GenerateRequest(text="Hi").SerializeToString()
        + ids_request(max_tokens=3, temperature=0.0).SerializeToString(),
        OK,
        ([5, 6, 7], SamplingParams(max_tokens=3, temperature=0.0)),
    ),
    "token_ids, then text": (
        ids_request(max_tokens=3, temperature=0.0).SerializeToString()
        + pb.GenerateRequest(text="Hi").SerializeToString(),
        OK,
        ("Hi", SamplingParams(max_tokens=3, temperature=0.0)),
    ),
    # unicode
    "unicode prompt with NUL": (
        text_request("日本語 🎉 \x00 end", max_tokens=4, temperature=0.0),
        OK,
        SamplingParams(max_tokens=4, temperature=0.0),
    ),
    "unicode stop string": (
        ids_request(max_tokens=4, temperature=0.0, stop=["🎉", "日"]),
        OK,
        SamplingParams(max_tokens=4, temperature=0.0, stop=["🎉", "日"]),
    ),
    "unicode request_id": (
        pb.GenerateRequest(
            request_id="ид-🎉", token_ids=IDS, sampling_params=SP(max_tokens=2, temperature=0.0)
        ),
        OK,
        SamplingParams(max_tokens=2, temperature=0.0),
    ),  # fmt: skip
    "whitespace prompt": (
        text_request("   ", max_tokens=3, temperature=0.0),
        OK,
        SamplingParams(max_tokens=3, temperature=0.0),
    ),
    "right-to-left prompt": (
        text_request("שלום עולם مرحبا", max_tokens=3, temperature=0.0),
        OK,
        SamplingParams(max_tokens=3, temperature=0.0),
    ),
    "an encoded lone surrogate": (b"\x12\x03\xed\xa0\x80", INVALID, "had bad UTF-8"),
    "request_id with a newline": (
        pb.GenerateRequest(request_id="a\nINFO forged", token_ids=IDS),
        INVALID,
        "holds a character that does not print",
    ),
    "request_id with NUL": (
        pb.GenerateRequest(request_id="a\x00", token_ids=IDS),
        INVALID,
        "use printable characters",
    ),
    # more ranges and sizes
    "max_tokens 2**31 - 1 ends at the context": (
        pb.GenerateRequest(
            token_ids=pb.TokenIds(ids=[5] * 2040),
            sampling_params=SP(max_tokens=2**31 - 1, ignore_eos=True, temperature=0.0),
        ),
        OK,
        SamplingParams(max_tokens=2**31 - 1, ignore_eos=True, temperature=0.0),
    ),
    "top_p 1.5": (ids_request(top_p=1.5), INVALID, "top_p must be in (0, 1], got 1.5"),
    "top_p -1": (ids_request(top_p=-1.0), INVALID, "top_p must be in (0, 1], got -1.0"),
    "stop string of 10k chars": (ids_request(stop=["s" * 10_000]), INVALID, "one of 10000"),
}


def send(client: InferenceClient, request: pb.GenerateRequest | bytes) -> list:
    if isinstance(request, bytes):  # bytes the schema may reject: sent as they are
        call = client.channel.unary_stream(
            "/epcluster.v1.Inference/Generate",
            request_serializer=lambda raw: raw,
            response_deserializer=pb.GenerateResponse.FromString,
        )
        return list(call(request, timeout=30))
    return list(client.stub.Generate(request, timeout=30))


def test_the_matrix_is_large_enough():
    assert len(CASES) >= 30


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_case(v1_client, backend, oracle, case):
    client = v1_client
    request, code, expected = CASES[case]
    if code == OK:
        outs = send(client, request)
        if isinstance(request, bytes):  # the prompt the bytes should give
            prompt, params = expected
        else:
            text = request.WhichOneof("prompt") == "text"
            prompt, params = request.text if text else list(request.token_ids.ids), expected
        want = oracle.generate([prompt], params)[0]
        assert [t for o in outs for t in o.token_ids] == want.token_ids
        assert outs[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        assert outs[-1].usage.prompt_tokens == want.num_prompt_tokens
        if not isinstance(request, bytes) and request.HasField("request_id"):
            assert {o.request_id for o in outs} == {request.request_id}
    else:
        with pytest.raises(grpc.RpcError) as err:
            send(client, request)
        assert err.value.code() == code, err.value.details()
        assert expected in err.value.details()
        assert "Traceback" not in err.value.details()
    # the server still serves, and nothing is left behind
    assert client.complete([5, 6], SERVES).num_completion_tokens == 2
    assert wait_idle(backend) == (False, 0)
    assert client.cluster_status().num_queued == 0


def test_a_100_mb_message_is_refused_by_grpc(v1_client, backend):
    """The router sets no receive limit: grpc's default (4 MiB) refuses it before any code of
    ours runs."""
    request = text_request("a" * 100_000_000)
    with pytest.raises(grpc.RpcError) as err:
        send(v1_client, request)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"larger than max ({request.ByteSize()} vs. {4 << 20})" in err.value.details()
    del request
    assert v1_client.complete([5, 6], SERVES).num_completion_tokens == 2
    assert wait_idle(backend) == (False, 0)


@pytest.mark.parametrize("timeout", [0.0, -1.0])
def test_a_deadline_already_past(v1_client, backend, timeout):
    """Whether the client or the server notices first, the call ends DEADLINE_EXCEEDED and the
    engine holds nothing."""
    with pytest.raises(grpc.RpcError) as err:
        list(v1_client.stub.Generate(ids_request(max_tokens=50, ignore_eos=True), timeout=timeout))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_idle(backend) == (False, 0)
    assert v1_client.cluster_status().num_queued == 0
    assert v1_client.complete([5, 6], SERVES).num_completion_tokens == 2
