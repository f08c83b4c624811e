"""bench/vs_llama_cpp.py's engine side (llama.cpp is not built here): a speculating engine's run
of a batch equals the plain engine's tokens, and the seeded oracle drafter accepts at the
fraction it is given (all at 1, none at 0, about half at 0.5), counted by the engine."""

from pathlib import Path

import pytest

from bench.decode_speed import decode_engine, run_batch
from bench.vs_llama_cpp import Oracle, engine_pair
from engine.config import SpeculativeConfig


def test_oracle_runs_accept_what_they_are_told_and_keep_the_tokens(ckpt: Path) -> None:
    plain = decode_engine(str(ckpt))
    vocab = plain.model.config.vocab_size
    want = run_batch(plain, 2, vocab, seed=5)["tokens"]
    spec = decode_engine(str(ckpt), speculative=SpeculativeConfig("mtp", 2))
    own = spec.runner.drafter.propose
    rows = {}
    for p in (1.0, 0.0, 0.5):
        spec.runner.drafter.propose = Oracle(want, p, vocab)
        rows[p] = engine_pair(spec, 2, vocab, 5, want)  # asserts the tokens equal want
    spec.runner.drafter.propose = own
    mtp = engine_pair(spec, 2, vocab, 5, want)
    assert rows[1.0]["tokens"] == rows[0.0]["tokens"] == mtp["tokens"] == want
    assert rows[1.0]["acceptance"] == 1.0 and rows[1.0]["tokens_per_verify"] == 3.0
    assert rows[0.0]["acceptance"] == 0.0 and rows[0.0]["tokens_per_verify"] == 1.0
    assert 0.3 < rows[0.5]["acceptance"] < 0.7  # seeded: the same fraction every run
    with pytest.raises(AssertionError, match="changed the tokens"):
        engine_pair(spec, 2, vocab, 6, want)  # another seed's prompts: other tokens
