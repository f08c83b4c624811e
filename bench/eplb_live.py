"""What a live expert rebalance costs and buys: an EP = 2 decode pool of `small` (two spawned ranks,
gloo on loopback) decodes a skewed workload (prompts of six repeated tokens: their routing piles
onto a few experts), asks for a rebalance, and keeps decoding. Reported: the step time before and
after (the busiest rank sets the pace), the longest step while the rebalance ran (the pause), the
balancer's own timings, and the measured per-rank load before and after.

    .venv/bin/python -m bench.eplb_live [--batch 32] [--steps 40] [--slots 40]
"""

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from bench.common import record


def skewed_prompts(rank: int, batch: int, vocab: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1234)  # the same six tokens on both ranks
    alphabet = torch.randint(2, vocab, (6,), generator=gen)
    gen.manual_seed(rank)
    return [alphabet[torch.randint(0, 6, (128,), generator=gen)].tolist() for _ in range(batch)]


def rank_load(engine) -> list[float]:
    """Tokens this rank's dispatchers sent to each rank, summed over layers, since the reset."""
    total = torch.zeros(2)
    for m in engine.model.moe_layers():
        load = m.dispatcher.load.peek()
        if load is not None:
            total += load.float().view(2, -1).sum(1)
    return total.tolist()


def worker(rank: int, args: argparse.Namespace, port: int, out: str) -> None:
    from engine import EngineConfig, SamplingParams
    from engine.ep import build_ep_engine
    from moe import ModelConfig, resolve_model_path
    from moe.placement import Placement

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    mc = ModelConfig.from_file(resolve_model_path(args.model))
    placement = Placement.contiguous(mc.moe_layers, mc.n_routed_experts, 2, args.slots)
    config = EngineConfig(
        model=args.model,
        max_num_seqs=args.batch,
        max_num_batched_tokens=4096,
        two_batch_overlap="off",
        eplb_min_gain=0.0,
        eplb_layers_per_round=args.layers_per_round,
        eplb_max_moves=args.max_moves,
    )
    engine = build_ep_engine(config, None, rank, 2, placement)
    params = SamplingParams(max_tokens=10_000, ignore_eos=True, temperature=0)
    for i, prompt in enumerate(skewed_prompts(rank, args.batch, mc.vocab_size)):
        engine.add_request(f"{rank}-{i}", prompt, params)
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in engine.requests.values()):
        engine.step()  # prefill: from here every step decodes the whole batch
    for m in engine.model.moe_layers():
        m.dispatcher.load.take()
    steps, events, loads = [], {}, {}
    balancer = engine.balancer
    for step in range(args.steps):
        if step == args.steps // 3:
            loads["before"] = rank_load(engine)
            if rank == 0:
                balancer.request()
            events["requested"] = step
        number, moving = balancer.last.number, bool(balancer._moves)
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
        if balancer.last.number > number:
            events["planned"] = step
            for m in engine.model.moe_layers():
                m.dispatcher.load.take()
        if moving and not balancer._moves:
            events["switched"] = step
            loads["after_start"] = step
    loads["after"] = rank_load(engine)
    torch.save({"steps": steps, "events": events, "last": balancer.last, "loads": loads},
               Path(out, f"{rank}.pt"))  # fmt: skip
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=32, help="decoding requests per rank")
    ap.add_argument("--steps", type=int, default=45)
    ap.add_argument("--slots", type=int, default=40, help="physical slots per layer (40: replicas)")
    ap.add_argument("--layers-per-round", type=int, default=1)
    ap.add_argument("--max-moves", type=int, default=0, help="slots per layer (0: any)")
    args = ap.parse_args()
    from moe import resolve_model_path

    resolve_model_path(args.model)  # written once, before the ranks race to read it
    with tempfile.TemporaryDirectory() as out:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(worker, args=(args, port, out), nprocs=2, join=True)
        results = [torch.load(Path(out, f"{r}.pt"), weights_only=False) for r in range(2)]
    # lockstep: a step's time is the slower rank's
    steps = [max(a, b) for a, b in zip(results[0]["steps"], results[1]["steps"], strict=True)]
    events = results[0]["events"]
    req, done = events["requested"], events.get("switched", events.get("planned"))
    before = steps[max(0, req - 10) : req]
    during = steps[req : done + 1]
    after = steps[done + 1 : done + 11]
    last = results[0]["last"]

    def imbalance(key: str) -> float:
        per_rank = [a + b for a, b in zip(*(r["loads"][key] for r in results), strict=True)]
        return max(per_rank) / (sum(per_rank) / 2)

    result = {
        "model": args.model,
        "batch_per_rank": args.batch,
        "slots_per_layer": args.slots,
        "layers_per_round": args.layers_per_round,
        "max_moves_per_layer": args.max_moves,
        "step_ms_before": round(1000 * statistics.mean(before), 1),
        "longest_step_ms_during": round(1000 * max(during), 1),
        "pause_ms_over_normal_step": round(1000 * (max(during) - statistics.median(before)), 1),
        "step_ms_after": round(1000 * statistics.mean(after), 1),
        "steps_from_request_to_switch": done - req,
        "balancer_longest_pause_ms": round(1000 * last.longest_pause_s, 1),
        "rebalance_duration_s": round(last.duration_s, 3),
        "slots_moved": last.slots_moved,
        "predicted_balancedness": [
            round(last.balancedness_before, 3),
            round(last.balancedness_after, 3),
        ],  # fmt: skip
        "measured_max_rank_load_over_mean": [
            round(imbalance("before"), 3),
            round(imbalance("after"), 3),
        ],  # fmt: skip
    }
    for key, value in result.items():
        print(f"{key}: {value}")
    print(record(f"eplb_live_{args.model}", result))


if __name__ == "__main__":
    main()
