"""Weights on huge pages or not (kernels/hugepages.py), side by side: two engines on one
checkpoint in one process, one loaded with EPCLUSTER_HUGE_PAGES=0 (4 KiB pages) and one with
its weights on 2 MiB pages, decoding alternately (the order flips every pair) with
bench.decode_speed's workload (B requests of 128 prompt tokens and 128 greedy output tokens;
decode tok/s = B x 127 / decode time). Reported per batch: each engine's tok/s, the ratio
within each pair, its median, and how many pairs the huge pages won; with each engine's load
time and the bytes of its weights on huge pages.

    .venv/bin/python -m bench.huge_pages [--model small] [--batches 1 32] [--pairs 8]
"""

import argparse
import os
import statistics
import time

import torch

from bench.common import record
from bench.decode_speed import decode_engine, run_batch
from kernels import hugepages


def build(model: str, huge: bool):
    os.environ["EPCLUSTER_HUGE_PAGES"] = "1" if huge else "0"
    try:
        start = time.perf_counter()
        engine = decode_engine(model)
        seconds = time.perf_counter() - start
    finally:
        os.environ.pop("EPCLUSTER_HUGE_PAGES")
    weights = engine.model.read_weights()
    runs = hugepages.regions(
        [(w.untyped_storage().data_ptr(), w.untyped_storage().nbytes()) for w in weights],
        hugepages.huge_page_size(),
    )
    return engine, {
        "load_s": round(seconds, 2),
        "weights_mib": round(sum(w.untyped_storage().nbytes() for w in weights) / 2**20),
        "on_huge_pages_mib": round(hugepages.huge_bytes(runs) / 2**20),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--pairs", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default=None, help="result file name (default huge_pages_MODEL)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not (hugepages.enabled() and hugepages.supported()):
        raise SystemExit("no transparent huge pages here (THP off, or no MADV_COLLAPSE)")
    small, small_info = build(args.model, huge=False)
    huge, huge_info = build(args.model, huge=True)
    engines = {"small_pages": small, "huge_pages": huge}
    vocab = small.model.config.vocab_size
    for engine in engines.values():
        run_batch(engine, 2, vocab, seed=999)  # warm-up
    rows = {}
    for batch in args.batches:
        tok_s: dict[str, list[float]] = {name: [] for name in engines}
        for pair in range(args.pairs):
            order = list(engines) if pair % 2 == 0 else list(reversed(engines))
            for name in order:  # the same requests for both
                out = run_batch(engines[name], batch, vocab, seed=batch * 100 + pair)
                tok_s[name].append(batch * 127 / out["decode_s"])
        ratios = [h / s for h, s in zip(tok_s["huge_pages"], tok_s["small_pages"])]
        rows[str(batch)] = {
            **{f"{name}_decode_tok_s": [round(x, 1) for x in v] for name, v in tok_s.items()},
            "ratio_per_pair": [round(r, 3) for r in ratios],
            "median_ratio": round(statistics.median(ratios), 3),
            "pairs_huge_faster": sum(r > 1 for r in ratios),
        }
        print(batch, rows[str(batch)], flush=True)
    result = {
        "model": args.model,
        "threads": args.threads,
        "small_pages": small_info,
        "huge_pages": huge_info,
        "batches": rows,
    }
    print(record(args.name or f"huge_pages_{args.model}", result))


if __name__ == "__main__":
    main()
