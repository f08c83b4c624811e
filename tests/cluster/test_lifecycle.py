"""A cluster's life: health is NOT_SERVING until both pools are ready; the context is lowered to
what the ranks' KV caches hold and a longer prompt gets INVALID_ARGUMENT (as in-process);
shutdown leaves none of the processes it started behind (other Ray clusters on the machine are
not this test's business)."""

import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import grpc
import psutil
import pytest

from engine import SamplingParams
from router.client import InferenceClient
from tests.cluster.conftest import make_cluster, wait_quiet
from tests.procs import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

RAY_NAMES = ("raylet", "gcs_server", "ray::", "default_worker", "ray/_private", "ray/dashboard")


def ray_descendants() -> dict[int, str]:
    """This process's Ray descendants (GCS, raylet, and the workers under it): pid -> command."""
    found = {}
    for proc in psutil.Process(os.getpid()).children(recursive=True):
        try:
            cmd = " ".join(proc.cmdline()) or proc.name()
            if proc.status() != psutil.STATUS_ZOMBIE and any(n in cmd for n in RAY_NAMES):
                found[proc.pid] = cmd
        except psutil.NoSuchProcess:
            continue
    return found


def alive(pids) -> list[int]:
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            continue
    return out


def watch_health(port: int, seen: list, stop: threading.Event) -> None:
    """Record each change of the health status until SERVING, and whether every rank of both
    pools was ready at the first SERVING."""
    with InferenceClient(f"127.0.0.1:{port}", timeout=10) as client:
        while not stop.is_set():
            try:
                health = client.health()
            except grpc.RpcError as e:  # the router is not up yet
                health = e.code().name
            if not seen or seen[-1] != health:
                seen.append(health)
            if health == "SERVING":
                status = client.cluster_status()
                ready = [r.ready for p in status.pools for r in p.ranks]
                seen.append(f"ranks ready at SERVING: {ready}")
                return
            time.sleep(0.05)


def test_startup_health_prompt_limits_and_clean_shutdown():
    port = free_port()
    seen: list = []
    stop = threading.Event()
    # 100 blocks of 16 tokens per rank (tiny: 3 layers x 40 numbers x 4 bytes per token)
    cluster = make_cluster(
        {
            "ports.port": port,
            "prefill.num_ranks": 1,
            "decode.num_ranks": 1,
            "engine.kv_cache_bytes": 768_000,
        }
    )
    # NOTE: Ray first: its processes must not be forked while another thread is inside gRPC.
    cluster.start_ray()
    watcher = threading.Thread(target=watch_health, args=(port, seen, stop))
    watcher.start()
    try:
        cluster.start()
    finally:
        watcher.join(30)
        stop.set()
    ours = ray_descendants()
    assert any("raylet" in cmd for cmd in ours.values()), ours
    assert "NOT_SERVING" in seen, seen
    assert seen[-2:] == ["SERVING", "ranks ready at SERVING: [True, True]"], seen
    try:
        with InferenceClient(cluster.address, timeout=60) as client:
            # the model's context is 2048; the ranks lowered it to what their caches hold
            assert client.model_info().max_model_len == 1600
            with pytest.raises(grpc.RpcError) as err:
                client.complete([5] * 1700, SamplingParams(max_tokens=8))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "context is 1600: shorten it to at most 1599 tokens" in err.value.details()
            out = client.complete([5] * 1599, SamplingParams(max_tokens=1, temperature=0))
            assert out.num_completion_tokens == 1
            out = client.complete([5, 6, 7], SamplingParams(max_tokens=4, temperature=0))
            assert out.num_completion_tokens == 4
            status = wait_quiet(client)
            assert all(r.kv_used_blocks == 0 for p in status.pools for r in p.ranks)
    finally:
        cluster.shutdown()
    ours.update(ray_descendants())  # workers started since
    end = time.monotonic() + 30
    while alive(ours) and time.monotonic() < end:
        time.sleep(0.5)
    assert not alive(ours), {pid: ours[pid] for pid in alive(ours)}


