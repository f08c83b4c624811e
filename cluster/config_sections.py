"""The sections of the cluster config that no role class of another package holds: a pool, the
router's calls to the ranks, the security files, the ports and Ray; and the value checks of every
section by field (cluster/config_checks.py runs them, naming `section.field`)."""

import re
from dataclasses import dataclass, field, fields
from typing import Any

from cluster.config_checks import Check
from engine.config import EngineConfig
from router.admission import AdmissionConfig
from router.backends.pools import HealthConfig
from router.backends.routing import RoutingConfig

POOLS = ("prefill", "decode")
# EngineConfig fields the engine sections may not set, and where they are set instead
SET_BY_CLUSTER = {
    "model": "is set at the top level (model)",
    "dtype": "is set at the top level (dtype)",
    "device": "follows ray.gpus_per_rank",
    # NOTE: the shared section's engine is built before the device is known (a CPU one)
    "cuda_graph": "is for the decode pool: set decode.engine.cuda_graph",
}


@dataclass(frozen=True, slots=True)
class PoolConfig:
    num_ranks: int = 2  # the pool's expert-parallel size
    placement_file: str | None = None  # the expert placement to start with (rebalance --save)
    # custom Ray resources each rank's bundle asks for, e.g. {"epcluster_prefill": 1}: a
    # pool's ranks then land only on nodes (worker groups) that offer them
    resources: dict[str, float] = field(default_factory=dict)
    # this pool's values of EngineConfig fields, over the shared `engine` section
    engine: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class CallsConfig:
    """The router's calls to the ranks (cluster/handles.py)."""

    rank_call_timeout_s: float = 30.0  # every control call to a rank (reserve, status...)
    # decode `start`: the KV's turn and its transfer (each up to routing.kv_lease_s) and its
    # import; a start that runs out is that request's loss (it resumes), never the rank's
    kv_start_timeout_s: float = 90.0


@dataclass(frozen=True, slots=True)
class SecurityConfig:
    """The files that secure the router's gRPC, HTTP and metrics ports (README "Security")."""

    auth_token_file: str | None = None  # clients send `authorization: Bearer <file's text>`
    admin_token_file: str | None = None  # Rebalance, others' vLLM Abort (a client token too)
    tls_cert_file: str | None = None  # PEM server certificate (with tls_key_file): TLS on
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None  # PEM CA: clients must present a cert it signed
    metrics_tls: bool = False  # the router's metrics port over TLS too (tls_cert_file's cert)
    metrics_token_file: str | None = None  # the metrics port wants this bearer token
    # a ports.host other than loopback needs auth_token_file or tls_client_ca_file, or this
    allow_insecure_bind: bool = False

    @property
    def files(self) -> dict[str, str | None]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name.endswith("_file")}


@dataclass(frozen=True, slots=True)
class PortsConfig:
    host: str = "127.0.0.1"  # gRPC, HTTP and the router's metrics
    port: int = 50051  # gRPC
    http_port: int | None = 8000  # OpenAI-compatible HTTP (0: any; null: off)
    metrics_port: int | None = 9400  # the router's /metrics and /sd/targets (0: any; null: off)
    rank_metrics_port: int | None = 9401  # a rank's /metrics: first port tried on its node


@dataclass(frozen=True, slots=True)
class RayConfig:
    ray_address: str | None = None  # None: start a local Ray; "auto" or host:port: join
    # names the pools' detached actors on Ray: a router started on a Ray cluster where this
    # cluster's pools run attaches to them (cluster/registry.py)
    cluster_name: str = "default"
    # at shutdown, keep the pools running for the next router (null: keep them on a joined Ray,
    # ray_address set; remove them with the local Ray this router started)
    keep_pools: bool | None = None
    gpus_per_rank: float | None = None  # None: 1 when the Ray cluster has GPUs, else 0
    # bytes of one GPU: every pool's rank must fit it (cluster/config_memory.py) before Ray
    # starts; null: unknown, no check
    gpu_memory_bytes: float | None = None
    cpus_per_rank: float = 0.5  # CPU share of a rank's bundle
    torch_threads: int = 1  # per rank process
    start_timeout_s: float = 300.0  # a pool's placement and start
    collective_timeout_s: float = 60.0  # torch.distributed collectives inside a pool
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the rank actors


def _port(name: str, top: int = 65536, why: str = "") -> Check:
    return (
        name,
        lambda s: getattr(s, name) is None or 0 <= getattr(s, name) < top,
        f"must be null or in [0, {top}){why}",
    )


def positive(*names: str) -> list[Check]:
    return [(n, lambda s, n=n: getattr(s, n) > 0, "must be > 0") for n in names]


def at_least(low: int, *names: str) -> list[Check]:
    return [(n, lambda s, n=n: getattr(s, n) >= low, f"must be >= {low}") for n in names]


# section -> (its class, its value checks; EngineConfig checks its own)
SECTIONS: dict[str, tuple[type, list[Check]]] = {
    "engine": (EngineConfig, []),
    "routing": (
        RoutingConfig,
        positive("kv_lease_s", "reserve_wait_s", "recovery_wait_s")
        + at_least(1, "max_reserve_waiters", "affinity_blocks")
        + at_least(0, "max_resumes", "prefill_max_imbalance", "eplb_interval_s"),
    ),
    "health": (
        HealthConfig,
        positive("stall_timeout_s", "status_interval_s", "status_timeout_s", "reform_retry_s")
        + at_least(1, "max_misses"),
    ),
    "calls": (CallsConfig, positive("rank_call_timeout_s", "kv_start_timeout_s")),
    "admission": (AdmissionConfig, at_least(1, "max_queued_requests", "max_queued_tokens")),
    "security": (SecurityConfig, []),
    "ports": (
        PortsConfig,
        [
            ("port", lambda s: 0 <= s.port < 65536, "must be in [0, 65536)"),
            _port("http_port"),
            _port("metrics_port"),
            _port("rank_metrics_port", 65520, " (ranks on a node take up to 16 ports)"),
        ],
    ),
    "ray": (
        RayConfig,
        positive("cpus_per_rank", "start_timeout_s", "collective_timeout_s")
        + at_least(1, "torch_threads")
        + [
            (
                "cluster_name",
                lambda s: (
                    re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?", s.cluster_name) is not None
                ),
                "must be 1-40 lowercase letters, digits and dashes (not at either end)",
            ),
            (
                "gpus_per_rank",
                lambda s: s.gpus_per_rank is None or s.gpus_per_rank >= 0,
                "must be null or >= 0",
            ),
            (
                "gpu_memory_bytes",
                lambda s: s.gpu_memory_bytes is None or s.gpu_memory_bytes > 0,
                "must be null or > 0",
            ),
        ],
    ),
}
POOL_CHECKS: list[Check] = at_least(1, "num_ranks") + [
    ("resources", lambda p: all(v > 0 for v in p.resources.values()), "must be > 0 each")
]
