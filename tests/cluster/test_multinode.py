"""A real multi-node Ray cluster on this machine (deploy/netns.py: three network namespaces on a
bridge, Ray token authentication on): the prefill pool on node 0, the decode pool spanning nodes
1 and 2, `epcluster serve --address` as the driver on node 0. For both KV transports, 32
concurrent requests equal the in-process engine token for token; the EP process groups, the KV
transfer and the metrics all cross real TCP links; a real Prometheus (outside the nodes, on the
bridge) discovers and scrapes the router and every rank of every node."""

import asyncio
import json
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest
import yaml

from deploy.netns import Nodes, unavailable
from engine import LLM, SamplingParams
from router.client import AsyncInferenceClient
from tests.prometheus import REPO, Prometheus, binary

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
WHY_NOT = unavailable()
if WHY_NOT is not None:
    pytestmark.append(pytest.mark.skip(reason=WHY_NOT))

PORT, METRICS_PORT = 50051, 9400


def requests() -> tuple[list[str], list[SamplingParams]]:
    import pydoc_data.topics as topics

    words = " ".join(topics.topics[k] for k in sorted(topics.topics)).split()
    prompts = [" ".join(words[i * 61 : i * 61 + 8 + i % 24]) for i in range(32)]
    params = [
        SamplingParams(max_tokens=12 + i % 9, temperature=0.0 if i % 3 else 0.8, seed=i,
                       ignore_eos=True)
        for i in range(32)
    ]  # fmt: skip
    return prompts, params


@pytest.fixture(scope="module")
def nodes():
    with Nodes([{"epcluster_prefill": 2}, {"epcluster_decode": 1}, {"epcluster_decode": 1}]) as n:
        yield n


@pytest.fixture(scope="module")
def expected():
    prompts, params = requests()
    return LLM("tiny").generate(prompts, params)


def serve(nodes: Nodes, transport: str, tmp_path) -> subprocess.Popen:
    config = {
        "model": "tiny",
        "host": nodes.addr(0),
        "port": PORT,
        "metrics_port": METRICS_PORT,
        "rank_metrics_port": 9401,
        "ray_address": nodes.ray_address,
        "kv_transport": transport,
        "prefill": {"num_ranks": 2, "resources": {"epcluster_prefill": 1}},
        "decode": {"num_ranks": 2, "resources": {"epcluster_decode": 1}},
    }
    path = tmp_path / f"{transport}.yaml"
    path.write_text(yaml.safe_dump(config))
    proc = nodes.popen(
        0, sys.executable, "-m", "cluster.cli", "serve", "--config", str(path),
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if "epcluster: ready on" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    end = time.monotonic() + 300
    while not ready.wait(0.5):
        assert proc.poll() is None and time.monotonic() < end, "".join(lines[-50:])
    proc.lines = lines
    return proc


async def stream_all(address: str) -> list[tuple[list[int], str]]:
    prompts, params = requests()
    async with AsyncInferenceClient(address, timeout=300) as client:

        async def one(i: int) -> tuple[list[int], str]:
            out = await client.complete(prompts[i], params[i])
            return out.token_ids, out.text

        return await asyncio.gather(*(one(i) for i in range(32)))


@pytest.mark.parametrize("transport", ["object_store", "p2p"])
def test_pools_across_nodes_equal_the_engine(nodes, expected, transport, tmp_path):
    proc = serve(nodes, transport, tmp_path)
    try:
        outs = asyncio.run(stream_all(f"{nodes.addr(0)}:{PORT}"))
        for i, ((tokens, text), want) in enumerate(zip(outs, expected, strict=True)):
            assert tokens == want.token_ids and text == want.text, i

        sd_url = f"http://{nodes.addr(0)}:{METRICS_PORT}/sd/targets"
        with urllib.request.urlopen(sd_url, timeout=10) as r:
            groups = json.load(r)
        where = sorted((g["labels"]["pool"], g["targets"][0].rpartition(":")[0]) for g in groups)
        a0, a1, a2 = nodes.addr(0), nodes.addr(1), nodes.addr(2)
        assert where == sorted(
            [("router", a0), ("prefill", a0), ("prefill", a0), ("decode", a1), ("decode", a2)]
        ), where  # prefill on node 0, the decode pool spans nodes 1 and 2

        if binary("prometheus") is not None:
            config = {
                "global": {"scrape_interval": "1s"},
                "scrape_configs": [
                    {"job_name": "epcluster",
                     "http_sd_configs": [{"url": sd_url, "refresh_interval": "1s"}]}
                ],
            }  # fmt: skip
            with Prometheus(config) as prom:

                def all_up():
                    up = prom.query("up")
                    return len(up) == 5 and all(r["value"][1] == "1" for r in up) and up

                up = prom.wait_for(all_up, 60, "every node's targets up")
                hosts = {r["metric"]["instance"].rpartition(":")[0] for r in up}
                assert hosts == {a0, a1, a2}
                tokens = prom.wait_for(
                    lambda: prom.query("sum(epcluster_generation_tokens_total)"), 30, "tokens"
                )
                assert float(tokens[0]["value"][1]) == sum(len(t) for t, _ in outs)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            assert proc.wait(120) == 0, "".join(proc.lines[-30:])
        finally:
            if proc.poll() is None:
                proc.kill()
