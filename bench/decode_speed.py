"""Decode speed of one engine (issue 12's method, llama.cpp's `llama-batched-bench -npp 128
-ntg 128 -npl 1,8,32`): B requests of 128 random prompt tokens, 128 greedy output tokens each
(ignore_eos), decode tok/s = B x 127 / decode time (from every request having its first token to
the last token); prefill tok/s of the B x 128 prompt tokens. Beside them: the machine's measured
read bandwidth, and at each batch the roofline of a decode step: the bytes it must read (every
dense weight, and the routed experts the step actually used, each once, as counted by the
dispatchers, and the latent cache the attention reads at the decode's mean context) over that
bandwidth, or the step's multiply-adds (2 x the weights a token uses x B, and the attention's)
over the machine's measured fp32 peak (the fastest of MKL's large sgemm and the compiled kernels
on weights in cache), whichever takes longer.

The bandwidth of a shared machine moves with its neighbours' load (36 to 71 GB/s was seen here
within an hour, seconds apart), so it is measured two ways: before every batch and after the
last (the roofline takes the best: "fraction_of_roofline"; the fp32 peak, which moves too, is
measured at the same times, the best taken), and between windows of 16 decode
steps (a 256 MB read, its time left out of the decode time), each window's median step against
the better of the two probes around it ("fraction_of_roofline_by_window": median, min and max
over the windows of every run).

    .venv/bin/python -m bench.decode_speed [--model small] [--batches 1 8 32] [--threads 2]
"""

import argparse
import statistics
import time

import torch

from bench.common import record, workload
from engine import EngineConfig, SamplingParams
from engine.config import DRAFT_HEADS, SpeculativeConfig
from engine.llm_engine import LLMEngine

PROBE_GIB = 0.25  # the probes between decode windows: ~10 ms each at 40 GB/s


def read_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes per second a sum over a large fp32 tensor reads (best of `repeats`)."""
    x = torch.ones(int(gib * 2**28))
    x.sum()
    best = min(_timed(lambda: x.sum()) for _ in range(repeats))
    return x.numel() * 4 / best


def peak_flops(repeats: int = 5) -> float:
    """fp32 multiply-add FLOP/s: the best of MKL's sgemm on 2048^3 and the compiled kernels
    (kernels/cpu/build.py) on weights that stay in cache: the dot tiles at 96 rows x 3 MB, the panel
    tiles (what the dense projections take) at 32, 96 and 256 rows x 1.5 MB."""
    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    a @ b
    best = 2 * 2048**3 / min(_timed(lambda: a @ b) for _ in range(repeats))
    from kernels.cpu.build import cpu_kernels

    kernel = cpu_kernels()
    if kernel is not None:
        w = torch.randn(1024, 768)
        p = kernel.pack_panels(w[:512].contiguous())
        cases = [(96, 1024, lambda x: kernel.linear(x, w))]
        cases += [(rows, 512, lambda x: kernel.linear_panels(x, p, 512)) for rows in (32, 96, 256)]
        for rows, n, fn in cases:
            x = torch.randn(rows, 768)
            fn(x)
            seconds = min(_timed(lambda: [fn(x) for _ in range(20)]) for _ in range(repeats))  # noqa: B023
            best = max(best, 20 * 2 * rows * 768 * n / seconds)
    return best


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def weight_bytes(model) -> tuple[int, int, int]:
    """(dense bytes read per step (all but the routed experts and the embedding), bytes of one
    routed expert, number of MoE layers)."""
    expert_params = dense = 0
    for name, p in model.named_parameters():
        if ".experts." in name:
            expert_params += p.numel() * p.element_size()
        elif "embed_tokens" not in name:
            dense += p.numel() * p.element_size()
    layers = list(model.moe_layers())
    per_expert = expert_params // sum(len(m.experts.expert_ids) for m in layers)
    return dense, per_expert, len(layers)


def attention_cost(config, batch: int, itemsize: int, prompt: int = 128, output: int = 128):
    """(bytes of latent cache, FLOPs) the absorbed attention of one decode step needs, at the
    decode's mean context: each sequence reads its cached rows once per layer; per head and key
    a score over C numbers and a weighted sum over Dc, plus q_nope W_UK and W_UV per head."""
    c = config
    context = prompt + output / 2
    width, rank = c.kv_cache_width, c.kv_lora_rank
    kv_bytes = batch * context * width * itemsize * c.num_hidden_layers
    per_token = c.num_attention_heads * (
        context * (width + rank) + rank * (c.qk_nope_head_dim + c.v_head_dim)
    )
    return kv_bytes, 2 * batch * per_token * c.num_hidden_layers


def used_experts(model) -> list[int]:
    """The slots each MoE layer's dispatcher has counted any token for (since the last reset)."""
    return [int((m.dispatcher.load.peek() > 0).sum()) for m in model.moe_layers()]


