"""The router's event loop under overload: GetModelInfo latency through real gRPC while 1,000
requests wait for decode room, and the status calls per second the router makes to its ranks,
BEFORE (each waiter polled every rank every 50 ms) and AFTER (they wait on the router's view of
the free blocks, router/backends/decode_room.py), side by side in one run.

    .venv/bin/python -m bench.router_waiters [--waiters 1000] [--calls 200] [--before REV]

For each pool shape (16 prefill + 16 decode ranks as on gpu-8x, and 2 + 2) and each version,
a router process (the real RouterServer and ClusterBackend, on 127.0.0.1) serves fake rank
handles of a full decode pool: every status says the KV cache is full, every reserve is refused.
Each call costs what a Ray call costs its caller at the least: a wait (--call-ms) and the pickle
of a RankStatus both ways (with its expert ids, DeepSeek-V3's 58 MoE layers x 256 experts split
over the pool). The BEFORE router runs the code of `--before` (a git worktree of that
revision); AFTER, this checkout's. A load process opens --waiters Generate streams (they are
admitted and wait for decode room; reserve_wait_s is an hour), then this process calls
GetModelInfo --calls times, one after the other (at most --budget-s seconds), and reads the
counts of calls the fakes answered. Results: bench/results/router_waiters.json and .md.
"""

import argparse
import asyncio
import collections
import json
import os
import pickle
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
LAYERS, EXPERTS, BLOCK, TOTAL_BLOCKS, PROMPT = range(3, 61), 256, 16, 4096, 100


# ---- the router process (run with PYTHONPATH=<the tree to measure>) ----


def serve_main(num_prefill: int, num_decode: int, waiters: int, call_s: float) -> None:
    import router
    from engine.messages import ModelInfo, RankStatus
    from engine.tokenizer import Tokenizer
    from router.admission import AdmissionConfig

    try:
        from router.backends.cluster import ClusterBackend
        from router.backends.routing import RoutingConfig
    except ImportError:  # NOTE: the BEFORE revision's layout (router/ before its two wings)
        from router.cluster_backend import ClusterBackend, RoutingConfig
    from router.server import serve

    counts = {"status": 0, "reserve": 0, "other": 0}

    class FullRank:
        """A rank of a full decode pool (or an idle prefill rank), as its handle answers."""

        def __init__(self, pool: str, rank: int, num_ranks: int) -> None:
            self.pool, self.rank, self.kv_rank = pool, rank, rank
            per = EXPERTS // num_ranks
            experts = list(range(rank * per, (rank + 1) * per))
            used = TOTAL_BLOCKS if pool == "decode" else 0
            self._status = RankStatus(
                pool, rank, True, 64 if pool == "decode" else 0, 0, used, TOTAL_BLOCKS,
                block_size=BLOCK, expert_ids={layer: experts for layer in LAYERS},
                max_model_len=4096,
            )  # fmt: skip

        async def _call(self, kind: str, reply: object = None) -> object:
            counts[kind] += 1
            await asyncio.sleep(call_s)
            return pickle.loads(pickle.dumps(reply))

        async def status(self) -> RankStatus:
            return await self._call("status", self._status)

        async def reserve(self, request_id, token_ids, lease_s, router_id) -> bool:
            return await self._call("reserve", False)

        async def renew(self, router_id, request_ids, lease_s) -> int:
            return await self._call("other", 0)

        async def abort(self, request_id: str) -> None:
            await self._call("other")

        async def discard_kv(self, kv) -> None:
            await self._call("other")

        async def register_router(self, router_id: str, lease_s: float) -> None:
            await self._call("other")

        async def stream(self, router_id: str):
            await asyncio.Event().wait()  # no request ever runs
            yield []

    info = ModelInfo("fake-deepseek-v3", "deepseek_v3", 129280, 4096, 61, EXPERTS, 8, 1, 70272)
    backend = ClusterBackend(
        [FullRank("prefill", i, num_prefill) for i in range(num_prefill)],
        [FullRank("decode", i, num_decode) for i in range(num_decode)],
        info, Tokenizer(None, info.vocab_size, 1, None), BLOCK,
        RoutingConfig(reserve_wait_s=3600.0),
    )  # fmt: skip
    admission = AdmissionConfig(max_queued_requests=waiters + 64)
    server = serve(backend, "127.0.0.1", 0, admission=admission)
    server.call(backend.start())
    assert server.wait_ready(60), "the router did not get ready"
    print(json.dumps({"port": server.port, "router": router.__file__}), flush=True)
    for line in sys.stdin:
        if line.strip() != "stats":
            break
        stats = dict(counts, t=time.monotonic(), admitted=server.frontend.admission.num_requests)
        print(json.dumps(stats), flush=True)
    server.stop(0.0, backend.close())


