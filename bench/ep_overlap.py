"""Two-batch overlap on and off: step time of an EP = 2 decode step, the two ranks in two network
namespaces joined by a shaped veth pair, so that the all-to-all costs real time.

    sudo .venv/bin/python -m bench.ep_overlap [--model small] [--batch 32] [--rates ...]

The link is shaped with tbf (this kernel has no netem, so bandwidth, not delay, is the knob).
At each rate both ranks run decode steps with overlap off and on, alternating blocks of steps,
and report the mean step time of each and the ratio. Needs root (ip netns, tc); it deletes the
namespaces it creates.
"""

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

import torch

NS = ("epbench0", "epbench1")
VETH = ("epb0", "epb1")
ADDR = ("10.77.0.1", "10.77.0.2")


def sh(*cmd: str) -> None:
    subprocess.run(cmd, check=True)


def setup_netns() -> None:
    teardown_netns()
    for ns in NS:
        sh("ip", "netns", "add", ns)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
    sh("ip", "link", "add", VETH[0], "type", "veth", "peer", "name", VETH[1])
    for ns, dev, addr in zip(NS, VETH, ADDR):
        sh("ip", "link", "set", dev, "netns", ns)
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{addr}/30", "dev", dev)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", dev, "up")


def shape(rate: str) -> None:
    for ns, dev in zip(NS, VETH):
        subprocess.run(
            ["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"],
            capture_output=True,
        )
        if rate != "unshaped":
            sh(
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                rate,
                "burst",
                "64kb",
                "latency",
                "50ms",
            )


def teardown_netns() -> None:
    for ns in NS:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def worker(args: argparse.Namespace) -> None:
    """One rank, inside its namespace: build the EP engine, fill a decode batch, time steps."""
    import torch.distributed as dist

    from engine import EngineConfig, SamplingParams
    from engine.ep import build_ep_engine

    torch.set_num_threads(1)
    os.environ["GLOO_SOCKET_IFNAME"] = VETH[args.rank]
    dist.init_process_group(
        "gloo", init_method=f"tcp://{ADDR[0]}:{args.port}", rank=args.rank, world_size=2
    )
    config = EngineConfig(
        model=args.model,
        two_batch_overlap="off",
        kv_cache_bytes=2**30,
        max_num_seqs=args.batch,
        max_num_batched_tokens=4096,
    )
    engine = build_ep_engine(config, None, args.rank, 2)
    gen = torch.Generator().manual_seed(args.rank)
    vocab = engine.model.config.vocab_size
    for i in range(args.batch):
        prompt = torch.randint(2, vocab, (16,), generator=gen).tolist()
        engine.add_request(
            str(i), prompt, SamplingParams(max_tokens=10_000, ignore_eos=True, temperature=0)
        )
    engine.step()  # prefill everything: from here on every step is a pure decode step
    results = {}
    for rate in args.rates:
        dist.barrier()
        if args.rank == 0:
            print(f"RATE {rate}", flush=True)
            sys.stdin.readline()  # the parent shapes the link, then answers
        dist.barrier()
        times = {"off": [], "on": []}
        for _ in range(args.rounds):
            for mode in ("off", "on"):
                engine.config = dataclasses.replace(config, two_batch_overlap=mode)
                engine.step()  # settle
                for _ in range(args.steps):
                    dist.barrier()
                    start = time.perf_counter()
                    engine.step()
                    times[mode].append(time.perf_counter() - start)
        results[rate] = {m: sum(t) / len(t) for m, t in times.items()}
    if args.rank == 0:
        print("RESULT " + json.dumps(results), flush=True)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="small")
    ap.add_argument("--batch", type=int, default=32, help="decoding requests per rank")
    ap.add_argument(
        "--rates", nargs="+", default=["unshaped", "1gbit", "400mbit", "200mbit", "100mbit"]
    )
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=29533, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        return worker(args)

    from bench.common import record
    from moe import ModelConfig
    from moe.presets import ensure_preset, preset_names

    path = ensure_preset(args.model) if args.model in preset_names() else args.model
    mc = ModelConfig.from_file(path)
    setup_netns()
    try:
        base = [
            sys.executable,
            "-m",
            "bench.ep_overlap",
            "--worker",
            "--model",
            args.model,
            "--batch",
            str(args.batch),
            "--steps",
            str(args.steps),
            "--rounds",
            str(args.rounds),
            "--port",
            str(args.port),
            "--rates",
            *args.rates,
        ]
        procs = [
            subprocess.Popen(
                ["ip", "netns", "exec", NS[r], *base, "--rank", str(r)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                cwd=os.getcwd(),
            )
            for r in range(2)
        ]
        result = None
        for line in procs[0].stdout:
            if line.startswith("RATE "):
                shape(line.split()[1])
                procs[0].stdin.write("go\n")
                procs[0].stdin.flush()
            elif line.startswith("RESULT "):
                result = json.loads(line[len("RESULT ") :])
        for p in procs:
            p.wait(timeout=60)
        if result is None:
            raise SystemExit("the workers failed")
    finally:
        teardown_netns()
    # Bytes over the wire per token per MoE layer: K rows of H fp32 out (dispatch) and back
    # (combine); with 2 ranks and contiguous experts about half the rows stay local.
    row = mc.hidden_size * 4
    per_token = {
        "dispatch_bytes": mc.num_experts_per_tok * row,
        "combine_bytes": mc.num_experts_per_tok * row,
    }
    rows = []
    print(f"{'link':>10} {'off s/step':>11} {'on s/step':>10} {'on/off':>7}")
    for rate, t in result.items():
        ratio = t["on"] / t["off"]
        rows.append(
            {
                "link": rate,
                "off_s": round(t["off"], 4),
                "on_s": round(t["on"], 4),
                "ratio_on_off": round(ratio, 3),
            }
        )
        print(f"{rate:>10} {t['off']:>11.3f} {t['on']:>10.3f} {ratio:>7.2f}")
    print(
        record(
            "ep_overlap",
            {
                "model": args.model,
                "ep": 2,
                "batch_per_rank": args.batch,
                "bytes_per_token_per_moe_layer": per_token,
                "results": rows,
            },
        )
    )


if __name__ == "__main__":
    main()
