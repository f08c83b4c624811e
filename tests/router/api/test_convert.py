"""Protobuf <-> engine dataclasses, and request validation (no server)."""

import re

import pytest

from engine.messages import (
    ClusterStatus,
    ModelInfo,
    PoolStatus,
    RankStatus,
    RequestOutput,
    TokenLogprobs,
)
from engine.model_info import PromptLimits
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from router.api import convert, convert_status
from router.proto import epcluster_pb2 as pb

INFO = ModelInfo("m", "deepseek_v3", 300, 16, 3, 16, 4, 1, 480)
LIMITS = PromptLimits(vocab_size=300, max_model_len=16, block_size=4, max_blocks=3)
TOKENIZER = Tokenizer(None, 300, 1, None)  # raw bytes: "abc" -> [97, 98, 99]


def varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def test_text_prompt_is_tokenized_and_defaults_apply():
    req = convert.generate_request_from_proto(pb.GenerateRequest(text="abc"), TOKENIZER, LIMITS)
    assert req.prompt_token_ids == [97, 98, 99]
    defaults = SamplingParams()
    assert (req.params.max_tokens, req.params.temperature, req.params.top_p) == (
        defaults.max_tokens,
        defaults.temperature,
        defaults.top_p,
    )
    assert len(req.request_id) == 32  # a fresh uuid4 hex


def test_unset_seed_is_resolved_to_a_random_63_bit_seed():
    msg = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5, 6]))
    seeds = {convert.generate_request_from_proto(msg, TOKENIZER, LIMITS).seed for _ in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)
    req = convert.generate_request_from_proto(msg, TOKENIZER, LIMITS)
    assert req.params.seed == req.seed  # the engine downstream uses exactly this seed
    msg.sampling_params.seed = 7
    assert convert.generate_request_from_proto(msg, TOKENIZER, LIMITS).seed == 7


def test_sampling_params_round_trip():
    params = SamplingParams(
        max_tokens=9,
        temperature=0.7,
        top_k=5,
        top_p=0.8,
        min_p=0.05,
        seed=2**63 - 1,
        stop=["x", "yz"],
        stop_token_ids=[3],
        ignore_eos=True,
        logprobs=0,
    )
    msg = pb.SamplingParams.FromString(convert.sampling_params_to_proto(params).SerializeToString())
    assert convert.sampling_params_from_proto(msg) == params
    assert convert.sampling_params_from_proto(pb.SamplingParams()) == SamplingParams()


def test_unknown_fields_are_found_with_their_path():
    params = pb.SamplingParams(max_tokens=3).SerializeToString() + varint(42 << 3) + varint(1)
    ids = pb.TokenIds(ids=[1]).SerializeToString() + varint(7 << 3 | 2) + varint(1) + b"x"
    raw = (
        varint(3 << 3 | 2)
        + varint(len(ids))
        + ids
        + varint(4 << 3 | 2)
        + varint(len(params))
        + params
        + varint(99 << 3)
        + varint(5)
    )
    msg = pb.GenerateRequest.FromString(raw)
    assert list(msg.token_ids.ids) == [1] and msg.sampling_params.max_tokens == 3
    assert sorted(convert.unknown_fields(msg)) == ["#99", "sampling_params.#42", "token_ids.#7"]
    with pytest.raises(ValueError, match="does not know: .*#99"):
        convert.generate_request_from_proto(msg, TOKENIZER, LIMITS)
    assert convert.unknown_fields(pb.GenerateRequest(text="a")) == []


def test_output_round_trip_with_logprobs():
    out = RequestOutput(
        "r", [4, 5], "ab", "length", 3, 7, 2, [TokenLogprobs(4, -0.5, [(4, -0.5), (9, -1.25)])]
    )
    msg = pb.GenerateResponse.FromString(convert.output_to_proto(out, 0.25).SerializeToString())
    assert msg.finish_reason == pb.FINISH_REASON_LENGTH and msg.time_to_first_token_s == 0.25
    assert convert.output_from_proto(msg) == out  # exact: the logprobs are float32-representable
    running = RequestOutput("r", [4], "a", None, 3, 1, 0)
    msg = convert.output_to_proto(running)
    assert msg.finish_reason == pb.FINISH_REASON_UNSPECIFIED
    assert not msg.HasField("time_to_first_token_s")
    assert convert.output_from_proto(msg) == running


def test_model_info_round_trip():
    assert convert_status.model_info_from_proto(convert_status.model_info_to_proto(INFO)) == INFO
    no_eos = ModelInfo("m", "deepseek_v2", 300, 16, 3, 16, 4, None, 480)
    assert (
        convert_status.model_info_from_proto(convert_status.model_info_to_proto(no_eos)) == no_eos
    )
    served = ModelInfo("m", "deepseek_v3", 300, 16, 3, 16, 4, 1, 480, kernels="cpu-avx2,triton")
    msg = pb.ModelInfo.FromString(convert_status.model_info_to_proto(served).SerializeToString())
    assert msg.kernels == "cpu-avx2,triton"
    assert convert_status.model_info_from_proto(msg) == served


