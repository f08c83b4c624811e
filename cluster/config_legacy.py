"""The flat cluster config of epcluster before the config tree: accepted for one release, its keys
moved to their dotted paths in the tree with one warning that names each of them."""

import logging
from typing import Any

from cluster.config_checks import ConfigError, has_path, set_path

log = logging.getLogger(__name__)

# old top-level key -> its path in the tree (a few fields took the name of where they act)
FLAT_KEYS: dict[str, str] = {
    **{
        k: f"engine.{k}"
        for k in (
            "kv_cache_bytes",
            "block_size",
            "max_model_len",
            "enable_prefix_caching",
            "eplb_min_gain",
            "eplb_max_moves",
            "eplb_layers_per_round",
            "eplb_decay",
        )
    },
    **{k: f"ports.{k}" for k in ("host", "port", "http_port", "metrics_port", "rank_metrics_port")},
    **{
        k: f"security.{k}"
        for k in (
            "auth_token_file",
            "admin_token_file",
            "tls_cert_file",
            "tls_key_file",
            "tls_client_ca_file",
            "metrics_tls",
            "metrics_token_file",
            "allow_insecure_bind",
        )
    },
    **{
        k: f"ray.{k}"
        for k in (
            "ray_address",
            "cluster_name",
            "keep_pools",
            "gpus_per_rank",
            "cpus_per_rank",
            "torch_threads",
            "start_timeout_s",
            "collective_timeout_s",
            "env",
        )
    },
    **{k: f"admission.{k}" for k in ("max_queued_requests", "max_queued_tokens")},
    **{
        k: f"routing.{k}"
        for k in ("reserve_wait_s", "recovery_wait_s", "max_resumes", "eplb_interval_s")
    },
    "kv_transfer_timeout_s": "routing.kv_lease_s",
    "kv_transport": "routing.kv_p2p",  # object_store | p2p -> false | true
    "rank_call_timeout_s": "calls.rank_call_timeout_s",
    "kv_start_timeout_s": "calls.kv_start_timeout_s",
    "rank_stall_timeout_s": "health.stall_timeout_s",
}
# old key of a pool (prefill, decode) -> its path under the pool
POOL_KEYS: dict[str, str] = {
    k: f"engine.{k}"
    for k in (
        "max_num_seqs",
        "max_num_batched_tokens",
        "two_batch_overlap",
        "cuda_graph",
        "cuda_graph_max_batch",
    )
}


def _kv_p2p(value: Any) -> Any:
    if value not in ("object_store", "p2p"):
        raise ConfigError(f"kv_transport must be object_store or p2p (got {value!r})")
    return value == "p2p"


def upgrade_flat(raw: dict[str, Any]) -> dict[str, Any]:
    """`raw` with its old flat keys moved into the tree (a copy; `raw` is left as it was), and
    one warning naming each moved key with its new path. A key given both ways is refused."""
    moves = [(old, new) for old, new in FLAT_KEYS.items() if old in raw]
    for pool in ("prefill", "decode"):
        old = raw.get(pool)
        if isinstance(old, dict):
            moves += [(f"{pool}.{k}", f"{pool}.{p}") for k, p in POOL_KEYS.items() if k in old]
    if not moves:
        return raw
    out = dict(raw)
    for old, new in moves:
        if has_path(raw, new):
            raise ConfigError(f"{old} (an old flat key) and {new} are both set: keep {new}")
        pool, _, key = old.rpartition(".")
        if pool:
            out[pool] = {k: v for k, v in out[pool].items() if k != key}
            value = raw[pool][key]
        else:
            value = out.pop(old)
        set_path(out, new, _kv_p2p(value) if old == "kv_transport" else value)
    log.warning(
        "the cluster config uses old flat keys, accepted for one release; move them: %s "
        "(deploy/config.example.yaml shows the tree)",
        ", ".join(f"{old} -> {new}" for old, new in moves),
    )
    return out
