"""The router's metrics through a real gRPC server: each request counted once, by how it ended,
with its tokens and latencies; refusals by reason."""

import time

import grpc
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from engine import SamplingParams
from router.admission import AdmissionConfig
from router.backends.local import LocalBackend
from router.client import InferenceClient
from router.metrics import RouterMetrics
from router.proto import epcluster_pb2 as pb
from router.server import serve
from tests.router.conftest import make_engine, wait_idle


def samples(metrics: RouterMetrics) -> list:
    text = generate_latest(metrics.registry).decode()
    return [s for f in text_string_to_metric_families(text) for s in f.samples]


def value(all_samples, name: str, **labels: str) -> float:
    found = [
        s.value
        for s in all_samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]
    assert len(found) == 1, (name, labels, found)
    return found[0]


@pytest.fixture(scope="module")
def served():
    backend = LocalBackend(make_engine())
    metrics = RouterMetrics("tiny-random")
    server = serve(
        backend, port=0, admission=AdmissionConfig(max_queued_requests=2), metrics=metrics
    )
    assert server.wait_ready(10)
    yield server, metrics, backend
    server.stop()
    backend.close()


def test_requests_are_counted_by_how_they_ended(served):
    server, metrics, backend = served
    with InferenceClient(server.address, timeout=30) as client:
        outs = [
            client.complete([5, 6, 7], SamplingParams(max_tokens=n, ignore_eos=True))
            for n in (1, 4, 6)
        ]
        with pytest.raises(grpc.RpcError):  # INVALID_ARGUMENT
            list(client.stub.Generate(pb.GenerateRequest(text="")))
        stream = client.generate([5, 6], SamplingParams(max_tokens=500, ignore_eos=True))
        next(stream)
        stream.cancel()
    assert wait_idle(backend) == (False, 0)
    for _ in range(250):  # the cancelled stream's handler finishes on the server's loop
        cancelled = "epcluster_requests_total", {"finished_reason": "abort", "code": "CANCELLED"}
        if any(  # the series is pre-created at 0: wait for the count
            x.name == cancelled[0] and x.labels.items() >= cancelled[1].items() and x.value >= 1
            for x in samples(metrics)
        ):
            break
        time.sleep(0.02)
    s = samples(metrics)
    assert value(s, "epcluster_requests_total", finished_reason="length", code="OK") == 3
    assert (
        value(s, "epcluster_requests_total", finished_reason="error", code="INVALID_ARGUMENT") == 1
    )
    assert value(s, "epcluster_requests_total", finished_reason="abort", code="CANCELLED") == 1
    assert value(s, "epcluster_time_to_first_token_seconds_count") == 4
    assert value(s, "epcluster_e2e_request_latency_seconds_count") == 4
    # the cancelled stream: the tokens the server wrote before the cancel reached it (1 or more)
    cancelled_tokens = value(s, "epcluster_generation_tokens_total") - (1 + 4 + 6)
    assert cancelled_tokens >= 1
    assert value(s, "epcluster_prompt_tokens_total") == 3 * 3 + 2
    # inter-token gaps: every token after the first of each stream
    assert value(s, "epcluster_inter_token_latency_seconds_count") == 0 + 3 + 5 + (
        cancelled_tokens - 1
    )
    # time per output token: the streams with more than one token (4, 6, and maybe the cancelled)
    assert value(s, "epcluster_request_time_per_output_token_seconds_count") == 2 + (
        cancelled_tokens > 1
    )
    assert value(s, "epcluster_router_requests_running") == 0
    assert value(s, "epcluster_router_requests_waiting") == 0
    assert [o.num_completion_tokens for o in outs] == [1, 4, 6]


def test_admission_refusals_are_counted_by_reason(served):
    server, metrics, backend = served
    before = value(samples(metrics), "epcluster_admission_rejections_total", reason="requests")
    with InferenceClient(server.address, timeout=30) as client:
        long = SamplingParams(max_tokens=500, ignore_eos=True)
        streams = [client.generate([5, 6], long) for _ in range(2)]
        for stream in streams:
            next(stream)
        with pytest.raises(grpc.RpcError) as err:
            client.complete([7, 8], SamplingParams(max_tokens=2))
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        for stream in streams:
            stream.cancel()
    assert wait_idle(backend) == (False, 0)
    s = samples(metrics)
    assert value(s, "epcluster_admission_rejections_total", reason="requests") == before + 1
    assert value(s, "epcluster_admission_rejections_total", reason="tokens") == 0
    version, commit = (
        next(x for x in s if x.name == "epcluster_build_info").labels[k]
        for k in ("version", "commit")
    )
    assert version and commit
