"""`epcluster plan`: the parser, the one function the CLI calls, and the table (plain text) or
JSON it prints."""

import argparse
import json
from dataclasses import replace

from cluster.plan.cost import StepCost
from cluster.plan.memory import GIB, MemoryPlan
from cluster.plan.models import load_model, model_names
from cluster.plan.planner import ModelCosts, Plan, make_plan
from cluster.plan.probe import get_hardware
from cluster.plan.routing import load_expert_tokens
from cluster.plan.search import Grid
from cluster.plan.workload import BUILTIN, load_workload


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    plan = sub.add_parser(
        "plan", help="nodes, EP sizes, batch, SLOs and cost of a deployment (docs/planning.md)"
    )
    plan.add_argument("--model", required=True, help=f"{model_names()} or a checkpoint dir")
    plan.add_argument("--gpu", required=True, help="H800, H100, H200, B200, or cpu (measured)")
    plan.add_argument("--gpus-per-node", type=int, default=8)
    plan.add_argument(
        "--workload", required=True, help=f"{sorted(BUILTIN)}, a stats JSON or a trace.jsonl"
    )
    plan.add_argument("--rate", type=float, help="requests/s (default: the workload's)")
    plan.add_argument("--slo-ttft", type=float, default=5.0, help="p90 seconds to first token")
    plan.add_argument("--slo-tpot", type=float, default=0.05, help="p90 seconds per output token")
    plan.add_argument(
        "--prefill-nodes", type=int, help="nodes per prefill unit (EP = nodes x gpus per node)"
    )
    plan.add_argument("--decode-nodes", type=int, help="nodes per decode unit")
    plan.add_argument("--dtype", choices=["fp8", "bf16", "fp32"], help="weights (GPU: fp8)")
    plan.add_argument("--kv-dtype", choices=["fp8", "bf16", "fp32"], help="KV (GPU: bf16)")
    plan.add_argument(
        "--expert-load",
        metavar="JSON",
        help='routing statistics, {"tokens_per_expert": [[...], ...]} per MoE layer: the EPLB '
        "imbalance of each EP size comes from them (default: an assumed 1.05)",
    )
    plan.add_argument("--samples", type=int, default=20000, help="requests simulated")
    plan.add_argument("--json", action="store_true", help="print one JSON object")
    plan.set_defaults(func=run_plan)


def build_plan(args: argparse.Namespace) -> Plan:
    hw = get_hardware(args.gpu)
    cpu = hw.name == "cpu"
    model = load_model(args.model)
    tokens = None
    if args.expert_load:
        tokens = load_expert_tokens(args.expert_load, model.config.n_routed_experts)
    costs = ModelCosts(
        model, hw, args.gpus_per_node,
        args.dtype or ("fp32" if cpu else "fp8"), args.kv_dtype or ("fp32" if cpu else "bf16"),
        expert_tokens=tokens,
    )  # fmt: skip
    work = load_workload(args.workload)
    if args.rate:
        work = work.scaled(args.rate)
    grid = Grid(gpus_per_node=args.gpus_per_node)
    if cpu:  # ranks that are processes on one machine: a few, with small steps
        grid = Grid(
            (1, 2), (1, 2), (128, 256, 512, 1024), (1, 2, 4, 8, 16, 32, 64), grid.gpus_per_node
        )
    # NOTE: a given pool that cannot fit even its smallest step is refused with the memory
    # plan's numbers (MemoryPlanError), before any search
    if args.prefill_nodes:
        grid = replace(grid, prefill_nodes=(args.prefill_nodes,))
        costs.memory(args.prefill_nodes * grid.gpus_per_node, min(grid.chunks), work.prompt_mean)
    if args.decode_nodes:
        grid = replace(grid, decode_nodes=(args.decode_nodes,))
        batch = min(grid.batches)
        context = batch * (work.prompt_mean + work.output_mean)
        costs.memory(args.decode_nodes * grid.gpus_per_node, batch, context)
    return make_plan(costs, work, args.slo_ttft, args.slo_tpot, grid, samples=args.samples)


def run_plan(args: argparse.Namespace) -> int:
    plan = build_plan(args)
    if args.json:
        print(json.dumps(plan_json(plan), indent=1))
    else:
        print(format_plan(plan, args))
    return 0


def plan_json(plan: Plan) -> dict:
    out = dict(plan.summary())
    out["roofline"] = {
        "prefill": _roofline(plan.prefill_step),
        "decode": _roofline(plan.decode_step),
    }
    out["memory_gib"] = {
        "prefill": _memory(plan.prefill_memory),
        "decode": _memory(plan.decode_memory),
    }
    return out