def test_a_local_cluster_stays_on_loopback_whatever_was_imported_first():
    """Ray reads its loopback switch when imported: a program that imported ray (through
    cluster.launcher) before starting a local cluster must still get a loopback-only Ray."""
    script = (
        "import ray, sys\n"
        "from cluster.launcher import Cluster\n"
        "from tests.cluster.conftest import make_cluster\n"
        "c = make_cluster()\n"
        "c.start_ray()\n"
        "print([n['NodeManagerAddress'] for n in ray.nodes()])\n"
        "ray.shutdown()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "['127.0.0.1']", out.stdout


def test_a_taken_metrics_port_is_a_clear_error_and_nothing_stays_up():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    before = set(ray_descendants())
    try:
        cluster = make_cluster({"ports.metrics_port": port})
        with pytest.raises(ValueError, match=f"ports.metrics_port {port} on 127.0.0.1 is taken"):
            cluster.start()
        assert cluster.server is None  # nothing was bound
    finally:
        taken.close()
    ours = {p: c for p, c in ray_descendants().items() if p not in before}
    end = time.monotonic() + 30
    while alive(ours) and time.monotonic() < end:
        time.sleep(0.5)
    assert not alive(ours), {pid: ours[pid] for pid in alive(ours)}


def test_a_ray_start_that_times_out_is_cleaned_up_and_retried(monkeypatch):
    """Ray's raylet gets a fixed 30 s to register; on a loaded machine ray.init raises and leaves
    what it started running. The launcher kills those processes and tries again (faked here: an
    init that starts a process and raises Ray's message, twice, then succeeds; and one that
    always does, which gives up after the last attempt with Ray's error)."""
    from cluster import launcher

    started: list[subprocess.Popen] = []
    calls: list[dict] = []

    def flaky_init(fail: int):
        def init(**kwargs):
            calls.append(kwargs)
            started.append(subprocess.Popen(["sleep", "300"]))
            if len(calls) <= fail:
                raise Exception("The current node timed out during startup. This could happen")

        return init

    monkeypatch.setattr(launcher.ray, "init", flaky_init(fail=2))
    monkeypatch.setattr(launcher.ray, "shutdown", lambda: None)
    launcher._start_local_ray(num_cpus=3)
    assert len(calls) == launcher.RAY_START_ATTEMPTS == 3
    assert all(c["address"] == "local" and c["num_cpus"] == 3 for c in calls)
    # the failed attempts' processes are gone (reaped by the launcher: no status left for Popen)
    assert [p.poll() is not None for p in started[:2]] == [True, True]
    assert started[2].poll() is None  # the successful one's left running
    started[2].kill()
    started[2].wait()

    calls.clear()
    started.clear()
    monkeypatch.setattr(launcher.ray, "init", flaky_init(fail=99))
    with pytest.raises(Exception, match="timed out during startup"):
        launcher._start_local_ray(num_cpus=3)
    assert len(calls) == 3
    assert [p.poll() is not None for p in started[:2]] == [True, True]
    started[2].kill()
    started[2].wait()

    monkeypatch.setattr(launcher.ray, "init", lambda **kw: (_ for _ in ()).throw(ValueError("x")))
    with pytest.raises(ValueError):  # any other error: no retry
        launcher._start_local_ray(num_cpus=3)


def test_a_pool_ray_cannot_place_fails_the_start_naming_it_and_nothing_stays_up():
    """placement_group.ready() waits forever for a bundle no node offers: Pool.start gives up
    after start_timeout_s with the pool named, and the start cleans up what it started."""
    before = set(ray_descendants())
    nowhere = {"num_ranks": 1, "resources": {"epcluster_nowhere": 1.0}}
    cluster = make_cluster({"ray.start_timeout_s": 3.0, "prefill": nowhere, "decode.num_ranks": 1})
    with pytest.raises(TimeoutError, match="the prefill pool's 1 bundles were not placed in 3 s"):
        cluster.start()
    assert cluster.pools == {} and cluster.server is None
    ours = {p: c for p, c in ray_descendants().items() if p not in before}
    end = time.monotonic() + 30
    while alive(ours) and time.monotonic() < end:
        time.sleep(0.5)
    assert not alive(ours), {pid: ours[pid] for pid in alive(ours)}
