"""epcluster's Grafana boards of the step's insides (dashboards.py holds the service-level
Overview and Pools): KV transfer (prefill -> decode) and MoE (expert load, rebalancing). The
same conventions as dashboards.py: the `datasource` variable everywhere, `job`, `instance`,
`model_name` and `pool` filters, `$__rate_interval` ranges."""

from deploy.monitoring.panels import DS, RI, K, R, board, panel, q, quantiles, rank_sel


def kv_transfer() -> dict:
    return board(
        "epcluster-kv-transfer",
        "epcluster / KV transfer",
        "The prompt's KV on its way from a prefill rank to a decode rank.",
        [
            panel(
                "Transfer time",
                "s",
                "p50 / p95 / p99 per side.",
                quantiles("epcluster_kv_transfer_duration_seconds", K, "side"),
            ),
            panel(
                "Throughput",
                "Bps",
                "KV bytes per second sent and received.",
                [
                    q(
                        f"sum by (side) (rate(epcluster_kv_transfer_bytes_total{K}[{RI}]))",
                        "{{side}}",
                    )
                ],
            ),
            panel(
                "Transfer size",
                "bytes",
                "p50 / p95 / p99 bytes of one request's KV payload.",
                quantiles("epcluster_kv_transfer_size_bytes", K),
            ),
            panel(
                "Failures and fallbacks",
                "short",
                "Failed transfers by stage, and requests resumed through the object store.",
                [
                    q(
                        f"sum by (stage) (increase(epcluster_kv_transfer_failures_total{K}[{RI}]))",
                        "failed: {{stage}}",
                    ),
                    q(
                        f"sum(increase(epcluster_kv_transfer_fallbacks_total{R}[{RI}]))",
                        "fallbacks",
                    ),
                ],
            ),
            panel(
                "Reservations",
                "short",
                "Decode KV reservations by outcome, per second.",
                [
                    q(
                        f"sum by (outcome) (rate(epcluster_kv_reservations_total{K}[{RI}]))",
                        "{{outcome}}",
                    )
                ],
            ),
            panel(
                "Reservation wait",
                "s",
                "p50 / p95 / p99 wait for decode KV room.",
                quantiles("epcluster_kv_reservation_wait_seconds"),
            ),
        ],  # fmt: skip
    )


def moe() -> dict:
    rebalances = {
        "name": "Rebalances",
        "datasource": DS,
        "enable": True,
        "iconColor": "orange",
        "expr": "changes(epcluster_eplb_rebalances_total"
        + rank_sel('outcome="applied"')
        + f"[{RI}]) > 0",
        "titleFormat": "rebalance ({{pool}} rank {{rank}})",
    }
    return board(
        "epcluster-moe",
        "epcluster / MoE",
        "Expert parallelism: load balance, rebalances, all-to-all, routed tokens.",
        [
            panel(
                "Balancedness",
                "percentunit",
                "Mean rank load / max rank load over the MoE layers (1 = even); worst layer.",
                [
                    q(
                        f"min by (pool, stat) (epcluster_eplb_balancedness_ratio{K})",
                        "{{pool}} {{stat}}",
                    )
                ],
            ),
            panel(
                "Rebalances",
                "short",
                "Rebalances by outcome (increase), and 1 while one's weights are moving.",
                [
                    q(
                        f"sum by (pool, outcome) (increase(epcluster_eplb_rebalances_total{K}"
                        f"[{RI}]))",
                        "{{pool}} {{outcome}}",
                    ),
                    q(
                        f"max by (pool) (epcluster_eplb_rebalance_in_progress{K})",
                        "{{pool}} moving",
                    ),
                ],
            ),
            panel(
                "Rebalance duration",
                "s",
                "p50 / p95 / p99 from the decision to the last layer switched.",
                quantiles("epcluster_eplb_rebalance_duration_seconds", K, "pool"),
            ),
            panel(
                "Weights moved",
                "Bps",
                "Expert weight bytes per second moved by rebalances.",
                [
                    q(
                        f"sum by (pool) (rate(epcluster_eplb_weight_bytes_moved_total{K}[{RI}]))",
                        "{{pool}}",
                    )
                ],
            ),
            panel(
                "All-to-all time",
                "s",
                "p50 / p95 / p99 per step, summed over the MoE layers, by phase.",
                quantiles("epcluster_alltoall_duration_seconds", K, "phase"),
            ),
            panel(
                "Exposed communication",
                "percentunit",
                "Share of wall time spent waiting on the all-to-all, by phase.",
                [
                    q(
                        f"sum by (pool, phase) (rate(epcluster_alltoall_exposed_seconds_total{K}"
                        f"[{RI}]))",
                        "{{pool}} {{phase}}",
                    )
                ],
            ),
            panel(
                "Two-batch overlap",
                "short",
                "Steps per second with and without the overlap.",
                [
                    q(
                        f"sum by (pool, overlapped) (rate(epcluster_tbo_steps_total{K}[{RI}]))",
                        "{{pool}} overlapped={{overlapped}}",
                    )
                ],
            ),
            panel(
                "All-to-all bytes",
                "Bps",
                "Bytes per second sent by the all-to-alls.",
                [
                    q(
                        f"sum by (pool, phase) (rate(epcluster_alltoall_bytes_total{K}[{RI}]))",
                        "{{pool}} {{phase}}",
                    )
                ],
            ),
            panel(
                "Routed tokens per rank",
                "short",
                "Tokens routed to each rank's experts per second (a straggler's load).",
                [
                    q(
                        f"sum by (pool, rank) (rate(epcluster_routed_tokens_total{K}[{RI}]))",
                        "{{pool}} {{rank}}",
                    )
                ],
                kind="heatmap",
            ),
        ],  # fmt: skip
        annotations=[rebalances],
    )
