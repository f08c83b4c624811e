"""Decode speed of two checkouts side by side (an A/B for changes on the hot path): each round
runs bench.decode_speed's batch (B requests of 128 random prompt tokens, 128 greedy output
tokens) in a fresh process of each checkout, the order swapped every round so that neither side
always runs first; the same seeds on both sides.

    .venv/bin/python -m bench.decode_ab --before-tree DIR [--after-tree .] [--rounds 4]
        [--batches 1 8 32] [--name decode_ab_small]

Each checkout uses its own code (the subprocess runs with that tree first on sys.path) and its
own compiled CPU kernels (built before the first round, outside the timing). Result:
bench/results/<name>.json: per batch, each side's decode tok/s in every round, the medians, and
after / before (the median of the per-round ratios).
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from bench.common import record

REPO = Path(__file__).resolve().parent.parent

# NOTE: run inside the checkout being measured; only names both sides' bench.decode_speed has
CHILD = """
import hashlib, json, sys, torch
torch.set_num_threads(int(sys.argv[1]))
from bench.decode_speed import decode_engine, run_batch
engine = decode_engine(sys.argv[2])
vocab = engine.model.config.vocab_size
run_batch(engine, 2, vocab, seed=999)  # warm-up (and the kernels' build, if not built yet)
out = {}
for batch in [int(b) for b in sys.argv[3:]]:
    r = run_batch(engine, batch, vocab, seed=batch * 10)
    out[batch] = {"decode_tok_s": batch * 127 / r["decode_s"],
                  "step_ms": r["decode_step_ms_median"]}
import engine as package
print(json.dumps({"batches": out, "engine": package.__file__}))
"""


def run_side(tree: Path, args: argparse.Namespace, batches: list[int]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, "-P", "-c", CHILD, str(args.threads), args.model, *map(str, batches)]
    done = subprocess.run(cmd, cwd=tree, env=env, text=True, capture_output=True, timeout=3600)
    if done.returncode != 0:
        raise RuntimeError(f"{tree}: {done.stderr[-2000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert Path(result["engine"]).is_relative_to(tree), (result["engine"], tree)
    return result["batches"]


def git_head(tree: Path) -> str:
    return subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=tree, text=True, capture_output=True, check=True
    ).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before-tree", type=Path, required=True, help="a checkout of the baseline")
    ap.add_argument("--after-tree", type=Path, default=REPO)
    ap.add_argument("--model", default="small")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    sides = {"before": args.before_tree.resolve(), "after": args.after_tree.resolve()}
    for tree in sides.values():  # builds each side's kernels, outside the timing
        run_side(tree, args, [1])
    runs: dict[str, list[dict]] = {"before": [], "after": []}
    for r in range(args.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for side in order:
            runs[side].append(run_side(sides[side], args, args.batches))
            print(f"round {r} {side}: {json.dumps(runs[side][-1])}", flush=True)
    rows = {}
    for b in map(str, args.batches):
        before = [run[b]["decode_tok_s"] for run in runs["before"]]
        after = [run[b]["decode_tok_s"] for run in runs["after"]]
        rows[b] = {
            "before_decode_tok_s": [round(x, 1) for x in before],
            "after_decode_tok_s": [round(x, 1) for x in after],
            "before_median": round(statistics.median(before), 1),
            "after_median": round(statistics.median(after), 1),
            "after_over_before": round(statistics.median(a / b for a, b in zip(after, before)), 3),
        }
    result = {
        "model": args.model,
        "threads": args.threads,
        "rounds": args.rounds,
        "before_commit": git_head(sides["before"]),
        "after_commit": git_head(sides["after"]),
        "batches": rows,
    }
    print(record(args.name or f"decode_ab_{args.model}", result))


if __name__ == "__main__":
    main()
