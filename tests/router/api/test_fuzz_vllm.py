"""Property-based fuzz of vLLM's engine gRPC protocol on the router (router/api/vllm_grpc.py): 1,000
generated Generate requests (hypothesis, derandomized), streamed and not, valid and not: every
numeric field over its whole wire range (uint32 top_k and max_tokens past int32, NaN and inf
float32s, negative int32 seeds), any Unicode text, huge strings and token-id lists, fields
epcluster cannot honour, unknown wire fields. Each ends OK (its tokens checked), INVALID_ARGUMENT,
or UNIMPLEMENTED for a feature epcluster refuses, as an independent reading of the documented
rules expects; never INTERNAL or UNKNOWN. The server serves throughout and holds no request and
no KV block after each case; the counts go to the terminal summary ("fuzz cases")."""

import collections
import math

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from smg_grpc_proto.generated import vllm_engine_pb2 as vpb
from smg_grpc_proto.generated import vllm_engine_pb2_grpc as vgrpc

from engine.sampling_params import MAX_TEMPERATURE
from moe import resolve_model_path
from router.server import RouterServer
from tests.router.conftest import record_fuzz_cases, wait_idle

pytestmark = pytest.mark.slow

MODEL, VOCAB, CONTEXT, CASES = "tiny-random", 512, 2048, 1000
U32, I32 = 2**32 - 1, 2**31 - 1


def mostly(good: st.SearchStrategy, bad: st.SearchStrategy) -> st.SearchStrategy:
    return st.sampled_from([good] * 7 + [bad]).flatmap(lambda chosen: chosen)


f32 = st.floats(width=32)  # NaN, inf and every float32
unit = st.floats(min_value=2.0**-100, max_value=1.0, width=32)
fields = st.fixed_dictionaries(
    {
        "input": mostly(
            st.tuples(st.just("ids"), st.lists(st.integers(0, VOCAB - 1), min_size=1,
                                               max_size=12))
            | st.tuples(st.just("text"), st.text(min_size=1, max_size=40)),
            st.tuples(st.just("ids"), st.lists(st.integers(0, U32), max_size=4))
            | st.tuples(st.just("ids"), st.sampled_from([CONTEXT, 300_000]).map(
                lambda n: [1] * n))
            | st.tuples(st.just("text"), st.just("") | st.just(100_000).map(lambda n: "é" * n))
            | st.just(("none", None)),
        ),
        "stream": st.booleans(),
        "max_tokens": mostly(st.integers(1, 4), st.just(0) | st.integers(I32 + 1, U32)),
        # unknown fields on the wire, ignored as vLLM's own server does: #99 (a varint), or #1
        # (request_id, a string) sent as a varint
        "extra": mostly(st.just(b""), st.sampled_from([b"\x98\x06\x01", b"\x08\x07"])),
    },
    optional={
        "request_id": mostly(
            st.text(st.characters(exclude_categories=["C", "Z"]) | st.just(" "), max_size=8),
            st.just(257).map(lambda n: "r" * n) | st.text(min_size=1, max_size=8),
        ),
        "temperature": mostly(st.floats(0.0, 2.0, width=32), f32),
        "top_p": mostly(unit | st.just(0.0), f32),
        "top_k": mostly(st.integers(0, I32), st.integers(I32 + 1, U32)),
        "min_p": mostly(st.floats(0.0, 1.0, width=32), f32),
        "seed": mostly(st.integers(0, I32), st.integers(-(2**31), -1)),
        "logprobs": mostly(st.integers(0, 20), st.integers(-(2**31), I32)),
        "stop": mostly(
            st.lists(st.text(min_size=1, max_size=4), max_size=16),
            st.lists(st.text(max_size=4), max_size=18)
            | st.lists(st.text(min_size=255, max_size=260), min_size=1, max_size=2)
            | st.just(100_000).map(lambda n: ["s" * n]),
        ),
        "stop_token_ids": mostly(
            st.lists(st.integers(0, VOCAB - 1), max_size=64),
            st.lists(st.integers(0, U32), max_size=70),
        ),
        "ignore_eos": st.booleans(),
        "n": mostly(st.integers(0, 1), st.integers(2, U32)),
        # features epcluster refuses (UNIMPLEMENTED): present 1 time in 8
        "unsupported": mostly(st.just(None), st.sampled_from(
            ["frequency_penalty", "presence_penalty", "repetition_penalty", "min_tokens",
             "prompt_logprobs", "regex", "mm_inputs"])),
    },
)  # fmt: skip


