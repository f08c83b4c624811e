import math

import pytest
import torch

from engine.sampler import filter_logits, noise_seed, sample, splitmix64
from engine.sampling_params import SamplingParams

V = 512


def _logits(n: int, v: int = V, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 3


def _one(logits_row: torch.Tensor, params: SamplingParams, seed: int, pos: int) -> int:
    return int(sample(logits_row[None], [params], [seed], [pos]).token_ids[0])


def _filter(logits: list[float], top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0):
    out = filter_logits(
        torch.tensor([logits]),
        torch.tensor([top_k]),
        torch.tensor([top_p]),
        torch.tensor([min_p]),
    )
    return torch.isfinite(out[0]).tolist()


def test_splitmix64_reference_values():
    # First outputs of the reference splitmix64 generator started at state 0 (Vigna's C code).
    assert splitmix64(0) == 0xE220A8397B1DCDAF
    assert splitmix64(0x9E3779B97F4A7C15) == 0x6E789E6AA1B965F4
    assert 0 <= noise_seed(2**63 - 1, 10**9) < 2**63


def test_greedy_is_argmax_with_lowest_index_on_ties():
    logits = _logits(6)
    logits[5, 7] = logits[5, 9] = logits[5].max() + 1  # a tie: index 7 must win
    params = [SamplingParams(temperature=0)] * 6
    out = sample(logits, params, seeds=list(range(6)), positions=[3] * 6)
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (6,)
    assert torch.equal(out.token_ids, logits.argmax(dim=-1))
    assert out.token_ids[5] == 7
    assert out.logprobs == [None] * 6


@pytest.mark.parametrize(
    "target",
    [SamplingParams(temperature=0.9, top_k=50, top_p=0.95, min_p=0.01), SamplingParams()],
    ids=["filtered", "unfiltered"],  # unfiltered alone skips filter_logits; in a batch it runs
)
def test_row_is_independent_of_batch(target: SamplingParams):
    logits = _logits(8)
    alone = _one(logits[0], target, seed=1234, pos=17)
    others = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=2.0),
        SamplingParams(top_k=1),
        SamplingParams(top_p=0.3, logprobs=5),
        SamplingParams(min_p=0.5, temperature=0.5),
    ]
    for n in (2, 3, 8):
        for shift in range(n):
            rows = torch.roll(logits[:n], shifts=shift, dims=0)
            params = [others[i % len(others)] for i in range(n)]
            seeds, positions = list(range(100, 100 + n)), list(range(n))
            params[shift], seeds[shift], positions[shift] = target, 1234, 17
            out = sample(rows, params, seeds, positions)
            assert int(out.token_ids[shift]) == alone, (n, shift)


def test_same_seed_and_position_same_token_other_positions_vary():
    row = torch.zeros(V)  # uniform: every draw is pure noise
    params = SamplingParams()
    first = [_one(row, params, seed=7, pos=p) for p in range(40)]
    assert first == [_one(row, params, seed=7, pos=p) for p in range(40)]
    assert len(set(first)) > 30  # 40 uniform draws from 512 tokens rarely collide
    other_seed = [_one(row, params, seed=8, pos=p) for p in range(40)]
    assert sum(a == b for a, b in zip(first, other_seed)) < 5


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_empirical_frequencies(temperature: float):
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 4000
    logits = probs.log().expand(n, 4)
    params = [SamplingParams(temperature=temperature)] * n
    out = sample(logits, params, seeds=list(range(n)), positions=[5] * n)
    expected = probs ** (1 / temperature)
    expected = expected / expected.sum() * n
    observed = torch.bincount(out.token_ids, minlength=4).float()
    chi2 = float(((observed - expected) ** 2 / expected).sum())
    assert chi2 < 16.27, (observed, expected)  # chi-square, 3 dof, p = 0.001


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = _logits(16)
    greedy = logits.argmax(dim=-1)
    seeds, positions = list(range(16)), list(range(16))
    for params in (SamplingParams(top_k=1, temperature=5.0), SamplingParams(top_p=1e-6)):
        out = sample(logits, [params] * 16, seeds, positions)
        assert torch.equal(out.token_ids, greedy)


