"""Speculative decoding's cost and ceiling on the CPU (engine/speculative.py): decode tok/s at
batch 1 and 8 with k = 0 (off), 1, 2, 3 on tiny-random's shapes with a random MTP layer
(tests/mtp_checkpoint.py), once with the MTP layer's own drafts (random weights: few accepted,
the overhead of drafting and verifying) and once with an oracle drafter (the plain run's tokens:
every draft accepted, the ceiling a perfect head would reach at this verify cost). The outputs
equal the plain run's in every case (checked). --model: another checkpoint with an MTP layer
(tiny with its trained head). Usage: .venv/bin/python -m bench.speculative [--model PATH]."""

import argparse
import tempfile
import time
from pathlib import Path

import torch

from bench.common import record
from engine import LLM, SamplingParams
from engine.config import SpeculativeConfig
from tests.mtp_checkpoint import write_mtp_random

NEW_TOKENS = 64
TEXTS = ["A class", "The function returns", "In Python, a list", "def main():"]
REPEATS = 5


def oracle(expected: dict[str, list[int]], lens: dict[str, int]):
    def propose(logits: torch.Tensor, reqs: list, positions: list[int]) -> list[int]:
        out = []
        for req, pos in zip(reqs, positions):
            tokens, i = expected[req.request_id], pos - lens[req.request_id]
            out.append(tokens[i] if i < len(tokens) else 1)
        return out

    return propose


def timed(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> tuple[float, list]:
    """The best of REPEATS runs (a shared machine: the others' load only adds time), after a
    warm-up; -> (seconds, the outputs). Prefix caching off: every run prefills."""
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        best = min(best, time.perf_counter() - start)
    return best, [o.token_ids for o in outs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a checkpoint with an MTP layer (default: random)")
    args = parser.parse_args()
    path = args.model or write_mtp_random(Path(tempfile.mkdtemp()) / "mtp-random")
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    rows = []
    for batch in (1, 8):
        plain = LLM(str(path), enable_prefix_caching=False)
        if args.model:  # a trained model: text it has seen the like of
            prompts = [plain.tokenizer.encode(TEXTS[i % len(TEXTS)]) for i in range(batch)]
        else:
            prompts = [torch.randint(2, 512, (32,), generator=gen).tolist() for _ in range(batch)]
        plain_s, want = timed(plain, prompts, params)
        rows.append(dict(batch=batch, k=0, drafter="none", tok_s=batch * NEW_TOKENS / plain_s))
        for k in (1, 2, 3):
            for drafter in ("mtp", "oracle"):
                llm = LLM(
                    str(path),
                    enable_prefix_caching=False,
                    speculative=SpeculativeConfig("mtp", k),
                )
                if drafter == "oracle":
                    expected = {str(i): w for i, w in enumerate(want)}
                    lens = {str(i): len(p) for i, p in enumerate(prompts)}
                    llm.engine.runner.drafter.propose = oracle(expected, lens)
                seconds, got = timed(llm, prompts, params)
                assert got == want, (batch, k, drafter)
                e = llm.engine  # counts over the warm-up and every repeat
                rows.append(
                    dict(
                        batch=batch,
                        k=k,
                        drafter=drafter,
                        tok_s=batch * NEW_TOKENS / seconds,
                        acceptance=e.num_accepted_tokens / max(e.num_draft_tokens, 1),
                        tokens_per_verify=1 + e.num_accepted_tokens / max(e.num_spec_verifies, 1),
                    )
                )
                print(rows[-1], flush=True)
    for row in rows:
        base = next(r for r in rows if r["batch"] == row["batch"] and r["k"] == 0)
        row["vs_plain"] = row["tok_s"] / base["tok_s"]
    model = args.model or "tiny-random + a random MTP layer"
    result = dict(new_tokens=NEW_TOKENS, repeats=REPEATS, model=model, rows=rows)
    print(record("speculative" if args.model is None else "speculative_model", result))


if __name__ == "__main__":
    main()
