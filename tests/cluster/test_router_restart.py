"""A router restart keeps the ranks (must-show 2), on a real local Ray started apart from the
routers (`ray start --head` on 127.0.0.1, token authentication on, as a Kubernetes head pod
runs it): `epcluster serve --address` is started as its own process, streams 8 requests and is
killed with SIGKILL mid-stream; a second `epcluster serve` on the same Ray attaches to the
running pools without reloading a rank (same actors, same processes, same generation), serves
new requests token for token as the in-process engine, and the killed streams' KV blocks are
freed by the decode ranks' router lease. Then a router with another config is refused with the
difference named and the pools untouched, and `epcluster stop` removes them for good.
Everything started is killed by its process group at the end; nothing listens beyond
127.0.0.1."""

import asyncio
import glob
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc
import psutil
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from deploy.netns import Serve
from engine import LLM, SamplingParams
from router.client import AsyncInferenceClient, InferenceClient
from tests.cluster.conftest import wait_quiet
from tests.procs import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
RAY = str(Path(sys.executable).with_name("ray"))
NAME = "restart-test"
LEASE_S = 4.0  # routing.kv_lease_s: the decode ranks' lease on a router
KILLED_MAX_TOKENS = 2000  # the killed streams could run this long: they must end sooner
LOOPBACK = {"127.0.0.1", "::ffff:127.0.0.1", "::1"}
# Four tokens whatever is sampled (a sampled end-of-text would end it sooner: ci-local on 600ccc7)
FOUR = SamplingParams(max_tokens=4, ignore_eos=True)

# A Ray driver that prints each rank actor's identity (cluster/pool.py RankIdentity) and the
# actor id, from the record a router attaches through; {} when the record is gone.
IDENTITIES = """
import json, sys, ray
from cluster import registry
ray.init(address=sys.argv[1], namespace=registry.NAMESPACE, log_to_driver=False)
record, out = registry.read(sys.argv[2]), {}
for entry in (record.pools.values() if record else []):
    for name in entry.actors:
        actor = registry.find_actor(name)
        i = ray.get(actor.describe.remote(), timeout=120)
        out[name] = {"actor_id": actor._actor_id.hex(), "pid": i.pid,
                     "generation": i.generation, "joined": i.joined, "cluster_id": i.cluster_id}
names = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)]
print(json.dumps({"ranks": out, "named": sorted(n for n in names if sys.argv[2] in n)}))
"""


class Head:
    """`ray start --head` on 127.0.0.1 in its own session: its processes (GCS, raylet, the rank
    workers it starts) share one process group, killed as one at the end."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="eprr-"))
        (self.dir / "token").write_text(secrets.token_hex(32))
        self.address = f"127.0.0.1:{free_port()}"
        self.env = dict(os.environ, RAY_AUTH_MODE="token", RAY_USAGE_STATS_ENABLED="0")
        self.env["RAY_AUTH_TOKEN_PATH"] = str(self.dir / "token")
        self.env.pop("RAY_AUTH_TOKEN", None)
        self.env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # nothing but loopback
        self.env["PYTHONPATH"] = str(REPO)
        self.routers: list[subprocess.Popen] = []
        proc = subprocess.run(
            [RAY, "start", "--head", "--port", self.address.rpartition(":")[2],
             "--node-ip-address", "127.0.0.1", "--include-dashboard=false", "--num-cpus", "8",
             "--ray-client-server-port", str(free_port()), "--temp-dir", str(self.dir / "ray"),
             "--disable-usage-stats"],
            env=self.env, capture_output=True, text=True, timeout=300, start_new_session=True,
        )  # fmt: skip
        self.pgid = self._pgid()
        if proc.returncode != 0:
            self.close()
            raise RuntimeError(f"ray start failed:\n{proc.stdout[-2000:]}{proc.stderr[-2000:]}")

    def _pgid(self) -> int | None:
        """The process group of this head's GCS (named by its temporary directory)."""
        for p in psutil.process_iter(["cmdline"]):
            cmd = " ".join(p.info["cmdline"] or [])
            if "gcs_server" in cmd and str(self.dir) in cmd:
                return os.getpgid(p.pid)
        return None

    def members(self) -> list[psutil.Process]:
        """Every live process of the head's group and every router."""
        pids = {r.pid for r in self.routers if r.poll() is None}
        out = []
        for p in psutil.process_iter():
            try:
                if p.pid in pids or (self.pgid is not None and os.getpgid(p.pid) == self.pgid):
                    if p.status() != psutil.STATUS_ZOMBIE:
                        out.append(p)
            except (psutil.Error, ProcessLookupError):
                continue
        return out

    def serve(self, config: dict, timeout: float = 600.0) -> tuple[Serve, float]:
        """`python -m cluster.cli serve` against this head; -> it, once ready, and the seconds
        from its start to its ready line."""
        path = self.dir / f"serve-{len(self.routers)}.yaml"
        path.write_text(yaml.safe_dump(config))
        started = time.monotonic()
        proc = subprocess.Popen(
            [sys.executable, "-m", "cluster.cli", "serve", "--config", str(path)], cwd=REPO,
            env=self.env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,
        )  # fmt: skip
        self.routers.append(proc)
        serve = Serve(proc).wait_ready(timeout)
        return serve, time.monotonic() - started

    def run(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *args], cwd=REPO, env=self.env, capture_output=True, text=True,
            timeout=timeout,
        )  # fmt: skip

    def identities(self) -> dict:
        out = self.run("-c", IDENTITIES, self.address, NAME)
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    def stop_routers(self) -> None:
        """SIGTERM every router still running, then SIGKILL what has not exited in 120 s."""
        for proc in self.routers:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.routers:
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)

    def close(self) -> None:
        for proc in self.routers:
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)
        if self.pgid is not None:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(self.pgid, sig)
                except ProcessLookupError:
                    break
                psutil.wait_procs(self.members(), timeout=15)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def head():
    h = Head()
    try:
        yield h
    finally:
        h.close()
    assert h.members() == [], h.members()


