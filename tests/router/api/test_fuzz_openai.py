"""Property-based fuzz of the OpenAI HTTP front end: 1,000 generated bodies (hypothesis,
derandomized: the same ones on every run) for /v1/completions and /v1/chat/completions, streamed
and not, valid and not: unbounded integers, floats past float64 and NaN/Infinity (Python's JSON
reads them), wrong types, nesting up to 100,000 deep, any Unicode (lone surrogates included),
strings past the body cap, unknown fields, raw bytes. Each must end in 200 (a valid body: its
choices and token counts checked) or a 4xx in OpenAI's envelope (an invalid one), never a 5xx;
the server serves throughout and holds no request and no KV block after each case. The case
counts go to the terminal summary ("fuzz cases")."""

import collections
import http.client
import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.sampling_params import MAX_TEMPERATURE
from router.api.openai_http import MAX_BODY_BYTES
from router.api.openai_requests import MAX_MESSAGES, MAX_PROMPTS
from router.server import serve
from tests.router.conftest import record_fuzz_cases, wait_idle

pytestmark = pytest.mark.slow

MODEL, VOCAB, CASES = "tiny-random", 512, 1000
I32 = 2**31 - 1


def tagged(good: st.SearchStrategy, bad: st.SearchStrategy) -> st.SearchStrategy:
    """(value, True) 7 times in 8, else (a bad value, False)."""
    return st.sampled_from([True] * 7 + [False]).flatmap(
        lambda ok: (good if ok else bad).map(lambda v: (v, ok))
    )


huge_ints = (
    st.sampled_from([2**31, 2**63, 2**64, 2**70, 10**30, -(2**63) - 1, -(2**70)])
    | st.integers(min_value=2**31)
    | st.integers(max_value=-(2**31) - 1)
)
wrong = (
    st.text(max_size=4)
    | st.lists(st.integers(0, 3), max_size=2)
    | st.dictionaries(st.text(max_size=2), st.integers(0, 3), max_size=1)
)
not_finite = st.sampled_from([math.nan, math.inf, -math.inf, 10**400])
bad_int = huge_ints | wrong | st.booleans() | st.floats(allow_nan=False, allow_infinity=False)
bad_float = not_finite | wrong | st.booleans()
ids = st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12)
text = st.text(max_size=30)  # any code point but surrogates
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner),
    max_leaves=6,
)

