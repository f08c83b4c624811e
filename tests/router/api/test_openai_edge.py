"""The OpenAI HTTP front end's input edge (router/api/openai_requests.py,
router/api/openai_http.py):
the poison bodies of issue 24 (a top_k of 2**63 once re-formed a pool; a 100,000-deep array was a
bare 500) each end in a 4xx naming the field while the server keeps serving and no block is held;
bodies over the cap are 413 whether or not they say their length; any chat template error is a
400; parsing runs off the router's event loop; a non-streaming request whose client disconnects
is aborted (it generated to its end before)."""

import asyncio
import contextlib
import http.client
import json
import socket
import time

import pytest

from router.api.openai_http import MAX_BODY_BYTES
from router.api.openai_requests import MAX_MESSAGES, MAX_PROMPTS, HttpError, RequestParser
from router.server import serve
from tests.router.conftest import wait_idle

MODEL = "tiny-random"
USER = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(backend):
    server = serve(backend, port=0)
    assert server.wait_ready(10)
    server.serve_http(0, MODEL)
    yield server
    server.stop()


@pytest.fixture(autouse=True)
def leaves_nothing_behind(backend):
    yield
    assert wait_idle(backend) == (False, 0)


def post(server, path: str, data: bytes, headers: dict | None = None) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    return r.status, json.loads(r.read() or b"{}")


def raw(text: str) -> bytes:
    return text.encode()


DEEP = "[" * 100_000 + "]" * 100_000
POISON = [  # (path, body, param; None: the body as a whole)
    ("/v1/completions", {"prompt": "x", "top_k": 9223372036854775808}, "top_k"),
    ("/v1/completions", {"prompt": "x", "top_k": 2**70}, "top_k"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2**64}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "seed": 2**64}, "seed"),
    ("/v1/completions", {"prompt": "x", "logprobs": 2**63}, "logprobs"),
    ("/v1/chat/completions", {"messages": USER, "max_completion_tokens": 2**64},
     "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": True, "top_logprobs": 2**63},
     "top_logprobs"),
    ("/v1/completions", raw('{"prompt": "x", "temperature": 1' + "0" * 400 + "}"), "temperature"),
    ("/v1/completions", raw('{"prompt": "x", "temperature": 1e400}'), "temperature"),
    ("/v1/completions", raw('{"prompt": "x", "top_p": NaN}'), "top_p"),
    ("/v1/completions", raw('{"prompt": "x", "min_p": -Infinity}'), "min_p"),
    ("/v1/completions", raw('{"prompt": "x", "top_k": 1' + "0" * 5000 + "}"), None),
    ("/v1/completions", raw('{"prompt": ' + DEEP + "}"), None),
    ("/v1/chat/completions", raw(DEEP), None),
    ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("/v1/completions", {"prompt": "x", "stream": True, "stream_options": []}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "ignore_eos": 1}, "ignore_eos"),
    ("/v1/chat/completions", {"messages": USER, "logprobs": "yes"}, "logprobs"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]}, "messages"),
    ("/v1/chat/completions",
     {"messages": [{"role": "user", "content": [{"type": "text", "text": ["a"]}]}]}, "messages"),
    ("/v1/completions", {"prompt": ["x"] * (MAX_PROMPTS + 1)}, "prompt"),
    ("/v1/chat/completions", {"messages": USER * (MAX_MESSAGES + 1)}, "messages"),
    ("/v1/completions", {"prompt": "x", "model": ["m"] * 10_000}, "model"),
]  # fmt: skip


@pytest.mark.parametrize(("path", "body", "param"), POISON, ids=range(len(POISON)))
def test_poison_bodies_are_4xx_naming_the_field(server, path, body, param):
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    code, reply = post(server, path, data)
    assert 400 <= code < 500, reply
    assert reply["error"]["param"] == param, reply
    assert len(reply["error"]["message"]) < 400  # never the value echoed whole
    # still serving, and the same field at a sane value is fine (ignore_eos: a sampled EOS would
    # end it after one token)
    sane = {"prompt": "x", "max_tokens": 2, "ignore_eos": True}
    code, reply = post(server, "/v1/completions", json.dumps(sane).encode())
    assert code == 200 and reply["usage"]["completion_tokens"] == 2, reply


