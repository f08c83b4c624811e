"""What a CPU rank's steps cost beyond the roofline of the probed machine: the engine's per-step
and per-sequence overheads, an expert-parallel rank's extra ones, and a prefill's per position,
measured, for the plan's CPU entry (cluster/plan/probe.py).

1. One engine (one torch thread, as a cluster rank runs) decodes `--batches` requests of 128
   prompt tokens with the fused decode layers; the mean step at each batch minus the plan's
   roofline of that step (cluster/plan/cost.py, EP1, fp32, this machine's one-thread bandwidth
   and peak from the probe, no overheads) is the overhead; a line through the two batches gives
   step_overhead_s + sequence_overhead_s x batch.
2. The same engine prefills one 128-token prompt at a time (no prefix cache): the mean step
   minus its roofline and the overheads of 1 is prefill_token_overhead_s x 128.
3. Two engines in an EP2 pool (two spawned single-threaded processes over gloo, as a cluster's
   pool: attention fused, the MoE block in Python with its dispatch and combine) decode the same
   batches each; the mean step minus the plan's EP2 step with the overheads of 1 and 2 (the
   roofline on two busy threads' share, the probe's exchange latency per round trip, the lone
   engine's overheads) is what an EP rank adds: a line through the two batches gives
   ep_step_overhead_s + ep_sequence_overhead_s x batch.
4. The engine of 1 and 2 prefills again, prompts PREFILL_GAP_S apart, alone and beside a
   neighbour engine decoding without pause on the other core, and decodes a batch of 3, alone
   and beside a neighbour prefilling without pause (bench/corun.py): how much slower a step
   computes when another rank computes beside it (corun_prefill, corun_decode; the local plan
   weighs them by the other pool's busy fraction where every rank has a core of its own).

Each is written into the probe's cache beside the bandwidth and peak (and recorded in
bench/results/cpu_overheads_<model>.json). Nothing here comes from a cluster or a goodput run.

    .venv/bin/python -m bench.cpu_overheads [--model small] [--batches 1,32] [--steps 40]
"""

import argparse
import os
import time
from functools import partial

import torch

from bench.common import record, workload
from bench.corun import NEIGHBOUR_BATCH, beside
from cluster.plan.cost import Unit, decode_step, prefill_step
from cluster.plan.models import load_model
from cluster.plan.probe import cpu_hardware, probe, save
from engine import EngineConfig, SamplingParams
from engine.llm_engine import LLMEngine

PROMPT = 128
PREFILL_GAP_S = 0.5  # between prompts in step 4 (1-3.5 req/s at a local prefill rank)


def _config(model: str, batch: int) -> EngineConfig:
    # NOTE: no two-batch overlap, as the plan of a CPU pool assumes (one thread both computes
    # and drives gloo; "auto" would split EP steps of 32 rows and more)
    return EngineConfig(model=model, max_num_seqs=max(64, batch), max_num_batched_tokens=4096,
                        enable_prefix_caching=False, two_batch_overlap="off")  # fmt: skip


def decode_seconds(engine: LLMEngine, batch: int, steps: int, first_id: int = 0) -> float:
    """Mean seconds of a decode step of `batch` requests (after the prefill and a warm-up). In
    an EP pool every rank calls this at once (its steps are the pool's)."""
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=steps + 10, temperature=0.0, ignore_eos=True)
    for i, (prompt, _) in enumerate(workload(batch, (PROMPT, PROMPT), (1, 1), vocab, first_id)):
        engine.add_request(str(first_id + i), prompt, params)
    for _ in range(3):
        engine.step()
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = (time.perf_counter() - start) / steps
    while engine.pool_has_unfinished if engine.ep_size > 1 else engine.has_unfinished():
        engine.step()  # finish, so the next batch starts from an empty engine
    return seconds


def prefill_seconds(engine: LLMEngine, prompts: int, gap_s: float = 0.0) -> float:
    """Mean seconds of a step prefilling one PROMPT-token prompt (max_tokens 1: the prefill is
    the request), after a warm-up one; `gap_s` idle before each (prompts arriving apart)."""
    vocab = engine.model.config.vocab_size
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for i, (prompt, _) in enumerate(workload(prompts + 1, (PROMPT, PROMPT), (1, 1), vocab, 7)):
        time.sleep(gap_s)
        engine.add_request(f"p{i}", prompt, params)
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
        assert not engine.has_unfinished()
    return sum(times[1:]) / prompts


def _decoding(engine: LLMEngine, i: int) -> None:
    """A neighbour's work (bench/corun.py): decode steps of a batch, without pause."""
    decode_seconds(engine, NEIGHBOUR_BATCH, 20, 10_000 + 100 * i)


def _prefilling(engine: LLMEngine, i: int) -> None:
    """A neighbour's work: 128-token prefills, without pause."""
    prefill_seconds(engine, 1)


def _ep_rank(rank: int, port: int, model: str, batches: tuple[int, ...], steps: int, out) -> None:
    import torch.distributed as dist

    from engine.ep import build_ep_engine

    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    engine = build_ep_engine(_config(model, max(batches)), None, rank, 2)
    result = [decode_seconds(engine, b, steps, 1000 * (rank + 1)) for b in batches]
    if rank == 0:
        out.put(result)
    dist.barrier()
    dist.destroy_process_group()