def test_min_p_filters_in_sampling():
    # probs 0.4, 0.3, 0.2, 0.1: min_p 0.3 drops what is below 0.12, i.e. token 3 only.
    n = 2000
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().expand(n, 4)
    out = sample(logits, [SamplingParams(min_p=0.3)] * n, list(range(n)), [0] * n)
    counts = torch.bincount(out.token_ids, minlength=4).tolist()
    assert counts[3] == 0 and min(counts[:3]) > 0, counts


def test_filter_masks_by_hand():
    # probs 0.4, 0.3, 0.2, 0.1, shuffled to check the unsort.
    logits = [math.log(p) for p in (0.2, 0.4, 0.1, 0.3)]
    assert _filter(logits) == [True] * 4
    assert _filter(logits, top_k=2) == [False, True, False, True]
    assert _filter(logits, top_k=-1) == [True] * 4
    assert _filter(logits, top_k=100) == [True] * 4
    assert _filter(logits, top_p=0.65) == [False, True, False, True]  # 0.4 + 0.3 >= 0.65
    assert _filter(logits, top_p=0.75) == [True, True, False, True]
    assert _filter(logits, top_p=0.35) == [False, True, False, False]  # top token always kept
    # top-k renormalises before top-p: 0.4 / 0.7 = 0.57 >= 0.5 keeps only the top token.
    assert _filter(logits, top_p=0.5) == [False, True, False, True]
    assert _filter(logits, top_k=2, top_p=0.5) == [False, True, False, False]
    # Exact boundary (0.25 each is exact in float32): the kept mass just reaches top_p.
    assert sum(_filter([0.0] * 4, top_p=0.5)) == 2
    assert sum(_filter([0.0] * 4, top_p=0.25)) == 1
    assert _filter(logits, min_p=0.3) == [True, True, False, True]  # 0.1 < 0.3 * 0.4
    assert _filter(logits, min_p=0.6) == [False, True, False, True]  # 0.2 < 0.24
    assert _filter(logits, min_p=1.0) == [False, True, False, False]


def test_filter_rows_with_different_params():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 3)
    out = filter_logits(
        logits, torch.tensor([1, 0, 3]), torch.tensor([1.0, 1.0, 1.0]), torch.tensor([0, 0, 0.0])
    )
    assert torch.isfinite(out).sum(dim=-1).tolist() == [1, 4, 3]
    assert torch.equal(out[1], logits[1])


def test_logprobs_from_raw_logits():
    logits = _logits(4, v=64).to(torch.bfloat16)
    params = [
        SamplingParams(logprobs=5, temperature=0.3),
        SamplingParams(),
        SamplingParams(logprobs=0, temperature=0),
        SamplingParams(logprobs=20, top_k=3),
    ]
    out = sample(logits, params, [1, 2, 3, 4], [9, 9, 9, 9])
    ref = logits.float().log_softmax(dim=-1)
    assert out.logprobs[1] is None
    for i, n in ((0, 5), (2, 0), (3, 20)):
        lp = out.logprobs[i]
        assert lp is not None and lp.token_id == int(out.token_ids[i])
        assert lp.logprob == pytest.approx(float(ref[i, lp.token_id]), abs=1e-5)
        assert len(lp.top) == n
        values = [v for _, v in lp.top]
        assert values == sorted(values, reverse=True)
        if n:
            top_vals, top_ids = ref[i].topk(n)
            assert [t for t, _ in lp.top] == top_ids.tolist()
            assert values == pytest.approx(top_vals.tolist(), abs=1e-5)
    assert out.logprobs[2].token_id == int(logits[2].float().argmax())