def test_bounds_at_the_edge_are_accepted(server):
    body = {
        "prompt": "x",
        "max_tokens": 2,
        "top_k": 2**31 - 1,
        "seed": 2**63 - 1,
        "ignore_eos": True,
    }
    code, reply = post(server, "/v1/completions", json.dumps(body).encode())
    assert code == 200 and reply["usage"]["completion_tokens"] == 2, reply
    code, reply = post(server, "/v1/completions", json.dumps({**body, "top_k": 2**31}).encode())
    assert code == 400 and reply["error"]["param"] == "top_k"


def chunked(data: bytes, size: int = 65536):
    for i in range(0, len(data), size):
        yield data[i : i + size]


@pytest.mark.parametrize("send_length", [True, False])
def test_a_body_over_the_cap_is_413(server, send_length):
    body = json.dumps({"prompt": "x" * MAX_BODY_BYTES}).encode()
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=60)
    if send_length:
        conn.putrequest("POST", "/v1/completions")
        conn.putheader("Content-Length", str(len(body)))
        conn.endheaders()  # the server answers from the header: the body need not follow
    else:
        conn.request("POST", "/v1/completions", chunked(body), encode_chunked=True)
    r = conn.getresponse()
    reply = json.loads(r.read())
    assert r.status == 413 and "larger than 4194304 bytes" in reply["error"]["message"]
    conn.close()
    # just under the cap is parsed (and refused for its length in tokens, not its size)
    body = json.dumps({"prompt": "x" * (MAX_BODY_BYTES - 64)}).encode()
    code, reply = post(server, "/v1/completions", body)
    assert code == 400 and reply["error"]["param"] == "prompt", reply


@pytest.mark.parametrize(
    ("template", "error"),
    [
        ("{{ messages[0]['content'] + 1 }}", "TypeError"),
        ("{{ (messages | length) // 0 }}", "ZeroDivisionError"),
        ("{{ messages.append(1) }}", "SecurityError"),
        ("{{ undefined_function() }}", "UndefinedError"),
    ],
)
def test_any_chat_template_error_is_a_400(backend, template, error):
    parser = RequestParser(backend, MODEL, template)
    with pytest.raises(HttpError) as e:
        parser.parse(json.dumps({"messages": USER}).encode(), True, None)
    assert e.value.status == 400 and e.value.param == "messages"
    assert error in e.value.message, e.value.message


def test_parsing_runs_off_the_event_loop(server, monkeypatch):
    seen = []
    parse = RequestParser.parse

    def spy(self, *args):
        try:
            asyncio.get_running_loop()
            seen.append("on the loop")
        except RuntimeError:
            seen.append("off the loop")
        return parse(self, *args)

    monkeypatch.setattr(RequestParser, "parse", spy)
    for path, body in [
        ("/v1/chat/completions", {"messages": USER, "max_tokens": 2}),
        ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2}),
    ]:
        code, reply = post(server, path, json.dumps(body).encode())
        assert code == 200, reply
    assert seen == ["off the loop"] * 2


class StuckBackend:
    """The real backend, except that each stream gives its first delta and then never another
    (the real request ends there): a non-streaming request waits until someone aborts it."""

    def __init__(self, inner) -> None:
        self.inner, self.aborted = inner, []

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    async def generate(self, req):
        async with contextlib.aclosing(self.inner.generate(req)) as deltas:
            async for out in deltas:
                yield out
                break
        await asyncio.Event().wait()

    async def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)
        await self.inner.abort(request_id)


def test_a_non_streaming_request_is_aborted_when_its_client_leaves(backend):
    stuck = StuckBackend(backend)
    server = serve(stuck, port=0)
    try:
        assert server.wait_ready(10)
        server.serve_http(0, MODEL)
        body = json.dumps({"prompt": "x", "max_tokens": 50, "stream": False}).encode()
        sock = socket.create_connection(("127.0.0.1", server.http_port), timeout=10)
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nX-Request-Id: gone-1\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(body) + body
        )
        end = time.monotonic() + 20
        while "gone-1" not in server.frontend.in_flight:
            assert time.monotonic() < end, "the request never started"
            time.sleep(0.02)
        sock.close()  # the client goes away before any answer
        while "gone-1" in server.frontend.in_flight or "gone-1" not in stuck.aborted:
            assert time.monotonic() < end + 20, (server.frontend.in_flight, stuck.aborted)
            time.sleep(0.02)
        assert stuck.aborted == ["gone-1"]
    finally:
        server.stop()