def reset_load(model) -> None:
    for m in model.moe_layers():
        m.dispatcher.load.take()


def run_batch(engine: LLMEngine, batch: int, vocab: int, seed: int, window: int = 16) -> dict:
    """One batch to the end. Every `window` decode steps (and before the first) the read
    bandwidth is probed (`read_bandwidth(PROBE_GIB)`, its time left out of the decode time):
    "windows" holds each window's median step and the better of the probes around it."""
    requests = workload(batch, (128, 128), (128, 128), vocab, seed)
    params = SamplingParams(max_tokens=128, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    for i, (prompt, _) in enumerate(requests):
        engine.add_request(f"{seed}-{i}", prompt, params)
    tokens: dict[str, list[int]] = {f"{seed}-{i}": [] for i in range(batch)}
    first_all = None
    decode_steps, experts_per_step, probes, probing_s = [], [], [], 0.0
    while engine.has_unfinished():
        if first_all is not None:
            if len(decode_steps) % window == 0:
                t0 = time.perf_counter()
                probes.append(read_bandwidth(PROBE_GIB, repeats=2))
                probing_s += time.perf_counter() - t0
            reset_load(engine.model)
        t0 = time.perf_counter()
        out = engine.step().outputs
        t1 = time.perf_counter()
        for delta in out:
            tokens[delta.request_id] += delta.token_ids
        if first_all is not None:
            decode_steps.append(t1 - t0)
            experts_per_step.append(sum(used_experts(engine.model)))
        elif all(tokens.values()):
            first_all = t1
    end = time.perf_counter()
    assert all(len(t) == 128 for t in tokens.values()), {r: len(t) for r, t in tokens.items()}
    probes.append(read_bandwidth(PROBE_GIB, repeats=2))
    windows = [
        (statistics.median(decode_steps[i : i + window]), max(probes[k], probes[k + 1]))
        for k, i in enumerate(range(0, len(decode_steps), window))
    ]
    return {
        "prefill_s": first_all - start,
        "decode_s": end - first_all - probing_s,
        "decode_step_ms_median": statistics.median(decode_steps) * 1e3,
        "experts_used_per_step": statistics.median(experts_per_step),
        "windows": windows,
        "tokens": tokens,  # request id -> its 128 output tokens
    }


def batch_arguments(doc: str, default_name: str, speculative: bool = False) -> argparse.Namespace:
    """The command line of the decode benchmarks (this one and bench.vs_llama_cpp;
    speculative: the options of MTP speculative decoding too)."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    if speculative:
        ap.add_argument(
            "--draft-tokens", type=int, nargs="+", default=[0],
            help="MTP draft tokens per step to run the engine with (0: off), side by side",
        )  # fmt: skip
        ap.add_argument(
            "--mtp-model",
            help="the checkpoint with an MTP layer for draft tokens > 0 (default: small's "
            "self-distilled head, built once by tools.small_mtp, or the model itself)",
        )
        ap.add_argument(
            "--draft-head", nargs="+", default=["auto"], choices=DRAFT_HEADS,
            help="the head of the drafts' logits (SpeculativeConfig.draft_head); several: an "
            "engine per k and head, side by side",
        )  # fmt: skip
        ap.add_argument(
            "--oracle-acceptance", type=float,
            help="also run each k > 0 with a drafter right at this seeded fraction of positions "
            "(knowing the plain run's tokens): the speed at that acceptance, e.g. 0.85",
        )  # fmt: skip
    ap.add_argument("--model", default="small")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--name", default=None, help=f"result file name (default {default_name})")
    ap.add_argument(
        "--python-layers",
        action="store_true",
        help="the Python decoder layers, not the fused ones (engine/cpu_decode.py)",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    return args


def decode_engine(
    model: str,
    python_layers: bool = False,
    speculative: SpeculativeConfig | None = None,
    greedy_head: str = "auto",
) -> LLMEngine:
    """An engine for up to 64 requests of 128 + 128 tokens, no prefix caching (python_layers:
    the fused decode layers off; speculative: MTP drafts, the checkpoint must have its layer;
    greedy_head: EngineConfig's)."""
    engine = LLMEngine(
        EngineConfig(model=model, max_num_seqs=64, max_num_batched_tokens=4096,
                     enable_prefix_caching=False, speculative=speculative,
                     greedy_head=greedy_head)
    )  # fmt: skip
    if python_layers:
        engine.runner.cpu_decode = None  # the runner's choice: the Python layers
    return engine


def main() -> None:
    args = batch_arguments(__doc__, "decode_speed_MODEL")
    engine = decode_engine(args.model, args.python_layers)
    vocab = engine.model.config.vocab_size
    top_k = engine.model.config.num_experts_per_tok
    itemsize = engine.model.lm_head.weight.element_size()
    dense, per_expert, num_moe = weight_bytes(engine.model)
    run_batch(engine, 2, vocab, seed=999)  # warm-up
    # NOTE: the read bandwidth of this shared machine moved between 36 and 62 GB/s within an
    # hour: it is measured before every batch and after the last, and the roofline takes the
    # best (the machine's attainable peak; the fraction at the median is beside it). The fp32
    # peak moves with the neighbours too (341 to 403 GFLOP/s seen): measured at the same times,
    # the best taken.
    bandwidths, peaks, all_runs = [], [], {}
    for batch in args.batches:
        bandwidths.append(read_bandwidth())
        peaks.append(peak_flops())
        all_runs[batch] = [
            run_batch(engine, batch, vocab, seed=batch * 10 + r) for r in range(args.repeats)
        ]
    bandwidths.append(read_bandwidth())
    peaks.append(peak_flops())
    bandwidth, typical, peak = max(bandwidths), statistics.median(bandwidths), max(peaks)
    rows = {}
    for batch, runs in all_runs.items():
        decode = [batch * 127 / r["decode_s"] for r in runs]
        prefill = [batch * 128 / r["prefill_s"] for r in runs]
        step_ms = statistics.median(r["decode_step_ms_median"] for r in runs)
        experts = statistics.median(r["experts_used_per_step"] for r in runs)
        kv_bytes, attention_flops = attention_cost(engine.model.config, batch, itemsize)
        read = dense + experts * per_expert + kv_bytes
        flops = 2 * batch * (dense + top_k * num_moe * per_expert) / itemsize + attention_flops
        roofline_s = max(read / bandwidth, flops / peak)
        at_typical_s = max(read / typical, flops / peak)
        # each window against the bandwidth probed around it (the same bytes and FLOPs a step)
        windowed = [max(read / bw, flops / peak) / step for r in runs for step, bw in r["windows"]]
        window_bw = [bw for r in runs for _, bw in r["windows"]]
        rows[str(batch)] = {
            "decode_tok_s": [round(x, 1) for x in decode],
            "prefill_tok_s": [round(x, 1) for x in prefill],
            "decode_step_ms": round(step_ms, 1),
            "experts_used_per_step": experts,
            "experts_per_moe_layer": round(experts / num_moe, 1),
            "kv_cache_mb_per_step": round(kv_bytes / 1e6, 1),
            "roofline_memory_ms": round(read / bandwidth * 1e3, 1),
            "roofline_compute_ms": round(flops / peak * 1e3, 1),
            "roofline_step_ms": round(roofline_s * 1e3, 1),
            "roofline_tok_s": round(batch / roofline_s, 1),
            "fraction_of_roofline": round(roofline_s * 1e3 / step_ms, 3),
            "fraction_of_roofline_by_tok_s": round(
                statistics.median(decode) * roofline_s / batch, 3
            ),
            "fraction_at_median_bandwidth": round(at_typical_s * 1e3 / step_ms, 3),
            "fraction_of_roofline_by_window": {
                "median": round(statistics.median(windowed), 3),
                "min": round(min(windowed), 3),
                "max": round(max(windowed), 3),
                "windows": len(windowed),
                "bandwidth_gb_s_min_max": [
                    round(min(window_bw) / 1e9, 1),
                    round(max(window_bw) / 1e9, 1),
                ],
            },
        }
        print(batch, rows[str(batch)], flush=True)
    result = {
        "model": args.model,
        "threads": args.threads,
        "fused_decode_layers": not args.python_layers,
        "read_bandwidth_gb_s": round(bandwidth / 1e9, 1),
        "read_bandwidths_measured_gb_s": [round(b / 1e9, 1) for b in bandwidths],
        "peak_fp32_gflop_s": round(peak / 1e9, 1),
        "peaks_measured_gflop_s": [round(p / 1e9, 1) for p in peaks],
        "dense_weight_mb": round(dense / 1e6, 1),
        "expert_mb": round(per_expert / 1e6, 2),
        "batches": rows,
    }
    print(record(args.name or f"decode_speed_{args.model}", result))


if __name__ == "__main__":
    main()
