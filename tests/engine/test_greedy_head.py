"""The greedy rows' screened head (engine/greedy_head.py): its error bound holds on random rows
(every element, many seeds and shapes, outliers in W and x); the candidates' logits are bitwise
the full head's; on hand-made heads with exact ties, one-ulp near-ties and rows whose int8
order flips, the screen returns torch.argmax of the full exact logits; rows it cannot bound fall
back. In the engine: greedy outputs equal the exact head's token for token (tiny, tiny-random,
with speculation k = 1, 2), rows that need logprobs or sampling take the full logits, no block
leaks, the int8 copy is the drafts' own when they quantize lm_head, and the knob is checked."""

from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig, EngineConfigError, SpeculativeConfig
from engine.greedy_head import AUTO_MIN_WEIGHTS, GreedyHead, bound_factors, greedy_head
from kernels.backend import use_cpu_kernel
from kernels.cpu.build import cpu_kernels
from kernels.linear import linear
from kernels.quantized import quantize_rows
from tests.mtp_checkpoint import write_mtp_random


@pytest.fixture(scope="module", autouse=True)
def kernels() -> None:
    """The screen serves on the compiled CPU kernels only: these tests assert it does."""
    x = torch.zeros(1)
    assert cpu_kernels() is not None and use_cpu_kernel(x), "the CPU kernels do not serve here"


