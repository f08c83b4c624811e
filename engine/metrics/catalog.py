"""Every Prometheus metric epcluster exports, in one catalog (SPECS: the router's and the
engines' here, the expert-parallel ones in engine/metrics/ep.py, Spec in engine/metrics/spec.py):
name, type, help, labels, buckets and which process exports it. The router (router/metrics.py)
and the ranks (engine/metrics/rank.py) build their collectors from it, and the dashboards and
alert rules (deploy/monitoring/) are checked against it: a panel or rule may only query what is
defined here.

Conventions (../shared/OPERATIONS.md): the `epcluster_` prefix, base units in the name, counters
end in `_total` (prometheus-client adds it: a Spec of kind counter is named with it), no colons.
Request histograms keep vLLM v1's meanings and buckets, so existing PromQL ports by a rename.
Every series carries `model_name`; rank series also `pool` (prefill | decode) and `rank`; router
series `pool="router"`. Labels that name a pool the router watches are `target_pool`.
"""

from engine.metrics.ep import EP_SPECS
from engine.metrics.spec import (  # noqa: F401  (the catalog's names, used by its readers)
    BYTES_BUCKETS,
    COUNT_BUCKETS,
    FINISHED_REASONS,
    ITL_BUCKETS,
    POOLS,
    RANK,
    REQUEST_BUCKETS,
    ROUTER,
    STEP_BUCKETS,
    TTFT_BUCKETS,
    Spec,
)
from engine.metrics.tiers import TIER_SPECS, TIERS

_ROUTER_AND_ENGINE: tuple[Spec, ...] = (
    # ---- the router: requests as users see them ----
    Spec(
        "epcluster_requests_total",
        "counter",
        "Requests that ended, by finish reason and gRPC status code.",
        ("finished_reason", "code"),
        where=ROUTER,
    ),
    Spec(
        "epcluster_time_to_first_token_seconds",
        "histogram",
        "Time from a request's arrival to its first token.",
        (),
        TTFT_BUCKETS,
        ROUTER,
    ),
    Spec(
        "epcluster_inter_token_latency_seconds",
        "histogram",
        "Time between two consecutive tokens of a stream.",
        (),
        ITL_BUCKETS,
        ROUTER,
    ),
    Spec(
        "epcluster_request_time_per_output_token_seconds",
        "histogram",
        "A finished request's decode time divided by its output tokens after the first.",
        (),
        ITL_BUCKETS,
        ROUTER,
    ),
    Spec(
        "epcluster_e2e_request_latency_seconds",
        "histogram",
        "Time from a request's arrival to its end.",
        (),
        REQUEST_BUCKETS,
        ROUTER,
    ),
    Spec(
        "epcluster_request_queue_time_seconds",
        "histogram",
        "Time from the pools taking the request until the prefill rank was asked "
        "(waiting for a re-forming pool and for decode KV room).",
        (),
        REQUEST_BUCKETS,
        ROUTER,
    ),
    Spec(
        "epcluster_request_prefill_time_seconds",
        "histogram",
        "Time from asking the prefill rank to the first token.",
        (),
        REQUEST_BUCKETS,
        ROUTER,
    ),
    Spec(
        "epcluster_request_decode_time_seconds",
        "histogram",
        "Time from the first token to the last.",
        (),
        REQUEST_BUCKETS,
        ROUTER,
    ),
    Spec(
        "epcluster_prompt_tokens_total",
        "counter",
        "Prompt tokens of admitted requests.",
        where=ROUTER,
    ),
    Spec(
        "epcluster_generation_tokens_total",
        "counter",
        "Tokens generated and streamed.",
        where=ROUTER,
    ),
    Spec(
        "epcluster_prompt_tokens_cached_total",
        "counter",
        "Prompt tokens served from a prefill rank's prefix cache.",
        where=ROUTER,
    ),
    Spec(
        "epcluster_router_requests_running",
        "gauge",
        "Requests streaming tokens (past their first token).",
        where=ROUTER,
    ),
    Spec(
        "epcluster_router_requests_waiting",
        "gauge",
        "Admitted requests that have no token yet.",
        where=ROUTER,
    ),
    Spec(
        "epcluster_admission_rejections_total",
        "counter",
        "Requests refused before they started, by reason.",
        ("reason",),
        where=ROUTER,
    ),
    Spec(
        "epcluster_request_resumes_total",
        "counter",
        "Requests resumed on a re-formed pool after a rank failure.",
        ("target_pool",),
        where=ROUTER,
    ),
    Spec(
        "epcluster_pool_ready",
        "gauge",
        "1 while a pool can take work, 0 while it re-forms.",
        ("target_pool",),
        where=ROUTER,
    ),
    Spec(
        "epcluster_pool_reforms_total",
        "counter",
        "Times a pool was re-formed after one of its ranks died or hung.",
        ("target_pool",),
        where=ROUTER,
    ),
    Spec(
        "epcluster_pool_recovery_seconds",
        "histogram",
        "Time from a rank failure to its pool being ready again.",
        ("target_pool",),
        REQUEST_BUCKETS,
        ROUTER,
    ),
    Spec(
        "epcluster_kv_reservation_wait_seconds",
        "histogram",
        "Time a request waited for KV room on a decode rank.",
        (),
        ITL_BUCKETS,
        ROUTER,
    ),
    Spec(
        "epcluster_kv_transfer_fallbacks_total",
        "counter",
        "Requests resumed through the object store after a p2p KV transfer failed.",
        where=ROUTER,
    ),
    Spec(
        "epcluster_kv_group_rebuilds_total",
        "counter",
        "Times every rank joined a rebuilt p2p KV transport group.",
        where=ROUTER,
    ),
    Spec(
        "epcluster_build_info",
        "gauge",
        "1, labelled with the version and commit.",
        ("version", "commit"),
        where=ROUTER,
    ),
    Spec(
        "epcluster_config_info",
        "gauge",
        "1, labelled with the cluster's shape.",
        (
            "prefill_ranks",
            "decode_ranks",
            "block_size",
            "kv_transport",
            "two_batch_overlap",
            "dtype",
        ),
        where=ROUTER,
    ),  # fmt: skip
    # ---- every rank: its engine ----
    Spec("epcluster_requests_running", "gauge", "Requests in the rank's running batch."),
    Spec(
        "epcluster_requests_waiting",
        "gauge",
        "Requests waiting on the rank: for room in the batch (capacity) or, on a decode rank, "
        "holding a KV reservation while their KV is on the way (kv_reservation).",
        ("reason",),
    ),
    Spec("epcluster_kv_cache_usage_ratio", "gauge", "Share of the KV cache blocks in use."),
    Spec(
        "epcluster_kv_cache_blocks",
        "gauge",
        "KV cache blocks by state: used (referenced), free, cached (reusable prefix), and "
        "reserved (held for KV on its way; part of used).",
        ("state",),
    ),
    Spec(
        "epcluster_prefix_cache_queries_total",
        "counter",
        "Prompt tokens looked up in the prefix cache.",
    ),
    Spec(
        "epcluster_prefix_cache_hits_total", "counter", "Prompt tokens found in the prefix cache."
    ),
    Spec("epcluster_preemptions_total", "counter", "Requests preempted (recomputed later)."),
    Spec("epcluster_engine_steps_total", "counter", "Engine steps (a heartbeat)."),
    Spec(
        "epcluster_engine_stalled_seconds",
        "gauge",
        "Seconds the engine thread has had work and made no progress (0 while it turns).",
    ),
    Spec(
        "epcluster_step_duration_seconds",
        "histogram",
        "Duration of an engine step with work.",
        (),
        STEP_BUCKETS,
    ),
    Spec(
        "epcluster_step_tokens", "histogram", "Tokens an engine step computed.", (), COUNT_BUCKETS
    ),
    Spec(
        "epcluster_step_batch_size", "histogram", "Requests in an engine step.", (), COUNT_BUCKETS
    ),
    # ---- speculative decoding (engine/speculative.py): zero with speculation off ----
    Spec(
        "epcluster_spec_draft_tokens_total",
        "counter",
        "Draft tokens the MTP layer proposed and the main model verified.",
    ),
    Spec(
        "epcluster_spec_accepted_tokens_total",
        "counter",
        "Draft tokens accepted (equal to the target's own token at their position).",
    ),
    Spec(
        "epcluster_spec_verifies_total",
        "counter",
        "A request's steps that verified drafts (each keeps its accepted drafts and one more).",
    ),
    Spec(
        "epcluster_spec_accepted_per_verify",
        "histogram",
        "Drafts accepted in one request's verify step (0 to num_draft_tokens).",
        (),
        (0, 1, 2, 3),
    ),
    Spec(
        "epcluster_spec_acceptance_ratio",
        "gauge",
        "Accepted / drafted tokens since the rank started (0 before any draft).",
    ),
    Spec(
        "epcluster_kernels_info",
        "gauge",
        "1, labelled with the kernels that serve the rank: triton, cpu-avx512, cpu-avx2 or "
        "reference (a fallback: no working triton on a GPU, a CPU without AVX2 or a compiler).",
        ("kernels",),
    ),
)
SPECS: tuple[Spec, ...] = _ROUTER_AND_ENGINE + EP_SPECS + TIER_SPECS

