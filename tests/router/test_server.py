"""The router over gRPC on 127.0.0.1, with LocalBackend over a real engine and the real clients:
tokens equal the in-process engine's, bad input gets INVALID_ARGUMENT, admission refuses with
RESOURCE_EXHAUSTED, cancel and deadlines free the KV cache, health and reflection work."""

import asyncio
import math
import threading
import time

import grpc
import pytest
from google.protobuf.descriptor_pool import DescriptorPool
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from engine import SamplingParams
from router.admission import AdmissionConfig
from router.backends.local import LocalBackend
from router.client import AsyncInferenceClient, InferenceClient
from router.proto import epcluster_pb2 as pb
from router.server import serve
from tests.router.conftest import make_engine, on_engine, wait_idle

LONG = SamplingParams(max_tokens=1500, ignore_eos=True, temperature=0.0)
QUICK = SamplingParams(max_tokens=2, temperature=0.0)


@pytest.fixture(scope="module")
def server(backend):
    server = serve(backend, port=0)
    assert server.wait_ready(10)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    with InferenceClient(server.address, timeout=30) as client:
        yield client


@pytest.fixture(autouse=True)
def leaves_nothing_behind(request):
    """After every test: no request left in the engine, no used KV block, no admitted request."""
    yield
    if "backend" not in request.fixturenames:
        return
    backend = request.getfixturevalue("backend")
    assert wait_idle(backend) == (False, 0)
    if "client" in request.fixturenames:
        client = request.getfixturevalue("client")
        end = time.monotonic() + 5
        while client.cluster_status().num_queued and time.monotonic() < end:
            time.sleep(0.02)
        assert client.cluster_status().num_queued == 0


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def with_unknown(msg, field: int):
    """msg plus a field its schema lacks (a varint numbered `field`), as a parsed message."""
    return type(msg).FromString(msg.SerializeToString() + varint(field << 3) + varint(1))


# ---- tokens ----


PROMPTS = [
    "Hello",
    "The expert-parallel cluster says",
    [5, 6, 7, 8, 9, 10],
    "A longer prompt, so that prefill takes a few blocks of four tokens each.",
    [300, 2, 17],
    "Hello",  # a repeated prompt: served from the prefix cache, same tokens
]
PARAMS = [
    SamplingParams(max_tokens=20, temperature=0.0),
    SamplingParams(max_tokens=16, temperature=0.0, logprobs=3),
    SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=1),
    SamplingParams(max_tokens=12, temperature=1.0, top_k=50, seed=2),
    SamplingParams(max_tokens=18, temperature=0.7, min_p=0.05, seed=3, stop=["ab"]),
    SamplingParams(max_tokens=20, temperature=0.0),
]


def test_concurrent_streams_equal_the_in_process_engine(server, oracle):
    async def stream(client, prompt, params):
        return [msg async for msg in client.generate(prompt, params)]

    async def run():
        async with AsyncInferenceClient(server.address, timeout=60) as client:
            return await asyncio.gather(*(stream(client, p, sp) for p, sp in zip(PROMPTS, PARAMS)))

    streams = asyncio.run(run())
    for messages, want, params in zip(streams, oracle.generate(PROMPTS, PARAMS), PARAMS):
        assert len(messages) > 1  # streamed, not one reply at the end
        assert len({m.request_id for m in messages}) == 1
        assert sum((list(m.token_ids) for m in messages), []) == want.token_ids
        assert "".join(m.text for m in messages) == want.text
        last = messages[-1]
        assert (
            last.finish_reason
            == {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}[
                want.finish_reason
            ]
        )
        assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in messages[:-1])
        assert last.usage.prompt_tokens == want.num_prompt_tokens
        assert last.usage.completion_tokens == want.num_completion_tokens
        # time to first token: on the first message with tokens, and only there
        with_ttft = [i for i, m in enumerate(messages) if m.HasField("time_to_first_token_s")]
        first = next(i for i, m in enumerate(messages) if m.token_ids)
        assert with_ttft == [first] and 0 < messages[first].time_to_first_token_s < 60
        if params.logprobs is not None:
            got = [lp for m in messages for lp in m.logprobs]
            assert [lp.token_id for lp in got] == want.token_ids
            for lp, ref in zip(got, want.logprobs):
                assert lp.logprob == pytest.approx(ref.logprob, rel=1e-6, abs=1e-6)
                assert [t.token_id for t in lp.top] == [t for t, _ in ref.top]
        else:
            assert not any(m.logprobs for m in messages)


