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

With --draft-tokens 0 1 2 the engine runs once per k in the same alternation, k > 0 with MTP
speculative decoding (docs/mtp.md) on a checkpoint with an MTP layer (small's self-distilled
head, tools/small_mtp.py, or --mtp-model); every k decodes the same prompts to the same tokens
(speculation is lossless), and the acceptance of each run is recorded beside its speed.

    .venv/bin/python -m bench.vs_llama_cpp [--model small] [--batches 1 8 32] [--repeats 3]
        [--draft-tokens 0 1 2] [--mtp-model PATH] [--draft-head auto|int8|exact ...]
"""

import argparse
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

import torch

from bench.common import record
from bench.decode_speed import batch_arguments, decode_engine, read_bandwidth, run_batch
from engine.config import SpeculativeConfig
from engine.llm_engine import LLMEngine
from moe.loader import resolve_model_path
from moe.presets import cache_root

LLAMA_CPP_PYTHON = "0.3.36"  # the llama-cpp-python release whose vendored llama.cpp is built
PROMPT_TOKENS = 128  # bench.decode_speed.run_batch's prompts

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


def mtp_checkpoint(args: argparse.Namespace) -> str:
    """The checkpoint the speculating engines load: --mtp-model, small's self-distilled head
    (built once into the cache), or the model itself (tiny ships its trained head)."""
    if args.mtp_model:
        return args.mtp_model
    if args.model == "small":
        from tools.small_mtp import ensure_small_mtp

        return str(ensure_small_mtp())
    return args.model


class Oracle:
    """A drafter that knows the plain engine's tokens and proposes the right one at a seeded
    fraction `p` of positions (a function of request id and position), a wrong one elsewhere:
    the verify path's speed at a given acceptance, e.g. DeepSeek-V3's published 85%."""

    def __init__(self, expected: dict[str, list[int]], p: float, vocab: int) -> None:
        self.expected, self.p, self.vocab = expected, p, vocab

    def __call__(self, logits: torch.Tensor, reqs: list, positions: list[int]) -> list[int]:
        out = []
        for req, pos in zip(reqs, positions):
            tokens, i = self.expected[req.request_id], pos - PROMPT_TOKENS
            right = tokens[i] if 0 <= i < len(tokens) else 1
            if random.Random(f"{req.request_id}/{pos}").random() < self.p:
                out.append(right)
            else:
                out.append((right + 1) % self.vocab)
        return out


def engine_pair(
    engine: LLMEngine, batch: int, vocab: int, seed: int, want: dict | None = None
) -> dict:
    """One engine's run of a batch -> its decode and prefill tok/s (and, speculating, the
    acceptance and tokens per verify step of this run); want: the plain engine's tokens of
    this batch, which every speculating run must equal (lossless)."""
    drafts, accepted, verifies = (
        engine.num_draft_tokens, engine.num_accepted_tokens, engine.num_spec_verifies
    )  # fmt: skip
    ours = run_batch(engine, batch, vocab, seed=seed)
    if want is not None:
        assert ours["tokens"] == want, "speculative decoding changed the tokens"
    row = {
        "decode_tok_s": round(batch * 127 / ours["decode_s"], 1),
        "prefill_tok_s": round(batch * 128 / ours["prefill_s"], 1),
        "tokens": ours["tokens"],  # dropped before the record
    }
    if engine.config.speculative is not None:
        drafts = engine.num_draft_tokens - drafts
        accepted = engine.num_accepted_tokens - accepted
        verifies = engine.num_spec_verifies - verifies
        row["acceptance"] = round(accepted / max(drafts, 1), 3)
        row["tokens_per_verify"] = round(1 + accepted / max(verifies, 1), 3)
    return row


def main() -> None:
    args = batch_arguments(__doc__, "vs_llama_cpp_MODEL", speculative=True)
    root = cache_root() / "llama.cpp"
    src = build_llama_cpp(root)
    checkpoint = Path(resolve_model_path(args.model))
    gguf = convert(src, checkpoint, root / f"{checkpoint.name}-f32.gguf")
    ks = sorted(set(args.draft_tokens))
    if args.oracle_acceptance is not None and 0 not in ks:
        sys.exit("--oracle-acceptance needs --draft-tokens 0 (the plain run's tokens)")
    mtp = mtp_checkpoint(args) if any(ks) else None
    # one engine per k and drafts' head (named by the head too when several are asked for)
    heads = list(dict.fromkeys(args.draft_head))
    engines = {}
    for k in ks:
        for head in heads if k else [None]:
            spec = SpeculativeConfig("mtp", k, draft_head=head) if k else None
            name = f"engine_k{k}" + (f"_{head}" if k and len(heads) > 1 else "")
            engines[name] = decode_engine(args.model if k == 0 else mtp, args.python_layers, spec)
    vocab = next(iter(engines.values())).model.config.vocab_size
    for engine in engines.values():
        run_batch(engine, 2, vocab, seed=999)  # warm-up
    llama_batched_bench(src, gguf, 1, args.threads)  # warm-up (page cache)
    runs: dict[int, list[dict]] = {b: [] for b in args.batches}
    for repeat in range(args.repeats):
        for batch in args.batches:
            bandwidth = read_bandwidth()
            theirs = llama_batched_bench(src, gguf, batch, args.threads)
            pair = {
                "read_bandwidth_gb_s": round(bandwidth / 1e9, 1),
                "llama_cpp_decode_tok_s": round(theirs["speed_tg"], 1),
                "llama_cpp_prefill_tok_s": round(theirs["speed_pp"], 1),
            }
            # the same prompts for every k (a function of the seed): the same greedy tokens
            want, seed = None, batch * 10 + repeat
            for engine_name, engine in engines.items():
                runs_of_k = [(engine_name, None)]
                if engine.config.speculative and args.oracle_acceptance is not None:
                    runs_of_k.append((f"{engine_name}_oracle", args.oracle_acceptance))
                for name, p in runs_of_k:
                    drafter = engine.runner.drafter
                    own = drafter.propose if drafter is not None else None
                    if p is not None:
                        drafter.propose = Oracle(want, p, vocab)
                    try:
                        ours = engine_pair(engine, batch, vocab, seed, want)
                    finally:
                        if p is not None:
                            drafter.propose = own
                    want = want or ours["tokens"]  # k = 0 runs first
                    del ours["tokens"]
                    ours["over_llama_cpp"] = round(
                        ours["decode_tok_s"] / pair["llama_cpp_decode_tok_s"], 2
                    )
                    pair[name] = ours
            runs[batch].append(pair)
            print(batch, pair, flush=True)
    rows = {}
    for batch, pairs in runs.items():

        def span(values: list[float]) -> list[float]:
            return [min(values), statistics.median(values), max(values)]

        row = {
            "pairs": pairs,
            "llama_cpp_decode_tok_s_min_median_max": span(
                [p["llama_cpp_decode_tok_s"] for p in pairs]
            ),
        }
        names = [n for n in pairs[0] if n.startswith("engine_k")]
        for name in names:
            k = int(name.split("_")[1][1:])
            mine = [p[name] for p in pairs]
            row[name] = {
                "decode_tok_s_min_median_max": span([m["decode_tok_s"] for m in mine]),
                "over_llama_cpp_min_median_max": span([m["over_llama_cpp"] for m in mine]),
                "prefill_over_llama_cpp_median": round(
                    statistics.median(m["prefill_tok_s"] for m in mine)
                    / statistics.median(p["llama_cpp_prefill_tok_s"] for p in pairs),
                    2,
                ),
            }
            if k:
                row[name]["acceptance_median"] = statistics.median(m["acceptance"] for m in mine)
                row[name]["tokens_per_verify_median"] = statistics.median(
                    m["tokens_per_verify"] for m in mine
                )
        rows[str(batch)] = row
    result = {
        "model": args.model,
        "mtp_model": mtp,
        "draft_tokens": ks,
        "draft_head": heads,
        "oracle_acceptance": args.oracle_acceptance,
        "threads": args.threads,
        "fused_decode_layers": not args.python_layers,
        "llama_cpp": f"llama-cpp-python {LLAMA_CPP_PYTHON} sdist's llama.cpp, GGUF F32, "
        "llama-batched-bench defaults (f16 KV cache, flash attention auto), no speculation",
        "batches": rows,
    }
    print(record(args.name or f"vs_llama_cpp_{args.model}", result))


if __name__ == "__main__":
    main()