# Enumerable labels, pre-created at 0 so that alerts never see a missing series; by label name,
# with per-metric overrides where a name means something else.
LABEL_VALUES: dict[str, tuple[str, ...]] = {
    "finished_reason": FINISHED_REASONS,
    "target_pool": POOLS,
    "reason": ("capacity", "kv_reservation"),
    "state": ("used", "free", "cached", "reserved"),
    "phase": ("dispatch", "combine"),
    "overlapped": ("yes", "no"),
    "side": ("send", "receive"),
    "stage": ("send", "receive", "import"),
    "outcome": ("granted", "rejected", "expired", "released", "started"),
    "stat": ("mean", "worst"),
    "tier": TIERS,
}
_OVERRIDES: dict[tuple[str, str], tuple[str, ...]] = {
    ("epcluster_admission_rejections_total", "reason"): ("requests", "tokens", "draining"),
    ("epcluster_eplb_rebalances_total", "outcome"): ("applied", "skipped"),
}

# Children of metrics with an open label, pre-created anyway: the outcomes the router reports,
# so that an error ratio's numerator exists (at 0) before the first error, and rate() sees that
# error (the first sample of a new series has no predecessor to increase from).
PRESET_CHILDREN: dict[str, tuple[tuple[str, ...], ...]] = {
    "epcluster_requests_total": (
        ("stop", "OK"),
        ("length", "OK"),
        ("abort", "CANCELLED"),
        ("abort", "DEADLINE_EXCEEDED"),
        ("error", "INTERNAL"),
        ("error", "UNAVAILABLE"),
        ("error", "RESOURCE_EXHAUSTED"),
    ),
}


def label_values(spec: Spec, label: str) -> tuple[str, ...] | None:
    """The values `label` of `spec` takes, or None when they are open (a status code, a
    version)."""
    return _OVERRIDES.get((spec.name, label), LABEL_VALUES.get(label))


def specs(where: str) -> tuple[Spec, ...]:
    return tuple(s for s in SPECS if s.where == where)


def series_names() -> set[str]:
    """Every metric name a scrape of any epcluster process can show."""
    return {name for spec in SPECS for name in spec.series_names}
