"""Property-based fuzz of Generate through gRPC: 1,000 generated requests (hypothesis), valid and
not, each answered with the status an independent reading of the documented rules expects
(epcluster.proto's comments and the README), the server serving throughout, and the block
invariant (no request, no used KV block, no admitted request) holding after every one. Every
integer field is drawn over its whole wire range (int32, int64) and strings up to 100,000
characters; the case counts go to the terminal summary ("fuzz cases")."""

import collections
import math
import unicodedata

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from engine.sampling_params import MAX_TEMPERATURE
from router.proto import epcluster_pb2 as pb
from tests.router.conftest import record_fuzz_cases, wait_idle

pytestmark = pytest.mark.slow

VOCAB, CONTEXT = 512, 2048  # the tiny-random preset
I32, I64 = 2**31 - 1, 2**63 - 1
CASES = 1000


def mostly(good: st.SearchStrategy, bad: st.SearchStrategy) -> st.SearchStrategy:
    """A valid value 7 times in 8: with 13 optional fields, about half the requests are valid."""
    return st.sampled_from([good] * 7 + [bad]).flatmap(lambda chosen: chosen)


bad_floats = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([-1e-9, math.nan])
printable = st.characters(exclude_categories=["C", "Z"]) | st.just(" ")
unit = st.floats(min_value=1e-300, max_value=1.0) | st.sampled_from([1e-300, 1.0])
fields = st.fixed_dictionaries(
    {
        "text": mostly(
            st.text(min_size=1, max_size=40),
            st.sampled_from(["", None]) | st.just(100_000).map(lambda n: "é" * n),
        ),
        # wire bytes after the message: a field the schema lacks (#99), or request_id (#1) as a
        # varint; either way a field the server cannot read
        "extra": mostly(st.just(b""), st.sampled_from([b"\x98\x06\x01", b"\x08\x07"])),
    },
    optional={
        "request_id": mostly(
            st.text(printable, min_size=1, max_size=8),
            st.sampled_from(["", "r" * 257])
            | st.text(min_size=1, max_size=8)
            | st.just(100_000).map(lambda n: "r" * n),
        ),
        "token_ids": mostly(
            st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
            st.lists(st.integers(-3, VOCAB + 3) | st.integers(-(2**31), I32), max_size=12)
            | st.just(300_000).map(lambda n: [1] * n),
        ),
        "max_tokens": mostly(st.integers(1, 5), st.integers(-(2**31), 0)),
        "temperature": mostly(
            st.floats(min_value=0.0, max_value=2.0)
            | st.sampled_from([1e-40, 1e-5, MAX_TEMPERATURE]),
            bad_floats | st.floats(min_value=MAX_TEMPERATURE * 1.0001) | st.just(1e300),
        ),
        "top_k": mostly(
            st.integers(-1, 3) | st.integers(VOCAB - 2, I32), st.integers(-(2**31), -2)
        ),
        "top_p": mostly(unit, bad_floats | st.just(0.0) | st.floats(min_value=1.0001)),
        "min_p": mostly(
            st.floats(min_value=0.0, max_value=1.0), bad_floats | st.floats(min_value=1.0001)
        ),
        "seed": mostly(st.integers(0, I64) | st.integers(0, 5), st.integers(-(2**63), -1)),
        "stop": mostly(
            st.lists(st.text(min_size=1, max_size=4), max_size=16),
            st.lists(st.text(max_size=4), max_size=18)  # an empty string, or too many
            | st.lists(st.text(min_size=1, max_size=2), min_size=17, max_size=20)
            | st.lists(st.text(min_size=255, max_size=260), min_size=1, max_size=2)
            | st.just(100_000).map(lambda n: ["s" * n]),
        ),
        "stop_token_ids": mostly(
            st.lists(st.integers(0, VOCAB - 1), max_size=64),
            st.lists(st.integers(-2, VOCAB + 2) | st.integers(-(2**31), I32), max_size=64)
            | st.lists(st.integers(0, VOCAB - 1), min_size=65, max_size=70),
        ),
        "ignore_eos": st.booleans(),
        "logprobs": mostly(st.integers(0, 20), st.integers(-(2**31), -1) | st.integers(21, I32)),
    },
)


