"""Where a speculating decode step's time goes (docs/mtp.md "Speed"): one engine with MTP
drafts (k per step) decodes one batch of random 128-token prompts, its drafts from
bench.vs_llama_cpp's seeded oracle (right at --oracle-acceptance of positions, knowing a plain
engine's tokens), each drafts' head in turn (--draft-heads, alternating run by run so that both
see the same machine). Regions, timed by wrapping the functions that compute them (CPU: host
clocks are the compute time), over the decode steps (not the prefill's): the verify forward
(its k + 1 rows a request), the target's logits (the model's head over them), the target's
sampling, the MTP block, the drafts' head, the oracle's pick, and the rest of the step.

    .venv/bin/python -m bench.spec_profile [--batch 1] [--k 1] [--oracle-acceptance 0.85]
        [--draft-heads exact int8] [--repeats 3] [--name spec_profile_small]
"""

import argparse
import statistics
import time

import torch

from bench.common import record, workload
from bench.decode_speed import decode_engine
from bench.step_profile import spent, timed
from bench.vs_llama_cpp import PROMPT_TOKENS, Oracle
from engine import SamplingParams
from engine.config import SpeculativeConfig
from engine.llm_engine import LLMEngine
from tools.small_mtp import ensure_small_mtp

NEW_TOKENS = 128


def decode(engine: LLMEngine, batch: int, vocab: int, seed: int) -> tuple[dict, float, int]:
    """One batch to the end -> (request id -> its tokens, decode seconds, decode steps)."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    requests = workload(batch, (PROMPT_TOKENS, PROMPT_TOKENS), (1, 1), vocab, seed)
    for i, (prompt, _) in enumerate(requests):
        engine.add_request(f"{seed}-{i}", prompt, params)
    tokens: dict[str, list[int]] = {f"{seed}-{i}": [] for i in range(batch)}
    steps, start = -1, 0.0
    while engine.has_unfinished():
        for delta in engine.step().outputs:
            tokens[delta.request_id] += delta.token_ids
        if steps == -1:  # the prefill (one step for these prompts): not counted
            spent.clear()
            start = time.perf_counter()
        steps += 1
    return tokens, time.perf_counter() - start, steps


def instrument(engine: LLMEngine) -> None:
    """Wrap the regions' functions (bench.step_profile.timed: their time goes to `spent`)."""
    runner, drafter = engine.runner, engine.runner.drafter
    regions = [
        ("verify forward", runner, "forward"),
        ("target logits", engine.model, "compute_logits"),
        ("target sampling", runner, "sample"),
        ("MTP block", drafter, "_run"),
        ("draft head", drafter, "head"),
        ("draft pick (oracle)", drafter, "propose"),
    ]
    for region, obj, name in regions:
        setattr(obj, name, timed(region, getattr(obj, name)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--k", type=int, default=1)
    ap.add_argument("--oracle-acceptance", type=float, default=0.85)
    ap.add_argument("--draft-heads", nargs="+", default=["exact", "int8"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="spec_profile_small")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    plain = decode_engine("small")
    vocab = plain.model.config.vocab_size
    mtp = str(ensure_small_mtp())
    engines = {h: decode_engine(mtp, False, SpeculativeConfig("mtp", args.k, draft_head=h))
               for h in args.draft_heads}  # fmt: skip
    runs: dict[str, list[dict]] = {h: [] for h in args.draft_heads}
    plain_ms = []
    for repeat in range(args.repeats + 1):  # the first: warm-up, not kept
        seed = 100 + repeat
        want, plain_s, plain_steps = decode(plain, args.batch, vocab, seed)
        if repeat:
            plain_ms.append(plain_s / plain_steps * 1e3)
        for head, engine in engines.items():
            drafter = engine.runner.drafter
            if repeat == 0:
                drafter.propose = Oracle(want, args.oracle_acceptance, vocab)
                instrument(engine)
            drafter.propose.__wrapped__.expected = want
            accepted, verifies = engine.num_accepted_tokens, engine.num_spec_verifies
            tokens, seconds, steps = decode(engine, args.batch, vocab, seed)
            assert tokens == want, "speculative decoding changed the tokens"
            if not repeat:
                continue
            verifies = engine.num_spec_verifies - verifies
            runs[head].append({
                "step_ms": seconds / steps * 1e3,
                "tokens_per_step": args.batch * (NEW_TOKENS - 1) / steps,
                "tokens_per_verify": 1 + (engine.num_accepted_tokens - accepted) / verifies,
                "decode_tok_s": args.batch * (NEW_TOKENS - 1) / seconds,
                **{f"{r}_ms": s / steps * 1e3 for r, s in spent.items()},
            })  # fmt: skip
            print(head, repeat, {k: round(v, 2) for k, v in runs[head][-1].items()}, flush=True)
    result = {
        "batch": args.batch,
        "k": args.k,
        "oracle_acceptance": args.oracle_acceptance,
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": NEW_TOKENS,
        "plain_step_ms_median": round(statistics.median(plain_ms), 3),
        "per_step_medians": {
            head: {key: round(statistics.median(r[key] for r in rows), 3) for key in rows[0]}
            for head, rows in runs.items()
        },
        "runs": runs,
    }
    for row in result["per_step_medians"].values():
        regions = sum(v for k, v in row.items() if k.endswith("_ms") and k != "step_ms")
        row["rest_ms"] = round(row["step_ms"] - regions, 3)
    print(record(args.name, result))


if __name__ == "__main__":
    main()
