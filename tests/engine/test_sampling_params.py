import math

import pytest

from engine.sampling_params import SamplingParams


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
