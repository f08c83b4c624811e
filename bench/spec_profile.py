"""Where a decode step's time goes (docs/mtp.md "Speed"): engines decode one batch of random
128-token prompts, greedy, each configuration in turn (alternating run by run so that all see
the same machine): the greedy rows' head (--greedy-heads: exact, the full fp32 head, or
screened by its int8 copy, engine/greedy_head.py) and, with MTP drafts (--k > 0), the drafts'
head (--draft-heads), the drafts from bench.vs_llama_cpp's seeded oracle (right at
--oracle-acceptance of positions, knowing a plain engine's tokens). Regions, timed by wrapping
the functions that compute them (CPU: host clocks are the compute time), over the decode steps
(not the prefill's): the forward (a verify's k + 1 rows a request), the target's full logits
(the model's head), the screen (int8 logits, bound, the candidates' exact logits), the target's
sampling, the MTP block, the drafts' head, the oracle's pick, and the rest of the step. Every
run's tokens are asserted equal to a plain engine's with the exact head; the screen's mean
candidates per row are recorded.

    .venv/bin/python -m bench.spec_profile [--batch 1] [--k 1] [--oracle-acceptance 0.85]
        [--draft-heads exact int8] [--greedy-heads exact screened] [--repeats 3]
        [--name spec_profile_small]
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
        ("target screen", runner.greedy_head, "argmax"),
        ("target sampling", runner, "sample"),
        ("MTP block", drafter, "_run"),
        ("draft head", drafter, "head"),
        ("draft pick (oracle)", drafter, "propose"),
    ]
    for region, obj, name in regions:
        if obj is not None:
            setattr(obj, name, timed(region, getattr(obj, name)))


def engines_for(args: argparse.Namespace) -> dict[str, LLMEngine]:
    """One engine per configuration, named "<greedy head>" (k = 0) or "<draft head>/<greedy
    head>"; the screen is the default (auto) on the CPU kernels, exact drops it."""
    mtp = str(ensure_small_mtp()) if args.k else "small"
    engines = {}
    for draft in args.draft_heads if args.k else [None]:
        for greedy in args.greedy_heads:
            spec = SpeculativeConfig("mtp", args.k, draft_head=draft) if args.k else None
            engine = decode_engine(mtp, False, spec)
            if greedy == "exact":
                engine.runner.greedy_head = None  # the runner's choice: the full head
            else:
                assert engine.runner.greedy_head is not None, "the screen does not serve here"
            engines[greedy if draft is None else f"{draft}/{greedy}"] = engine
    return engines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--k", type=int, default=1, help="draft tokens a step (0: no speculation)")
    ap.add_argument("--oracle-acceptance", type=float, default=0.85)
    ap.add_argument("--draft-heads", nargs="+", default=["exact", "int8"])
    ap.add_argument("--greedy-heads", nargs="+", default=["exact", "screened"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default="spec_profile_small")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    plain = decode_engine("small")
    plain.runner.greedy_head = None  # the oracle of the tokens: the full exact head
    vocab = plain.model.config.vocab_size
    engines = engines_for(args)
    runs: dict[str, list[dict]] = {name: [] for name in engines}
    plain_ms = []
    for repeat in range(args.repeats + 1):  # the first: warm-up, not kept
        seed = 100 + repeat
        want, plain_s, plain_steps = decode(plain, args.batch, vocab, seed)
        if repeat:
            plain_ms.append(plain_s / plain_steps * 1e3)
        for name, engine in engines.items():
            drafter, screen = engine.runner.drafter, engine.runner.greedy_head
            if repeat == 0:
                if drafter is not None:
                    drafter.propose = Oracle(want, args.oracle_acceptance, vocab)
                instrument(engine)
            if drafter is not None:
                drafter.propose.__wrapped__.expected = want
            accepted, verifies = engine.num_accepted_tokens, engine.num_spec_verifies
            counts = (
                (screen.num_rows - screen.num_fallbacks, screen.num_candidates) if screen else None
            )
            tokens, seconds, steps = decode(engine, args.batch, vocab, seed)
            assert tokens == want, f"{name} changed the tokens"
            if not repeat:
                continue
            run = {
                "step_ms": seconds / steps * 1e3,
                "tokens_per_step": args.batch * (NEW_TOKENS - 1) / steps,
                "decode_tok_s": args.batch * (NEW_TOKENS - 1) / seconds,
                **{f"{r}_ms": s / steps * 1e3 for r, s in spent.items()},
            }
            if args.k:
                verifies = engine.num_spec_verifies - verifies
                run["tokens_per_verify"] = 1 + (engine.num_accepted_tokens - accepted) / verifies
            if screen is not None:  # the prefill's rows too: one per request
                rows = screen.num_rows - screen.num_fallbacks - counts[0]
                run["screen_candidates_per_row"] = (screen.num_candidates - counts[1]) / rows
                run["screen_fallbacks"] = screen.num_fallbacks
            runs[name].append(run)
            print(name, repeat, {k: round(v, 2) for k, v in run.items()}, flush=True)
    result = {
        "batch": args.batch,
        "k": args.k,
        "oracle_acceptance": args.oracle_acceptance if args.k else None,
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": NEW_TOKENS,
        "plain_step_ms_median": round(statistics.median(plain_ms), 3),
        "per_step_medians": {
            name: {key: round(statistics.median(r[key] for r in rows), 3) for key in rows[0]}
            for name, rows in runs.items()
        },
        "runs": runs,
    }
    for row in result["per_step_medians"].values():
        regions = sum(v for k, v in row.items() if k.endswith("_ms") and k != "step_ms")
        row["rest_ms"] = round(row["step_ms"] - regions, 3)
    print(record(args.name, result))


if __name__ == "__main__":
    main()