SAMPLING = {
    "temperature": tagged(
        st.floats(0, 2) | st.integers(0, 2) | st.just(MAX_TEMPERATURE) | st.none(),
        bad_float | st.floats(max_value=-1e-300) | st.floats(min_value=MAX_TEMPERATURE * 1.01),
    ),
    "top_p": tagged(
        st.floats(1e-300, 1.0) | st.just(1) | st.none(),
        bad_float | st.floats(max_value=0.0) | st.floats(min_value=1.0001),
    ),
    "min_p": tagged(st.floats(0.0, 1.0) | st.none(), bad_float | st.floats(min_value=1.0001)),
    "top_k": tagged(st.integers(-1, I32) | st.none(), bad_int | st.integers(-(2**31), -2)),
    "seed": tagged(
        st.integers(0, 2**63 - 1) | st.none(),
        st.integers(max_value=-1) | st.integers(min_value=2**63) | wrong | st.booleans(),
    ),
    "n": tagged(st.just(1) | st.none(), st.integers().filter(lambda n: n != 1) | wrong),
    "stop": tagged(
        st.none() | st.text(min_size=1, max_size=4) | st.lists(st.text(min_size=1, max_size=4),
                                                                 max_size=4),
        st.just("") | st.lists(st.just(""), min_size=1, max_size=1)
        | st.lists(st.text(min_size=1, max_size=2), min_size=17, max_size=18)
        | st.lists(st.text(min_size=257, max_size=260), min_size=1, max_size=1)
        | st.lists(st.integers(), min_size=1, max_size=2) | st.integers(),
    ),
    "stop_token_ids": tagged(
        st.none() | st.lists(st.integers(0, VOCAB - 1), max_size=8),
        st.lists(st.integers(VOCAB, 2**70) | st.integers(max_value=-1), min_size=1, max_size=2)
        | st.lists(st.integers(0, VOCAB - 1), min_size=65, max_size=66)
        | st.text(min_size=1, max_size=3)
        | st.dictionaries(st.text(max_size=2), st.integers(0, 3), min_size=1, max_size=2),
    ),
    "ignore_eos": tagged(st.booleans() | st.none(), st.integers() | st.text(max_size=3)),
    "stream": tagged(st.booleans() | st.none(), st.integers() | st.text(max_size=3)),
    "stream_options": tagged(
        st.none() | st.just({}) | st.builds(lambda u: {"include_usage": u}, st.booleans()),
        st.just([]) | st.text(max_size=2) | st.builds(lambda u: {"include_usage": u}, wrong),
    ),
    "model": tagged(
        st.just(MODEL) | st.none(), st.text(min_size=1).filter(lambda m: m != MODEL) | wrong
    ),
    "presence_penalty": tagged(st.just(0) | st.none(), st.floats(0.1, 2.0) | st.just("x")),
}  # fmt: skip
COMPLETIONS = {
    "max_tokens": tagged(st.integers(1, 4), bad_int | st.integers(max_value=0)),
    "logprobs": tagged(st.integers(0, 20) | st.none(), bad_int | st.integers(21, I32)),
    "prompt": tagged(
        st.text(min_size=1, max_size=40)
        | st.lists(st.text(min_size=1, max_size=20), min_size=1, max_size=3)
        | ids
        | st.lists(ids, min_size=1, max_size=3),
        st.sampled_from(["", [], [[]], [""], [-1], [VOCAB], [2**64], [1.5], [True], ["x", 1]])
        | st.none() | st.integers() | st.dictionaries(st.text(max_size=2), text, max_size=1)
        | st.lists(st.just("x"), min_size=MAX_PROMPTS + 1, max_size=MAX_PROMPTS + 1)
        | st.sampled_from([100_000, MAX_BODY_BYTES + 1]).map(lambda n: "é" * n),
    ),
}  # fmt: skip
message = st.fixed_dictionaries(
    {
        "role": st.sampled_from(["system", "user", "assistant"]),
        "content": text
        | st.lists(
            st.fixed_dictionaries({"type": st.just("text")}, optional={"text": text}),
            min_size=1,
            max_size=2,
        ),
    }
)
bad_message = st.just(100_000).map(
    lambda n: {"role": "user", "content": "é" * n}
) | st.sampled_from(
    [
        {"role": "tool", "content": "x"},
        {"role": "user"},
        {"role": "user", "content": 5},
        {"role": "user", "content": [{"type": "image_url"}]},
        {"role": "user", "content": [{"type": "text", "text": 5}]},
        "x",
    ]
)
MAX_TOKENS_FIELD = st.sampled_from(["max_tokens", "max_completion_tokens"])
CHAT = {
    # chat without a cap generates to the context: the good cases always cap
    "max_tokens": tagged(st.integers(1, 4), bad_int | st.integers(max_value=0)),
    "logprobs": tagged(
        st.none() | st.just((False, None)) | st.tuples(st.just(True), st.integers(0, 20)),
        st.tuples(st.just(True), st.integers(21, I32) | huge_ints)
        | st.tuples(st.integers() | st.text(max_size=2), st.none()),
    ),
    "messages": tagged(
        st.lists(message, min_size=1, max_size=3),
        st.none() | st.just([]) | st.just("hi")
        | st.lists(bad_message, min_size=1, max_size=2)
        | st.lists(message, min_size=1, max_size=1).map(lambda m: m * (MAX_MESSAGES + 1)),
    ),
}  # fmt: skip