def test_model_info_kernels_is_a_new_field_on_the_wire():
    """Field 10, after every older one: an older router's message reads as kernels "" (unknown),
    and an older client skips the field."""
    assert pb.ModelInfo.DESCRIPTOR.fields_by_name["kernels"].number == 10
    numbers = {f.name: f.number for f in pb.ModelInfo.DESCRIPTOR.fields}
    assert sorted(numbers.values()) == list(range(1, 11))
    old = convert_status.model_info_to_proto(INFO)  # kernels "" is not sent (proto3 default)
    assert "kernels" not in {f.name for f, _ in old.ListFields()}
    assert (
        convert_status.model_info_from_proto(pb.ModelInfo.FromString(old.SerializeToString()))
        == INFO
    )
    with_kernels = pb.ModelInfo(model="m", kernels="triton").SerializeToString()
    assert with_kernels.endswith(bytes([10 << 3 | 2, 6]) + b"triton")


def test_cluster_status_round_trip_and_placement_summary():
    def rank(pool, i, ids):
        return RankStatus(pool, i, True, i, 2 * i, 10 + i, 100, 3, 1, 4, ids)

    status = ClusterStatus(
        pools=[
            PoolStatus(
                "prefill", [rank("prefill", 0, {2: [0, 1]}), rank("prefill", 1, {2: [2, 3]})]
            ),
            PoolStatus("decode", [rank("decode", 0, {}), rank("decode", 1, {})]),
        ],
        num_in_flight=5,
        num_queued=6,
        num_queued_tokens=70,
    )
    status.pools[1].ranks[1].spec_verifies = 7  # speculative decoding's counters
    status.pools[1].ranks[1].spec_draft_tokens = 14
    status.pools[1].ranks[1].spec_accepted_tokens = 9
    msg = convert_status.cluster_status_to_proto(status)
    assert msg.pools[1].ranks[1].spec_accepted_tokens == 9
    assert [p.pool for p in msg.placement] == ["prefill"]  # decode reported no experts
    assert msg.placement[0].layer == 2
    assert [(r.rank, r.num_slots, list(r.expert_ids)) for r in msg.placement[0].ranks] == [
        (0, 2, [0, 1]),
        (1, 2, [2, 3]),
    ]
    assert msg.pools[0].ranks[1].kv_usage == pytest.approx(11 / 100)
    assert convert_status.cluster_status_from_proto(msg) == status

    # only the first MoE layer survives the summary
    status.pools[0].ranks[0].expert_ids = {3: [1, 1], 2: [0, 1]}
    back = convert_status.cluster_status_from_proto(convert_status.cluster_status_to_proto(status))
    assert back.pools[0].ranks[0].expert_ids == {2: [0, 1]}


@pytest.mark.parametrize(
    "ids, message",
    [
        ([5, 300], "prompt token 1 is 300, out of range: ids must be in [0, 300)"),
        ([5] * 16, "prompt has 16 tokens but the model's context is 16"),
        # 12 tokens + 1 need 4 blocks of 4; the smallest cache holds 3: at most 11 tokens
        ([5] * 12, "needs 4 KV blocks, but a KV cache here holds 3: shorten it to at most 11"),
    ],
)
def test_prompts_get_the_engines_check(ids, message):
    msg = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids))
    with pytest.raises(ValueError, match=re.escape(message)):
        convert.generate_request_from_proto(msg, TOKENIZER, LIMITS)
    assert (
        convert.generate_request_from_proto(
            pb.GenerateRequest(token_ids=pb.TokenIds(ids=[5] * 11)), TOKENIZER, LIMITS
        ).prompt_token_ids
        == [5] * 11
    )


@pytest.mark.parametrize(
    ("value", "fragment"),
    [
        (2**31, "top_k must be an integer in [-2147483648, 2147483647], got 2147483648"),
        (2**70, "got 1180591620717411303424"),
        (10**400, "got a 1329-bit integer"),  # not echoed whole
        (True, "top_k must be an integer, got bool"),
        (1.0, "top_k must be an integer, got float"),
    ],
)
def test_check_int_names_the_field(value, fragment):
    with pytest.raises(ValueError, match=re.escape(fragment)):
        convert.check_int("top_k", value, -(2**31), 2**31 - 1)


def test_check_float_and_bounds():
    assert convert.check_float("top_p", 1) == 1.0 and convert.check_float("top_p", 0.5) == 0.5
    for value, fragment in [
        (10**400, "too large for a float"),
        (float("nan"), "got nan"),
        (float("-inf"), "got -inf"),
        ("0.5", "must be a number, got str"),
        (None, "must be a number, got NoneType"),
    ]:
        with pytest.raises(ValueError, match=re.escape(fragment)):
            convert.check_float("top_p", value)
    convert.check_bounds({"max_tokens": 2**31 - 1, "seed": 2**63 - 1, "stop": ["x"]})
    with pytest.raises(ValueError, match="seed must be an integer"):
        convert.check_bounds({"seed": 2**63})


def test_conversion_cost_counts_text_and_token_ids():
    from smg_grpc_proto.generated import vllm_engine_pb2 as vpb

    assert convert.conversion_cost(pb.GenerateRequest(text="abcd")) == 4
    msg = pb.GenerateRequest()
    msg.token_ids.ids.extend(range(100_000))
    assert convert.conversion_cost(msg) == 100_000  # off the loop past BIG_TEXT
    assert convert.conversion_cost(pb.GenerateRequest()) == 0
    tokenized = vpb.GenerateRequest(tokenized=vpb.TokenizedInput(input_ids=[1, 2, 3]))
    assert convert.conversion_cost(tokenized) == 3
    assert convert.conversion_cost(vpb.GenerateRequest(text="xy")) == 2
