"""End to end on a local Ray: the gRPC router, a 2-rank prefill pool and a 2-rank decode pool
(each an expert-parallel group over gloo), against the in-process engine."""

import asyncio

import grpc
import pytest
import torch

from engine import LLM, SamplingParams
from router.client import AsyncInferenceClient, InferenceClient
from router.proto import epcluster_pb2 as pb
from tests.cluster.conftest import start_cluster, wait_quiet

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

LONG = SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0.0)


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster({"admission.max_queued_requests": 40})
    yield c
    c.shutdown()


@pytest.fixture(scope="module")
def client(cluster):
    with InferenceClient(cluster.address, timeout=120) as client:
        yield client


@pytest.fixture(autouse=True)
def every_block_comes_back(client):
    yield
    wait_quiet(client)


def workload(n: int = 32):
    gen = torch.Generator().manual_seed(77)
    prompts, params = [], []
    for i in range(n):
        length = int(torch.randint(2, 120, (1,), generator=gen))
        prompts.append(torch.randint(2, 512, (length,), generator=gen).tolist())
        max_tokens = int(torch.randint(4, 40, (1,), generator=gen))
        params.append(
            SamplingParams(
                max_tokens=max_tokens,
                ignore_eos=i % 5 != 0,
                temperature=0.0 if i % 2 else 0.9,
                top_p=0.95,
                seed=i,
            )
        )
    prompts[3] = prompts[1][:40] + [9, 9, 9]  # shares a prefix with another request
    return prompts, params


def test_32_concurrent_streams_equal_the_in_process_engine(cluster):
    prompts, params = workload()
    want = LLM("tiny-random").generate(prompts, params)

    async def stream(client, prompt, sp):
        return [m async for m in client.generate(prompt, sp)]

    async def run():
        async with AsyncInferenceClient(cluster.address, timeout=120) as client:
            return await asyncio.gather(*(stream(client, p, sp) for p, sp in zip(prompts, params)))

    streams = asyncio.run(run())
    for i, (messages, expected) in enumerate(zip(streams, want)):
        assert sum((list(m.token_ids) for m in messages), []) == expected.token_ids, i
        assert "".join(m.text for m in messages) == expected.text, i
        assert messages[-1].usage.completion_tokens == expected.num_completion_tokens
        assert messages[-1].finish_reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH)
        first = next(m for m in messages if m.token_ids)
        assert first.HasField("time_to_first_token_s")


def test_health_status_and_model_info(client):
    assert client.health() == "SERVING"
    info = client.model_info()
    assert (info.model, info.model_type, info.vocab_size) == ("tiny-random", "deepseek_v3", 512)
    assert info.kv_bytes_per_token == 3 * 40 * 4  # layers x (32 + 8) x fp32
    # what the ranks' engines report: fp32 CPU ranks on one machine share one value
    assert info.kernels in ("cpu-avx512", "cpu-avx2", "reference"), info.kernels
    status = client.cluster_status()
    assert [p.name for p in status.pools] == ["prefill", "decode"]
    for pool in status.pools:
        assert [r.rank for r in pool.ranks] == [0, 1]
        assert all(r.ready and r.kv_total_blocks > 0 for r in pool.ranks)
        # expert parallelism: each rank holds its half of the 16 experts of every MoE layer
        held = [r.expert_ids for r in pool.ranks]
        assert list(held[0]) == [1]  # the summary covers the first MoE layer
        assert sorted(held[0][1] + held[1][1]) == list(range(16))
        assert len(held[0][1]) == 8


def test_cluster_status_shows_kv_in_use_while_a_request_runs(client):
    stream = client.generate(list(range(5, 70)), LONG, request_id="busy")
    next(stream)
    next(stream)
    status = client.cluster_status()
    decode = next(p for p in status.pools if p.name == "decode")
    assert sum(r.kv_used_blocks for r in decode.ranks) >= 5  # 65 tokens in blocks of 16
    assert sum(r.num_running for r in decode.ranks) == 1
    assert status.num_in_flight == 1
    stream.cancel()


def test_cancel_mid_stream_frees_blocks_on_both_pools(client):
    stream = client.generate(list(range(5, 200)), LONG, request_id="cancel-me")
    got = [next(stream) for _ in range(5)]
    assert all(m.token_ids for m in got)
    stream.cancel()
    with pytest.raises(grpc.RpcError) as err:
        list(stream)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    wait_quiet(client)


def test_deadline_frees_blocks_on_both_pools(client):
    with pytest.raises(grpc.RpcError) as err:
        client.complete(list(range(5, 100)), LONG, timeout=1.0)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_quiet(client)


