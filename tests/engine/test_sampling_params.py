import math

import pytest
import torch

from engine.sampler import sample
from engine.sampling_params import (
    MAX_TEMPERATURE,
    MAX_TOKEN_ID,
    MAX_TOKENS,
    MAX_TOP_K,
    MIN_TEMPERATURE,
    SamplingParams,
)


def test_defaults():
    p = SamplingParams()
    assert (p.max_tokens, p.temperature, p.top_k, p.top_p, p.min_p) == (16, 1.0, 0, 1.0, 0.0)
    assert p.seed is None and p.stop == [] and p.stop_token_ids == [] and p.logprobs is None
    assert not p.ignore_eos and not p.greedy


def test_default_lists_are_not_shared():
    a, b = SamplingParams(), SamplingParams()
    a.stop.append("x")
    assert b.stop == []


def test_greedy_and_normalisation():
    p = SamplingParams(temperature=0, stop="\n\n", stop_token_ids=(1, 2), top_k=-1)
    assert p.greedy and p.temperature == 0.0 and isinstance(p.temperature, float)
    assert p.stop == ["\n\n"] and p.stop_token_ids == [1, 2]


def test_valid_edges():
    SamplingParams(max_tokens=1, top_k=1, top_p=1.0, min_p=1.0, seed=0, logprobs=0)
    SamplingParams(top_p=1e-9, min_p=0.0, seed=2**63 - 1, logprobs=20, temperature=1e-5)


INVALID = [
    ("max_tokens", 0, "got 0"),
    ("max_tokens", -3, "got -3"),
    ("max_tokens", True, "got True"),
    ("max_tokens", 2.0, "got 2.0"),
    ("temperature", -0.1, "got -0.1"),
    ("temperature", "1.0", "got str"),
    ("temperature", math.nan, "finite"),
    ("temperature", math.inf, "finite"),
    ("temperature", None, "got NoneType"),
    ("top_k", -2, "got -2"),
    ("top_k", 1.5, "got 1.5"),
    ("top_k", False, "got False"),
    ("top_p", 0.0, "(0, 1], got 0.0"),
    ("top_p", 1.5, "(0, 1], got 1.5"),
    ("top_p", math.nan, "finite"),
    ("min_p", -0.01, "[0, 1], got -0.01"),
    ("min_p", 1.01, "[0, 1], got 1.01"),
    ("min_p", -math.inf, "finite"),
    ("seed", -1, "got -1"),
    ("seed", 2**63, f"got {2**63}"),
    ("seed", "7", "got '7'"),
    ("seed", True, "got True"),
    ("stop", [""], "non-empty"),
    ("stop", ["ok", 3], "got 3"),
    ("stop", 3, "got 3"),
    ("stop_token_ids", [-1], "got -1"),
    ("stop_token_ids", [1, "2"], "got '2'"),
    ("stop_token_ids", 5, "got 5"),
    ("stop", ["x"] * 17, "holds 17 strings: at most 16"),
    ("stop", ["x" * 257], "at most 256 characters, got one of 257"),
    ("stop_token_ids", list(range(65)), "holds 65 ids: at most 64"),
    ("ignore_eos", 1, "got 1"),
    ("logprobs", -1, "[0, 20], got -1"),
    ("logprobs", 21, "[0, 20], got 21"),
    ("logprobs", 1.0, "got 1.0"),
]


@pytest.mark.parametrize(("field", "value", "detail"), INVALID)
def test_invalid(field: str, value: object, detail: str):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert message.startswith(field), message
    assert detail in message, message


def test_the_bounds_themselves_are_accepted():
    p = SamplingParams(stop=["y" * 256] * 16, stop_token_ids=list(range(64)))
    assert len(p.stop) == 16 and len(p.stop_token_ids) == 64