def _roofline(step: StepCost) -> dict:
    phases = {
        name: {"bytes": p.bytes, "flops": p.flops, "memory_s": p.memory_s, "compute_s": p.compute_s}
        for name, p in step.phases.items()
    }
    return {
        "tokens": step.tokens, "phases": phases, "compute_s": step.compute_s,
        "all_to_all_s": step.comm_s, "hidden_s": step.hidden_comm_s,
        "overhead_s": step.overhead_s, "step_s": step.time_s,
    }  # fmt: skip


def _memory(m: MemoryPlan) -> dict:
    gib = ("replicated_weights", "expert_weights", "activations", "reserve", "kv_cache")
    out = {name: getattr(m, name) / GIB for name in gib}
    return {**out, "kv_tokens": m.kv_tokens, "headroom": m.headroom / GIB, "gpu": m.gpu_bytes / GIB}


def _ms(s: float | None) -> str:
    return "-" if s is None else f"{1000 * s:.1f} ms"


def format_plan(plan: Plan, args: argparse.Namespace) -> str:
    s, w, d = plan.summary(), plan.workload, plan.deployment
    lines = [
        f"plan: {args.model} on {args.gpu} x{args.gpus_per_node} per node; workload {w.name}: "
        f"{w.rate:.4g} req/s, prompt {w.prompt_mean:.0f} (hit {w.prefix_hit:.0%}), output "
        f"{w.output_mean:.0f} tokens; SLO p90 TTFT {plan.slo_ttft} s, TPOT {plan.slo_tpot} s",
        "",
        f"{'pool':8}{'EP':>5}{'nodes/unit':>12}{'units':>7}{'nodes':>7}  step size",
        f"{'prefill':8}{d.prefill.ep:>5}{d.prefill.nodes_per_unit:>12}{d.prefill.units:>7}"
        f"{d.prefill.nodes:>7}  {d.prefill.size} tokens per GPU per step",
        f"{'decode':8}{d.decode.ep:>5}{d.decode.nodes_per_unit:>12}{d.decode.units:>7}"
        f"{d.decode.nodes:>7}  batch {d.decode.size} per GPU",
        f"P:D nodes = {d.prefill.nodes}:{d.decode.nodes}",
        "",
        "roofline of one rank's step (time = max(bytes / bandwidth, FLOPs / peak) per phase)",
    ]
    for name, step in (("prefill", plan.prefill_step), ("decode", plan.decode_step)):
        lines.append(f"  {name}, {step.tokens} tokens per rank:")
        lines.append(f"    {'phase':11}{'GB read':>10}{'TFLOP':>10}{'memory':>11}{'compute':>11}")
        for pname, p in step.phases.items():
            lines.append(
                f"    {pname:11}{p.bytes / 1e9:>10.3f}{p.flops / 1e12:>10.3f}"
                f"{_ms(p.memory_s):>11}{_ms(p.compute_s):>11}  {p.bound}-bound"
            )
        lines.append(
            f"    compute {_ms(step.compute_s)} + all-to-all {_ms(step.comm_s)} - hidden by "
            f"two-batch overlap {_ms(step.hidden_comm_s)} + overhead {_ms(step.overhead_s)} "
            f"= step {_ms(step.time_s)}"
        )
    lines += ["", "memory per GPU"]
    for name, m in (("prefill", plan.prefill_memory), ("decode", plan.decode_memory)):
        lines.append(f"  {name}: {m.describe()}")
    lines += [
        "",
        f"prefill {s['prefill_tokens_per_s_per_node']:,.0f} input tok/s per node at this load "
        f"(capacity {s['prefill_capacity_tokens_per_s_per_node']:,.0f}, cache hits included)",
        f"decode  {s['decode_tokens_per_s_per_node']:,.0f} output tok/s per node at this load "
        f"(capacity {s['decode_capacity_tokens_per_s_per_node']:,.0f} at batch {d.decode.size})",
        f"TTFT p50 {_ms(s['ttft_s'])}, p90 {_ms(s['ttft_p90_s'])}; TPOT p50 {_ms(s['tpot_s'])}, "
        f"p90 {_ms(s['tpot_p90_s'])}; e2e p50 {s['e2e_s']:.2f} s; goodput "
        f"{s['goodput_rps']:.4g} of {s['rate_rps']:.4g} req/s; {s['preemptions_simulated']} "
        "preemptions",
        f"cost ${s['cost_per_day_usd']:,.0f} per day; ${s['cost_per_million_input_tokens_usd']:.4f}"
        f" per million input tokens, ${s['cost_per_million_output_tokens_usd']:.4f} per million "
        "output tokens",
        f"(simulated {s['sampled_requests']} sampled requests of the day's "
        f"{s['requests_per_day']:,.0f} on one representative rank per pool, scaled by the ranks)",
    ]
    return "\n".join(lines)