def test_sync_complete_equals_the_in_process_engine(client, oracle):
    params = SamplingParams(max_tokens=10, temperature=0.9, seed=42)
    got = client.complete([7, 8, 9], params, request_id="sync-1")
    want = oracle.generate([[7, 8, 9]], params)[0]
    assert got.request_id == "sync-1"
    assert (got.token_ids, got.text, got.finish_reason) == (
        want.token_ids,
        want.text,
        want.finish_reason,
    )


# ---- bad input ----


SP = pb.SamplingParams
OK_IDS = pb.TokenIds(ids=[5, 6, 7])
INVALID = {
    "no prompt": (pb.GenerateRequest(), "no prompt: set `text` or `token_ids`"),
    "empty text": (pb.GenerateRequest(text=""), "prompt text is empty"),
    "empty token list": (pb.GenerateRequest(token_ids=pb.TokenIds()), "token_ids is empty"),
    "token id = vocab": (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 512])),
        "prompt token 1 is 512, out of range: ids must be in [0, 512)",
    ),
    "negative token id": (pb.GenerateRequest(token_ids=pb.TokenIds(ids=[-1])), "[0, 512)"),
    "prompt = context": (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 2048)),
        "shorten it to at most 2047 tokens",
    ),
    "max_tokens 0": (
        pb.GenerateRequest(token_ids=OK_IDS, sampling_params=SP(max_tokens=0)),
        "max_tokens must be an int in [1,",
    ),
    "temperature < 0": (
        pb.GenerateRequest(token_ids=OK_IDS, sampling_params=SP(temperature=-0.5)),
        "temperature must be in [0,",
    ),
    "temperature nan": (
        pb.GenerateRequest(token_ids=OK_IDS, sampling_params=SP(temperature=math.nan)),
        "temperature must be finite",
    ),
    "top_p 0": (
        pb.GenerateRequest(token_ids=OK_IDS, sampling_params=SP(top_p=0.0)),
        "top_p must be in (0, 1]",
    ),
    "top_k -2": (
        pb.GenerateRequest(token_ids=OK_IDS, sampling_params=SP(top_k=-2)),
        "top_k must be 0 or -1",
    ),
    "min_p 1.5": (
        pb.GenerateRequest(token_ids=OK_IDS, sampling_params=SP(min_p=1.5)),
        "min_p must be in [0, 1]",
    ),
    "seed < 0": (
        pb.GenerateRequest(token_ids=OK_IDS, sampling_params=SP(seed=-1)),
        "seed must be None or an int in [0, 2**63)",
    ),
    "logprobs 21": (
        pb.GenerateRequest(token_ids=OK_IDS, sampling_params=SP(logprobs=21)),
        "logprobs must be None or an int in [0, 20]",
    ),
    "empty stop string": (
        pb.GenerateRequest(token_ids=OK_IDS, sampling_params=SP(stop=[""])),
        "stop must hold non-empty strings",
    ),
    "stop token < 0": (
        pb.GenerateRequest(token_ids=OK_IDS, sampling_params=SP(stop_token_ids=[-3])),
        "stop_token_ids must hold ints in [0,",
    ),
    "stop token = vocab": (
        pb.GenerateRequest(token_ids=OK_IDS, sampling_params=SP(stop_token_ids=[512])),
        "stop_token_ids holds 512",
    ),
    "empty request_id": (
        pb.GenerateRequest(request_id="", token_ids=OK_IDS),
        "request_id is empty",
    ),
    "long request_id": (
        pb.GenerateRequest(request_id="x" * 257, token_ids=OK_IDS),
        "use at most 256",
    ),
    "unknown field": (
        with_unknown(pb.GenerateRequest(token_ids=OK_IDS), 99),
        "does not know: #99",
    ),
    "unknown nested field": (
        pb.GenerateRequest(token_ids=OK_IDS, sampling_params=with_unknown(SP(max_tokens=3), 42)),
        "does not know: sampling_params.#42",
    ),
}


@pytest.mark.parametrize("case", list(INVALID))
def test_invalid_input_gets_invalid_argument(client, case):
    msg, expected = INVALID[case]  # unknown fields survive parsing and re-serialization
    with pytest.raises(grpc.RpcError) as err:
        list(client.stub.Generate(msg, timeout=10))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert expected in err.value.details()
    # and the server still serves
    assert client.complete([5, 6, 7], QUICK).num_completion_tokens == 2


