"""A real multi-node Ray cluster on this machine (deploy/netns.py: three network namespaces on a
bridge, Ray token authentication on with the cluster's own token): the prefill pool on node 0,
the decode pool spanning nodes 1 and 2, `epcluster serve --address` as the driver on node 0.
For both KV transports, 32 concurrent requests equal the in-process engine token for token; the
EP process groups, the KV transfer and the metrics all cross real TCP links: every rank's
/metrics answers from another node's namespace, and a real Prometheus (outside the nodes, on the
bridge) discovers and scrapes the router and every rank of every node. Afterwards nothing of the
cluster is left: namespaces, links, processes, files."""

import asyncio
import json
import secrets
from collections import defaultdict

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families
from ray.core.generated import gcs_service_pb2, gcs_service_pb2_grpc

from deploy.netns import Nodes, Serve, unavailable
from engine import LLM, SamplingParams
from router.client import AsyncInferenceClient
from tests.prometheus import Prometheus, binary

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# node 0: the Ray head, the router and the prefill pool; nodes 1 and 2: a decode rank each
TOPOLOGY = [{"epcluster_prefill": 2}, {"epcluster_decode": 1}, {"epcluster_decode": 1}]
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
    why = unavailable()
    if why is not None:
        pytest.skip(why)
    cluster = Nodes(TOPOLOGY)
    with cluster:
        yield cluster
    assert cluster.leftovers() == []


@pytest.fixture(scope="module")
def expected():
    prompts, params = requests()
    return LLM("tiny").generate(prompts, params)


@pytest.fixture(scope="module", params=["object_store", "p2p"])
def served(request, nodes):
    """The cluster serving with one KV transport; -> (the router's gRPC address, its service
    discovery URL)."""
    config = {
        "model": "tiny",
        "ports": {
            "host": nodes.addr(0),
            "port": PORT,
            "metrics_port": METRICS_PORT,
            "rank_metrics_port": 9401,
        },
        "security": {"allow_insecure_bind": True},  # a private network namespace of this test's
        "routing": {"kv_p2p": request.param == "p2p"},
        # keep_pools false: the next transport's router starts its own (a joined Ray keeps them)
        "ray": {"ray_address": nodes.ray_address, "keep_pools": False},
        "prefill": {"num_ranks": 2, "resources": {"epcluster_prefill": 1}},
        "decode": {"num_ranks": 2, "resources": {"epcluster_decode": 1}},
    }
    serve: Serve = nodes.serve(0, config)
    try:
        yield f"{nodes.addr(0)}:{PORT}", f"http://{nodes.addr(0)}:{METRICS_PORT}/sd/targets"
    finally:
        assert serve.stop() == 0, serve.output(30)


def test_ray_refuses_a_caller_without_the_cluster_token(nodes):
    """Token authentication is on: the head's GCS answers a call that carries the cluster's
    token and refuses one with another token or none."""
    token = nodes.token_file.read_text()
    with grpc.insecure_channel(nodes.ray_address) as channel:
        stub = gcs_service_pb2_grpc.NodeInfoGcsServiceStub(channel)

        def cluster_id(token: str | None) -> bytes:
            auth = [("authorization", f"Bearer {token}")] if token is not None else None
            request = gcs_service_pb2.GetClusterIdRequest()
            return stub.GetClusterId(request, metadata=auth, timeout=30).cluster_id

        assert len(cluster_id(token)) > 0
        for wrong in (None, secrets.token_hex(32)):
            with pytest.raises(grpc.RpcError) as err:
                cluster_id(wrong)
            assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_32_concurrent_requests_equal_the_engine(served, expected):
    prompts, params = requests()

    async def run() -> list:
        async with AsyncInferenceClient(served[0], timeout=300) as client:
            return await asyncio.gather(*(client.complete(p, sp) for p, sp in zip(prompts, params)))

    for i, (out, want) in enumerate(zip(asyncio.run(run()), expected, strict=True)):
        assert (out.token_ids, out.text) == (want.token_ids, want.text), i


def test_every_endpoint_answers_from_another_node(nodes, served, expected):
    """The router's discovery lists the ranks on their nodes' addresses (prefill on node 0, the
    decode pool on nodes 1 and 2); each endpoint, GET from another node's namespace, reports
    its own pool and rank; the decode ranks received all the KV the prefill ranks sent."""
    (groups,) = nodes.fetch(2, served[1])
    groups = json.loads(groups)
    index = {nodes.addr(i): i for i in range(len(TOPOLOGY))}
    where = sorted((g["labels"]["pool"], index[g["targets"][0].rpartition(":")[0]]) for g in groups)
    assert where == [("decode", 1), ("decode", 2), ("prefill", 0), ("prefill", 0), ("router", 0)]

    by_fetcher = defaultdict(list)  # each endpoint from the next node: never its own
    for g in groups:
        by_fetcher[(index[g["targets"][0].rpartition(":")[0]] + 1) % len(TOPOLOGY)].append(g)
    pages = {}
    for fetcher, targets in by_fetcher.items():
        bodies = nodes.fetch(fetcher, *(f"http://{g['targets'][0]}/metrics" for g in targets))
        for g, body in zip(targets, bodies, strict=True):
            pages[g["labels"]["pool"], g["labels"].get("rank")] = body
    kv = defaultdict(float)  # (pool, rank, side) -> bytes
    for (pool, rank), page in pages.items():
        samples = [s for f in text_string_to_metric_families(page) for s in f.samples]
        assert {(s.labels["pool"], s.labels.get("rank")) for s in samples} == {(pool, rank)}
        for s in samples:
            if s.name == "epcluster_kv_transfer_bytes_total":
                kv[pool, rank, s.labels["side"]] += s.value
        if pool == "router":
            tokens = sum(s.value for s in samples if s.name == "epcluster_generation_tokens_total")
            assert tokens == sum(len(e.token_ids) for e in expected)
    # all of it crossed from node 0 to nodes 1 and 2
    received = kv["decode", "0", "receive"] + kv["decode", "1", "receive"]
    assert received == kv["prefill", "0", "send"] + kv["prefill", "1", "send"] > 0


def test_prometheus_discovers_and_scrapes_every_node(nodes, served, expected):
    if binary("prometheus") is None:
        pytest.skip("no prometheus binary: run `make prometheus`")
    sd = {"url": served[1], "refresh_interval": "1s"}
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "epcluster", "http_sd_configs": [sd]}],
    }
    with Prometheus(config) as prom:

        def all_up():
            up = prom.query("up")
            return len(up) == 5 and all(r["value"][1] == "1" for r in up) and up

        up = prom.wait_for(all_up, 60, "every node's targets up")
        hosts = {r["metric"]["instance"].rpartition(":")[0] for r in up}
        assert hosts == {nodes.addr(i) for i in range(len(TOPOLOGY))}
        tokens = prom.wait_for(
            lambda: prom.query("sum(epcluster_generation_tokens_total)"), 30, "tokens"
        )
        assert float(tokens[0]["value"][1]) == sum(len(e.token_ids) for e in expected)
