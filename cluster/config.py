"""ClusterConfig: a YAML file, then command-line flags over it. Checked once, at start."""

from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from engine.config import EngineConfig


class ConfigError(ValueError):
    """An invalid cluster config; the message names the field."""


@dataclass(frozen=True, slots=True)
class PoolConfig:
    num_ranks: int = 2  # the pool's expert-parallel size
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    two_batch_overlap: str = "auto"

    def check(self, name: str) -> None:
        if not isinstance(self.num_ranks, int) or self.num_ranks < 1:
            raise ConfigError(f"{name}.num_ranks must be an integer >= 1 (got {self.num_ranks!r})")


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    model: str = "tiny"  # preset or checkpoint directory (visible to every node)
    dtype: str = "float32"
    prefill: PoolConfig = field(default_factory=PoolConfig)
    decode: PoolConfig = field(default_factory=PoolConfig)
    kv_cache_bytes: int = 256 * 2**20  # per rank
    block_size: int = 16
    enable_prefix_caching: bool = True
    host: str = "127.0.0.1"  # gRPC
    port: int = 50051
    ray_address: str | None = None  # None: start a local Ray; "auto" or host:port: join
    gpus_per_rank: float | None = None  # None: 1 when the cluster has GPUs, else 0
    cpus_per_rank: float = 0.5  # CPU share of a rank's bundle
    torch_threads: int = 1  # per rank process
    max_queued_requests: int = 1024
    max_queued_tokens: int = 1 << 20
    kv_transfer_timeout_s: float = 30.0
    kv_transport: str = "object_store"  # or "p2p": torch.distributed send/recv between ranks
    start_timeout_s: float = 300.0
    env: dict[str, str] = field(default_factory=dict)  # extra environment for the rank actors

    def __post_init__(self) -> None:
        self.prefill.check("prefill")
        self.decode.check("decode")
        checks = [
            (self.kv_cache_bytes > 0, "kv_cache_bytes", "must be > 0"),
            (self.block_size >= 1, "block_size", "must be >= 1"),
            (0 <= self.port < 65536, "port", "must be in [0, 65536)"),
            (self.cpus_per_rank > 0, "cpus_per_rank", "must be > 0"),
            (self.torch_threads >= 1, "torch_threads", "must be >= 1"),
            (self.kv_transfer_timeout_s > 0, "kv_transfer_timeout_s", "must be > 0"),
            (self.max_queued_requests >= 1, "max_queued_requests", "must be >= 1"),
            (
                self.kv_transport in ("object_store", "p2p"),
                "kv_transport",
                "must be object_store or p2p",
            ),
        ]
        for ok, name, why in checks:
            if not ok:
                raise ConfigError(f"{name} {why} (got {getattr(self, name)!r})")
        try:
            self.engine_config("prefill")
        except ValueError as e:
            raise ConfigError(str(e)) from e

    def engine_config(self, pool: str) -> EngineConfig:
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
            enable_prefix_caching=self.enable_prefix_caching,
            two_batch_overlap=p.two_batch_overlap,
        )

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> "ClusterConfig":
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ConfigError(f"unknown config fields {unknown}; known: {sorted(known)}")
        data = dict(raw)
        for pool in ("prefill", "decode"):
            if isinstance(data.get(pool), dict):
                pool_known = {f.name for f in fields(PoolConfig)}
                bad = sorted(set(data[pool]) - pool_known)
                if bad:
                    raise ConfigError(
                        f"unknown fields {bad} in {pool}; known: {sorted(pool_known)}"
                    )
                data[pool] = PoolConfig(**data[pool])
        try:
            return cls(**data)
        except TypeError as e:
            raise ConfigError(str(e)) from e

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides: Any) -> "ClusterConfig":
        """The YAML file (if any), then the non-None overrides; `prefill_ranks` and
        `decode_ranks` set the pools' sizes."""
        raw = yaml.safe_load(Path(path).read_text()) if path else {}
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: the config must be a mapping")
        config = cls.from_dict(raw or {})
        pools = {}
        for pool in ("prefill", "decode"):
            n = overrides.pop(f"{pool}_ranks", None)
            if n is not None:
                pools[pool] = replace(getattr(config, pool), num_ranks=n)
        overrides = {k: v for k, v in overrides.items() if v is not None}
        try:
            return replace(config, **pools, **overrides)
        except TypeError as e:
            raise ConfigError(str(e)) from e