def to_request(f: dict) -> vpb.GenerateRequest:
    p = vpb.SamplingParams(max_tokens=f["max_tokens"])
    for k in ("temperature", "top_p", "top_k", "min_p", "seed", "logprobs", "ignore_eos", "n"):
        if k in f:
            setattr(p, k, f[k])
    p.stop.extend(f.get("stop", []))
    p.stop_token_ids.extend(f.get("stop_token_ids", []))
    msg = vpb.GenerateRequest(sampling_params=p, stream=f["stream"])
    kind, value = f["input"]
    if kind == "ids":
        msg.tokenized.input_ids.extend(value)
        msg.tokenized.SetInParent()
    elif kind == "text":
        msg.text = value
    if "request_id" in f:
        msg.request_id = f["request_id"]
    u = f.get("unsupported")
    if u in ("frequency_penalty", "presence_penalty", "repetition_penalty"):
        setattr(msg.sampling_params, u, 0.5)
    elif u == "min_tokens":
        msg.sampling_params.min_tokens = 2
    elif u == "prompt_logprobs":
        msg.sampling_params.prompt_logprobs = 1
    elif u == "regex":
        msg.sampling_params.regex = "a+"
    elif u == "mm_inputs":
        msg.mm_inputs.SetInParent()
    return vpb.GenerateRequest.FromString(msg.SerializeToString() + f["extra"])


def expected(f: dict) -> set[grpc.StatusCode]:
    """The documented outcome, read independently of the converter: {OK}, or the codes a
    refusal may carry (UNIMPLEMENTED for a feature epcluster refuses, which is checked before
    or after the values, so either code when both apply)."""
    invalid = not valid(f)
    if f.get("unsupported") or f.get("n", 0) > 1:
        return {grpc.StatusCode.UNIMPLEMENTED} | ({grpc.StatusCode.INVALID_ARGUMENT} if invalid
                                                  else set())  # fmt: skip
    return {grpc.StatusCode.INVALID_ARGUMENT} if invalid else {grpc.StatusCode.OK}


def valid(f: dict) -> bool:
    kind, value = f["input"]
    if kind == "none":
        return False
    if kind == "ids" and (not value or len(value) >= CONTEXT or max(value) >= VOCAB):
        return False
    if kind == "text" and not value or kind == "text" and len(value) >= CONTEXT:
        return False  # (the tiny tokenizer makes at least a token of each character)
    rid = f.get("request_id", "")
    if rid and not (len(rid) <= 256 and rid.isprintable()):
        return False
    if not 1 <= f["max_tokens"] <= I32:
        return False
    t = f.get("temperature", 1.0)
    if not (math.isfinite(t) and 0 <= t <= MAX_TEMPERATURE):
        return False
    p = f.get("top_p", 0.0) or 1.0  # proto3: 0 is unset
    if not (math.isfinite(p) and 0 < p <= 1) or math.isnan(p):
        return False
    if f.get("top_k", 0) > I32:
        return False
    m = f.get("min_p", 0.0)
    if not (math.isfinite(m) and 0 <= m <= 1):
        return False
    if f.get("seed", 0) < 0:
        return False
    stop = f.get("stop", [])
    if len(stop) > 16 or any(not s or len(s) > 256 for s in stop):
        return False
    ids = f.get("stop_token_ids", [])
    if len(ids) > 64 or any(t >= VOCAB for t in ids):
        return False
    return 0 <= f.get("logprobs", 0) <= 20


@pytest.fixture(scope="module")
def server(backend):
    server = RouterServer(backend, port=0).serve_vllm(MODEL, resolve_model_path(MODEL)).start()
    assert server.wait_ready(10)
    yield server
    server.stop()


def test_fuzzed_vllm_requests_get_the_documented_status(server, backend, capsys):
    channel = grpc.insecure_channel(server.address)
    stub = vgrpc.VllmEngineStub(channel)
    counts: collections.Counter = collections.Counter()

    @settings(
        max_examples=CASES,
        deadline=None,
        derandomize=True,  # the same requests on every run
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(f=fields)
    def one(f: dict) -> None:
        want = expected(f)
        try:
            replies = list(stub.Generate(to_request(f), timeout=60))
            code = grpc.StatusCode.OK
        except grpc.RpcError as e:
            code, replies = e.code(), []
            assert "Traceback" not in (e.details() or "")
        counts[code.name] += 1
        assert code in want, (f, code, want)
        if code == grpc.StatusCode.OK:
            complete = replies[-1].complete
            assert complete.finish_reason in ("stop", "length"), replies[-1]
            tokens = (
                [t for r in replies[:-1] for t in r.chunk.token_ids]
                if f["stream"]
                else list(complete.output_ids)
            )
            assert len(tokens) == complete.completion_tokens <= f["max_tokens"]
            assert complete.finish_reason == "stop" or len(tokens) == f["max_tokens"]
        assert wait_idle(backend) == (False, 0)
        assert not server.frontend.in_flight

    try:
        one()
    finally:
        channel.close()
    record_fuzz_cases("test_fuzz_vllm", counts)
    with capsys.disabled():
        print(f"\ntest_fuzz_vllm: {sum(counts.values())} cases: {dict(sorted(counts.items()))}")
    assert sum(counts.values()) >= CASES
