"""ClusterConfig: a YAML file, then command-line flags over it, as one tree of the role configs.
Checked once, at start: a wrong type, an unknown field, a bad value or malformed YAML fails with a
message that names the field by its dotted path (`decode.engine.max_num_seqs`).

The tree composes the dataclasses of the roles where the fields act, so each field has one name
from the YAML to there:

    model, dtype, drain_timeout_s
    engine:    EngineConfig (engine/config.py), every rank's engine
    prefill:   PoolConfig: num_ranks, placement_file, resources, engine: {overrides}
    decode:    PoolConfig
    routing:   RoutingConfig (router/backends/routing.py), the router's requests on the pools
    health:    HealthConfig (router/backends/pools.py), when a rank counts as failed
    calls:     CallsConfig, the timeouts of the router's calls to the ranks (cluster/handles.py)
    admission: AdmissionConfig (router/admission.py)
    security:  SecurityConfig, the files that secure the router's ports (router/auth.py)
    ports:     PortsConfig
    ray:       RayConfig, the Ray cluster and the rank processes on it

The flat config of the previous release is accepted with a warning (cluster/config_legacy.py).
"""

import typing
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from cluster.config_checks import (
    ConfigError,
    build_nested,
    build_section,
    check_types,
    describe,
    engine_message,
    is_a,
    reject_unknown,
    run_checks,
    set_path,
)
from cluster.config_legacy import upgrade_flat
from cluster.config_memory import pool_memory
from cluster.config_sections import (
    POOL_CHECKS,
    POOLS,
    SECTIONS,
    SET_BY_CLUSTER,
    CallsConfig,
    PoolConfig,
    PortsConfig,
    RayConfig,
    SecurityConfig,
    positive,
)
from engine.config import EngineConfig, EngineConfigError
from router.admission import AdmissionConfig
from router.backends.pools import HealthConfig
from router.backends.routing import RoutingConfig


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    model: str = "tiny"  # preset or checkpoint directory (visible to every node)
    dtype: str = "float32"
    drain_timeout_s: float = 30.0  # SIGTERM / Ctrl-C: in-flight streams get this long to finish
    engine: EngineConfig = field(default_factory=EngineConfig)
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    health: HealthConfig = field(default_factory=HealthConfig)
    calls: CallsConfig = field(default_factory=CallsConfig)
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    ports: PortsConfig = field(default_factory=PortsConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        for name, (cls, checks) in SECTIONS.items():
            section = getattr(self, name)
            if not isinstance(section, cls):
                raise ConfigError(f"{name} must be a mapping of {name} fields")
            check_types(cls, section, f"{name}.")
            run_checks(checks, section, f"{name}.")
        for name in POOLS:
            self._check_pool(name)
        check_types(type(self), self)
        run_checks(positive("drain_timeout_s"), self)
        try:  # NOTE: the engine section's model and dtype are the top level's
            engine = replace(self.engine, model=self.model, dtype=self.dtype)
        except EngineConfigError as e:
            raise ConfigError(engine_message(e, "")) from e
        object.__setattr__(self, "engine", engine)
        self._check_across()

    def _check_pool(self, name: str) -> None:
        pool = getattr(self, name)
        if not isinstance(pool, PoolConfig):
            raise ConfigError(f"{name} must be a mapping of pool fields")
        check_types(PoolConfig, pool, f"{name}.")
        run_checks(POOL_CHECKS, pool, f"{name}.")
        _refuse_set_by_cluster(pool.engine, f"{name}.engine.", keep=("cuda_graph",))
        engine_fields = {f.name for f in fields(EngineConfig)} - set(SET_BY_CLUSTER)
        reject_unknown(pool.engine, engine_fields | {"cuda_graph"}, f"{name}.engine.")
        hints = typing.get_type_hints(EngineConfig)
        for key, value in pool.engine.items():
            if not is_a(value, hints[key]):
                raise ConfigError(
                    f"{name}.engine.{key} must be {describe(hints[key])} (got "
                    f"{type(value).__name__} {value!r})"
                )

    def _check_across(self) -> None:
        """Checks over several fields, and of the files the router's process reads."""
        if self.calls.kv_start_timeout_s <= 2 * self.routing.kv_lease_s:
            raise ConfigError(
                "calls.kv_start_timeout_s must be more than 2 x routing.kv_lease_s (a decode "
                "start waits for the KV's turn and its transfer, each up to routing.kv_lease_s, "
                f"then imports it; routing.kv_lease_s is {self.routing.kv_lease_s!r}) (got "
                f"{self.calls.kv_start_timeout_s!r})"
            )
        if self.ray.keep_pools and self.ray.ray_address is None:
            raise ConfigError(
                "ray.keep_pools needs a Ray cluster that outlives the router: set "
                "ray.ray_address (a local Ray, which this router starts, stops with it)"
            )
        self._check_files()
        for pool in POOLS:
            if pool == "prefill" and self._pool_engine_value(pool, "cuda_graph"):
                raise ConfigError(
                    f"{self._engine_path(pool, 'cuda_graph')} is for the decode pool: prefill "
                    "ranks run no decode steps (set decode.engine.cuda_graph)"
                )
            try:
                self.engine_config(pool)
            except EngineConfigError as e:
                path = self._engine_path(pool, e.field).rpartition(".")[0] + "."
                raise ConfigError(engine_message(e, path)) from e
        if self.ray.gpu_memory_bytes is not None:
            for pool in POOLS:
                pool_memory(
                    self.model,
                    self.engine_config(pool),
                    pool,
                    getattr(self, pool),
                    self.ray.gpu_memory_bytes,
                )
        if self._pool_engine_value("decode", "cuda_graph") and self.ray.gpus_per_rank == 0:
            raise ConfigError(
                f"{self._engine_path('decode', 'cuda_graph')} needs GPUs: ray.gpus_per_rank is 0 "
                "(set it, or leave it null on a Ray cluster with GPUs, or turn cuda_graph off)"
            )

    def _pool_engine_value(self, pool: str, name: str) -> Any:
        return getattr(self, pool).engine.get(name, getattr(self.engine, name))

    def _engine_path(self, pool: str, name: str) -> str:
        """Where the engine field `name` of `pool`'s ranks is set: its override, or the shared
        engine section."""
        return f"{pool}.engine.{name}" if name in getattr(self, pool).engine else f"engine.{name}"

    def _check_files(self) -> None:
        """The model, security and placement files exist (the router's process reads them)."""
        from moe.presets import preset_names

        if self.model not in preset_names() and not (Path(self.model) / "config.json").is_file():
            raise ConfigError(
                f"model must be a preset ({', '.join(preset_names())}) or a checkpoint directory "
                f"with config.json (got {self.model!r}: no such directory or no config.json in it)"
            )
        s = self.security
        for name, path in s.files.items():
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"security.{name} {path!r} does not exist or is not a file")
        if (s.tls_cert_file is None) != (s.tls_key_file is None):
            raise ConfigError(
                "security.tls_cert_file and security.tls_key_file go together: set both or neither"
            )
        if s.tls_client_ca_file is not None and s.tls_cert_file is None:
            raise ConfigError(
                "security.tls_client_ca_file (mutual TLS) needs TLS: set security.tls_cert_file "
                "and security.tls_key_file"
            )
        if s.metrics_tls and s.tls_cert_file is None:
            raise ConfigError(
                "security.metrics_tls needs TLS: set security.tls_cert_file and tls_key_file"
            )
        for pool in POOLS:
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

        s = self.security
        if (
            is_loopback(self.ports.host)
            or s.auth_token_file is not None
            or s.tls_client_ca_file is not None
            or s.allow_insecure_bind
        ):
            return
        raise ConfigError(
            f"ports.host {self.ports.host!r} is reachable from other machines and the router "
            "would serve it without authentication: set security.auth_token_file (and "
            "security.tls_cert_file, tls_key_file), or security.tls_client_ca_file (mutual TLS); "
            "or set security.allow_insecure_bind: true to serve it open (--allow-insecure-bind)"
        )

    @property
    def keeps_pools(self) -> bool:
        """Whether a router's shutdown leaves the pools running (ray.keep_pools, decided)."""
        keep = self.ray.keep_pools
        return self.ray.ray_address is not None if keep is None else keep

    def engine_config(self, pool: str) -> EngineConfig:
        """The engine of a rank of `pool`: the engine section with the pool's overrides. NOTE:
        call it on a resolved config (resolve_gpus): gpus_per_rank None means "not decided yet"
        and gives a CPU engine."""
        device = "cuda" if (self.ray.gpus_per_rank or 0) > 0 else "cpu"
        # NOTE: a resolved config on CPUs has none (_check_across, resolve_gpus refuse it)
        cuda_graph = self._pool_engine_value(pool, "cuda_graph") and device == "cuda"
        overrides = {**getattr(self, pool).engine, "device": device, "cuda_graph": cuda_graph}
        return replace(self.engine, **overrides)

    def resolve_gpus(self, cluster_gpus: float) -> "ClusterConfig":
        """gpus_per_rank decided from what the Ray cluster offers (1 per rank when it has GPUs)."""
        if self.ray.gpus_per_rank is not None:
            return self
        if cluster_gpus < 1 and self._pool_engine_value("decode", "cuda_graph"):
            raise ConfigError(
                f"{self._engine_path('decode', 'cuda_graph')} needs GPUs and this Ray cluster "
                f"offers {cluster_gpus:g}: turn it off, or join a cluster with a GPU per rank"
            )
        gpus = 1.0 if cluster_gpus >= 1 else 0.0
        return replace(self, ray=replace(self.ray, gpus_per_rank=gpus))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ClusterConfig":
        """The config from its YAML tree (or the old flat mapping, with a warning)."""
        if not isinstance(raw, dict):
            raise ConfigError(f"the config must be a mapping of fields, got {type(raw).__name__}")
        data = upgrade_flat(raw)
        reject_unknown(data, {f.name for f in fields(cls)}, "")
        built = {k: v for k, v in data.items() if k not in SECTIONS and k not in POOLS}
        for name, (section_cls, checks) in SECTIONS.items():
            if name in data:
                exclude: tuple[str, ...] = ()
                section = data[name]
                if section_cls is EngineConfig and isinstance(section, dict):
                    _refuse_set_by_cluster(section, "engine.")
                    exclude = tuple(SET_BY_CLUSTER)
                    section = build_nested(EngineConfig, section, name)
                built[name] = build_section(section_cls, section, name, checks, exclude)
        for name in POOLS:
            if name in data:
                if not isinstance(data[name], dict):
                    got = data[name]
                    raise ConfigError(f"{name} must be a mapping of pool fields, got {got!r}")
                pool = data[name]
                if isinstance(pool.get("engine"), dict):  # kv_tiers: {...} -> KVTiersConfig
                    engine = build_nested(EngineConfig, pool["engine"], f"{name}.engine")
                    pool = {**pool, "engine": engine}
                built[name] = build_section(PoolConfig, pool, name, POOL_CHECKS)
        return cls(**built)

    @classmethod
    def load(
        cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None
    ) -> "ClusterConfig":
        """The YAML file (if any), then the non-None `overrides`, keyed by dotted path
        ("ports.port", "prefill.num_ranks"; a mapping value replaces the whole section)."""
        raw: Any = {}
        if path:
            try:
                raw = yaml.safe_load(Path(path).read_text()) or {}
            except OSError as e:
                raise ConfigError(f"cannot read the config file {path}: {e.strerror}") from e
            except yaml.YAMLError as e:
                raise ConfigError(f"{path} is not valid YAML: {e}") from e
        if not isinstance(raw, dict):
            return cls.from_dict(raw)  # refused, naming what it got
        # NOTE: the flags join the file's fields before the checks, so that a check over
        # several fields sees both (a public host in the file, its token file as a flag); the
        # file's old flat keys move first, so a flag lands on the path they moved to
        raw = upgrade_flat(raw)
        for key, value in (overrides or {}).items():
            if value is not None:
                set_path(raw, key, value)
        return cls.from_dict(raw)


def _refuse_set_by_cluster(
    section: dict[str, Any], prefix: str, keep: tuple[str, ...] = ()
) -> None:
    """A ConfigError for an engine field of SET_BY_CLUSTER in `section` (but those in keep)."""
    for name, why in SET_BY_CLUSTER.items():
        if name in section and name not in keep:
            raise ConfigError(f"{prefix}{name} {why}, not here")