def full_logits(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The head as the engine computes it (DeepseekForCausalLM.compute_logits: lm_head's
    `linear`, packed)."""
    return linear(x, w, packed=True)


def random_head(gen: torch.Generator, v: int, d: int) -> torch.Tensor:
    """[v, d]: row scales over 4 decades, a zero row, rows of subnormals (or a subnormal scale),
    an outlier column and outlier elements."""
    w = torch.randn(v, d, generator=gen) * 10 ** (torch.rand(v, 1, generator=gen) * 4 - 2)
    w[3] = 0.0
    w[4] *= 1e-39  # subnormal
    w[6] *= 1e-34  # normal, its scale subnormal
    w[:, 5] *= 30
    w[torch.rand(v, d, generator=gen) < 0.002] *= 50
    return w.contiguous()


def random_x(gen: torch.Generator, n: int, d: int) -> torch.Tensor:
    """[n, d] with heavy tails (a few coordinates 20-100x the rest, as hidden states have)."""
    x = torch.randn(n, d, generator=gen)
    x[:, 7] *= 100
    return x * torch.where(torch.rand(n, d, generator=gen) < 0.01, 20.0, 1.0)


@pytest.mark.parametrize("d", [64, 100, 768])
def test_the_bound_holds_on_every_element(d: int) -> None:
    """|int8 logit - exact logit| <= ||x||_1 e[n] for every element, 20 seeds of 300 x d heads
    and 9 rows (the kernels' tiles: 6 rows and a tail), both computed by the engine's kernels."""
    worst = 0.0
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        w, x = random_head(gen, 300, d), random_x(gen, 9, d)
        head = quantize_rows(w)
        z = cpu_kernels().linear_int8(x, head.q, head.scale).double()  # [9, 300]
        y = full_logits(x, w).double()
        factors = bound_factors(head, w.abs().amax(dim=1))
        bound = x.double().abs().sum(dim=1, keepdim=True) * factors[None, :]
        assert torch.all((z - y).abs() <= bound), seed
        assert z[:, 4].abs().max() < 1e-30 and y[:, 4].abs().max() < 1e-30  # what subnormals give
        worst = max(worst, float(((z - y).abs() / bound.clamp(min=1e-300)).max()))
    assert 0.01 < worst < 1  # the bound is not vacuous: the errors reach a fair share of it


def test_candidates_logits_are_the_full_heads_bit_for_bit() -> None:
    """The screen's step 4 (gathered rows, packed, the panel kernel) against the full head, for
    candidate sets of 1-200 rows anywhere in the vocabulary and 1-9 rows of x."""
    gen = torch.Generator().manual_seed(1)
    w = random_head(gen, 1000, 96)
    k = cpu_kernels()
    for n, c in [(1, 1), (2, 7), (3, 48), (9, 49), (4, 200)]:
        x = random_x(gen, n, 96)
        cols = torch.randperm(1000, generator=gen)[:c].sort().values
        got = k.linear_panels(x, k.pack_panels(w.index_select(0, cols)), c)
        assert torch.equal(got, full_logits(x, w)[:, cols])


def screen(w: torch.Tensor, x: torch.Tensor) -> tuple[list[int | None], GreedyHead]:
    g = GreedyHead(w, quantize_rows(w))
    return g.argmax(x), g


def test_exact_ties_take_the_lowest_index() -> None:
    gen = torch.Generator().manual_seed(2)
    w, x = random_head(gen, 200, 64), random_x(gen, 1, 64)
    top = (x[0] / x[0].norm() * 5000).contiguous()
    w[[37, 150, 199]] = top  # three equal rows: exact ties at the maximum
    y = full_logits(x, w)[0]
    assert y[37] == y[150] == y[199] == y.max()
    got, g = screen(w, x)
    assert got == [37] == [torch.argmax(y).item()] and g.num_candidates >= 3


def test_near_ties_of_an_ulp_go_by_the_exact_logits() -> None:
    """Two equal rows, then one element of row b moved by m ulps, m doubling until b's exact
    logit passes a's: their int8 rows stay equal, their logits differ by a few ulps; b wins,
    whether its index is above or below a's."""
    for a, b in [(20, 120), (120, 20)]:
        gen = torch.Generator().manual_seed(3)
        w, x = random_head(gen, 200, 64), random_x(gen, 1, 64)
        w[a] = w[b] = x[0] / x[0].norm() * 5000
        j = int(x[0].abs().argmax())  # where a weight's ulp moves the logit most
        ulp = torch.nextafter(w[a, j].abs(), torch.tensor(float("inf"))) - w[a, j].abs()
        m = 1
        while full_logits(x, w)[0, b] <= full_logits(x, w)[0, a]:
            w[b, j] = w[a, j] + m * ulp * torch.sign(x[0, j])
            m *= 2
        y = full_logits(x, w)[0]
        assert torch.equal(quantize_rows(w).q[a], quantize_rows(w).q[b])
        y_ulp = torch.nextafter(y[a], torch.tensor(float("inf"))) - y[a]
        assert 0 < y[b] - y[a] <= 8 * y_ulp and y[b] == y.max()
        got, _ = screen(w, x)
        assert got == [b] == [torch.argmax(y).item()]


def test_rows_whose_int8_order_flips_get_the_exact_argmax() -> None:
    """Heads of 64 rows a quantization step apart: the int8 argmax differs from the exact one
    in many of 200 cases; the screen always returns the exact one."""
    flips = 0
    for seed in range(200):
        gen = torch.Generator().manual_seed(100 + seed)
        base = torch.randn(1, 128, generator=gen)
        w = (base + torch.randn(64, 128, generator=gen) * 0.004).contiguous()
        x = torch.randn(3, 128, generator=gen)
        head = quantize_rows(w)
        z = cpu_kernels().linear_int8(x, head.q, head.scale)
        want = torch.argmax(full_logits(x, w), dim=1)
        flips += int((torch.argmax(z, dim=1) != want).sum())
        got, g = screen(w, x)
        assert got == want.tolist(), seed
        assert g.num_fallbacks == 0
    assert flips > 50


def test_rows_it_cannot_bound_fall_back() -> None:
    gen = torch.Generator().manual_seed(4)
    w, x = random_head(gen, 300, 64), random_x(gen, 4, 64)
    x[1, 3] = float("nan")
    x[2, 0] = float("inf")
    x[3] *= 1e36  # logits past float32's range
    got, g = screen(w, x)
    assert got[0] == torch.argmax(full_logits(x[:1], w)).item()
    assert got[1:] == [None, None, None]
    assert (g.num_rows, g.num_fallbacks) == (4, 3)
    g.max_candidates = 0  # too many candidates: the full head pays more
    assert g.argmax(x[:1]) == [None] and g.num_fallbacks == 4
    g.max_candidates = 256
    many = x[:1].expand(g.max_rows + 1, -1)  # the int8 kernel is slower than the full head
    assert g.argmax(many) == [None] * (g.max_rows + 1) and g.num_rows == 5
    assert g.argmax(many[: g.max_rows]) == got[:1] * g.max_rows


def test_off_the_kernels_nothing_is_screened(monkeypatch: pytest.MonkeyPatch) -> None:
    w = random_head(torch.Generator().manual_seed(5), 300, 64)
    g = GreedyHead(w, quantize_rows(w))
    monkeypatch.setenv("EPCLUSTER_KERNELS", "reference")  # the head takes torch's path then
    assert g.argmax(torch.ones(2, 64)) == [None, None] and g.num_rows == 0
    with pytest.raises(ValueError, match="greedy_head screened: the compiled CPU kernels"):
        greedy_head(w, "screened")
    assert greedy_head(w, "auto") is None
    monkeypatch.undo()
    assert greedy_head(w, "exact") is None
    assert isinstance(greedy_head(w, "screened"), GreedyHead)


# ---- in the engine ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mtp_random(tmp_path_factory.mktemp("mtp-random"))


def prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (int(k),), generator=gen).tolist() for k in range(3, 3 + n)]


def greedy(n: int) -> list[SamplingParams]:
    return [SamplingParams(max_tokens=10 + i % 7, temperature=0.0, ignore_eos=i % 2 == 0)
            for i in range(n)]  # fmt: skip


