"""ClusterConfig: a YAML file, then command-line flags over it. Checked once, at start: a wrong
type, an unknown field, a bad value or malformed YAML fails with a message that names the field."""

import re
import types
import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from engine.config import EngineConfig


class ConfigError(ValueError):
    """An invalid cluster config; the message names the field."""


def _check_types(obj: object, prefix: str = "") -> None:
    """Every field of a config dataclass holds a value of its annotated type (ints are accepted
    for floats; bools are never numbers)."""
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        value, hint = getattr(obj, f.name), hints[f.name]
        if not _is_a(value, hint):
            raise ConfigError(
                f"{prefix}{f.name} must be {_describe(hint)} (got {type(value).__name__} {value!r})"
            )


def _is_a(value: object, hint: Any) -> bool:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is_a(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if origin is dict:
        key_t, value_t = typing.get_args(hint)
        return isinstance(value, dict) and all(
            _is_a(k, key_t) and _is_a(v, value_t) for k, v in value.items()
        )
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    return isinstance(value, hint)


def _describe(hint: Any) -> str:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(h) for h in typing.get_args(hint))
    if hint is type(None):
        return "null"
    if origin is dict:
        key_t, value_t = typing.get_args(hint)
        return f"a mapping of {_describe(key_t)} to {_describe(value_t)}"
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(
        hint, getattr(hint, "__name__", str(hint))
    )


def _need(checks: list[tuple[bool, str, str]], obj: object, prefix: str = "") -> None:
    for ok, name, why in checks:
        if not ok:
            raise ConfigError(f"{prefix}{name} {why} (got {getattr(obj, name)!r})")


