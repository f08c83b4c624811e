import math

import pytest
import torch

from engine.sampler import sample
from engine.sampling_params import MIN_TEMPERATURE, SamplingParams


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
