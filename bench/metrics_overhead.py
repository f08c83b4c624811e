"""What recording metrics costs a decode step: the same engine and batch, steps timed with the
rank's metrics recorded (and a scraper reading them once a second, as Prometheus would) and
without, interleaved in blocks so that drift hits both alike.

    .venv/bin/python -m bench.metrics_overhead [--model small] [--batch 32] [--rounds 6]
"""

import argparse
import statistics
import threading
import time

import torch
from prometheus_client import CollectorRegistry, generate_latest

from bench.common import record
from engine import EngineConfig, LLMEngine, SamplingParams
from engine.metrics.rank import RankCollector


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=6, help="blocks of steps per setting")
    ap.add_argument("--steps", type=int, default=10, help="decode steps per block")
    args = ap.parse_args()
    torch.set_num_threads(2)
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=args.batch))
    gen = torch.Generator().manual_seed(0)
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=10_000, ignore_eos=True, temperature=0)
    for i in range(args.batch):
        engine.add_request(str(i), torch.randint(2, vocab, (128,), generator=gen).tolist(), params)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.requests.values()):
        engine.step()  # prefill: every later step is a pure decode step of the whole batch
    registry = CollectorRegistry()
    registry.register(RankCollector(engine.stats, lambda: {}, args.model, "decode", 0))
    scrapes = {"n": 0}
    stop = threading.Event()

    def scraper() -> None:
        while not stop.wait(1.0):
            generate_latest(registry)
            scrapes["n"] += 1

    thread = threading.Thread(target=scraper, daemon=True)
    thread.start()
    times: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(args.rounds):
        for on in (True, False):
            object.__setattr__(engine.config, "metrics", on)
            for _ in range(args.steps):
                start = time.perf_counter()
                engine.step()
                times[on].append(time.perf_counter() - start)
    stop.set()
    thread.join()
    on, off = statistics.mean(times[True]), statistics.mean(times[False])
    on_med, off_med = statistics.median(times[True]), statistics.median(times[False])
    print(f"step with metrics {1000 * on:.1f} ms, without {1000 * off:.1f} ms (means)")
    overhead = 100 * (on_med / off_med - 1)
    print(f"medians {1000 * on_med:.1f} / {1000 * off_med:.1f} ms: {overhead:+.2f}%")
    print(
        record(
            f"metrics_overhead_{args.model}",
            {
                "model": args.model,
                "batch": args.batch,
                "steps_per_setting": len(times[True]),
                "scrapes_during_the_run": scrapes["n"],
                "step_ms_with_metrics": {
                    "mean": round(1000 * on, 2),
                    "median": round(1000 * on_med, 2),
                },
                "step_ms_without": {
                    "mean": round(1000 * off, 2),
                    "median": round(1000 * off_med, 2),
                },
                "overhead_percent_of_median": round(overhead, 2),
            },
        )
    )


if __name__ == "__main__":
    main()
