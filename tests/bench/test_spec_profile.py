"""bench/spec_profile.py's engine side: the instrumented speculating engine decodes the plain
engine's tokens, every region is timed, and with an oracle right at every
position each decode step keeps k + 1 tokens. Its greedy rows take the screen (as `small`'s do
by default on the CPU kernels), so the full head and the sampler never run; with the screen off
they do."""

from pathlib import Path

from bench.decode_speed import decode_engine
from bench.spec_profile import NEW_TOKENS, decode, instrument
from bench.step_profile import spent
from bench.vs_llama_cpp import Oracle
from engine.config import SpeculativeConfig


def test_regions_of_an_oracle_run(ckpt: Path) -> None:
    plain = decode_engine(str(ckpt))
    vocab = plain.model.config.vocab_size
    want, _, plain_steps = decode(plain, 2, vocab, seed=3)
    assert plain_steps == NEW_TOKENS - 1  # one token a decode step after the prefill's
    spec = decode_engine(str(ckpt), speculative=SpeculativeConfig("mtp", 2), greedy_head="screened")
    spec.runner.drafter.propose = Oracle(want, 1.0, vocab)
    instrument(spec)
    tokens, _, steps = decode(spec, 2, vocab, seed=3)
    assert tokens == want and all(len(t) == NEW_TOKENS for t in tokens.values())
    assert steps == -(-(NEW_TOKENS - 1) // 3)  # 3 tokens a step, the last capped
    regions = ["verify forward", "target screen", "MTP block", "draft head"]
    assert all(spent[r] > 0 for r in [*regions, "draft pick (oracle)"])
    assert spent["target logits"] == spent["target sampling"] == 0
    exact = decode_engine(str(ckpt), speculative=SpeculativeConfig("mtp", 2))
    exact.runner.greedy_head = None  # as spec_profile's --greedy-heads exact
    exact.runner.drafter.propose = Oracle(want, 1.0, vocab)
    instrument(exact)
    spent.clear()
    assert decode(exact, 2, vocab, seed=3)[0] == want
    assert spent["target logits"] > 0 and spent["target sampling"] > 0
    assert spent["target screen"] == 0