def to_request(f: dict) -> pb.GenerateRequest:
    sampling = {k: v for k, v in f.items() if k not in ("request_id", "text", "token_ids", "extra")}
    msg = pb.GenerateRequest(sampling_params=pb.SamplingParams(**sampling))
    if "request_id" in f:
        msg.request_id = f["request_id"]
    if "token_ids" in f:  # a oneof: token_ids wins when both are drawn
        msg.token_ids.ids.extend(f["token_ids"])
    elif f["text"] is not None:  # None: no prompt at all
        msg.text = f["text"]
    return pb.GenerateRequest.FromString(msg.SerializeToString() + f["extra"])


def prints(text: str) -> bool:
    """No character of Unicode's Other (control, format, ...) or Separator categories but ' '."""
    return all(c == " " or unicodedata.category(c)[0] not in "CZ" for c in text)


def valid(f: dict) -> bool:
    """The documented rules, read independently of SamplingParams and the converter."""
    if "token_ids" in f:
        ids = f["token_ids"]
        if not ids or len(ids) >= CONTEXT or any(not 0 <= t < VOCAB for t in ids):
            return False
    elif not f.get("text") or len(f["text"]) >= CONTEXT:  # a token or more per character
        return False
    if "request_id" in f and not (1 <= len(f["request_id"]) <= 256 and prints(f["request_id"])):
        return False
    if f["extra"]:
        return False
    if f.get("max_tokens", 16) < 1:
        return False
    t = f.get("temperature", 1.0)
    if not math.isfinite(t) or not 0 <= t <= MAX_TEMPERATURE:
        return False
    if f.get("top_k", 0) not in (0, -1) and f.get("top_k", 0) < 1:
        return False
    p = f.get("top_p", 1.0)
    if not (math.isfinite(p) and 0 < p <= 1):
        return False
    m = f.get("min_p", 0.0)
    if not (math.isfinite(m) and 0 <= m <= 1):
        return False
    if not 0 <= f.get("seed", 0) < 2**63:
        return False
    stop = f.get("stop", [])
    if len(stop) > 16 or any(not s or len(s) > 256 for s in stop):
        return False
    stop_ids = f.get("stop_token_ids", [])
    if len(stop_ids) > 64 or any(not 0 <= t < VOCAB for t in stop_ids):
        return False
    return 0 <= f.get("logprobs", 0) <= 20


def test_fuzzed_requests_get_the_documented_status(v1_client, backend, capsys):
    counts: collections.Counter = collections.Counter()

    @settings(
        max_examples=CASES,
        deadline=None,
        derandomize=True,  # the same 1,000 requests on every run
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(f=fields)
    def one(f: dict) -> None:
        counts[check_one(v1_client, backend, f)] += 1

    one()
    record_fuzz_cases("test_fuzz (epcluster.v1)", counts)
    with capsys.disabled():
        print(f"\ntest_fuzz (epcluster.v1): {sum(counts.values())} cases: {dict(counts)}")
    assert sum(counts.values()) >= CASES


def check_one(client, backend, f: dict) -> str:
    """One request: the documented status, the tokens of a valid one, nothing held after."""
    request = to_request(f)
    event("valid" if valid(f) else "invalid")  # the mix: --hypothesis-show-statistics
    if valid(f):
        outs = list(client.stub.Generate(request, timeout=30))
        tokens = [t for o in outs for t in o.token_ids]
        max_tokens, reason = f.get("max_tokens", 16), outs[-1].finish_reason
        assert reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH), (f, outs[-1])
        assert (
            len(tokens) == max_tokens
            if reason == pb.FINISH_REASON_LENGTH
            else len(tokens) <= max_tokens
        )
        if "logprobs" in f:
            assert sum(len(o.logprobs) for o in outs) == len(tokens)
        outcome = "OK"
    else:
        with pytest.raises(grpc.RpcError) as err:
            list(client.stub.Generate(request, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (f, err.value.details())
        assert "Traceback" not in err.value.details()
        outcome = "INVALID_ARGUMENT"
    assert wait_idle(backend) == (False, 0)
    assert client.cluster_status().num_queued == 0
    return outcome
