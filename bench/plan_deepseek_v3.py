"""DeepSeek-V3 on H800 with DeepSeek's published deployment, predicted by `epcluster plan`'s
model, beside DeepSeek's published figures (Inference System Overview, Mar 2025) with the
relative error. Nothing is fitted to those figures: the hardware numbers are datasheets and
the V3 report's link rates, the kernel efficiencies are published kernel benchmarks, and the
workload comes from the published daily totals (cluster/plan/workload.py, "deepseek-v3-day").

    .venv/bin/python -m bench.plan_deepseek_v3 [--samples 20000]
"""

import argparse
import time

from bench.common import record
from cluster.plan.hardware import CATALOG
from cluster.plan.memory import RESERVE_FRACTION
from cluster.plan.models import load_model
from cluster.plan.planner import REDUNDANT_SHARE, ModelCosts, make_plan
from cluster.plan.search import MAX_UTILISATION, Grid
from cluster.plan.workload import BUILTIN

PUBLISHED = {
    "prefill_tokens_per_s_per_node": 73.7e3,  # input tokens incl. cache hits, day average
    "decode_tokens_per_s_per_node": 14.8e3,  # output tokens, day average
    "nodes": 226.75,  # average nodes in use over the day (peak 278)
    "cost_per_day_usd": 87072.0,  # at $2 per H800-hour
    "output_tokens_per_s_per_user": 21.0,  # "20-22"
}
SLO_TTFT = 5.0  # assumption: not published
SLO_TPOT = 1 / 20  # the published 20-22 tokens/s per user, as a p90 bound


def assumptions(costs: ModelCosts) -> list[str]:
    e, unit = costs.hw.efficiency, costs.unit(32)
    return [
        f"kernel efficiencies: HBM {e.memory}, tensor-core {e.compute}, links {e.link} of peak "
        "(cluster/plan/hardware.py: STREAM-like reads, DeepGEMM and DeepEP's published "
        "kernel benchmarks)",
        f"fp8 weights, bf16 latent cache, fp8 dispatch / bf16 combine; EPLB imbalance "
        f"{unit.imbalance} (max / mean rank load); per-step overhead {unit.step_overhead_s} s",
        f"redundant experts: the fewest >= {REDUNDANT_SHARE:.3f} of the experts that spread "
        "evenly (gives DeepSeek's 32 for EP32 and EP144)",
        f"memory reserve {RESERVE_FRACTION:.0%} of each GPU; the rest after weights and "
        "activations is KV cache",
        "workload: prompt 4,390 / output 1,213 tokens per request (from 608B in, 168B out and "
        "the 4,989-token mean KV length), lognormal sigma 1, 56.3% prefix hits, 1,603 req/s",
        f"SLOs: p90 TPOT {SLO_TPOT} s (the published per-user speed), p90 TTFT {SLO_TTFT} s "
        f"(not published); pools sized to at most {MAX_UTILISATION} utilisation",
        "no MTP speculation (the published figures do not say whether it was on)",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=20000)
    args = parser.parse_args()
    costs = ModelCosts(load_model("deepseek-v3"), CATALOG["H800"], gpus_per_node=8)
    work = BUILTIN["deepseek-v3-day"]
    start = time.perf_counter()
    plan = make_plan(costs, work, SLO_TTFT, SLO_TPOT, Grid(prefill_nodes=(4,), decode_nodes=(18,)),
                     samples=args.samples)  # fmt: skip
    seconds = time.perf_counter() - start
    s = plan.summary()
    predicted = {
        "prefill_tokens_per_s_per_node": s["prefill_tokens_per_s_per_node"],
        "decode_tokens_per_s_per_node": s["decode_tokens_per_s_per_node"],
        "nodes": s["prefill_nodes"] + s["decode_nodes"],
        "cost_per_day_usd": s["cost_per_day_usd"],
        "output_tokens_per_s_per_user": 1 / s["tpot_s"],
    }
    rows = {
        k: {"predicted": predicted[k], "published": v, "relative_error": predicted[k] / v - 1}
        for k, v in PUBLISHED.items()
    }
    print(f"{'figure':34}{'predicted':>14}{'published':>14}{'error':>9}")
    for k, r in rows.items():
        print(f"{k:34}{r['predicted']:>14,.1f}{r['published']:>14,.1f}{r['relative_error']:>+9.0%}")
    p_cap = s["prefill_capacity_tokens_per_s_per_node"]
    d_cap = s["decode_capacity_tokens_per_s_per_node"]
    print(f"capacity per node at the chosen step: prefill {p_cap:,.0f}, decode {d_cap:,.0f} tok/s")
    print(f"planned (search + simulated day) in {seconds:.1f} s")
    path = record(
        "plan_deepseek_v3",
        {
            "deployment": "prefill EP32 units of 4 nodes, decode EP144 units of 18 nodes, "
            "32 redundant experts, 8 x H800 per node",
            "comparison": rows,
            "plan": s,
            "prefill_step_s": plan.prefill_step.time_s,
            "decode_step_s": plan.decode_step.time_s,
            "plan_seconds": seconds,
            "assumptions": assumptions(costs),
        },
    )
    print(f"recorded {path}")


if __name__ == "__main__":
    main()
