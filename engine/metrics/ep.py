"""The catalog's metrics of a pool's expert parallelism: the all-to-all, the KV transfer from
prefill to decode, and expert load balancing (engine/metrics/catalog.py joins them to the rest)."""

from engine.metrics.spec import BYTES_BUCKETS, STEP_BUCKETS, Spec

EP_SPECS: tuple[Spec, ...] = (
    # ---- expert parallelism ----
    Spec(
        "epcluster_alltoall_duration_seconds",
        "histogram",
        "Per step, summed over MoE layers: from sending the rows (dispatch) or the expert "
        "outputs (combine) to having them back, overlapped work included.",
        ("phase",),
        STEP_BUCKETS,
    ),
    Spec(
        "epcluster_alltoall_exposed_seconds_total",
        "counter",
        "Time the rank's step waited on all-to-alls (communication not hidden by overlap).",
        ("phase",),
    ),
    Spec(
        "epcluster_alltoall_bytes_total",
        "counter",
        "Bytes this rank sent by all-to-all.",
        ("phase",),
    ),
    Spec(
        "epcluster_tbo_steps_total",
        "counter",
        "EP steps, by whether they ran as two overlapped micro-batches.",
        ("overlapped",),
    ),
    Spec(
        "epcluster_routed_tokens_total",
        "counter",
        "Token-expert rows this rank's routed experts computed.",
    ),
    # ---- KV transfer, prefill -> decode ----
    Spec(
        "epcluster_kv_transfer_duration_seconds",
        "histogram",
        "A prompt's KV transfer: export and send on the prefill rank, receive and import on "
        "the decode rank.",
        ("side",),
        STEP_BUCKETS,
    ),
    Spec(
        "epcluster_kv_transfer_size_bytes",
        "histogram",
        "Size of a prompt's KV payload.",
        (),
        BYTES_BUCKETS,
    ),
    Spec("epcluster_kv_transfer_bytes_total", "counter", "KV bytes sent or received.", ("side",)),
    Spec(
        "epcluster_kv_transfer_failures_total",
        "counter",
        "KV transfers that failed, by stage.",
        ("stage",),
    ),
    Spec(
        "epcluster_kv_reservations_total",
        "counter",
        "Decode KV reservations by outcome: granted, rejected (no room), expired (lease ran "
        "out), released (aborted), started (the KV arrived).",
        ("outcome",),
    ),
    # ---- expert load balancing ----
    Spec(
        "epcluster_eplb_balancedness_ratio",
        "gauge",
        "Mean rank load / max rank load of the pool's MoE layers over the load window: the "
        "mean over layers, and the worst layer.",
        ("stat",),
    ),
    Spec(
        "epcluster_eplb_rebalance_in_progress",
        "gauge",
        "1 while a re-placement's expert weights are moving (decided, not every layer switched "
        "yet), else 0.",
    ),
    Spec(
        "epcluster_eplb_rebalances_total",
        "counter",
        "Expert re-placements, by outcome (applied, skipped).",
        ("outcome",),
    ),
    Spec(
        "epcluster_eplb_rebalance_duration_seconds",
        "histogram",
        "Time a re-placement took, from the decision to the switch.",
        (),
        STEP_BUCKETS,
    ),
    Spec(
        "epcluster_eplb_weight_bytes_moved_total",
        "counter",
        "Expert weight bytes this rank received for re-placements.",
    ),
)
