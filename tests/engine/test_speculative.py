"""Speculative decoding with the MTP layer (engine/speculative.py): the tokens equal the engine's
without speculation, token for token (greedy and seeded sampling), over batching, chunked
prefill, stops, max_tokens, preemption and prefix caching; rejected drafts leave no block
behind; an oracle drafter (drafts equal to the target's tokens) exercises the accept path.
The drafts' head: the default on the CPU kernels (an int8 copy) and the exact one both keep the
tokens, and the int8 drafts' logits are the quantized head's (torch over q * scale).

The model (tests/mtp_checkpoint.py): tiny-random with one random MTP layer, whose drafts are
mostly wrong, so correctness cannot lean on them."""

import logging
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.block_manager import blocks_for
from engine.config import EngineConfig, EngineConfigError, KVTiersConfig, SpeculativeConfig
from engine.llm_engine import LLMEngine
from engine.messages import Resume
from engine.speculative import num_accepted
from kernels.backend import use_cpu_kernel
from kernels.cpu.build import cpu_kernels
from kernels.quantized import int8_linear_ref, int8_linear_vnni_ref, quantize_rows
from tests.mtp_checkpoint import LAYERS, write_mtp_random

BS = 4


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_mtp_random(tmp_path_factory.mktemp("mtp-random"))


def prompts(n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=gen).tolist()
    return [torch.randint(2, 512, (k,), generator=gen).tolist() for k in lengths]


def spec(k: int, draft_head: str = "auto") -> SpeculativeConfig:
    return SpeculativeConfig("mtp", k, draft_head=draft_head)


def assert_draft_head(llm: LLM, draft_head: str) -> None:
    """The drafter holds an int8 head where draft_head asks for one ("auto": on the CPU
    kernels, which serve this fp32 CPU model where they built)."""
    drafter = llm.engine.runner.drafter
    cpu = use_cpu_kernel(llm.engine.model.lm_head.weight)
    assert (drafter.head_int8 is not None) == (draft_head == "int8" or draft_head == "auto" and cpu)
    assert drafter.draft_head_bytes == (
        0 if drafter.head_int8 is None else drafter.head_int8.nbytes
    )


def mixed_params(n: int, temperature: float) -> list[SamplingParams]:
    """Different lengths and seeds, every other request greedy when temperature > 0."""
    return [
        SamplingParams(
            max_tokens=8 + 3 * (i % 5),
            temperature=temperature if i % 2 else 0.0,
            top_p=0.9,
            seed=100 + i,
            ignore_eos=True,
        )
        for i in range(n)
    ]


def outputs(llm: LLM, batch: list[list[int]], params: list[SamplingParams]) -> list:
    got = llm.generate(batch, params)
    llm.engine.assert_no_leaks()
    return [(o.token_ids, o.finish_reason, o.text) for o in got]


class Oracle:
    """A drafter that proposes the tokens a run without speculation produced (wrong at every
    `wrong`-th position when set): the verify then accepts runs of several drafts."""

    def __init__(self, expected: dict[str, list[int]], prompt_lens: dict[str, int], wrong: int = 0):
        self.expected, self.prompt_lens, self.wrong = expected, prompt_lens, wrong

    def __call__(self, logits: torch.Tensor, reqs: list, positions: list[int]) -> list[int]:
        out = []
        for req, pos in zip(reqs, positions):
            tokens, i = self.expected[req.request_id], pos - self.prompt_lens[req.request_id]
            token = tokens[i] if i < len(tokens) else 1
            out.append(token + 1 if self.wrong and pos % self.wrong == 0 else token)
        return out


def with_oracle(llm: LLM, batch: list[list[int]], want: list, wrong: int = 0) -> None:
    expected = {str(i): w[0] for i, w in enumerate(want)}
    lens = {str(i): len(p) for i, p in enumerate(batch)}
    llm.engine.runner.drafter.propose = Oracle(expected, lens, wrong)


