"""The real `smg` gateway (PyPI `smg`, the Shepherd Model Gateway) in front of epcluster's router:
smg runs with its vLLM backend and the router as its gRPC worker (vllm.grpc.engine.VllmEngine,
router/api/vllm_grpc.py), and serves OpenAI chat requests end to end; the text equals what
epcluster.v1 returns for the prompt smg's chat template renders."""

import json
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import openai
import pytest

from engine import SamplingParams
from moe import resolve_model_path
from router.api.openai_http import DEFAULT_CHAT_TEMPLATE
from router.client import InferenceClient
from router.server import RouterServer
from tests.procs import free_port
from tests.router.conftest import wait_idle

SMG = shutil.which("smg", path=str(Path(sys.executable).parent)) or shutil.which("smg")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(SMG is None, reason="the smg gateway is not installed (pip install smg)"),
]
MODEL = "tiny-random"


@pytest.fixture(scope="module")
def router(backend):
    server = RouterServer(backend, port=0).serve_vllm(MODEL, resolve_model_path(MODEL)).start()
    assert server.wait_ready(10)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def gateway(router, tmp_path_factory):
    template = tmp_path_factory.mktemp("smg") / "chat.jinja"
    template.write_text(DEFAULT_CHAT_TEMPLATE)
    port = free_port()
    ckpt = str(resolve_model_path(MODEL))
    log = tmp_path_factory.getbasetemp() / "smg.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [SMG, "launch", "--host", "127.0.0.1", "--port", str(port), "--backend", "vllm",
             "--worker-urls", f"grpc://{router.address}", "--model-path", ckpt,
             "--tokenizer-path", ckpt, "--chat-template", str(template),
             "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        end = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as r:
                    if any(m["id"] == MODEL for m in json.load(r)["data"]):
                        break
            except OSError:
                pass
            assert time.monotonic() < end, log.read_text()[-3000:]
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


@pytest.mark.parametrize("stream", [False, True])
def test_smg_serves_chat_through_the_router(router, gateway, backend, stream):
    client = openai.OpenAI(base_url=gateway, api_key="unused", max_retries=0)
    messages = [{"role": "user", "content": "Hi there"}]
    kwargs = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0}
    with InferenceClient(router.address, timeout=60) as v1:
        rendered = "user: Hi there\nassistant:"  # smg renders the template it was given
        want = v1.complete(rendered, SamplingParams(max_tokens=8, temperature=0))
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        got = client.chat.completions.create(**kwargs)
        text = got.choices[0].message.content
        assert got.usage.prompt_tokens == want.num_prompt_tokens
        assert got.usage.completion_tokens == want.num_completion_tokens == 8
    assert text == want.text
    assert wait_idle(backend) == (False, 0)