def router_config(head: Head, **engine: object) -> dict:
    """engine: fields of the config's shared engine section."""
    return {
        "model": "tiny-random",
        "ports": {
            "host": "127.0.0.1",
            "port": 0,
            "http_port": None,
            "metrics_port": None,
            "rank_metrics_port": 0,
        },
        "ray": {"ray_address": head.address, "cluster_name": NAME},
        "routing": {"kv_lease_s": LEASE_S},
        "engine": engine,
        "prefill": {"num_ranks": 2},
        "decode": {"num_ranks": 2},
    }


def address_of(serve: Serve) -> str:
    (line,) = [x for x in serve.lines if "epcluster: ready on" in x]
    return re.search(r"ready on (\S+) ", line).group(1)


def decode_ranks(status) -> list:
    return [r for p in status.pools if p.name == "decode" for r in p.ranks]


def decoded_tokens(status) -> float:
    """Tokens the decode ranks' steps computed since they started (their /metrics)."""
    total = 0.0
    for rank in decode_ranks(status):
        with urllib.request.urlopen(f"http://{rank.metrics_endpoint}/metrics", timeout=30) as r:
            page = r.read().decode()
        total += sum(
            s.value
            for f in text_string_to_metric_families(page)
            for s in f.samples
            if s.name == "epcluster_step_tokens_sum"
        )
    return total


async def stream_until_killed(address: str, router: subprocess.Popen) -> tuple[list[int], object]:
    """8 long streams; once each has tokens, SIGKILL the router; -> the tokens each received,
    and the cluster's status just before the kill."""
    received = [0] * 8
    params = SamplingParams(max_tokens=KILLED_MAX_TOKENS, ignore_eos=True, temperature=0.0)

    async def one(i: int, client: AsyncInferenceClient) -> None:
        async for out in client.generate([5 + i, 6, 7, 8], params):
            received[i] += len(out.token_ids)

    async with AsyncInferenceClient(address, timeout=600) as client:
        tasks = [asyncio.create_task(one(i, client)) for i in range(8)]
        end = time.monotonic() + 300
        while min(received) < 2 and time.monotonic() < end and not any(t.done() for t in tasks):
            await asyncio.sleep(0.05)
        assert min(received) >= 2, received
        status = await client.cluster_status()
        router.send_signal(signal.SIGKILL)
        results = await asyncio.gather(*tasks, return_exceptions=True)
    assert all(isinstance(r, grpc.RpcError) for r in results), results  # cut off, not finished
    return received, status