def test_num_accepted_is_the_matching_prefix() -> None:
    assert num_accepted([], [7]) == 0
    assert num_accepted([3, 4, 5], [3, 4, 5, 6]) == 3
    assert num_accepted([3, 4, 5], [3, 9, 5, 6]) == 1
    assert num_accepted([3], [2, 3]) == 0


@pytest.mark.parametrize(
    ("k", "draft_head"), [(1, "auto"), (2, "auto"), (3, "auto"), (1, "exact"), (3, "exact")]
)
def test_greedy_equals_greedy_without_speculation(ckpt: Path, k: int, draft_head: str) -> None:
    """16 requests of 3-60 tokens in one batch, chunked prefill (16 tokens a step)."""
    batch = prompts(16, 3, 60, seed=1)
    params = mixed_params(16, 0.0)
    options = dict(block_size=BS, max_num_batched_tokens=16)
    want = outputs(LLM(str(ckpt), **options), batch, params)
    llm = LLM(str(ckpt), speculative=spec(k, draft_head), **options)
    assert_draft_head(llm, draft_head)
    assert outputs(llm, batch, params) == want
    e = llm.engine
    assert e.num_draft_tokens >= e.num_spec_verifies > 0
    assert (e.num_draft_tokens > e.num_spec_verifies) == (k > 1)
    assert 0 <= e.num_accepted_tokens < e.num_draft_tokens  # random weights: drafts mostly wrong
    assert len(e.runner.kv_caches) == LAYERS + 1  # the MTP layer's own cache layer


@pytest.mark.parametrize("draft_head", ["auto", "exact", "int8"])
def test_seeded_sampling_equals_sampling_without_speculation(ckpt: Path, draft_head: str) -> None:
    batch = prompts(12, 5, 40, seed=2)
    params = mixed_params(12, 0.9)
    want = outputs(LLM(str(ckpt), block_size=BS), batch, params)
    for k in (1, 3):
        llm = LLM(str(ckpt), block_size=BS, speculative=spec(k, draft_head))
        assert_draft_head(llm, draft_head)
        assert outputs(llm, batch, params) == want


