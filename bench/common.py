"""Shared helpers for benchmarks: seeded workloads and result files."""

import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench" / "results"


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


def git_commit(repo: Path = REPO) -> str:
    """HEAD's hash, plus " (dirty)" when files other than result files differ from it: the
    code that ran is then not that commit's."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", *args], cwd=repo, capture_output=True, text=True, check=True
        ).stdout

    try:
        head = git("rev-parse", "HEAD").strip()
        status = git("status", "--porcelain", "--untracked-files=all")
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout)"
    # NOTE: a porcelain line is "XY path" (a rename "XY old -> new"); the path starts at col 3.
    changed = [line[3:].split(" -> ")[-1] for line in status.splitlines()]
    dirty = any(not path.strip('"').startswith("bench/results/") for path in changed)
    return head + (" (dirty)" if dirty else "")


def cpu_info() -> dict[str, object]:
    """The CPU model (lscpu's "Model name"), the vector flags the kernels choose by, the cores."""
    model = platform.processor() or platform.machine()
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        names = [
            line.split(":", 1)[1].strip()
            for line in lscpu.splitlines()
            if ":" in line and line.split(":", 1)[0].strip() == "Model name"
        ]
        model = names[0] if names else model
    except (OSError, subprocess.CalledProcessError):
        pass
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        flags = set(next(line for line in cpuinfo.splitlines() if line.startswith("flags")).split())
    except (OSError, StopIteration):
        flags = set()
    wanted = [f for f in ("avx2", "avx512f", "avx512_bf16") if f in flags]
    wanted += sorted(f for f in flags if f.startswith("amx"))
    return {"cpu": model, "cpu_flags": wanted, "cores": os.cpu_count()}


def result_path(name: str, command: str) -> Path:
    """bench/results/<name>.json, unless that file holds a run of another command: then the first
    free <name>_<k>.json, so that no result is overwritten by a different configuration (a rerun
    of the same command replaces its file; git keeps the old one)."""
    path = RESULTS / f"{name}.json"
    k = 2
    while path.exists() and json.loads(path.read_text()).get("command") != command:
        path = RESULTS / f"{name}_{k}.json"
        k += 1
    return path


def record(name: str, result: dict) -> Path:
    """Write bench/results/<name>.json: the result, the command line, the machine (threads, CPU
    model, vector flags, cores, load average), the git commit and the UTC date and time.
    EPCLUSTER_BENCH_NOTE, when set, is kept as `note` (say there whether the run was contended)."""
    script = Path(sys.argv[0])
    module = f"-m bench.{script.stem}" if script.parent.name == "bench" else str(script)
    command = " ".join([".venv/bin/python", module, *sys.argv[1:]])
    result = dict(
        result,
        command=command,
        machine=f"{platform.machine()}, {torch.get_num_threads()} torch threads",
        date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        commit=git_commit(),
        **cpu_info(),
        load_average=[round(x, 2) for x in os.getloadavg()],
    )
    if os.environ.get("EPCLUSTER_BENCH_NOTE"):
        result["note"] = os.environ["EPCLUSTER_BENCH_NOTE"]
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = result_path(name, command)
    if path.name != f"{name}.json":
        print(
            f"bench: {name}.json holds another command's run; writing {path.name}", file=sys.stderr
        )
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
