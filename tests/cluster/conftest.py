"""A real local Ray cluster: 2 prefill ranks and 2 decode ranks on the tiny-random model (unless
told otherwise), with the gRPC router on 127.0.0.1, shared by the tests of a module."""

import time

from cluster.config import ClusterConfig
from cluster.launcher import Cluster
from router.client import InferenceClient


def wait_quiet(client: InferenceClient, timeout: float = 20.0):
    """Until no rank holds a referenced block, a reservation or a request; -> the status."""
    end = time.monotonic() + timeout
    while True:
        status = client.cluster_status()
        busy = [
            (p.name, r.rank, r.kv_used_blocks, r.num_reserved, r.num_running, r.num_waiting)
            for p in status.pools
            for r in p.ranks
            if r.kv_used_blocks or r.num_reserved or r.num_running or r.num_waiting
        ]
        if not busy and status.num_in_flight == 0 and status.num_queued == 0:
            return status
        if time.monotonic() > end:
            raise AssertionError(f"ranks still busy: {busy}, in flight {status.num_in_flight}")
        time.sleep(0.05)


def make_cluster(overrides: dict[str, object] | None = None) -> Cluster:
    """overrides: config fields by dotted path ("routing.kv_p2p"), over any free ports and the
    tiny-random model."""
    defaults = {
        "ports.port": 0,
        "ports.http_port": 0,
        "ports.metrics_port": 0,
        "ports.rank_metrics_port": 0,
        "model": "tiny-random",
    }
    return Cluster(ClusterConfig.load(None, {**defaults, **(overrides or {})}))


def start_cluster(overrides: dict[str, object] | None = None) -> Cluster:
    return make_cluster(overrides).start()
