"""The router's metrics port as the cluster config sets it up (cluster/launcher.py): with
metrics_tls and metrics_token_file, /metrics and /sd/targets answer over TLS to the token only,
and discovery marks the router's own target https for Prometheus. No Ray: the launcher's metrics
step alone, over a stand-in backend."""

import json

import pytest

from cluster.config import ClusterConfig
from cluster.config_sections import PortsConfig, SecurityConfig
from cluster.launcher import Cluster
from router.metrics import RouterMetrics
from tests.router.api.test_http_security import NO_RESPONSE, context, raw
from tests.router.test_security import TOKEN, write_pki

RANK_TARGET = {"targets": ["10.0.0.7:9401"], "labels": {"pool": "decode", "rank": "0"}}


class _Backend:
    def pool_ready(self, pool: str) -> float:
        return 1.0

    def sd_targets(self) -> list[dict]:
        return [RANK_TARGET]


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> dict[str, str]:
    return write_pki(tmp_path_factory.mktemp("pki"))


def metrics_of(config: ClusterConfig) -> Cluster:
    cluster = Cluster(config)
    cluster.metrics, cluster.backend = RouterMetrics(config.model), _Backend()
    cluster._serve_metrics()
    return cluster


def test_metrics_tls_and_token(pki):
    security = SecurityConfig(
        tls_cert_file=pki["server_cert"],
        tls_key_file=pki["server_key"],
        metrics_tls=True,
        metrics_token_file=pki["token"],
    )
    config = ClusterConfig(ports=PortsConfig(metrics_port=0), security=security)
    server = metrics_of(config).metrics_server
    try:
        auth = f"Bearer {TOKEN}"
        status, _, body = raw(server.port, "/sd/targets", auth, context(pki))
        router = {"pool": "router", "model_name": "tiny", "__scheme__": "https"}
        assert status == 200
        assert json.loads(body) == [{"targets": [server.endpoint], "labels": router}, RANK_TARGET]
        status, _, body = raw(server.port, "/metrics", auth, context(pki))
        assert status == 200 and b'pool="router",target_pool="decode"} 1.0' in body
        for path in ("/metrics", "/sd/targets"):
            assert raw(server.port, path, None, context(pki))[0] == 401
            assert raw(server.port, path, "Bearer wrong", context(pki))[0] == 401
            with pytest.raises(NO_RESPONSE):
                raw(server.port, path, auth)  # plaintext
    finally:
        server.close()


def test_metrics_stay_plain_and_open_by_default(pki):
    server = metrics_of(ClusterConfig(ports=PortsConfig(metrics_port=0))).metrics_server
    try:
        status, _, body = raw(server.port, "/sd/targets", None)
        assert status == 200 and "__scheme__" not in json.loads(body)[0]["labels"]
    finally:
        server.close()