def test_backend_refusal_gets_invalid_argument():
    """What only the engine knows (its KV cache is too small for the prompt) still comes back
    as INVALID_ARGUMENT with the engine's message."""
    small = LocalBackend(make_engine(kv_cache_bytes=32 * 480))  # 8 blocks of 4 tokens
    try:
        with serve(small, port=0) as server, InferenceClient(server.address, timeout=10) as c:
            assert server.wait_ready(10)
            with pytest.raises(grpc.RpcError) as err:
                c.complete(list(range(5, 45)), QUICK)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "context is 32: shorten it to at most 31" in err.value.details()
            assert c.complete([5, 6], QUICK).finish_reason == "length"
        assert wait_idle(small) == (False, 0)
    finally:
        small.close()


def test_duplicate_request_id_in_flight(client):
    first = client.generate([5, 6, 7], LONG, request_id="dup")
    next(first)
    with pytest.raises(grpc.RpcError) as err:
        client.complete([8, 9], QUICK, request_id="dup")
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "'dup' is already in flight" in err.value.details()
    first.cancel()
    for _ in range(200):  # once the first one is gone, the id is free again
        try:
            assert client.complete([8, 9], QUICK, request_id="dup").finish_reason == "length"
            break
        except grpc.RpcError as e:
            assert "already in flight" in e.details()
            time.sleep(0.05)
    else:
        raise AssertionError("the id of a cancelled request never became free")


def test_unknown_field_in_other_rpcs(client):
    raw = varint(5 << 3) + varint(1)
    with pytest.raises(grpc.RpcError) as err:
        client.stub.GetModelInfo(pb.GetModelInfoRequest.FromString(raw))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "#5" in err.value.details()


# ---- admission ----


def test_admission_refuses_over_the_caps(backend):
    cfg = AdmissionConfig(max_queued_requests=1, max_queued_tokens=64)
    with serve(backend, port=0, admission=cfg) as capped, InferenceClient(capped.address) as c:
        assert capped.wait_ready(10)
        with pytest.raises(grpc.RpcError) as err:
            c.complete(list(range(5, 70)), QUICK)  # 65 prompt tokens
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "65 tokens" in err.value.details() and "shorten" in err.value.details()

        held = c.generate([5, 6, 7], LONG)
        next(held)
        status = c.cluster_status()
        assert (status.num_queued, status.num_queued_tokens) == (1, 3)
        with pytest.raises(grpc.RpcError) as err:
            c.complete([8, 9], QUICK)
        assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "too many requests in flight (1 of 1)" in err.value.details()

        held.cancel()
        end = time.monotonic() + 5
        while c.cluster_status().num_queued and time.monotonic() < end:
            time.sleep(0.02)
        assert c.complete([8, 9], QUICK).finish_reason == "length"  # the slot came back


# ---- cancel, deadline, failure, shutdown ----


def test_cancel_mid_stream_frees_the_kv_cache(client, backend):
    idle = client.cluster_status()
    stream = client.generate(list(range(5, 25)), LONG, request_id="to-cancel")
    got = [next(stream) for _ in range(3)]
    assert all(m.token_ids for m in got)
    busy = client.cluster_status()
    (rank,) = busy.pools[0].ranks
    assert (rank.num_running, busy.num_in_flight, busy.num_queued) == (1, 1, 1)
    assert rank.kv_used_blocks >= 6 > idle.pools[0].ranks[0].kv_used_blocks == 0
    assert rank.kv_usage > 0

    stream.cancel()
    assert wait_idle(backend) == (False, 0)
    assert on_engine(backend, lambda e: "to-cancel" in e.requests) is False
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.CANCELLED


def test_deadline_ends_the_request_and_frees_the_kv_cache(client, backend):
    with pytest.raises(grpc.RpcError) as err:
        client.complete([5, 6, 7], LONG, timeout=0.4)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert wait_idle(backend) == (False, 0)


class FailingBackend:
    """LocalBackend whose streams break after their first delta (an internal failure)."""

    def __init__(self, inner: LocalBackend) -> None:
        self.inner = inner
        self.tokenizer = inner.tokenizer
        self.model_info, self.ready = inner.model_info, inner.ready
        self.prompt_limits = inner.prompt_limits
        self.abort, self.status = inner.abort, inner.status

    async def generate(self, request):
        async for out in self.inner.generate(request):
            yield out
            raise RuntimeError("rank 3 lost its NCCL communicator")


