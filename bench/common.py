"""Shared helpers for benchmarks: seeded workloads and result files."""

import json
import platform
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def workload(
    num: int,
    prompt_range: tuple[int, int],
    output_range: tuple[int, int],
    vocab: int,
    seed: int = 0,
) -> list[tuple[list[int], int]]:
    """`num` (prompt token ids, output length) pairs, uniformly random in the given ranges."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(num):
        plen = int(torch.randint(prompt_range[0], prompt_range[1] + 1, (1,), generator=gen))
        olen = int(torch.randint(output_range[0], output_range[1] + 1, (1,), generator=gen))
        out.append((torch.randint(2, vocab, (plen,), generator=gen).tolist(), olen))
    return out


def record(name: str, result: dict) -> Path:
    """Write bench/results/<name>.json with the command line and the machine."""
    script = Path(sys.argv[0])
    module = f"-m bench.{script.stem}" if script.parent.name == "bench" else str(script)
    result = dict(
        result,
        command=" ".join([".venv/bin/python", module, *sys.argv[1:]]),
        machine=f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        date=time.strftime("%Y-%m-%d"),
    )
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    return path


def run_engine(model: str, requests: list[tuple[list[int], int]], **options: object) -> float:
    """Seconds for the in-process engine to generate every request (greedy, EOS ignored, all
    submitted at once), after a warm-up; checks each got its tokens."""
    from engine import LLM, SamplingParams

    llm = LLM(model, **options)
    llm.generate([[3, 4, 5]], SamplingParams(max_tokens=2))  # warm-up
    params = [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True) for _, n in requests]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in requests], params)
    elapsed = time.perf_counter() - start
    assert [len(o.token_ids) for o in outs] == [n for _, n in requests]
    return elapsed