def outputs(llm: LLM, batch: list[list[int]], params: list[SamplingParams]) -> list:
    got = llm.generate(batch, params)
    llm.engine.assert_no_leaks()
    return [(o.token_ids, o.finish_reason, o.logprobs) for o in got]


@pytest.mark.parametrize(
    ("model", "k"), [("tiny", 0), ("tiny-random", 0), ("tiny", 1), ("ckpt", 1), ("ckpt", 2)]
)
def test_greedy_tokens_equal_the_exact_heads(ckpt: Path, model: str, k: int) -> None:
    """12 greedy requests in one batch, chunked prefill: screened against exact."""
    name = str(ckpt) if model == "ckpt" else model
    spec = SpeculativeConfig("mtp", k) if k else None
    options = dict(block_size=4, max_num_batched_tokens=24, speculative=spec)
    exact = LLM(name, greedy_head="exact", **options)
    vocab = exact.engine.model.config.vocab_size
    batch, params = prompts(12, vocab, seed=7), greedy(12)
    assert exact.engine.runner.greedy_head is None
    want = outputs(exact, batch, params)
    llm = LLM(name, greedy_head="screened", **options)
    g = llm.engine.runner.greedy_head
    assert g is not None
    g.max_rows = 64  # every step screened here (12 requests' verifies exceed the default)
    assert outputs(llm, batch, params) == want
    produced = sum(len(tokens) for tokens, _, _ in want)  # each from one screened row
    assert (g.num_rows == produced) if not k else (g.num_rows > produced)
    assert g.num_fallbacks == 0
    assert 1 <= g.mean_candidates < 64
    if k:
        assert llm.engine.num_spec_verifies > 0


def test_rows_that_need_the_logits_bypass_the_screen() -> None:
    """Greedy with logprobs, and sampled rows, get the full head's logits (the sampler sees
    [rows, V]); plain greedy rows go to the screen only; every output (logprobs too) equals the
    exact head's."""
    params = [
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=3, ignore_eos=True),
    ]
    batch = prompts(3, 512, seed=8)
    want = outputs(LLM("tiny-random", greedy_head="exact", block_size=4), batch, params)
    llm = LLM("tiny-random", greedy_head="screened", block_size=4)
    runner = llm.engine.runner
    screened, sampled = [], []
    real_argmax, real_sample = runner.greedy_head.argmax, runner.sample

    def argmax(x: torch.Tensor) -> list[int | None]:
        screened.append(x.shape[0])
        return real_argmax(x)

    def sample(logits, p, seeds, positions):
        assert logits.shape == (len(p), 512)
        sampled.extend((q.greedy, q.logprobs) for q in p)
        return real_sample(logits, p, seeds, positions)

    runner.greedy_head.argmax, runner.sample = argmax, sample
    assert outputs(llm, batch, params) == want
    assert sum(screened) == 8 and len(screened) == 8  # request 0's rows, one a step
    assert sorted(set(sampled)) == [(False, None), (True, 2)] and len(sampled) == 16


def test_the_drafts_int8_head_is_shared() -> None:
    """tiny's MTP layer drafts with lm_head itself: the screen holds the drafter's copy; with
    exact drafts it makes its own."""
    llm = LLM("tiny", greedy_head="screened", speculative=SpeculativeConfig("mtp", 1))
    runner = llm.engine.runner
    assert runner.drafter.head_int8 is not None
    assert runner.greedy_head.head is runner.drafter.head_int8
    llm = LLM(
        "tiny", greedy_head="screened", speculative=SpeculativeConfig("mtp", 1, draft_head="exact")
    )
    runner = llm.engine.runner
    assert runner.drafter.head_int8 is None and runner.greedy_head is not None
    assert torch.equal(runner.greedy_head.head.q, quantize_rows(runner.model.lm_head.weight).q)


def test_auto_screens_a_head_that_pays() -> None:
    """auto: tiny's 512 x 64 head reads faster than the screen runs (the full head); a head of
    AUTO_MIN_WEIGHTS or more is screened."""
    assert LLM("tiny").engine.runner.greedy_head is None
    big = torch.randn(AUTO_MIN_WEIGHTS // 64, 64)
    assert greedy_head(big, "auto") is not None
    assert greedy_head(big[:-1], "auto") is None
    assert greedy_head(big[:-1], "screened") is not None


def test_the_knob_is_checked() -> None:
    assert EngineConfig().greedy_head == "auto"
    with pytest.raises(EngineConfigError, match="greedy_head: must be auto, screened or exact"):
        EngineConfig(greedy_head="int8")
    with pytest.raises(EngineConfigError, match="greedy_head: screened needs the compiled CPU"):
        EngineConfig(greedy_head="screened", device="cuda")
    with pytest.raises(EngineConfigError, match="greedy_head: screened needs the compiled CPU"):
        EngineConfig(greedy_head="screened", dtype="bfloat16")
    assert EngineConfig(greedy_head="exact", device="cuda").greedy_head == "exact"