@dataclass(frozen=True, slots=True)
class PoolConfig:
    num_ranks: int = 2  # the pool's expert-parallel size
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    two_batch_overlap: str = "auto"
    placement_file: str | None = None  # the expert placement to start with (rebalance --save)
    # custom Ray resources each rank's bundle asks for, e.g. {"epcluster_prefill": 1}: a
    # pool's ranks then land only on nodes (worker groups) that offer them
    resources: dict[str, float] = field(default_factory=dict)
    # decode steps replayed from CUDA graphs (engine/decode_graphs.py): the decode pool on GPUs;
    # a rank whose experts are shared (num_ranks > 1) runs them eagerly
    cuda_graph: bool = False
    cuda_graph_max_batch: int = 32

    def check(self, name: str) -> None:
        _check_types(self, f"{name}.")
        _need(
            [
                (self.num_ranks >= 1, "num_ranks", "must be >= 1"),
                (self.max_num_seqs >= 1, "max_num_seqs", "must be >= 1"),
                (self.max_num_batched_tokens >= 1, "max_num_batched_tokens", "must be >= 1"),
                (
                    self.two_batch_overlap in ("on", "off", "auto"),
                    "two_batch_overlap",
                    "must be on, off or auto",
                ),
                (all(v > 0 for v in self.resources.values()), "resources", "must be > 0 each"),
                (self.cuda_graph_max_batch >= 1, "cuda_graph_max_batch", "must be >= 1"),
                (
                    not (self.cuda_graph and name == "prefill"),
                    "cuda_graph",
                    "is for the decode pool: prefill ranks run no decode steps",
                ),
            ],
            self,
            f"{name}.",
        )


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    model: str = "tiny"  # preset or checkpoint directory (visible to every node)
    dtype: str = "float32"
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    kv_cache_bytes: int = 256 * 2**20  # per rank
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's; lowered to what every cache holds
    enable_prefix_caching: bool = True
    host: str = "127.0.0.1"  # gRPC
    port: int = 50051
    http_port: int | None = 8000  # OpenAI-compatible HTTP on `host` (0: any; null: off)
    metrics_port: int | None = 9400  # the router's /metrics and /sd/targets (0: any; null: off)
    rank_metrics_port: int | None = 9401  # a rank's /metrics: first port tried on its node
    # Security of the gRPC and HTTP ports (README "Security", router/auth.py): a bearer token,
    # TLS, and mutual TLS with a client CA
    auth_token_file: str | None = None  # clients send `authorization: Bearer <file's text>`
    admin_token_file: str | None = None  # Rebalance, others' vLLM Abort (a client token too)
    tls_cert_file: str | None = None  # PEM server certificate (with tls_key_file): TLS on
    tls_key_file: str | None = None
    tls_client_ca_file: str | None = None  # PEM CA: clients must present a cert it signed
    metrics_tls: bool = False  # the router's metrics port over TLS too (tls_cert_file's cert)
    metrics_token_file: str | None = None  # the metrics port wants this bearer token (Prometheus)
    # a host other than loopback needs auth_token_file or tls_client_ca_file, or this
    allow_insecure_bind: bool = False
    ray_address: str | None = None  # None: start a local Ray; "auto" or host:port: join
    # names the pools' detached actors on Ray: a router started on a Ray cluster where this
    # cluster's pools run attaches to them (cluster/registry.py)
    cluster_name: str = "default"
    # at shutdown, keep the pools running for the next router (null: keep them on a joined Ray,
    # ray_address set; remove them with the local Ray this router started)
    keep_pools: bool | None = None
    gpus_per_rank: float | None = None  # None: 1 when the Ray cluster has GPUs, else 0
    cpus_per_rank: float = 0.5  # CPU share of a rank's bundle
    torch_threads: int = 1  # per rank process
    max_queued_requests: int = 1024
    max_queued_tokens: int = 1 << 20
    kv_transfer_timeout_s: float = 30.0  # a decode reservation's lease, renewed by the router
    # decode `start`: the KV's turn and its transfer (each up to kv_transfer_timeout_s) and its
    # import; a start that runs out is that request's loss (it resumes), never the rank's
    kv_start_timeout_s: float = 90.0
    kv_transport: str = "object_store"  # or "p2p": torch.distributed send/recv between ranks
    reserve_wait_s: float = 10.0  # a request waits this long for decode KV room (then 429-like)
    rank_call_timeout_s: float = 30.0  # every control call to a rank (reserve, start, status...)
    rank_stall_timeout_s: float = 30.0  # a rank with work and no progress for this long is hung
    collective_timeout_s: float = 60.0  # torch.distributed collectives inside a pool
    recovery_wait_s: float = 120.0  # a request waits this long for a re-forming pool
    max_resumes: int = 3  # times one request is resumed after rank failures
    drain_timeout_s: float = 30.0  # SIGTERM / Ctrl-C: in-flight streams get this long to finish
    eplb_interval_s: float = 0.0  # rebalance both pools' experts this often (0: on demand only)
    eplb_min_gain: float = 0.05  # skip a rebalance that lowers the max rank load by less
    eplb_max_moves: int = 0  # slots per layer one rebalance may change (0: any)
    eplb_layers_per_round: int = 1  # layers moved and switched per round (0: all at once)
    eplb_decay: float = 0.5  # share of the previous load window kept at each rebalance
    start_timeout_s: float = 300.0
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the rank actors

    def __post_init__(self) -> None:
        for name in ("prefill", "decode"):
            if not isinstance(getattr(self, name), PoolConfig):
                raise ConfigError(f"{name} must be a mapping of pool fields")
        self.prefill.check("prefill")
        self.decode.check("decode")
        _check_types(self)
        positive = [
            "kv_cache_bytes",
            "cpus_per_rank",
            "kv_transfer_timeout_s",
            "kv_start_timeout_s",
            "reserve_wait_s",
            "rank_call_timeout_s",
            "rank_stall_timeout_s",
            "collective_timeout_s",
            "recovery_wait_s",
            "drain_timeout_s",
            "start_timeout_s",
        ]
        _need(
            [(getattr(self, name) > 0, name, "must be > 0") for name in positive]
            + [
                (self.block_size >= 1, "block_size", "must be >= 1"),
                (0 <= self.port < 65536, "port", "must be in [0, 65536)"),
                (
                    self.http_port is None or 0 <= self.http_port < 65536,
                    "http_port",
                    "must be null or in [0, 65536)",
                ),
                (
                    self.metrics_port is None or 0 <= self.metrics_port < 65536,
                    "metrics_port",
                    "must be null or in [0, 65536)",
                ),
                (
                    self.rank_metrics_port is None or 0 <= self.rank_metrics_port < 65520,
                    "rank_metrics_port",
                    "must be null or in [0, 65520) (ranks on a node take up to 16 ports)",
                ),
                (self.torch_threads >= 1, "torch_threads", "must be >= 1"),
                (
                    re.fullmatch(r"[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?", self.cluster_name)
                    is not None,
                    "cluster_name",
                    "must be 1-40 lowercase letters, digits and dashes (not at either end)",
                ),
                (self.max_queued_requests >= 1, "max_queued_requests", "must be >= 1"),
                (self.max_queued_tokens >= 1, "max_queued_tokens", "must be >= 1"),
                (self.max_resumes >= 0, "max_resumes", "must be >= 0"),
                (
                    self.kv_start_timeout_s > 2 * self.kv_transfer_timeout_s,
                    "kv_start_timeout_s",
                    "must be more than 2 x kv_transfer_timeout_s (a decode start waits for the "
                    "KV's turn and its transfer, each up to kv_transfer_timeout_s, then imports "
                    f"it; kv_transfer_timeout_s is {self.kv_transfer_timeout_s!r})",
                ),
                (
                    self.gpus_per_rank is None or self.gpus_per_rank >= 0,
                    "gpus_per_rank",
                    "must be null or >= 0",
                ),
                (
                    self.kv_transport in ("object_store", "p2p"),
                    "kv_transport",
                    "must be object_store or p2p",
                ),
            ],
            self,
        )
        if self.keep_pools and self.ray_address is None:
            raise ConfigError(
                "keep_pools needs a Ray cluster that outlives the router: set ray_address (a "
                "local Ray, which this router starts, stops with it)"
            )
        self._check_files()
        if self.decode.cuda_graph and self.gpus_per_rank == 0:
            raise ConfigError(
                "decode.cuda_graph needs GPUs: gpus_per_rank is 0 (set it, or leave it null "
                "on a Ray cluster with GPUs, or turn decode.cuda_graph off)"
            )
        try:
            for pool in ("prefill", "decode"):
                self.engine_config(pool)
        except ValueError as e:
            raise ConfigError(str(e)) from e

    def _check_files(self) -> None:
        """The model, security and placement files exist (the router's process reads them)."""
        from moe.presets import preset_names

        if self.model not in preset_names() and not (Path(self.model) / "config.json").is_file():
            raise ConfigError(
                f"model must be a preset ({', '.join(preset_names())}) or a checkpoint directory "
                f"with config.json (got {self.model!r}: no such directory or no config.json in it)"
            )
        for name in (
            "auth_token_file",
            "admin_token_file",
            "tls_cert_file",
            "tls_key_file",
            "tls_client_ca_file",
            "metrics_token_file",
        ):
            path = getattr(self, name)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{name} {path!r} does not exist or is not a file")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("tls_cert_file and tls_key_file go together: set both or neither")
        if self.tls_client_ca_file is not None and self.tls_cert_file is None:
            raise ConfigError(
                "tls_client_ca_file (mutual TLS) needs TLS: set tls_cert_file and tls_key_file"
            )
        if self.metrics_tls and self.tls_cert_file is None:
            raise ConfigError("metrics_tls needs TLS: set tls_cert_file and tls_key_file")
        for pool in ("prefill", "decode"):
            path = getattr(self, pool).placement_file
            if path is not None and not Path(path).is_file():
                raise ConfigError(
                    f"{pool}.placement_file {path!r} does not exist (write one with "
                    "`epcluster rebalance --save FILE`)"
                )
        self._check_bind()

    def _check_bind(self) -> None:
        """The router's ports on an address others reach need a credential: a bearer token or
        mutual TLS (forced with allow_insecure_bind, for a network that is private anyway)."""
        from router.auth import is_loopback

        if (
            is_loopback(self.host)
            or self.auth_token_file is not None
            or self.tls_client_ca_file is not None
            or self.allow_insecure_bind
        ):
            return
        raise ConfigError(
            f"host {self.host!r} is reachable from other machines and the router would serve it "
            "without authentication: set auth_token_file (and tls_cert_file, tls_key_file), or "
            "tls_client_ca_file (mutual TLS); or set allow_insecure_bind: true to serve it open "
            "(--allow-insecure-bind)"
        )

    @property
    def keeps_pools(self) -> bool:
        """Whether a router's shutdown leaves the pools running (keep_pools, decided)."""
        return self.ray_address is not None if self.keep_pools is None else self.keep_pools

    def engine_config(self, pool: str) -> EngineConfig:
        """The engine of a rank of `pool`. NOTE: call it on a resolved config (resolve_gpus):
        gpus_per_rank None means "not decided yet" and gives a CPU engine."""
        p: PoolConfig = getattr(self, pool)
        device = "cuda" if (self.gpus_per_rank or 0) > 0 else "cpu"
        return EngineConfig(
            model=self.model,
            dtype=self.dtype,
            device=device,
            block_size=self.block_size,
            kv_cache_bytes=self.kv_cache_bytes,
            max_num_seqs=p.max_num_seqs,
            max_num_batched_tokens=p.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            enable_prefix_caching=self.enable_prefix_caching,
            two_batch_overlap=p.two_batch_overlap,
            # NOTE: a resolved config on CPUs has none (__post_init__, resolve_gpus refuse it)
            cuda_graph=p.cuda_graph and device == "cuda",
            cuda_graph_max_batch=p.cuda_graph_max_batch,
            eplb_min_gain=self.eplb_min_gain,
            eplb_max_moves=self.eplb_max_moves,
            eplb_layers_per_round=self.eplb_layers_per_round,
            eplb_decay=self.eplb_decay,
        )

    def resolve_gpus(self, cluster_gpus: float) -> "ClusterConfig":
        """gpus_per_rank decided from what the Ray cluster offers (1 per rank when it has GPUs)."""
        if self.gpus_per_rank is not None:
            return self
        if cluster_gpus < 1 and self.decode.cuda_graph:
            raise ConfigError(
                f"decode.cuda_graph needs GPUs and this Ray cluster offers {cluster_gpus:g}: "
                "turn decode.cuda_graph off, or join a cluster with a GPU per rank"
            )
        return replace(self, gpus_per_rank=1.0 if cluster_gpus >= 1 else 0.0)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ClusterConfig":
        if not isinstance(raw, dict):
            raise ConfigError(f"the config must be a mapping of fields, got {type(raw).__name__}")
        data = dict(raw)
        _reject_unknown(data, cls, "")
        for pool in ("prefill", "decode"):
            if pool not in data:
                continue
            if not isinstance(data[pool], dict):
                raise ConfigError(f"{pool} must be a mapping of pool fields, got {data[pool]!r}")
            _reject_unknown(data[pool], PoolConfig, f"{pool}.")
            data[pool] = PoolConfig(**data[pool])
        return cls(**data)

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> "ClusterConfig":
        """The YAML file (if any), then the non-None overrides; `prefill_ranks` and
        `decode_ranks` set the pools' sizes."""
        raw: Any = {}
        if path:
            try:
                raw = yaml.safe_load(Path(path).read_text()) or {}
            except OSError as e:
                raise ConfigError(f"cannot read the config file {path}: {e.strerror}") from e
            except yaml.YAMLError as e:
                raise ConfigError(f"{path} is not valid YAML: {e}") from e
        ranks = {pool: overrides.pop(f"{pool}_ranks", None) for pool in ("prefill", "decode")}
        overrides = {k: v for k, v in overrides.items() if v is not None}
        _reject_unknown(overrides, cls, "")
        if isinstance(raw, dict):
            # NOTE: the flags join the file's fields before the checks, so that a check over
            # several fields sees both (a public host in the file, its token file as a flag)
            raw = {**raw, **overrides}
        config = cls.from_dict(raw)  # the overrides are in raw (a non-mapping is refused)
        pools = {
            p: replace(getattr(config, p), num_ranks=n) for p, n in ranks.items() if n is not None
        }
        return replace(config, **pools) if pools else config


def _reject_unknown(data: dict[str, Any], cls: type, prefix: str) -> None:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        names = ", ".join(f"{prefix}{u}" for u in unknown)
        raise ConfigError(f"unknown config field {names}; known fields: {sorted(known)}")