def test_internal_failure_gets_internal_and_frees_everything(backend):
    cfg = AdmissionConfig(max_queued_requests=1)
    with serve(FailingBackend(backend), port=0, admission=cfg) as failing:
        assert failing.wait_ready(10)
        with InferenceClient(failing.address, timeout=10) as c:
            for _ in range(2):  # the second is admitted: the first one's slot was released
                stream = c.generate([5, 6, 7], LONG)
                assert next(stream).token_ids
                with pytest.raises(grpc.RpcError) as err:
                    list(stream)
                assert err.value.code() == grpc.StatusCode.INTERNAL
                assert "RuntimeError: rank 3 lost its NCCL communicator" in err.value.details()
                assert wait_idle(backend) == (False, 0)


def test_stop_cancels_streams_and_aborts_their_requests(backend):
    server = serve(backend, port=0)
    assert server.wait_ready(10)
    with InferenceClient(server.address) as c:
        stream = c.generate([5, 6, 7], LONG)
        next(stream)
        server.stop(grace=0.1)
        # the cancelled stream ran its cleanup before stop returned: nothing open, no abort
        # pending (a handler left for the garbage collector would never send its abort)
        assert server.frontend.in_flight == set() and server.frontend.cleaning == 0
        with pytest.raises(grpc.RpcError):
            list(stream)
    assert wait_idle(backend) == (False, 0)
    server.stop()  # idempotent


def test_while_stopping_new_calls_get_unavailable_and_streams_finish(backend):
    server = serve(backend, port=0)
    assert server.wait_ready(10)
    with InferenceClient(server.address, timeout=60) as c:
        params = SamplingParams(max_tokens=200, ignore_eos=True, temperature=0.0)
        stream = c.generate([5, 6, 7], params)
        got = list(next(stream).token_ids)
        stopper = threading.Thread(target=server.stop, kwargs={"grace": 60})
        stopper.start()
        end = time.monotonic() + 10
        while c.health() == "SERVING" and time.monotonic() < end:
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as refused:
            c.complete([8, 9], QUICK)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # retryable, not CANCELLED
        assert "shutting down" in refused.value.details()
        got += [t for m in stream for t in m.token_ids]
        assert len(got) == 200
    stopper.join(60)
    assert not stopper.is_alive()
    assert wait_idle(backend) == (False, 0)


def test_port_in_use_fails_loudly(server, backend):
    with pytest.raises(RuntimeError, match="(?i)bind"):
        serve(backend, port=server.port)


# ---- health, reflection, model info, cluster status ----


def test_health_is_not_serving_until_the_backend_is_ready():
    local = LocalBackend(make_engine(), start=False)
    server = serve(local, port=0, ready_poll_s=0.02, ready_wait_s=0.3)
    try:
        with InferenceClient(server.address, timeout=10) as c:
            assert c.health() == "NOT_SERVING"
            assert c.health("epcluster.v1.Inference") == "NOT_SERVING"
            assert c.health("liveness") == "SERVING"  # the process: what a liveness probe asks
            assert not server.wait_ready(0.1)
            with pytest.raises(grpc.RpcError) as err:  # waited ready_wait_s, then gave up
                c.complete([5, 6], QUICK)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "retry in a few seconds" in err.value.details()
            assert ("grpc-retry-pushback-ms", "2000") in err.value.trailing_metadata()

            server.frontend.ready_wait_s = 30.0  # a request now waits for the backend
            waiting = c.generate([5, 6], QUICK)
            time.sleep(0.2)
            local.start()
            assert [len(m.token_ids) for m in waiting] == [1, 1]
            assert server.wait_ready(5)
            assert c.health() == c.health("epcluster.v1.Inference") == "SERVING"
            assert c.complete([5, 6], QUICK).num_completion_tokens == 2

            local.close()  # a backend that goes away is reported again
            end = time.monotonic() + 5
            while c.health() == "SERVING" and time.monotonic() < end:
                time.sleep(0.02)
            assert c.health() == "NOT_SERVING"
            assert c.health("liveness") == "SERVING"  # a backend down never restarts the router
    finally:
        server.stop()
        local.close()