def test_a_new_router_attaches_to_the_running_pools(head):
    first, took = head.serve(router_config(head))
    print(f"\nfirst router: started the pools, ready in {took:.1f} s")
    assert "started its pools" in first.output(200)
    before = head.identities()["ranks"]
    assert len(before) == 4 and all(r["joined"] for r in before.values()), before
    received, at_kill = asyncio.run(stream_until_killed(address_of(first), first.proc))
    assert first.proc.wait(30) == -signal.SIGKILL
    held = decode_ranks(at_kill)
    assert sum(r.num_running for r in held) == 8 and all(r.kv_used_blocks > 0 for r in held), held

    second, attach_s = head.serve(router_config(head))
    print(f"second router: attached and ready in {attach_s:.1f} s (process start to ready)")
    log = second.output(200)
    assert "attached to the running pools" in log and "started its pools" not in log, log
    print("".join(x for x in second.lines if "attached to the running pools of" in x), end="")
    assert "re-forming" not in log, log
    assert head.identities()["ranks"] == before  # the same actors, processes and generation

    with InferenceClient(address_of(second), timeout=120) as client:
        # nobody aborts the killed router's 8 streams: the decode ranks end them when its
        # lease lapses, before they finish (finished, they would have decoded 8 x 1999 tokens)
        quiet = wait_quiet(client, timeout=120)
        assert quiet.num_in_flight == 0
        decoded = decoded_tokens(quiet)
        assert sum(received) - 8 <= decoded < 8 * (KILLED_MAX_TOKENS - 1), (decoded, received)
        print(f"killed streams: {decoded:.0f} tokens decoded of {8 * (KILLED_MAX_TOKENS - 1)}")

        prompts = [[11, 12, 13], [7] * 40, [3, 1, 4, 1, 5, 9, 2, 6]]
        params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, seed=i)
                  for i in range(3)]  # fmt: skip
        expected = LLM("tiny-random").generate(prompts, params)
        for prompt, p, want in zip(prompts, params, expected, strict=True):
            assert client.complete(prompt, p).token_ids == want.token_ids
        wait_quiet(client, timeout=60)
    leaks = [
        (p.pid, c.laddr)
        for p in head.members()
        for c in p.net_connections("inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.ip not in LOOPBACK
    ]
    assert leaks == [], leaks
    assert second.stop(120) == 0  # SIGTERM: drains, and keeps the pools (a joined Ray)
    assert head.identities()["ranks"] == before


def test_a_re_formed_pool_is_attached_to_at_its_new_generation(head):
    """A decode rank killed under an attached router: that router re-forms the pool (actors
    named ...-g1, recorded); a router started after it attaches to generation 1."""
    serve, _ = head.serve(router_config(head))
    before = head.identities()["ranks"]
    victim = before[f"epcluster-{NAME}-decode-1"]
    gen = victim["generation"]
    os.kill(victim["pid"], signal.SIGKILL)
    with InferenceClient(address_of(serve), timeout=120) as client:
        end = time.monotonic() + 300
        while time.monotonic() < end:
            now = head.identities()["ranks"]
            decode = {n: r for n, r in now.items() if "-decode-" in n}
            if sorted(decode) == [
                f"epcluster-{NAME}-decode-{r}-g{gen + 1}" for r in (0, 1)
            ] and all(r["joined"] for r in decode.values()):
                break
            time.sleep(1)
        assert sorted(decode) == [f"epcluster-{NAME}-decode-{r}-g{gen + 1}" for r in (0, 1)], now
        assert {n: r for n, r in now.items() if "-prefill-" in n} == {
            n: r for n, r in before.items() if "-prefill-" in n
        }  # the other pool was not touched
        assert client.complete([5, 6, 7], FOUR).num_completion_tokens == 4
        wait_quiet(client, timeout=60)
    assert serve.stop(120) == 0
    again, _ = head.serve(router_config(head))
    log = again.output(200)
    assert f"decode generation {gen + 1}" in log and "re-forming" not in log, log
    assert head.identities()["ranks"] == now
    with InferenceClient(address_of(again), timeout=120) as client:
        assert client.complete([5, 6, 7], FOUR).num_completion_tokens == 4
        wait_quiet(client, timeout=60)
    assert again.stop(120) == 0


def test_a_router_with_another_config_is_refused_and_stop_removes_the_pools(head):
    head.stop_routers()  # one a failed test above left would re-form the pools `stop` removes
    if not head.identities()["ranks"]:  # run alone: a router starts the pools, and goes
        serve, _ = head.serve(router_config(head))
        assert serve.stop(120) == 0
    before = head.identities()
    path = head.dir / "other.yaml"
    path.write_text(yaml.safe_dump(router_config(head, kv_cache_bytes=64 * 2**20)))
    other = head.run("-m", "cluster.cli", "serve", "--config", str(path))
    assert other.returncode == 2, other.stdout[-2000:] + other.stderr[-3000:]
    assert f"the prefill pool of cluster '{NAME}' already runs" in other.stderr
    assert "kv_cache_bytes: running 268435456, config 67108864" in other.stderr
    assert head.identities() == before  # untouched
    (cluster_id,) = {r["cluster_id"] for r in before["ranks"].values()}
    stores = f"{tempfile.gettempdir()}/epcluster-{cluster_id}-*"  # the groups' file stores

    out = head.run("-m", "cluster.cli", "stop", "--address", head.address, "--cluster-name", NAME)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.count("actor epcluster-") == 4 and "placement group" in out.stdout
    assert head.identities() == {"ranks": {}, "named": []}
    # a re-formed group's owner removed the killed generation's; each rank, at stop, its own
    assert glob.glob(stores) == []
    again = head.run("-m", "cluster.cli", "stop", "--address", head.address, "--cluster-name", NAME)
    assert again.returncode == 1 and "no pools" in again.stdout