def test_int8_drafts_take_the_quantized_head(ckpt: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The int8 drafter's logits are shared_head.norm, then the main head quantized per row
    (this checkpoint's MTP layer shares it), as torch computes them over q * scale; the exact
    drafter's are model.mtp_head's. On the torch paths (EPCLUSTER_KERNELS=reference), "auto"
    keeps the exact head and "int8" takes the reference product: the tokens stay."""
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(13))  # [T, D]
    llm = LLM(str(ckpt), block_size=BS, speculative=spec(1, "int8"))
    model, drafter = llm.engine.model, llm.engine.runner.drafter
    assert model.mtp[0].shared_head.head is None  # the main lm_head serves the MTP layer
    want = quantize_rows(model.lm_head.weight)
    assert torch.equal(drafter.head_int8.q, want.q) and torch.equal(
        drafter.head_int8.scale, want.scale
    )
    with torch.inference_mode():
        got = drafter.head(hidden)
        vnni = cpu_kernels() is not None and cpu_kernels().int8_vnni
        ref = (int8_linear_vnni_ref if vnni else int8_linear_ref)(
            model.mtp[0].shared_head.norm(hidden), want
        )
        exact = model.mtp_head(hidden)
    assert got.shape == exact.shape == (5, model.config.vocab_size) and got.dtype == torch.float32
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert not torch.equal(got, exact)  # an approximation: 8 bits a weight
    torch.testing.assert_close(got, exact, rtol=0, atol=0.05 * exact.abs().max().item())
    monkeypatch.setenv("EPCLUSTER_KERNELS", "reference")
    batch, params = prompts(4, 5, 20, seed=14), mixed_params(4, 0.9)
    want_out = outputs(LLM(str(ckpt), block_size=BS), batch, params)
    for draft_head in ("auto", "int8"):
        llm = LLM(str(ckpt), block_size=BS, speculative=spec(2, draft_head))
        assert (llm.engine.runner.drafter.head_int8 is None) == (draft_head == "auto")
        assert outputs(llm, batch, params) == want_out


def test_logprobs_are_the_target_rows(ckpt: Path) -> None:
    """Each kept token's logprobs come from its own verify row: those of the plain engine."""
    batch = prompts(4, 5, 20, seed=10)
    params = [
        SamplingParams(max_tokens=9, temperature=0.7 * (i % 2), seed=i, logprobs=3, ignore_eos=True)
        for i in range(4)
    ]
    want = LLM(str(ckpt), block_size=BS).generate(batch, params)
    llm = LLM(str(ckpt), block_size=BS, speculative=spec(2))
    with_oracle(llm, batch, [(o.token_ids,) for o in want], wrong=4)
    got = llm.generate(batch, params)
    assert llm.engine.num_accepted_tokens > 0
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids and len(g.logprobs) == len(w.logprobs) == 9
        for a, b in zip(g.logprobs, w.logprobs):
            assert a.token_id == b.token_id and [t for t, _ in a.top] == [t for t, _ in b.top]
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)


@pytest.mark.parametrize("temperature", [0.0, 0.9], ids=["greedy", "seeded"])
def test_oracle_drafts_are_all_accepted(ckpt: Path, temperature: float) -> None:
    """Drafts equal to the target's tokens: every one is accepted (k + 1 tokens a step), and
    with every 3rd position wrong the requests of one batch accept different counts."""
    batch = prompts(8, 4, 30, seed=3)
    params = mixed_params(8, temperature)
    want = outputs(LLM(str(ckpt), block_size=BS), batch, params)
    llm = LLM(str(ckpt), block_size=BS, speculative=spec(3))
    with_oracle(llm, batch, want)
    steps_before = llm.engine.num_steps
    assert outputs(llm, batch, params) == want
    e = llm.engine
    assert e.num_accepted_tokens == e.num_draft_tokens > 0
    # each request: one prefill step, then 4 tokens a step (k = 3, capped by max_tokens)
    longest = max(p.max_tokens for p in params)
    assert e.num_steps - steps_before <= 1 + -(-(longest - 1) // 4) + 1
    partly = LLM(str(ckpt), block_size=BS, speculative=spec(3))
    with_oracle(partly, batch, want, wrong=3)
    assert outputs(partly, batch, params) == want
    p = partly.engine
    assert 0 < p.num_accepted_tokens < p.num_draft_tokens


def test_no_drafts_in_steps_above_max_batch_size(ckpt: Path) -> None:
    """speculative.max_batch_size 3: a step that starts with more running requests verifies
    nothing and runs no MTP layer; once 3 or fewer run, drafting resumes within a step (oracle
    drafts: all accepted); the tokens are the plain engine's throughout."""
    batch = prompts(6, 4, 20, seed=8)
    params = mixed_params(6, 0.9)  # max_tokens 8 .. 20: the batch shrinks as they finish
    want = outputs(LLM(str(ckpt), block_size=BS), batch, params)
    llm = LLM(str(ckpt), block_size=BS, speculative=SpeculativeConfig("mtp", 2, max_batch_size=3))
    with_oracle(llm, batch, want)
    e, steps = llm.engine, []
    mtp_calls = []
    step, run_mtp = e.step, e.runner.drafter._run

    def counted_step():  # -> (requests running as the step starts, verifies, MTP calls)
        running, verifies, calls = len(e.scheduler.running), e.num_spec_verifies, len(mtp_calls)
        result = step()
        steps.append((running, e.num_spec_verifies - verifies, len(mtp_calls) - calls))
        return result

    def counted_mtp(*args, **kwargs):
        mtp_calls.append(1)
        return run_mtp(*args, **kwargs)

    e.step, e.runner.drafter._run = counted_step, counted_mtp
    assert outputs(llm, batch, params) == want
    crowded = [s for s in steps if s[0] > 3]
    few = [s for s in steps if 0 < s[0] <= 3]
    assert crowded and few  # both kinds of step happened
    assert all(verifies == 0 and calls == 0 for _, verifies, calls in crowded)
    assert sum(verifies for _, verifies, _ in few) > 0
    assert e.num_accepted_tokens == e.num_draft_tokens > 0  # the oracle's: none stale


def test_stops_and_max_tokens_inside_an_accepted_run(ckpt: Path) -> None:
    """A stop id, a stop string or max_tokens falling inside a run of accepted drafts ends the
    request there: not one token past it, the same text and finish reason."""
    batch = prompts(6, 5, 20, seed=4)
    free = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    runs = [o.token_ids for o in LLM(str(ckpt), block_size=BS).generate(batch, free)]
    params = []
    for i, tokens in enumerate(runs):
        if i % 3 == 0:
            params.append(SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[tokens[6]]))
        elif i % 3 == 1:
            params.append(SamplingParams(max_tokens=5 + i, temperature=0, ignore_eos=True))
        else:  # a stop string: the bytes of two tokens in the middle (ids < 256 are bytes)
            text = bytes(t for t in tokens[4:12] if t < 256).decode("utf-8", errors="replace")
            stop = text[len(text) // 2 : len(text) // 2 + 1] or "\x00"
            params.append(SamplingParams(max_tokens=24, temperature=0, stop=[stop]))
    want = outputs(LLM(str(ckpt), block_size=BS), batch, params)
    assert any(r == "stop" for _, r, _ in want) and any(r == "length" for _, r, _ in want)
    llm = LLM(str(ckpt), block_size=BS, speculative=spec(3))
    with_oracle(llm, batch, [(r,) for r in runs])
    assert outputs(llm, batch, params) == want
    assert llm.engine.num_accepted_tokens > 0


def test_a_resumed_request_goes_on_as_the_undisturbed_one(ckpt: Path) -> None:
    """Resumed after 7 tokens (a rank failure), seeded: the rest equals the undisturbed run."""
    prompt = prompts(1, 15, 15, seed=11)[0]
    params = SamplingParams(max_tokens=20, temperature=0.8, seed=5, ignore_eos=True)
    whole = LLM(str(ckpt), block_size=BS).generate([prompt], params)[0]
    engine = LLMEngine(EngineConfig(str(ckpt), block_size=BS, speculative=spec(3)))
    head = Resume(whole.token_ids[:7], "")
    engine.add_request("r", prompt, params, resume=head)
    rest = []
    while engine.has_unfinished():
        rest += [t for o in engine.step().outputs for t in o.token_ids]
    assert rest == whole.token_ids[7:]
    assert engine.num_draft_tokens > 0
    engine.assert_no_leaks()


def test_preemption_with_a_tiny_cache(ckpt: Path) -> None:
    batch = prompts(12, 10, 40, seed=5)
    params = mixed_params(12, 0.9)
    want = outputs(LLM(str(ckpt), block_size=BS), batch, params)
    # 4 cache layers (3 + the MTP layer) x BS x C 40 x float32 a block; 40 blocks
    llm = LLM(str(ckpt), block_size=BS, kv_cache_bytes=40 * 4 * BS * 40 * 4, speculative=spec(2))
    assert llm.engine.block_manager.num_blocks == 40
    assert outputs(llm, batch, params) == want
    assert llm.engine.num_preemptions > 0


def test_rejected_drafts_blocks_go_back_at_once(ckpt: Path) -> None:
    """After every step a running request holds no block past its tokens (a verify wrote up
    to k more); aborts in the middle free everything."""
    llm = LLM(str(ckpt), block_size=BS, speculative=spec(3))
    e = llm.engine
    for i, p in enumerate(prompts(6, 3, 14, seed=6)):
        e.add_request(str(i), p, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    for _ in range(6):
        e.step()
        for req in e.scheduler.running:
            held = len(req.block_table)
            assert blocks_for(req.num_computed_tokens, BS) <= held <= blocks_for(req.num_tokens, BS)
        e.block_manager.assert_consistent()
    assert e.num_draft_tokens > e.num_accepted_tokens
    for i in range(6):
        e.abort_request(str(i))
    e.assert_no_leaks()


def mtp_rows(engine: LLMEngine, prompt: list[int]) -> torch.Tensor:
    """Run `prompt`'s prefill alone; -> the MTP cache layer's rows for its positions [n, C]."""
    engine.add_request("x", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    engine.step()
    req = engine.requests["x"]
    assert req.num_computed_tokens == len(prompt)
    cache = engine.runner.kv_caches[LAYERS]
    rows = torch.stack([cache[req.block_table[p // BS], p % BS] for p in range(len(prompt))])
    engine.abort_request("x")
    return rows


@pytest.mark.parametrize("where", ["paged", "host tier"])
def test_prefix_hits_keep_the_mtp_layers_entries(ckpt: Path, where: str) -> None:
    """The MTP layer's cache rides in the same blocks (and the tiers store every cache layer):
    a prefix hit brings its entries for the hit positions, equal to a fresh prefill's, but for
    the last one, computed with the token that followed it in the request that filled the
    block (here 5, not the suffix's): a stale entry costs acceptance, never a token (the
    tokens below equal those without speculation)."""
    prefix, suffix = prompts(1, 24, 24, seed=7)[0], prompts(1, 6, 6, seed=8)[0]
    tiers = KVTiersConfig(host_bytes=10**7) if where == "host tier" else None
    cold = LLMEngine(EngineConfig(str(ckpt), block_size=BS, speculative=spec(1)))
    want = mtp_rows(cold, prefix + suffix)
    warm = LLMEngine(EngineConfig(str(ckpt), block_size=BS, speculative=spec(1), kv_tiers=tiers))
    mtp_rows(warm, prefix + [5])
    if tiers is not None:
        warm.tiers.flush()
        warm.block_manager.reset_prefix_cache()  # the paged copies gone: the tier serves
    got = mtp_rows(warm, prefix + suffix)
    assert warm.scheduler.num_prefix_hits == 24
    torch.testing.assert_close(got[:23], want[:23], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got[23], want[23], atol=1e-3)
    torch.testing.assert_close(got[24:], want[24:], atol=1e-5, rtol=1e-5)  # computed here
    # and the tokens are the same as without speculation
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    plain = LLM(str(ckpt), block_size=BS).generate([prefix + suffix], params)[0].token_ids
    warm.add_request("y", prefix + suffix, params)
    tokens = []
    while warm.has_unfinished():
        tokens += [t for o in warm.step().outputs for t in o.token_ids]
    assert tokens == plain
    warm.assert_no_leaks()


def test_counters_in_the_metrics_and_the_status(ckpt: Path) -> None:
    """The rank's series and its status carry the engine's counts; with an oracle drafter
    (every draft right, k = 2) each verify keeps 3 tokens but where max_tokens caps it."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from engine.metrics.rank import RankCollector

    batch = prompts(4, 5, 12, seed=9)
    params = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)] * 4
    want = outputs(LLM(str(ckpt), block_size=BS), batch, params)
    llm = LLM(str(ckpt), block_size=BS, speculative=spec(2))
    with_oracle(llm, batch, want)
    assert outputs(llm, batch, params) == want
    e = llm.engine
    # 9 tokens after the prefill's first: verifies of 2 drafts keep 3 (3 + 3 + 3 = 9)
    assert (e.num_spec_verifies, e.num_draft_tokens, e.num_accepted_tokens) == (12, 24, 24)
    status = e.rank_status("decode", 0, True)
    assert (status.spec_draft_tokens, status.spec_accepted_tokens) == (24, 24)
    assert status.spec_acceptance_rate == 1.0 and status.spec_tokens_per_verify == 3.0
    registry = CollectorRegistry()
    registry.register(RankCollector(e.stats, dict, "m", "decode", 0))
    text = generate_latest(registry).decode()
    samples = {
        (s.name, s.labels.get("le")): s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
    }
    assert samples["epcluster_spec_draft_tokens_total", None] == 24
    assert samples["epcluster_spec_accepted_tokens_total", None] == 24
    assert samples["epcluster_spec_verifies_total", None] == 12
    assert samples["epcluster_spec_accepted_per_verify_bucket", "1.0"] == 0
    assert samples["epcluster_spec_accepted_per_verify_bucket", "2.0"] == 12


def test_off_without_an_mtp_layer(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        llm = LLM("tiny-random", block_size=BS, speculative=spec(2))
    assert llm.engine.config.speculative is None and llm.engine.runner.drafter is None
    assert len(llm.engine.runner.kv_caches) == LAYERS
    assert sum("no MTP layer" in r.getMessage() for r in caplog.records) == 1
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].token_ids) == 4 and llm.engine.num_draft_tokens == 0


@pytest.mark.parametrize(
    "bad",
    [
        dict(num_draft_tokens=0),
        dict(num_draft_tokens=4),
        dict(method="eagle"),
        dict(max_batch_size=0),
        dict(max_batch_size=2.5),
        dict(draft_head="int4"),
    ],
)
def test_speculative_config_is_checked(bad: dict) -> None:
    with pytest.raises(EngineConfigError, match=next(iter(bad))):
        SpeculativeConfig(**bad)
    with pytest.raises(EngineConfigError, match="speculative"):
        EngineConfig(speculative={"method": "mtp"})  # a dict is not a SpeculativeConfig


def test_pre_norm_states_in_batch_order_with_two_micro_batches(ckpt: Path) -> None:
    """The verify's MTP input: the states before the final norm, in batch order also when the
    step runs as two interleaved micro-batches (two-batch overlap)."""
    engine = LLMEngine(EngineConfig(str(ckpt), block_size=BS, speculative=spec(1)))
    for i, p in enumerate(prompts(3, 5, 9, seed=12)):
        engine.add_request(str(i), p, SamplingParams(max_tokens=4))
    batch = engine.scheduler.schedule()
    one: list[torch.Tensor] = []
    two: list[torch.Tensor] = []
    with torch.inference_mode():
        whole = engine.runner.forward(batch.requests, batch.num_new_tokens, False, one)
        split = engine.runner.forward(batch.requests, batch.num_new_tokens, True, two)
        normed = engine.model.model.norm(one[0])
    assert engine.runner.num_split_steps == 1 and one[0].shape == (sum(batch.num_new_tokens), 64)
    torch.testing.assert_close(split, whole)
    torch.testing.assert_close(two[0], one[0])
    torch.testing.assert_close(normed, whole)
    assert not torch.allclose(one[0], whole, atol=1e-3)
    for i in range(3):
        engine.abort_request(str(i))
    engine.assert_no_leaks()


def test_the_compiled_mtp_block_equals_the_python_one(ckpt: Path) -> None:
    """On the CPU the MTP block runs compiled (engine/cpu_decode.py fused_block) for absorbed
    rows: the same output as the Python layer, and the same tokens and counts in the engine."""
    engine = LLMEngine(EngineConfig(str(ckpt), block_size=BS, speculative=spec(2)))
    drafter = engine.runner.drafter
    assert drafter.fused is not None
    p = prompts(1, 9, 9, seed=13)[0]
    engine.add_request("a", p, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    engine.step()  # the prefill: the MTP layer's rows 0 .. 8
    req = engine.requests["a"]
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 64, generator=g)
    with torch.inference_mode():
        before = drafter.num_fused_calls
        fused = drafter._run([req], [7], hidden, [5, 6], [2])  # rows 7, 8 again
        assert drafter.num_fused_calls == before + 1
        compiled, drafter.fused = drafter.fused, None
        python = drafter._run([req], [7], hidden, [5, 6], [2])
        drafter.fused = compiled
    torch.testing.assert_close(fused, python, atol=1e-5, rtol=1e-5)
    engine.abort_request("a")
    batch = prompts(6, 4, 20, seed=14)
    params = mixed_params(6, 0.9)
    runs = {}
    for compiled_block in (True, False):
        llm = LLM(str(ckpt), block_size=BS, speculative=spec(2))
        if not compiled_block:
            llm.engine.runner.drafter.fused = None
        e = llm.engine
        runs[compiled_block] = (outputs(llm, batch, params), e.num_accepted_tokens)
        assert (e.runner.drafter.num_fused_calls > 0) == compiled_block
    assert runs[True] == runs[False]
