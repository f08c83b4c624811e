"""Read bandwidth of y = x @ W.T on CPU for a few rows of x, by path: F.linear (MKL), W @ x.T,
and the compiled kernels (kernels/cpu/gemm.cpp: the dot tiles reading W in place, which the
routed experts take, and the panel tiles over a packed copy, which the dense projections take);
on the projection shapes of the `small` preset, with weights that are not in cache (a rotation of
copies larger than the last-level cache). It picks kernels/linear.py's switches.
--int8-head: instead, the MTP drafts' head (small's lm_head, 32,000 x 768) per call, in ms: fp32
over panels and in place against its int8 copy (kernels/quantized.py: weight-only, and with x
quantized on AVX512-VNNI where the CPU has it), and how often the int8 logits' argmax is the
fp32 one's (random rows of x).

    .venv/bin/python -m bench.linear [--threads 2] [--int8-head]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from bench.common import record
from kernels.cpu.build import cpu_kernels
from kernels.quantized import Int8Weight, quantize_rows

SHAPES = [(32000, 768), (768, 768), (768, 384), (1152, 384)]  # lm_head, o_proj, experts, q_b
ROWS = (1, 2, 4, 6, 8, 12, 16, 32, 64)


def median_s(fn, repeats: int = 30) -> float:
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def speeds(
    weights: list[torch.Tensor], packed: list[torch.Tensor], x: torch.Tensor, kernel
) -> dict[str, float]:
    """GB/s of W read by each path, W taken in turn from `weights` (`packed`: as panels)."""
    turn = iter(range(10**9))

    def w() -> torch.Tensor:
        return weights[next(turn) % len(weights)]

    def p() -> torch.Tensor:
        return packed[next(turn) % len(packed)]

    paths = {"F.linear": lambda: F.linear(x, w()), "W @ x.T": lambda: (w() @ x.T).T}
    if kernel is not None:
        n = weights[0].shape[0]
        paths["compiled, dot tiles"] = lambda: kernel.linear(x, w())
        paths["compiled, panels"] = lambda: kernel.linear_panels(x, p(), n)
    gb = weights[0].numel() * 4 / 1e9
    return {p: round(gb / median_s(fn), 1) for p, fn in paths.items()}


def int8_head(kernel, n: int = 32000, k: int = 768) -> dict[str, object]:
    """ms per call of the head [n, k] at each row count, by path, weights rotated out of cache;
    and the share of rows whose argmax the int8 copy keeps."""
    weights = [torch.randn(n, k) for _ in range(max(2, 300_000_000 // (n * k * 4)))]
    packed = [kernel.pack_panels(w) for w in weights]
    # as many int8 copies as make 300 MB too (each a copy in memory of its own)
    quantized = [quantize_rows(weights[i % len(weights)]) for i in range(4 * len(weights))]
    turn = iter(range(10**9))

    def weight_only(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
        return kernel.linear_int8(x, w.q, w.scale)

    def vnni(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
        return kernel.linear_int8_vnni(x, w.q, w.scale, w.sums)

    def pick(items: list) -> object:  # the next copy: each call reads from memory
        return items[next(turn) % len(items)]

    result = {}
    for rows in ROWS:
        x = torch.randn(rows, k)
        paths = {
            "fp32, panels": lambda x=x: kernel.linear_panels(x, pick(packed), n),
            "fp32, dot tiles": lambda x=x: kernel.linear(x, pick(weights)),
            "int8, weight-only": lambda x=x: weight_only(x, pick(quantized)),
        }
        if kernel.int8_vnni:
            paths["int8, VNNI"] = lambda x=x: vnni(x, pick(quantized))
        got = {p: round(median_s(fn) * 1e3, 3) for p, fn in paths.items()}
        result[f"{rows} rows"] = got
        print(f"head {n}x{k}, {rows:2d} rows: ms {got}", flush=True)
    x = torch.randn(512, k)
    want = (x @ weights[0].T).argmax(1)
    for name, fn in [("weight-only", weight_only), ("VNNI", vnni)][: 1 + kernel.int8_vnni]:
        same = (fn(x, quantized[0]).argmax(1) == want).float().mean().item()
        result[f"argmax kept, int8 {name} (512 random rows)"] = round(same, 4)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--int8-head", action="store_true", help="the drafts' head only (ms)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernel = cpu_kernels()
    if args.int8_head:
        assert kernel is not None, "the compiled CPU kernels did not build"
        print(record("linear_int8_head", {"threads": args.threads, "ms": int8_head(kernel)}))
        return
    result = {}
    for n, k in SHAPES:
        weights = [torch.randn(n, k) for _ in range(max(2, 300_000_000 // (n * k * 4)))]
        packed = [kernel.pack_panels(w) for w in weights] if kernel is not None else []
        for rows in ROWS:
            got = speeds(weights, packed, torch.randn(rows, k), kernel)
            result[f"{n}x{k}, {rows} rows"] = got
            print(f"W {n}x{k}, {rows:2d} rows: {got}", flush=True)
    print(record("linear_paths", {"threads": args.threads, "read_gb_s": result}))


if __name__ == "__main__":
    main()
