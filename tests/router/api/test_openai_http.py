"""OpenAI-compatible HTTP on the router, with the official `openai` SDK: completions and chat,
streaming and not, include_usage, stop strings, seeded sampling, several prompts; the text equals
what epcluster.v1 returns for the same request and seed (the chat prompt rendered by hand from
the documented default template); errors in OpenAI's envelope with the documented status; a
client that disconnects mid-stream frees the request's blocks."""

import http.client
import json
import time

import openai
import pytest

from engine import SamplingParams
from router.admission import AdmissionConfig
from router.auth import ServerSecurity
from router.client import InferenceClient
from router.server import serve
from tests.router.conftest import wait_idle

MODEL = "tiny-random"


@pytest.fixture(scope="module")
def server(backend):
    server = serve(backend, port=0)
    assert server.wait_ready(10)
    server.serve_http(0, MODEL)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def oa(server):
    return openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1", api_key="unused")


@pytest.fixture(scope="module")
def v1(server):
    with InferenceClient(server.address, timeout=60) as client:
        yield client


@pytest.fixture(autouse=True)
def leaves_nothing_behind(backend):
    yield
    assert wait_idle(backend) == (False, 0)


def test_models_and_health(oa, server):
    (model,) = oa.models.list().data
    assert model.id == MODEL and model.max_model_len == 2048
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=10)
    conn.request("GET", "/health")
    assert conn.getresponse().status == 200


@pytest.mark.parametrize(
    "sampling",
    [
        {"temperature": 0.0, "max_tokens": 12},
        {"temperature": 0.9, "seed": 7, "top_p": 0.9, "max_tokens": 10},
        {"temperature": 0.0, "max_tokens": 30, "stop": [" "]},
    ],
)
def test_completions_equal_epcluster_v1(oa, v1, sampling):
    want = v1.complete("The expert says", SamplingParams(**sampling))
    got = oa.completions.create(model=MODEL, prompt="The expert says", **sampling)
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == want.finish_reason
    assert got.usage.completion_tokens == want.num_completion_tokens
    assert got.usage.prompt_tokens == want.num_prompt_tokens
    chunks = list(
        oa.completions.create(
            model=MODEL, prompt="The expert says", stream=True,
            stream_options={"include_usage": True}, **sampling,
        )
    )  # fmt: skip
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want.text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(want.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_chat_equals_epcluster_v1_on_the_rendered_prompt(oa, v1):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = "system: Be brief.\nuser: Hi\nassistant:"  # the default template, by hand
    params = SamplingParams(max_tokens=9, temperature=0.7, seed=3)
    want = v1.complete(rendered, params)
    got = oa.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=9, temperature=0.7, seed=3
    )
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.text
    assert got.usage.prompt_tokens == want.num_prompt_tokens
    chunks = list(
        oa.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=9, temperature=0.7, seed=3, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want.text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.total_tokens == want.num_prompt_tokens + 9


def test_chat_logprobs_and_token_prompts(oa, v1):
    got = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=3,
    )  # fmt: skip
    content = got.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 3 for t in content)
    two = oa.completions.create(model=MODEL, prompt=[[5, 6, 7], [8, 9]], max_tokens=5,
                                temperature=0)  # fmt: skip
    for choice, prompt in zip(sorted(two.choices, key=lambda c: c.index), [[5, 6, 7], [8, 9]]):
        assert choice.text == v1.complete(prompt, SamplingParams(max_tokens=5, temperature=0)).text


def request(server, path: str, body, headers=None):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    conn.request("POST", path, data, {"Content-Type": "application/json", **(headers or {})})
    r = conn.getresponse()
    return r.status, json.loads(r.read() or b"{}"), r.headers  # case-insensitive


@pytest.mark.parametrize(
    ("body", "status", "param", "fragment"),
    [
        ({"model": "nope", "prompt": "x"}, 404, "model", "is not served here"),
        ({"prompt": "x", "temperature": -1}, 400, "temperature", "temperature must be in [0,"),
        ({"prompt": "x", "n": 2}, 400, "n", "n must be 1"),
        ({"prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty", "not supported"),
        ({"prompt": ""}, 400, "prompt", "prompt is empty"),
        ({"prompt": 5}, 400, "prompt", "prompt must be a string"),
        ({"prompt": [5] * 3000}, 400, "prompt", "shorten it"),
        ({"prompt": "x", "stop": ["a"] * 17}, 400, "stop", "at most 16"),
        ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", "max_tokens must be"),
    ],
)
def test_errors_use_openais_envelope(server, body, status, param, fragment):
    code, reply, _ = request(server, "/v1/completions", body)
    assert code == status, reply
    assert reply["error"]["param"] == param and fragment in reply["error"]["message"]
    assert reply["error"]["type"] in ("invalid_request_error", "not_found_error")


def test_bad_json_and_bad_messages(server):
    code, reply, _ = request(server, "/v1/completions", b"{not json")
    assert code == 400 and "not valid JSON" in reply["error"]["message"]
    code, reply, _ = request(server, "/v1/chat/completions", {"messages": [{"role": "x"}]})
    assert code == 400 and reply["error"]["param"] == "messages"


def test_request_id_is_echoed(server):
    code, reply, headers = request(
        server, "/v1/completions", {"prompt": "x", "max_tokens": 2}, {"X-Request-Id": "abc-1"}
    )
    assert code == 200 and headers["X-Request-Id"] == "abc-1" and reply["id"] == "cmpl-abc-1"
    code, reply, _ = request(
        server, "/v1/completions", {"prompt": "x", "max_tokens": 2}, {"X-Request-Id": "r" * 257}
    )  # the same rule as epcluster.v1's request_id: it goes into log lines
    assert code == 400 and reply["error"]["param"] == "X-Request-Id"
    assert "use at most 256" in reply["error"]["message"]


def test_a_disconnect_mid_stream_frees_the_blocks(server, backend):
    conn = http.client.HTTPConnection("127.0.0.1", server.http_port, timeout=30)
    body = {"prompt": "x", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body).encode())
    r = conn.getresponse()
    assert r.status == 200
    assert r.readline().startswith(b"data: {")  # streaming
    conn.close()  # the client goes away
    assert wait_idle(backend, timeout=20) == (False, 0)


def test_overload_draining_and_token(backend):
    server = serve(backend, port=0, admission=AdmissionConfig(max_queued_requests=1),
                   security=ServerSecurity(token="t0k"))  # fmt: skip
    try:
        assert server.wait_ready(10)
        server.serve_http(0, MODEL)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.http_port}/v1",
                               api_key="t0k", max_retries=0)  # fmt: skip
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=client.base_url, api_key="wrong", max_retries=0).models.list()
        stream = client.completions.create(model=MODEL, prompt="x", max_tokens=1500, stream=True,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        next(iter(stream))
        with pytest.raises(openai.RateLimitError) as err:  # the one admission slot is taken
            client.completions.create(model=MODEL, prompt="y", max_tokens=2)
        assert err.value.body["code"] == "RESOURCE_EXHAUSTED"
        stream.close()
        end = time.monotonic() + 20
        while server.frontend.in_flight and time.monotonic() < end:
            time.sleep(0.02)
        server.drain()
        code, reply, headers = request(server, "/v1/completions", {"prompt": "x"},
                                       {"Authorization": "Bearer t0k"})  # fmt: skip
        assert code == 503 and "shutting down" in reply["error"]["message"]
        assert headers["Retry-After"] == "1"
    finally:
        server.stop()
    assert wait_idle(backend) == (False, 0)
