"""The catalog's metrics of the KV tiers below a rank's paged cache (engine/kv_tiers/,
docs/kv_tiers.md), labelled by tier (host, disk), and their values read from the engine's
kv_tier_stats() at scrape time (engine/metrics/catalog.py joins the specs to the rest).

Read latency is two counters (seconds summed over the reads that hit, and those reads): the
tiers count a sum and a count, and rate(sum) / rate(count) is the mean read time."""

from engine.metrics.spec import Spec

TIERS = ("host", "disk")
_PER_TIER = (  # (metric, TierStats field, kind, help)
    ("epcluster_kv_tier_hits_total", "hits", "counter", "Blocks read back from the tier."),
    ("epcluster_kv_tier_misses_total", "misses", "counter", "Block lookups the tier missed."),
    ("epcluster_kv_tier_written_bytes_total", "bytes_written", "counter", "Bytes written."),
    ("epcluster_kv_tier_read_bytes_total", "bytes_read", "counter", "Bytes read back."),
    (
        "epcluster_kv_tier_read_seconds_total",
        "read_seconds_sum",
        "counter",
        "Seconds spent reading the blocks that hit (over epcluster_kv_tier_reads_total: the "
        "mean read time).",
    ),
    ("epcluster_kv_tier_reads_total", "read_count", "counter", "Reads that hit, timed."),
    (
        "epcluster_kv_tier_evictions_total",
        "evictions",
        "counter",
        "Blocks evicted (least recently used) to stay within the tier's budget.",
    ),
    (
        "epcluster_kv_tier_errors_total",
        "errors",
        "counter",
        "Failed writes or reads (a bad block file is a miss and removed).",
    ),
    (
        "epcluster_kv_tier_disabled",
        "disabled",
        "gauge",
        "1 once the tier turned itself off (a full disk, an unwritable directory) until the "
        "rank restarts.",
    ),
    ("epcluster_kv_tier_blocks", "blocks", "gauge", "Blocks the tier holds."),
    ("epcluster_kv_tier_bytes", "bytes_held", "gauge", "Bytes the tier holds."),
)
DROPPED = "epcluster_kv_tier_dropped_writes_total"

TIER_SPECS: tuple[Spec, ...] = (
    *(Spec(name, kind, why, ("tier",)) for name, _, kind, why in _PER_TIER),
    # NOTE: one queue feeds both tiers, so a dropped offer belongs to no tier
    Spec(
        DROPPED,
        "counter",
        "Blocks offered to the tiers and dropped: the write-back queue was full (the step "
        "never waits on it).",
    ),
)

Series = dict[tuple[str, tuple[str, ...]], float]


def tier_series(stats: dict[str, object]) -> Series:
    """The series of LLMEngine.kv_tier_stats() (per tier its TierStats, and dropped_writes);
    {} when the tiers are off."""
    out: Series = {}
    for tier in TIERS:
        tier_stats = stats.get(tier)
        if tier_stats is None:
            continue
        for name, attr, _, _ in _PER_TIER:
            out[name, (tier,)] = float(getattr(tier_stats, attr))
    if "dropped_writes" in stats:
        out[DROPPED, ()] = float(stats["dropped_writes"])  # type: ignore[arg-type]
    return out