# ---- the load process: streams that wait ----


def load_main(address: str, num: int) -> None:
    import grpc

    from router.proto import epcluster_pb2 as pb
    from router.proto import epcluster_pb2_grpc as pb_grpc

    async def main() -> None:
        stubs = [pb_grpc.InferenceStub(grpc.aio.insecure_channel(address)) for _ in range(8)]

        async def one(i: int) -> None:
            request = pb.GenerateRequest(
                request_id=f"waiter-{i}",
                token_ids=pb.TokenIds(ids=list(range(5, 5 + PROMPT))),
                sampling_params=pb.SamplingParams(max_tokens=4, seed=i),
            )
            try:
                async for _ in stubs[i % len(stubs)].Generate(request):
                    pass
                print(f"waiter {i} finished", flush=True)
            except grpc.aio.AioRpcError as e:
                print(f"waiter {i}: {e.code().name} {e.details()}", flush=True)

        await asyncio.gather(*(one(i) for i in range(num)))

    asyncio.run(main())


# ---- the driver ----


class Router:
    """A router process over fake ranks, running the code of `tree`."""

    def __init__(self, tree: Path, prefill: int, decode: int, waiters: int, call_ms: float):
        env = dict(os.environ, PYTHONPATH=str(tree))
        # NOTE: -P: bench/ is not put first on sys.path (its kernels.py would hide the package)
        args = [sys.executable, "-P", __file__, "--serve", str(prefill), str(decode), str(waiters)]
        self.proc = subprocess.Popen(
            [*args, str(call_ms / 1e3)], env=env, cwd=tree, text=True,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        )  # fmt: skip
        hello = json.loads(self.proc.stdout.readline())
        self.address, self.module = f"127.0.0.1:{hello['port']}", hello["router"]
        assert Path(self.module).is_relative_to(tree), (self.module, tree)

    def stats(self) -> dict:
        self.proc.stdin.write("stats\n")
        self.proc.stdin.flush()
        return json.loads(self.proc.stdout.readline())

    def close(self) -> None:
        self.proc.stdin.write("quit\n")
        self.proc.stdin.flush()
        self.proc.wait(120)


def latencies(address: str, calls: int, budget_s: float) -> list[float]:
    """Seconds per GetModelInfo call, one after the other."""
    import grpc

    from router.proto import epcluster_pb2 as pb
    from router.proto import epcluster_pb2_grpc as pb_grpc

    with grpc.insecure_channel(address) as channel:
        stub = pb_grpc.InferenceStub(channel)
        stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=120)  # the connection is up
        out: list[float] = []
        end = time.monotonic() + budget_s
        while len(out) < calls and time.monotonic() < end:
            start = time.perf_counter()
            stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=120)
            out.append(time.perf_counter() - start)
    return out


def summary(seconds: list[float]) -> dict:
    ms = sorted(1e3 * s for s in seconds)
    p99 = ms[min(len(ms) - 1, int(0.99 * len(ms)))]
    return {"calls": len(ms), "p50_ms": round(statistics.median(ms), 2), "p99_ms": round(p99, 2),
            "max_ms": round(ms[-1], 2)}  # fmt: skip