def ep2_seconds(model: str, batches: tuple[int, ...], steps: int) -> list[float]:
    """Mean decode step of an EP2 pool at each batch per rank (two spawned processes)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_ep_rank, args=(r, port, model, batches, steps, out))
             for r in range(2)]  # fmt: skip
    for p in procs:
        p.start()
    result = out.get(timeout=1800)
    for p in procs:
        p.join()
    return result


def _line(lo: int, lo_s: float, hi: int, hi_s: float) -> tuple[float, float]:
    """(per step, per sequence) of the line through two overheads, clamped at 0."""
    per_seq = max(0.0, (hi_s - lo_s) / (hi - lo))
    return max(0.0, lo_s - per_seq * lo), per_seq


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=8, help="prefills timed")
    args = ap.parse_args()
    torch.set_num_threads(1)  # a cluster rank's torch_threads
    lo, hi = (int(b) for b in args.batches.split(","))
    probe()  # bandwidth and peak first (measured now if not cached)
    hw = cpu_hardware(busy_threads=1.0)
    fp32 = ("fp32",) * 4
    unit = Unit(1, 1, 0, *fp32, imbalance=1.0, step_overhead_s=0.0)
    plan_model = load_model(args.model)
    context = PROMPT + 3 + args.steps / 2
    # Step 1: one engine's decode
    engine = LLMEngine(_config(args.model, hi))
    rows = {}
    for batch in (lo, hi):
        measured = decode_seconds(engine, batch, args.steps, 100 * batch)
        roofline = decode_step(plan_model, hw, unit, batch, context).time_s
        rows[batch] = {"step_ms": measured * 1e3, "roofline_ms": roofline * 1e3,
                       "overhead_ms": (measured - roofline) * 1e3}  # fmt: skip
        print("decode", batch, rows[batch])
    per_step, per_seq = _line(lo, rows[lo]["overhead_ms"] / 1e3, hi, rows[hi]["overhead_ms"] / 1e3)
    # Step 2: one engine's prefill, per new position beyond the roofline and the step's overheads
    measured = prefill_seconds(engine, args.prompts)
    roofline = prefill_step(plan_model, hw, unit, PROMPT, 1).time_s
    per_token = max(0.0, (measured - roofline - per_step - per_seq) / PROMPT)
    prefill = {"tokens": PROMPT, "step_ms": measured * 1e3, "roofline_ms": roofline * 1e3,
               "token_overhead_us": per_token * 1e6}  # fmt: skip
    print("prefill", prefill)
    # Step 4: the same steps beside a neighbour computing on the other core, side by side
    # prompts PREFILL_GAP_S apart, as they arrive at a prefill rank: a neighbour that computes
    # meanwhile evicts what the last prefill left in the caches
    alone = prefill_seconds(engine, args.prompts, PREFILL_GAP_S)
    make = partial(LLMEngine, _config(args.model, NEIGHBOUR_BATCH))
    with_decode = beside(
        make, _decoding, partial(prefill_seconds, engine, args.prompts, PREFILL_GAP_S)
    )
    decode_alone = decode_seconds(engine, NEIGHBOUR_BATCH, args.steps, 5000)
    timed = partial(decode_seconds, engine, NEIGHBOUR_BATCH, args.steps, 6000)
    with_prefill = beside(make, _prefilling, timed)
    corun = {"prefill_alone_ms": alone * 1e3, "prefill_beside_decode_ms": with_decode * 1e3,
             "decode_alone_ms": decode_alone * 1e3,
             "decode_beside_prefill_ms": with_prefill * 1e3,
             "corun_prefill": with_decode / alone,
             "corun_decode": with_prefill / decode_alone}  # fmt: skip
    print("corun", corun)
    del engine
    # Step 3: an EP2 pair's decode, beyond the plan's EP2 step with the overheads above
    cache = probe()
    pair_hw = cpu_hardware(busy_threads=2.0)
    pair = Unit(2, 1, 0, *fp32, imbalance=1.0, two_batch_overlap=False, step_overhead_s=per_step,
                sequence_overhead_s=per_seq,
                exchange_latency_s=pair_hw.exchange_latency_s)  # fmt: skip
    ep_rows = {}
    for batch, measured in zip((lo, hi), ep2_seconds(args.model, (lo, hi), args.steps)):
        planned = decode_step(plan_model, pair_hw, pair, batch, context).time_s
        ep_rows[batch] = {"step_ms": measured * 1e3, "plan_without_ep_ms": planned * 1e3,
                          "overhead_ms": (measured - planned) * 1e3}  # fmt: skip
        print("ep2 decode", batch, ep_rows[batch])
    ep_lo, ep_hi = (ep_rows[b]["overhead_ms"] / 1e3 for b in (lo, hi))
    ep_step, ep_seq = _line(lo, ep_lo, hi, ep_hi)
    measured_now = {"step_overhead_s": per_step, "sequence_overhead_s": per_seq,
                    "prefill_token_overhead_s": per_token, "ep_step_overhead_s": ep_step,
                    "ep_sequence_overhead_s": ep_seq, "corun_prefill": corun["corun_prefill"],
                    "corun_decode": corun["corun_decode"]}  # fmt: skip
    cache = cache | measured_now | {"overheads": f"bench/cpu_overheads.py --batches {args.batches}"}
    save(cache)
    result = {
        "model": args.model,
        "threads": 1,
        "batches": rows,
        "prefill": prefill,
        "ep2_batches": ep_rows,
        "corun": corun,
        "step_overhead_ms": per_step * 1e3,
        "sequence_overhead_ms": per_seq * 1e3,
        "prefill_token_overhead_us": per_token * 1e6,
        "ep_step_overhead_ms": ep_step * 1e3,
        "ep_sequence_overhead_ms": ep_seq * 1e3,
        "probe": {k: v for k, v in cache.items() if k != "overheads"},
    }
    print(record(f"cpu_overheads_{args.model}", result))


if __name__ == "__main__":
    main()