@pytest.mark.parametrize("temperature", [1e-40, 1e-30, MIN_TEMPERATURE / 2])
def test_a_temperature_under_the_floor_is_greedy(temperature: float):
    """logits / 1e-40 is inf in float32, and softmax of it nan: such rows must take argmax."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 50, generator=gen) * 4
    params = [SamplingParams(temperature=temperature, seed=i) for i in range(6)]
    assert all(p.greedy for p in params)
    out = sample(logits, params, list(range(6)), [3] * 6)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()


def test_the_smallest_sampling_temperature_stays_finite():
    """At the floor itself sampling is still a draw, and it picks the argmax (the scaled logits
    are finite and differ by far more than the race's noise)."""
    logits = torch.tensor([[0.0, 1.0, 0.5, -2.0]])
    p = SamplingParams(temperature=MIN_TEMPERATURE, seed=7)
    assert not p.greedy
    assert sample(logits, [p], [7], [0]).token_ids.tolist() == [1]


# ---- upper bounds: every number fits the tensors the engine fills (issue 24, C1, L1) ----

BIG = [
    ("max_tokens", 2**31, f"[1, {MAX_TOKENS}], got {2**31}"),
    ("max_tokens", 2**63, f"got {2**63}"),
    ("max_tokens", 2**64, f"got {2**64}"),  # the "max_tokens 2**64 is accepted"
    ("max_tokens", 2**70, f"got {2**70}"),
    ("max_tokens", 2**200, "got an integer of 201 bits"),
    ("top_k", 2**31, f"[1, {MAX_TOP_K}], got {2**31}"),
    ("top_k", 9223372036854775808, "got 9223372036854775808"),  # the poison body
    ("top_k", 2**70, f"got {2**70}"),
    ("top_k", 10**5000, "got an integer of 16610 bits"),  # str() would raise past 4300 digits
    ("top_k", -(2**63), f"got {-(2**63)}"),
    ("stop_token_ids", [2**31], f"[0, {MAX_TOKEN_ID}], got {2**31}"),
    ("stop_token_ids", [1, 2**64], f"got {2**64}"),
    ("seed", 2**70, f"got {2**70}"),
    ("logprobs", 2**64, f"got {2**64}"),
    ("temperature", MAX_TEMPERATURE * 1.01, "[0, 1e+06]"),
    ("temperature", 3.5e38, "[0, 1e+06]"),  # inf in float32
    ("temperature", 10**400, "finite, got an integer of 1329 bits"),  # OverflowError in float()
    ("top_p", 10**400, "finite, got an integer of 1329 bits"),
    ("min_p", -(10**400), "finite, got an integer of 1329 bits"),
]


@pytest.mark.parametrize(
    ("field", "value", "detail"), BIG, ids=[f"{f}-{i}" for i, (f, _, _) in enumerate(BIG)]
)
def test_numbers_past_the_bounds_are_value_errors(field: str, value: object, detail: str):
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})
    message = str(info.value)
    assert message.startswith(field), message
    assert detail in message, message
    assert len(message) < 200, message  # one line for the client, never the whole number


def test_the_upper_bounds_themselves_are_accepted():
    p = SamplingParams(
        max_tokens=MAX_TOKENS,
        top_k=MAX_TOP_K,
        stop_token_ids=[MAX_TOKEN_ID],
        temperature=MAX_TEMPERATURE,
        top_p=5e-324,  # the smallest float64 above 0 (0 in float32)
        seed=2**63 - 1,
    )
    assert (p.max_tokens, p.top_k, p.stop_token_ids) == (2**31 - 1, 2**31 - 1, [2**31 - 1])
    # every bound fits a signed 32-bit tensor and the 32-bit proto fields
    torch.tensor([p.max_tokens, p.top_k, *p.stop_token_ids], dtype=torch.int32)


def test_the_largest_top_k_samples_as_top_k_off():
    """top_k is clamped to the vocabulary: 2**31 - 1 is the same draw as top_k 0."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(8, 40, generator=gen)
    seeds, positions = list(range(8)), [5] * 8
    big = sample(logits, [SamplingParams(top_k=MAX_TOP_K, seed=1)] * 8, seeds, positions)
    off = sample(logits, [SamplingParams(top_k=0, top_p=0.999999, seed=1)] * 8, seeds, positions)
    plain = sample(logits, [SamplingParams(seed=1)] * 8, seeds, positions)
    assert big.token_ids.tolist() == plain.token_ids.tolist() == off.token_ids.tolist()


@pytest.mark.parametrize("top_p", [5e-324, 1e-300, 1e-46, 1e-40])
def test_a_top_p_that_is_zero_in_float32_keeps_the_top_token(top_p: float):
    """L1: such a top_p used to drop every token (softmax of all -inf is nan) and sample token
    0 on every step; it keeps the top token: greedy."""
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=gen) * 3
    logits[:, 0] = -10.0  # token 0 is never the argmax here
    params = [SamplingParams(top_p=top_p, temperature=1.0) for _ in range(6)]
    out = sample(logits, params, list(range(6)), [9] * 6)
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
