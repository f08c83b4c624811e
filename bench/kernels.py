"""The Triton kernels against their torch references on a GPU, at decode shapes of the `small`
preset and of DeepSeek-V3, in bf16.

    .venv/bin/python -m bench.kernels [--batch 32 256] [--context 4096]

Per op and shape: the median time of each path (triton.testing.do_bench), the speed-up and the
largest difference from the reference. MoE rows: V3 as one rank of EP 8 (32 expert slots, about
one row per token), `small` with all 32 experts local (4 rows per token); counts drawn at random.
Then the `small` engine's decode step eager and from CUDA graphs (EngineConfig.cuda_graph) at
batch 1, 8 and 32. Writes bench/results/kernels.json. Without CUDA it prints that it needs a GPU
and exits 0: there is nothing to time, which is not a failure.
"""

import argparse
import sys

import torch

# name: (hidden, moe intermediate, slots, rows per token, heads, kv_lora_rank, rope dims,
#        experts, groups, topk_group, top_k)
SHAPES = {
    "small": (768, 384, 32, 4, 12, 256, 32, 32, 4, 2, 4),
    "deepseek-v3": (7168, 2048, 32, 1, 128, 512, 64, 256, 8, 4, 8),
}
PAGE = 64  # cache block size on GPUs


def timed(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")


def compare(name: str, ref_fn, triton_fn, diff) -> dict:
    ref_ms, triton_ms = timed(ref_fn), timed(triton_fn)
    err = diff(ref_fn(), triton_fn())
    print(
        f"{name:<44} reference {ref_ms:8.3f} ms  triton {triton_ms:8.3f} ms  "
        f"x{ref_ms / triton_ms:6.1f}  max diff {err:.3g}"
    )
    return {"reference_ms": ref_ms, "triton_ms": triton_ms, "max_abs_diff": err}


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def bench_moe(shape: tuple, tokens: int, fp8: bool) -> dict:
    from kernels import moe_mlp
    from kernels.fp8 import quantize_block_fp8

    hidden, inter, slots, rows_per_token = shape[:4]
    rows = tokens * rows_per_token
    counts = torch.bincount(torch.randint(0, slots, (rows,)), minlength=slots).tolist()
    x = torch.randn(rows, hidden, device="cuda", dtype=torch.bfloat16)
    w13 = torch.randn(slots, 2 * inter, hidden, device="cuda") / hidden**0.5
    w2 = torch.randn(slots, hidden, inter, device="cuda") / inter**0.5
    if not fp8:
        w13, w2 = w13.bfloat16(), w2.bfloat16()
        return compare(
            f"moe mlp   N={rows:<5} S={slots} H={hidden} I={inter}",
            lambda: moe_mlp.grouped_expert_mlp_ref(x, counts, w13, w2),
            lambda: moe_mlp.grouped_expert_mlp_triton(x, counts, w13, w2),
            max_diff,
        )
    gate_up = [[quantize_block_fp8(w[:inter]), quantize_block_fp8(w[inter:])] for w in w13]
    w13_q = torch.stack([torch.cat([g[0], u[0]]) for g, u in gate_up])
    w13_s = torch.stack([torch.cat([g[1], u[1]]) for g, u in gate_up])
    w2_q, w2_s = (torch.stack(t) for t in zip(*(quantize_block_fp8(w) for w in w2)))
    return compare(
        f"moe fp8   N={rows:<5} S={slots} H={hidden} I={inter}",
        lambda: moe_mlp.grouped_expert_mlp_fp8_ref(x, counts, w13_q, w13_s, w2_q, w2_s),
        lambda: moe_mlp.grouped_expert_mlp_triton(x, counts, w13_q, w2_q, w13_s, w2_s),
        max_diff,
    )


def bench_mla(shape: tuple, seqs: int, context: int) -> dict:
    from kernels import mla_attention

    heads, rank, rope = shape[4:7]
    blocks_per_seq = -(-context // PAGE)
    cache = torch.randn(seqs * blocks_per_seq, PAGE, rank + rope, device="cuda").bfloat16()
    tables = torch.randperm(seqs * blocks_per_seq, device="cuda").view(seqs, blocks_per_seq)
    lens = torch.full((seqs,), context, device="cuda")
    q = torch.randn(seqs, heads, rank + rope, device="cuda").bfloat16()
    args = (q, cache, tables, lens, (rank + rope) ** -0.5, rank)
    return compare(
        f"mla decode N={seqs:<4} L={context} H={heads} R={rank}",
        lambda: mla_attention.paged_latent_attention_ref(*args),
        lambda: mla_attention.paged_latent_attention_triton(*args),
        max_diff,
    )


def bench_gate(shape: tuple, tokens: int) -> dict:
    from kernels import gate

    experts, groups, topk_group, top_k = shape[7:]
    logits = torch.randn(tokens, experts, device="cuda")
    bias = 0.1 * torch.randn(experts, device="cuda")
    args = (logits, top_k, "sigmoid", "noaux_tc", groups, topk_group, True, 2.5, bias)

    def diff(ref, out) -> float:  # same experts per token (compared as sets) and their weights
        (ref_w, ref_i), (w, i) = ref, out
        ref_i, ref_order = ref_i.sort(1)
        i, order = i.sort(1)
        if not torch.equal(ref_i, i):
            return float("inf")
        return max_diff(ref_w.gather(1, ref_order), w.gather(1, order))

    return compare(
        f"gate      T={tokens:<5} E={experts} G={groups}/{topk_group} K={top_k}",
        lambda: gate.grouped_topk_ref(*args),
        lambda: gate.grouped_topk_triton(*args),
        diff,
    )


def bench_decode_graphs(model: str, batches: list[int], steps: int = 64) -> dict:
    """The engine's decode step eager and replayed from CUDA graphs (EngineConfig.cuda_graph),
    side by side: B requests of 128 random prompt tokens, `steps` greedy tokens; the median step
    and whether the tokens agree."""
    import statistics
    import time

    from bench.common import workload
    from engine import EngineConfig, SamplingParams
    from engine.llm_engine import LLMEngine

    engines = {
        graphs: LLMEngine(EngineConfig(model=model, device="cuda", cuda_graph=graphs,
                                       cuda_graph_max_batch=max(batches)))
        for graphs in (False, True)
    }  # fmt: skip
    vocab = engines[False].model.config.vocab_size
    params = SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
    results = {}
    for batch in batches:
        prompts = [p for p, _ in workload(batch, (128, 128), (1, 1), vocab, batch)]
        step_ms, tokens = {}, {}
        for graphs, engine in engines.items():
            for i, prompt in enumerate(prompts):
                engine.add_request(f"{batch}-{i}", prompt, params)
            engine.step()  # the prefill
            times, out = [], {}
            while engine.has_unfinished():
                torch.cuda.synchronize()
                start = time.perf_counter()
                for delta in engine.step().outputs:
                    out.setdefault(delta.request_id, []).extend(delta.token_ids)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
            step_ms[graphs], tokens[graphs] = statistics.median(times) * 1e3, out
        same = tokens[False] == tokens[True]
        print(
            f"{model} decode step, batch {batch:<4} eager {step_ms[False]:8.3f} ms  "
            f"graphs {step_ms[True]:8.3f} ms  x{step_ms[False] / step_ms[True]:5.2f}  "
            f"same tokens: {same}"
        )
        results[batch] = {"eager_ms": step_ms[False], "graphs_ms": step_ms[True], "same": same}
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, nargs="+", default=[32, 256], help="decode batch sizes")
    ap.add_argument("--context", type=int, nargs="+", default=[4096], help="context lengths")
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench.kernels needs a CUDA GPU, and this machine has none: nothing timed.")
        return 0
    from bench.common import record

    torch.manual_seed(0)
    results = {}
    for name in args.shapes:
        shape = SHAPES[name]
        print(f"== {name}")
        for batch in args.batch:
            results[f"{name}/moe/{batch}"] = bench_moe(shape, batch, fp8=False)
            results[f"{name}/moe_fp8/{batch}"] = bench_moe(shape, batch, fp8=True)
            results[f"{name}/gate/{batch}"] = bench_gate(shape, batch)
            for context in args.context:
                results[f"{name}/mla/{batch}x{context}"] = bench_mla(shape, batch, context)
            torch.cuda.empty_cache()
    results["decode_graphs/small"] = bench_decode_graphs("small", [1, 8, 32])
    path = record("kernels", {"device": torch.cuda.get_device_name(), "results": results})
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