def test_reflection_lists_the_services(server):
    with grpc.insecure_channel(server.address) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        services = set(db.get_services())
        assert {
            "epcluster.v1.Inference",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        } <= services
        inference = DescriptorPool(db).FindServiceByName("epcluster.v1.Inference")
        assert set(inference.methods_by_name) == {
            "Generate",
            "GetModelInfo",
            "GetClusterStatus",
            "GetExpertLoad",
            "Rebalance",
        }
        assert inference.methods_by_name["Generate"].server_streaming


def test_model_info_describes_the_served_model(client, backend):
    info = client.model_info()
    cfg, max_len, per_token = on_engine(
        backend,
        lambda e: (
            e.model.config,
            e.max_model_len,
            # what one token occupies in the paged cache, summed over the layers' cache tensors
            sum(c.shape[-1] * c.element_size() for c in e.runner.kv_caches),
        ),
    )
    assert (info.model, info.model_type, info.vocab_size, info.max_model_len) == (
        "tiny-random",
        "deepseek_v3",
        512,
        max_len,
    )
    assert (info.num_layers, info.num_routed_experts, info.experts_per_token) == (3, 16, 4)
    assert info.eos_token_id == backend.tokenizer.eos_token_id == cfg.eos_token_id
    mla = cfg.num_hidden_layers * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * 4  # fp32
    assert info.kv_bytes_per_token == per_token == mla
    # fp32 on the CPU: the compiled kernels for this CPU's vectors, or the references
    assert info.kernels == on_engine(backend, lambda e: e.runner.kernels)
    assert info.kernels in ("cpu-avx512", "cpu-avx2", "reference")


def test_cluster_status_when_idle(client, backend):
    status = client.cluster_status()
    (pool,) = status.pools
    (rank,) = pool.ranks
    num_blocks = on_engine(backend, lambda e: e.block_manager.num_blocks)
    assert (pool.name, rank.ready, rank.num_running, rank.num_waiting) == ("local", True, 0, 0)
    assert (rank.kv_used_blocks, rank.kv_total_blocks, rank.block_size) == (0, num_blocks, 4)
    assert (status.num_in_flight, status.num_queued, status.num_queued_tokens) == (0, 0, 0)
    raw = client.stub.GetClusterStatus(pb.GetClusterStatusRequest())
    (placement,) = raw.placement
    assert (placement.pool, placement.layer) == ("local", 1)  # tiny-random's first MoE layer
    assert [(r.rank, r.num_slots, list(r.expert_ids)) for r in placement.ranks] == [
        (0, 16, list(range(16)))
    ]


def test_sync_and_async_code_can_share_a_server(server):
    """serve() hosts its own loop: a client in another thread's event loop works too."""
    results = []

    def in_thread():
        async def run():
            async with AsyncInferenceClient(server.address, timeout=10) as c:
                results.append(await c.health())
                results.append((await c.complete("Hi", QUICK)).num_completion_tokens)

        asyncio.run(run())

    t = threading.Thread(target=in_thread)
    t.start()
    t.join(20)
    assert results == ["SERVING", 2]


def test_rebalance_on_one_engine_is_a_failed_precondition(client):
    with pytest.raises(grpc.RpcError) as err:
        client.rebalance()
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "nothing to balance" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        client.stub.Rebalance(pb.RebalanceRequest(pool="middle"), timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_big_prompt_is_tokenized_off_the_event_loop(backend, client, monkeypatch):
    """While a 70k-character prompt tokenizes (held until the test lets it go), the router still
    answers other calls: the encode runs on a worker thread, not on the event loop."""
    from router.frontend import BIG_TEXT

    encoding, release = threading.Event(), threading.Event()
    real = backend.tokenizer.encode

    def held(text: str) -> list[int]:
        if len(text) > BIG_TEXT:
            encoding.set()
            assert release.wait(30), "never released"
            return [5, 6, 7]
        return real(text)

    monkeypatch.setattr(backend.tokenizer, "encode", held)
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    result = {}
    big = threading.Thread(
        target=lambda: result.setdefault("out", client.complete("x" * 70_000, params))
    )
    big.start()
    assert encoding.wait(30)
    try:
        info = client.model_info()  # on the router's loop, while the encode is held
        small = client.complete("hello", params)
    finally:
        release.set()
        big.join(30)
    assert info.vocab_size > 0 and len(small.token_ids) == 2
    assert len(result["out"].token_ids) == 2
