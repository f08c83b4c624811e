"""A cluster's life: health is NOT_SERVING until both pools are ready; a KV transfer that fails
ends its request with an error and leaks no block; shutdown leaves no process behind."""

import subprocess
import threading
import time

import grpc
import pytest

from engine import SamplingParams
from engine.kv_transfer import FAIL_IMPORT_ENV
from router.client import InferenceClient
from tests.cluster.conftest import make_cluster, wait_quiet
from tests.ep_harness import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def ray_processes() -> list[str]:
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return [
        line
        for line in out.splitlines()
        if any(k in line for k in ("raylet", "gcs_server", "ray::", "default_worker"))
        and "<defunct>" not in line  # a zombie is already dead
    ]


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


def test_startup_health_failed_transfer_and_clean_shutdown():
    assert not ray_processes(), "a Ray from an earlier test is still running"
    port = free_port()
    seen: list = []
    stop = threading.Event()
    cluster = make_cluster(port=port, prefill_ranks=1, decode_ranks=1, env={FAIL_IMPORT_ENV: "1"})
    # NOTE: Ray first: its processes must not be forked while another thread is inside gRPC.
    cluster.start_ray()
    watcher = threading.Thread(target=watch_health, args=(port, seen, stop))
    watcher.start()
    try:
        cluster.start()
    finally:
        watcher.join(30)
        stop.set()
    assert "NOT_SERVING" in seen, seen
    assert seen[-2:] == ["SERVING", "ranks ready at SERVING: [True, True]"], seen
    try:
        with InferenceClient(cluster.address, timeout=60) as client:
            with pytest.raises(grpc.RpcError) as err:
                client.complete(list(range(5, 60)), SamplingParams(max_tokens=8), timeout=60)
            assert err.value.code() == grpc.StatusCode.INTERNAL
            assert "KV cache did not reach decode rank" in err.value.details()
            status = wait_quiet(client)  # no block reserved or held anywhere
            assert all(
                r.kv_used_blocks == 0 and r.num_reserved == 0 for p in status.pools for r in p.ranks
            )
            # the cluster still serves requests that finish on the prefill rank
            out = client.complete([5, 6, 7], SamplingParams(max_tokens=1, temperature=0))
            assert out.num_completion_tokens == 1
    finally:
        cluster.shutdown()
    end = time.monotonic() + 30
    while ray_processes() and time.monotonic() < end:
        time.sleep(0.5)
    assert not ray_processes()