@st.composite
def cases(draw: st.DrawFn) -> dict:
    """One request: its path, its body as bytes, and whether every part of it is valid."""
    chat = draw(st.booleans())
    fields = {**SAMPLING, **(CHAT if chat else COMPLETIONS)}
    drawn = {k: draw(s) for k, s in fields.items() if k == "messages" or k == "prompt"
             or k == "max_tokens" or draw(st.integers(0, 3)) == 0}  # fmt: skip
    body = {k: v for k, (v, _) in drawn.items() if k not in ("logprobs", "max_tokens")}
    ok = all(good for _, good in drawn.values())
    if "max_tokens" in drawn:
        key = draw(MAX_TOKENS_FIELD) if chat else "max_tokens"
        body[key] = drawn["max_tokens"][0]
    if "logprobs" in drawn:
        value = drawn["logprobs"][0]
        if chat and value is not None:
            body["logprobs"], top = value
            if top is not None:
                body["top_logprobs"] = top
        elif not chat:
            body["logprobs"] = value
    extra = draw(st.dictionaries(st.text(max_size=6).map(lambda k: "x_" + k), json_values,
                                 max_size=2))  # fmt: skip
    body.update(extra)  # unknown fields are ignored
    raw = json.dumps(body, ensure_ascii=draw(st.booleans())).encode()
    mangle = draw(st.sampled_from(["none"] * 40 + ["deep", "surrogate", "bytes"]))
    if mangle == "deep":  # as a value of an unknown field: too deep for any parser
        depth = draw(st.sampled_from([5_000, 100_000]))
        raw = b'{"x_deep": ' + b"[" * depth + b"]" * depth + b", " + raw[1:]
        ok = False
    elif mangle == "surrogate":
        raw = b'{"x_s": "a\\udc80", ' + raw[1:]
        ok = False
    elif mangle == "bytes":
        raw, ok = draw(st.binary(max_size=24)), False
    ok = ok and len(raw) <= MAX_BODY_BYTES
    return {"path": "/v1/chat/completions" if chat else "/v1/completions", "raw": raw,
            "ok": ok, "body": body, "chat": chat}  # fmt: skip


def post(port: int, path: str, raw: bytes) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", path, raw, {"Content-Type": "application/json"})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def check_ok(case: dict, data: bytes) -> None:
    """A valid body's answer: one choice per prompt, each within its max_tokens."""
    body, chat = case["body"], case["chat"]
    cap = body.get("max_tokens", body.get("max_completion_tokens", 16))
    prompts = body["prompt"] if not chat else ["chat"]
    n = len(prompts) if isinstance(prompts, list) and not isinstance(prompts[0], int) else 1
    if body.get("stream"):
        lines = [ln for ln in data.decode().split("\n\n") if ln]
        assert lines[-1] == "data: [DONE]", lines[-3:]
        events = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
        assert all("error" not in e for e in events), events
        reasons = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
        assert len(reasons) == n and set(reasons) <= {"stop", "length"}, reasons
        usage = [e["usage"] for e in events if e.get("usage")]
        include = (body.get("stream_options") or {}).get("include_usage")
        assert len(usage) == (1 if include else 0)
        return
    reply = json.loads(data)
    assert len(reply["choices"]) == n, reply
    assert {c["finish_reason"] for c in reply["choices"]} <= {"stop", "length"}
    done = reply["usage"]["completion_tokens"]
    assert done <= cap * n and (done == cap * n) >= all(
        c["finish_reason"] == "length" for c in reply["choices"]
    )


@pytest.fixture(scope="module")
def server(backend):
    server = serve(backend, port=0)
    assert server.wait_ready(10)
    server.serve_http(0, MODEL)
    yield server
    server.stop()


def test_fuzzed_openai_bodies_end_in_200_or_4xx(server, backend, capsys):
    counts: collections.Counter = collections.Counter()

    @settings(
        max_examples=CASES,
        deadline=None,
        derandomize=True,  # the same bodies on every run
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(case=cases())
    def one(case: dict) -> None:
        status, data = post(server.http_port, case["path"], case["raw"])
        counts[f"{'chat' if case['chat'] else 'completions'} {status}"] += 1
        assert status < 500, (case["raw"][:300], data[:300])
        if case["ok"]:
            assert status == 200, (case["raw"][:300], data[:300])
            check_ok(case, data)
        else:
            assert 400 <= status < 500, (case["raw"][:300], data[:300])
            error = json.loads(data)["error"]
            assert error["message"] and "Traceback" not in error["message"]
        assert wait_idle(backend) == (False, 0)
        assert not server.frontend.in_flight

    one()
    record_fuzz_cases("test_fuzz_openai", counts)
    with capsys.disabled():
        print(f"\ntest_fuzz_openai: {sum(counts.values())} cases: {dict(sorted(counts.items()))}")
    assert sum(counts.values()) >= CASES
    status, _ = post(server.http_port, "/v1/completions", b'{"prompt": "x", "max_tokens": 1}')
    assert status == 200  # still serving