INVALID = [
    pb.GenerateRequest(),
    pb.GenerateRequest(text=""),
    pb.GenerateRequest(token_ids=pb.TokenIds()),
    pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 512])),
    pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 2048)),
    pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(max_tokens=0)),
    pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(temperature=-1)),
    pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(top_p=1.5)),
    pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(top_k=-7)),
    pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(min_p=2)),
    pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(logprobs=99)),
    pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(stop=[""])),
    pb.GenerateRequest(text="hi", sampling_params=pb.SamplingParams(stop_token_ids=[600])),
    pb.GenerateRequest(request_id="", text="hi"),
    pb.GenerateRequest.FromString(
        pb.GenerateRequest(text="hi").SerializeToString() + b"\xf8\x06\x01"
    ),
]


def test_invalid_input_gets_invalid_argument_and_the_server_keeps_serving(client):
    for msg in INVALID:
        with pytest.raises(grpc.RpcError) as err:
            list(client.stub.Generate(msg, timeout=30))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, msg
        assert len(err.value.details()) > 10
    out = client.complete([5, 6, 7], SamplingParams(max_tokens=3, temperature=0))
    assert out.num_completion_tokens == 3


def test_over_the_admission_cap_gets_resource_exhausted(cluster):
    async def one(client, i):
        try:
            await client.complete([5 + i, 6, 7], SamplingParams(max_tokens=60, ignore_eos=True))
            return "ok"
        except grpc.aio.AioRpcError as e:
            assert "retry later" in e.details()
            return e.code()

    async def run():
        async with AsyncInferenceClient(cluster.address, timeout=120) as client:
            return await asyncio.gather(*(one(client, i) for i in range(48)))

    results = asyncio.run(run())
    assert results.count(grpc.StatusCode.RESOURCE_EXHAUSTED) >= 8
    assert results.count("ok") >= 32


def test_after_everything_no_rank_holds_a_block(client):
    status = wait_quiet(client)
    for pool in status.pools:
        for r in pool.ranks:
            assert (r.kv_used_blocks, r.num_reserved, r.num_running) == (0, 0, 0)


def test_a_request_done_on_the_prefill_rank_releases_its_decode_reservation(client):
    out = client.complete(list(range(5, 40)), SamplingParams(max_tokens=1, temperature=0))
    assert (out.num_completion_tokens, out.finish_reason) == (1, "length")
    status = wait_quiet(client)
    assert all(r.num_reserved == 0 for p in status.pools for r in p.ranks)


def test_status_draws_the_expert_load(cluster, client, tmp_path, capsys):
    """`epcluster status --expert-load` through the router: every pool's per-slot counts,
    consistent with the placement GetClusterStatus reports, drawn as a PNG."""
    from cluster.cli import main

    client.complete(list(range(5, 60)), SamplingParams(max_tokens=4, temperature=0))
    png = tmp_path / "load.png"
    assert main(["status", "--target", cluster.address, "--expert-load", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "tokens per rank" in capsys.readouterr().out
    pools = {p.pool: p for p in client.expert_load()}
    status = client.cluster_status()
    for pool in status.pools:
        load = pools[pool.name]
        layer = min(load.layers)
        tokens, experts = load.layers[layer]
        held = sum((r.expert_ids[layer] for r in pool.ranks), [])
        assert experts == held and len(tokens) == 16  # slot order is rank-major
        assert sum(tokens) > 0 and sum(load.expert_tokens()[layer]) == sum(tokens)


def test_openai_http_equals_epcluster_v1_on_the_cluster(cluster, client):
    """The official openai SDK against the cluster's HTTP port: completions and chat, streamed
    and not, the same tokens as epcluster.v1; a stream dropped mid-way frees its blocks."""
    import openai

    oa = openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused")
    params = SamplingParams(max_tokens=16, temperature=0.8, seed=11)
    want = client.complete("Ranks of the pool", params)
    got = oa.completions.create(model="tiny-random", prompt="Ranks of the pool", max_tokens=16,
                                temperature=0.8, seed=11)  # fmt: skip
    assert got.choices[0].text == want.text
    chat = client.complete("user: hello\nassistant:", SamplingParams(max_tokens=8, temperature=0))
    chunks = oa.chat.completions.create(
        model="tiny-random", messages=[{"role": "user", "content": "hello"}], max_tokens=8,
        temperature=0, stream=True,
    )  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == chat.text
    stream = oa.completions.create(model="tiny-random", prompt="x", max_tokens=900, stream=True,
                                   extra_body={"ignore_eos": True})  # fmt: skip
    next(iter(stream))
    stream.close()  # every_block_comes_back checks the ranks after this test
