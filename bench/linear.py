"""Read bandwidth of y = x @ W.T on CPU for a few rows of x, by path: F.linear (MKL), W @ x.T,
and the compiled kernels (kernels/cpu/gemm.cpp: the dot tiles reading W in place, which the
routed experts take, and the panel tiles over a packed copy, which the dense projections take);
on the projection shapes of the `small` preset, with weights that are not in cache (a rotation of
copies larger than the last-level cache). It picks kernels/linear.py's switches.

    .venv/bin/python -m bench.linear [--threads 2]
"""

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from bench.common import record
from kernels.cpu.build import cpu_kernels

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    kernel = cpu_kernels()
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