def measure(tree: Path, prefill: int, decode: int, args: argparse.Namespace) -> dict:
    router = Router(tree, prefill, decode, args.waiters, args.call_ms)
    load = None
    try:
        idle = latencies(router.address, args.idle_calls, args.budget_s)
        a = router.stats()
        time.sleep(2.0)
        b = router.stats()
        idle_status = (b["status"] - a["status"]) / (b["t"] - a["t"])
        log = tempfile.TemporaryFile("w+")
        load = subprocess.Popen(
            [sys.executable, "-P", __file__, "--load", router.address, str(args.waiters)],
            cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True,
            env=dict(os.environ, PYTHONPATH=str(REPO)),
        )  # fmt: skip
        ramp = time.monotonic()
        # NOTE: a router whose loop is saturated admits slowly; past --ramp-s it is measured
        # with the waiters it has admitted by then (recorded as `waiters`)
        while router.stats()["admitted"] < args.waiters and time.monotonic() - ramp < args.ramp_s:
            assert load.poll() is None, "the load stopped"
            time.sleep(0.5)
        ramp_s = time.monotonic() - ramp
        time.sleep(args.settle_s)  # every waiter is in its wait loop
        a = router.stats()
        busy = latencies(router.address, args.calls, args.budget_s)
        b = router.stats()
        while b["t"] - a["t"] < args.rate_s:  # the rates over at least rate_s
            time.sleep(0.5)
            b = router.stats()
        assert b["admitted"] >= a["admitted"], f"waiters were refused or ended: {a} {b}"
        load.kill()
        load.wait()
        log.seek(0)
        ended = collections.Counter(line.split(": ")[-1] for line in log.read().splitlines())
        dt = b["t"] - a["t"]
        return {
            "router_module": router.module,
            "getmodelinfo_idle": summary(idle),
            "getmodelinfo_with_waiters": summary(busy),
            "status_calls_per_s_idle": round(idle_status, 1),
            "status_calls_per_s_with_waiters": round((b["status"] - a["status"]) / dt, 1),
            "reserve_calls_per_s_with_waiters": round((b["reserve"] - a["reserve"]) / dt, 1),
            "other_calls_per_s_with_waiters": round((b["other"] - a["other"]) / dt, 1),
            "waiters": b["admitted"],
            "all_admitted": b["admitted"] == args.waiters,
            # waiters that ended before the load was stopped (none should: reserve_wait_s is
            # an hour), by how they ended
            "waiters_ended": dict(ended),
            "load_average_1m": round(os.getloadavg()[0], 1),
            "seconds_to_admit_the_waiters": round(ramp_s, 1),
            "measured_for_s": round(dt, 1),
        }
    finally:
        if load is not None and load.poll() is None:
            load.kill()
        router.close()


def git(*args: str) -> str:
    return subprocess.run(
        ["git", *args], cwd=REPO, text=True, capture_output=True, check=True
    ).stdout


