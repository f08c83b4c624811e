"""Where a decode step's time goes (issue 12's regions): routed experts, paged latent attention,
the rest of attention, lm_head, shared experts, the gate and the rest of the forward, and
everything outside the forward (scheduling, sampling, bookkeeping). One engine decodes
`--batch` requests of 128 random prompt tokens; the regions are timed by wrapping the functions
that compute them (CPU: host clocks are the compute time), over `--steps` decode steps of the
Python layers; the same number of steps of the fused decode layers (engine/cpu_decode.py) before
them gives the step time without the layer glue (fused_layers_step_ms).

    .venv/bin/python -m bench.step_profile [--model small] [--batch 32] [--steps 30] [--name N]
"""

import argparse
import collections
import functools
import time

import torch

import moe.attention
import moe.layers
from bench.common import record, workload
from engine import EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine

spent: collections.Counter = collections.Counter()


def timed(region: str, fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[region] += time.perf_counter() - start

    return run


def instrument(engine: LLMEngine) -> None:
    """Wrap the region functions (instances and module attributes the model calls)."""
    # NOTE: mla_decode is the absorbed decode: W_UK, the paged attention and W_UV (one call of
    # the compiled kernel on CPU); the W_UK / W_UV multiplies were "other attention" before it.
    moe.attention.mla_decode = timed("paged attention", moe.attention.mla_decode)
    model = engine.model
    model.compute_logits = timed("lm_head", model.compute_logits)
    for module in model.modules():
        if isinstance(module, moe.attention.MLAttention):
            module.forward = timed("attention (all)", module.forward)
        elif isinstance(module, moe.layers.MoE):
            module.experts.forward = timed("routed experts", module.experts.forward)
            if module.shared_experts is not None:
                module.shared_experts.forward = timed(
                    "shared experts", module.shared_experts.forward
                )
            module.gate.forward = timed("gate", module.gate.forward)
        elif isinstance(module, moe.layers.MLP) and module not in [
            m.shared_experts for m in model.moe_layers()
        ]:
            module.forward = timed("dense MLP", module.forward)
    engine.runner.forward = timed("forward (all)", engine.runner.forward)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--name", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    engine = LLMEngine(EngineConfig(model=args.model, max_num_seqs=64, max_num_batched_tokens=4096,
                                    enable_prefix_caching=False))  # fmt: skip
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=2 * args.steps + 10, temperature=0.0, ignore_eos=True)
    for i, (prompt, _) in enumerate(workload(args.batch, (128, 128), (1, 1), vocab, 0)):
        engine.add_request(str(i), prompt, params)
    for _ in range(3):  # the prefill, and a warm-up decode step
        engine.step()
    # NOTE: the regions are timed around the Python layers' calls; the fused decode layers
    # (engine/cpu_decode.py: the same kernels, one call per layer) are timed whole first.
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    fused_total = (time.perf_counter() - start) / args.steps
    engine.runner.cpu_decode = None  # from here the runner runs the Python layers
    instrument(engine)
    spent.clear()
    start = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    total = (time.perf_counter() - start) / args.steps
    per_step = {k: v / args.steps for k, v in spent.items()}
    attention_other = per_step["attention (all)"] - per_step.get("paged attention", 0.0)
    regions = {
        "routed experts": per_step.get("routed experts", 0.0),
        "paged attention": per_step.get("paged attention", 0.0),
        "other attention (projections, rope, cache write)": attention_other,
        "lm_head": per_step.get("lm_head", 0.0),
        "shared experts": per_step.get("shared experts", 0.0),
        "dense MLP (first layer)": per_step.get("dense MLP", 0.0),
        "gate": per_step.get("gate", 0.0),
    }
    forward = per_step["forward (all)"]
    regions["rest of the forward (norms, dispatch, combine, embedding)"] = forward - sum(
        v for k, v in regions.items() if k != "lm_head"
    )
    regions["outside the forward (schedule, prepare, sample, outputs)"] = (
        total - forward - regions["lm_head"]
    )
    result = {
        "model": args.model,
        "batch": args.batch,
        "steps": args.steps,
        "threads": args.threads,
        "step_ms": round(total * 1e3, 1),
        "fused_layers_step_ms": round(fused_total * 1e3, 1),
        "regions_ms": {k: round(v * 1e3, 1) for k, v in regions.items()},
        "regions_share": {k: round(v / total, 3) for k, v in regions.items()},
    }
    for k, v in result.items():
        print(f"{k}: {v}")
    print(record(args.name or f"step_profile_{args.model}_b{args.batch}", result))


if __name__ == "__main__":
    main()
