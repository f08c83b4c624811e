"""The engine and llama.cpp side by side on one checkpoint, issue 12's method: llama.cpp's
`llama-batched-bench -npp 128 -ntg 128 -npl B -t THREADS` (defaults otherwise: f16 KV cache,
flash attention auto) on the checkpoint converted to GGUF F32, and the engine on the same shapes
(bench.decode_speed.run_batch: B requests of 128 random prompt tokens, 128 greedy output tokens;
decode tok/s = B x 127 / decode time), alternating batch by batch and repeat by repeat in one run
so that both see the same machine (its bandwidth moves by 2x within minutes here).

llama.cpp comes from the llama-cpp-python source distribution on PyPI (its vendored llama.cpp),
built once with cmake and a C++ compiler into ~/.cache/epcluster/ (EPCLUSTER_CACHE), native
CPU flags, Release; the checkpoint is converted with its convert_hf_to_gguf.py, told that the
preset's tokenizer pre-tokenizes like "default" (its hash is not in llama.cpp's list; the bench
feeds token ids, never text).

    .venv/bin/python -m bench.vs_llama_cpp [--model small] [--batches 1 8 32] [--repeats 3]
"""

import json
import os
import shutil
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

from bench.common import record
from bench.decode_speed import batch_arguments, decode_engine, read_bandwidth, run_batch
from moe.loader import resolve_model_path
from moe.presets import cache_root

LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python release whose vendored llama.cpp is built

CONVERT = """
import runpy, sys
src = sys.argv[1]
sys.path[:0] = [src, src + "/gguf-py"]
import conversion.base
# the preset's tokenizer is not one llama.cpp knows by hash; the bench never tokenizes text
conversion.base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "default"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[2:]]
runpy.run_path(src + "/convert_hf_to_gguf.py", run_name="__main__")
"""


def build_llama_cpp(root: Path) -> Path:
    """llama-batched-bench built from the pinned sdist (once); returns the source directory."""
    src = root / f"llama-cpp-python-{LLAMA_CPP_PYTHON}" / "vendor" / "llama.cpp"
    binary = src / "build" / "bin" / "llama-batched-bench"
    if binary.exists():
        return src
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            sys.exit(f"building llama.cpp needs {tool} on PATH (Debian: apt install cmake g++)")
    root.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
    subprocess.run([*pip, "-d", str(root), f"llama-cpp-python=={LLAMA_CPP_PYTHON}"], check=True)
    with tarfile.open(root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz") as tar:
        tar.extractall(root, filter="data")
    (root / f"llama_cpp_python-{LLAMA_CPP_PYTHON}").rename(src.parents[1])
    cmake = ["cmake", "-S", str(src), "-B", str(src / "build"), "-DCMAKE_BUILD_TYPE=Release"]
    cmake += ["-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF"]
    if shutil.which("ninja"):
        cmake += ["-G", "Ninja"]
    subprocess.run(cmake, check=True)
    jobs = str(os.cpu_count() or 1)
    build = ["cmake", "--build", str(src / "build"), "--target", "llama-batched-bench", "-j", jobs]
    subprocess.run(build, check=True)
    return src


def convert(src: Path, checkpoint: Path, out: Path) -> Path:
    if not out.exists():
        tmp = out.with_suffix(".partial")
        args = [str(checkpoint), "--outtype", "f32", "--outfile", str(tmp)]
        subprocess.run([sys.executable, "-c", CONVERT, str(src), *args], check=True)
        tmp.rename(out)
    return out


def llama_batched_bench(src: Path, gguf: Path, batch: int, threads: int) -> dict:
    """One llama-batched-bench run at `batch` parallel sequences: its JSON line."""
    binary = src / "build" / "bin" / "llama-batched-bench"
    cmd = [str(binary), "-m", str(gguf), "-c", str(batch * 256), "-npp", "128", "-ntg", "128"]
    cmd += ["-npl", str(batch), "-t", str(threads), "--output-format", "jsonl"]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    (row,) = [r for r in lines if r.get("pl") == batch]
    return row


def main() -> None:
    args = batch_arguments(__doc__, "vs_llama_cpp_MODEL")
    root = cache_root() / "llama.cpp"
    src = build_llama_cpp(root)
    checkpoint = Path(resolve_model_path(args.model))
    gguf = convert(src, checkpoint, root / f"{checkpoint.name}-f32.gguf")
    engine = decode_engine(args.model, args.python_layers)
    vocab = engine.model.config.vocab_size
    run_batch(engine, 2, vocab, seed=999)  # warm-up
    llama_batched_bench(src, gguf, 1, args.threads)  # warm-up (page cache)
    runs: dict[int, list[dict]] = {b: [] for b in args.batches}
    for repeat in range(args.repeats):
        for batch in args.batches:
            bandwidth = read_bandwidth()
            theirs = llama_batched_bench(src, gguf, batch, args.threads)
            ours = run_batch(engine, batch, vocab, seed=batch * 10 + repeat)
            pair = {
                "read_bandwidth_gb_s": round(bandwidth / 1e9, 1),
                "llama_cpp_decode_tok_s": round(theirs["speed_tg"], 1),
                "engine_decode_tok_s": round(batch * 127 / ours["decode_s"], 1),
                "llama_cpp_prefill_tok_s": round(theirs["speed_pp"], 1),
                "engine_prefill_tok_s": round(batch * 128 / ours["prefill_s"], 1),
            }
            pair["engine_over_llama_cpp"] = round(
                pair["engine_decode_tok_s"] / pair["llama_cpp_decode_tok_s"], 2
            )
            runs[batch].append(pair)
            print(batch, pair, flush=True)
    rows = {}
    for batch, pairs in runs.items():

        def span(key: str, pairs=pairs) -> list[float]:
            values = [p[key] for p in pairs]
            return [min(values), statistics.median(values), max(values)]

        rows[str(batch)] = {
            "pairs": pairs,
            "llama_cpp_decode_tok_s_min_median_max": span("llama_cpp_decode_tok_s"),
            "engine_decode_tok_s_min_median_max": span("engine_decode_tok_s"),
            "engine_over_llama_cpp_min_median_max": span("engine_over_llama_cpp"),
            "prefill_engine_over_llama_cpp_median": round(
                statistics.median(p["engine_prefill_tok_s"] for p in pairs)
                / statistics.median(p["llama_cpp_prefill_tok_s"] for p in pairs),
                2,
            ),
        }
    result = {
        "model": args.model,
        "threads": args.threads,
        "fused_decode_layers": not args.python_layers,
        "llama_cpp": f"llama-cpp-python {LLAMA_CPP_PYTHON} sdist's llama.cpp, GGUF F32, "
        "llama-batched-bench defaults (f16 KV cache, flash attention auto)",
        "batches": rows,
    }
    print(record(args.name or f"vs_llama_cpp_{args.model}", result))


if __name__ == "__main__":
    main()