def cpu_model() -> str:
    for line in subprocess.run(["lscpu"], text=True, capture_output=True).stdout.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def markdown(result: dict) -> str:
    rows = [
        "| ranks (prefill + decode) | code | waiters admitted (s to admit) | GetModelInfo p50 / p99"
        " / max, idle (ms) | with waiters (ms) | calls | status calls/s idle | with waiters | "
        "reserve calls/s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for case in result["cases"]:
        for name in ("before", "after"):
            r = case[name]
            i, w = r["getmodelinfo_idle"], r["getmodelinfo_with_waiters"]
            rows.append(
                f"| {case['prefill']} + {case['decode']} | {name} | {r['waiters']} "
                f"({r['seconds_to_admit_the_waiters']}) | {i['p50_ms']} / {i['p99_ms']}"
                f" / {i['max_ms']} | {w['p50_ms']} / {w['p99_ms']} / {w['max_ms']} | "
                f"{w['calls']} | {r['status_calls_per_s_idle']} | "
                f"{r['status_calls_per_s_with_waiters']} | "
                f"{r['reserve_calls_per_s_with_waiters']} |"
            )
    head = [
        "# Router event loop with requests waiting for decode room (issue 24, must-show 5)",
        "",
        f"{result['waiters']} Generate streams wait for decode room (every status full, every "
        f"reserve refused) while GetModelInfo is called {result['calls']} times in a row "
        f"(at most {result['budget_s']} s) over real gRPC on 127.0.0.1. Fake rank handles: "
        f"{result['call_ms']} ms per call plus the pickle of a RankStatus both ways. Status "
        "calls per second are counted on the rank handles over the GetModelInfo calls (at "
        f"least {result['rate_s']} s).",
        "",
        f"- before: `{result['before_commit']}` (each waiter: poll_once every 50 ms); after: "
        f"`{result['after_commit']}`",
        f"- command: `{result['command']}`",
        f"- CPU: {result['cpu']}; date: {result['date']}",
        "",
    ]
    return "\n".join([*head, *rows, "", *result.get("notes", []), ""])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--waiters", type=int, default=1000)
    ap.add_argument("--calls", type=int, default=200, help="GetModelInfo calls with waiters")
    ap.add_argument("--idle-calls", type=int, default=50, help="GetModelInfo calls, no waiter")
    ap.add_argument("--budget-s", type=float, default=60.0, help="at most this long per series")
    ap.add_argument("--settle-s", type=float, default=3.0)
    ap.add_argument("--ramp-s", type=float, default=300.0, help="at most this long to admit")
    ap.add_argument("--rate-s", type=float, default=10.0, help="count calls at least this long")
    ap.add_argument("--call-ms", type=float, default=0.5, help="each rank call's wait")
    ap.add_argument("--shapes", default="16+16,2+2", help="prefill+decode ranks, comma-separated")
    ap.add_argument("--before", default=None, help="the revision with the polling waiters")
    args = ap.parse_args()
    # 6339fee: the last commit whose waiters called poll_once (its child 5bf793f removed it)
    before = args.before or "6339feee3a1095984f6aa0fbc802d90aa8713ab7"
    before_sha = git("rev-parse", before).strip()
    tree = Path(tempfile.mkdtemp(prefix="router-waiters-before-"))
    git("worktree", "add", "--detach", str(tree), before_sha)
    try:
        cases = []
        for shape in args.shapes.split(","):
            prefill, decode = (int(n) for n in shape.split("+"))
            case = {"prefill": prefill, "decode": decode}
            for name, root in (("before", tree), ("after", REPO)):
                case[name] = measure(root, prefill, decode, args)
                print(shape, name, json.dumps(case[name]), flush=True)
            cases.append(case)
    finally:
        git("worktree", "remove", "--force", str(tree))
    from bench.common import RESULTS, record

    dirty = bool(git("status", "--porcelain", "--", "router").strip())
    result = {
        "waiters": args.waiters,
        "calls": args.calls,
        "budget_s": args.budget_s,
        "call_ms": args.call_ms,
        "rate_s": args.rate_s,
        "before_commit": before_sha,
        "after_commit": git("rev-parse", "HEAD").strip() + (" (router/ modified)" if dirty else ""),
        "cpu": cpu_model(),
        "cases": cases,
    }
    path = record("router_waiters", result)
    result = json.loads(path.read_text())
    (RESULTS / "router_waiters.md").write_text(markdown(result))
    print(path)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--serve":
        n_prefill, n_decode, n_waiters, call = sys.argv[2:6]
        serve_main(int(n_prefill), int(n_decode), int(n_waiters), float(call))
    elif len(sys.argv) > 1 and sys.argv[1] == "--load":
        load_main(sys.argv[2], int(sys.argv[3]))
    else:
        main()
