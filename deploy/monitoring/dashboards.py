"""epcluster's Grafana dashboards, built from code (../../shared/OPERATIONS.md "Grafana"):
Overview and Pools here, KV transfer and MoE in dashboards_internals.py. Every panel and
target uses the `datasource` variable; `job`, `instance`, `model_name` and `pool` variables
filter; ranges are `$__rate_interval`."""

from deploy.monitoring.dashboards_internals import kv_transfer, moe
from deploy.monitoring.panels import RI, K, R, board, panel, q, quantiles


def overview() -> dict:
    reqs = f"epcluster_requests_total{R}"
    return board(
        "epcluster-overview",
        "epcluster / Overview",
        "Requests as clients see them, measured at the router.",
        [
            panel(
                "Requests",
                "reqps",
                "Finished requests per second, by finish reason.",
                [q(f"sum by (finished_reason) (rate({reqs}[{RI}]))", "{{finished_reason}}")],
            ),
            panel(
                "Tokens",
                "short",
                "Prompt and generated tokens per second.",
                [
                    q(f"sum(rate(epcluster_prompt_tokens_total{R}[{RI}]))", "prompt"),
                    q(f"sum(rate(epcluster_generation_tokens_total{R}[{RI}]))", "generated"),
                    q(
                        f"sum(rate(epcluster_prompt_tokens_cached_total{R}[{RI}]))",
                        "prompt, cached",
                    ),
                ],
            ),
            panel(
                "Error ratio",
                "percentunit",
                "Share of requests that ended in a server error (client cancels excluded).",
                [
                    q(
                        f'sum(rate(epcluster_requests_total{R[:-1]}, finished_reason="error"}}'
                        f"[{RI}])) / (sum(rate({reqs}[{RI}])) > 0)",
                        "errors",
                    )
                ],
            ),
            panel(
                "gRPC codes",
                "reqps",
                "Finished requests per second by gRPC status code.",
                [q(f"sum by (code) (rate({reqs}[{RI}]))", "{{code}}")],
            ),
            panel(
                "Time to first token",
                "s",
                "p50 / p95 / p99 from the router's histogram.",
                quantiles("epcluster_time_to_first_token_seconds"),
            ),
            panel(
                "Inter-token latency",
                "s",
                "p50 / p95 / p99 between a stream's tokens.",
                quantiles("epcluster_inter_token_latency_seconds"),
            ),
            panel(
                "End-to-end latency",
                "s",
                "p50 / p95 / p99 of whole requests.",
                quantiles("epcluster_e2e_request_latency_seconds"),
            ),
            panel(
                "TTFT SLO attainment",
                "percentunit",
                "Share of requests whose first token came within 2.5 s (the alerts' SLO).",
                [
                    q(
                        f'sum(rate(epcluster_time_to_first_token_seconds_bucket{R[:-1]}, le="2.5"}}'
                        f"[{RI}])) / (sum(rate(epcluster_time_to_first_token_seconds_count{R}"
                        f"[{RI}])) > 0)",
                        "within 2.5 s",
                    )
                ],
            ),
            panel(
                "Router queue",
                "short",
                "Requests admitted and running or waiting.",
                [
                    q(f"sum(epcluster_router_requests_running{R})", "running"),
                    q(f"sum(epcluster_router_requests_waiting{R})", "waiting"),
                ],
            ),
            panel(
                "Refusals and resumes",
                "reqps",
                "Admission refusals (RESOURCE_EXHAUSTED) and requests resumed after a rank "
                "failure.",
                [
                    q(
                        f"sum by (reason) (rate(epcluster_admission_rejections_total{R}[{RI}]))",
                        "refused: {{reason}}",
                    ),
                    q(
                        f"sum by (target_pool) (rate(epcluster_request_resumes_total{R}[{RI}]))",
                        "resumed: {{target_pool}}",
                    ),
                ],
            ),
        ],  # fmt: skip
    )


def pools() -> dict:
    return board(
        "epcluster-pools",
        "epcluster / Pools",
        "Prefill and decode pools side by side: queues, KV usage, steps, stragglers.",
        [
            panel(
                "Pool ready",
                "short",
                "1 while the pool can take work (router's view).",
                [q(f"epcluster_pool_ready{R}", "{{target_pool}}")],
            ),
            panel(
                "Running and waiting per pool",
                "short",
                "Requests on the pool's ranks.",
                [
                    q(f"sum by (pool) (epcluster_requests_running{K})", "{{pool}} running"),
                    q(
                        f"sum by (pool, reason) (epcluster_requests_waiting{K})",
                        "{{pool}} waiting: {{reason}}",
                    ),
                ],
            ),
            panel(
                "KV cache usage",
                "percentunit",
                "Min, mean and max across a pool's ranks.",
                [
                    q(f"min by (pool) (epcluster_kv_cache_usage_ratio{K})", "{{pool}} min"),
                    q(f"avg by (pool) (epcluster_kv_cache_usage_ratio{K})", "{{pool}} mean"),
                    q(f"max by (pool) (epcluster_kv_cache_usage_ratio{K})", "{{pool}} max"),
                ],
            ),
            panel(
                "Step time",
                "s",
                "p50 / p95 / p99 of an engine step with work, per pool.",
                quantiles("epcluster_step_duration_seconds", K, "pool"),
            ),
            panel(
                "Batch size",
                "short",
                "Mean requests per step.",
                [
                    q(
                        f"sum by (pool) (rate(epcluster_step_batch_size_sum{K}[{RI}])) / "
                        f"(sum by (pool) (rate(epcluster_step_batch_size_count{K}[{RI}])) > 0)",
                        "{{pool}}",
                    )
                ],
            ),
            panel(
                "Steps per rank (stragglers)",
                "short",
                "Engine steps per second per rank: in a pool they step in lockstep; a rank "
                "behind the others is stalled.",
                [
                    q(
                        f"sum by (pool, rank) (rate(epcluster_engine_steps_total{K}[{RI}]))",
                        "{{pool}} {{rank}}",
                    )
                ],
            ),
            panel(
                "Stalled",
                "s",
                "How long a rank with work has made no progress.",
                [q(f"epcluster_engine_stalled_seconds{K}", "{{pool}} {{rank}}")],
            ),
            panel(
                "Preemptions and prefix cache",
                "short",
                "Preemptions per second, and the share of prompt tokens the prefix cache served.",
                [
                    q(
                        f"sum by (pool) (rate(epcluster_preemptions_total{K}[{RI}]))",
                        "{{pool}} preemptions/s",
                    ),
                    q(
                        f"sum by (pool) (rate(epcluster_prefix_cache_hits_total{K}[{RI}])) / "
                        "(sum by (pool) (rate(epcluster_prefix_cache_queries_total"
                        f"{K}[{RI}])) > 0)",
                        "{{pool}} hit ratio",
                    ),
                ],
            ),
            panel(
                "KV tiers: hits",
                "short",
                "Blocks per second read back from the host and disk tiers below the paged "
                "cache, and each tier's hit ratio (hits over hits and misses).",
                [
                    q(
                        f"sum by (pool, tier) (rate(epcluster_kv_tier_hits_total{K}[{RI}]))",
                        "{{pool}} {{tier}} hits/s",
                    ),
                    q(
                        f"sum by (pool, tier) (rate(epcluster_kv_tier_hits_total{K}[{RI}])) / "
                        "(sum by (pool, tier) (rate(epcluster_kv_tier_hits_total"
                        f"{K}[{RI}])) + sum by (pool, tier) (rate("
                        f"epcluster_kv_tier_misses_total{K}[{RI}])) > 0)",
                        "{{pool}} {{tier}} hit ratio",
                    ),
                ],
            ),
            panel(
                "KV tiers: bytes and read time",
                "Bps",
                "Bytes per second written to and read from each tier, per pool.",
                [
                    q(
                        "sum by (pool, tier) (rate(epcluster_kv_tier_written_bytes_total"
                        f"{K}[{RI}]))",
                        "{{pool}} {{tier}} written",
                    ),
                    q(
                        f"sum by (pool, tier) (rate(epcluster_kv_tier_read_bytes_total{K}[{RI}]))",
                        "{{pool}} {{tier}} read",
                    ),
                ],
            ),
            panel(
                "KV tiers: mean read time",
                "s",
                "Mean time to read one block back from a tier.",
                [
                    q(
                        "sum by (pool, tier) (rate(epcluster_kv_tier_read_seconds_total"
                        f"{K}[{RI}])) / (sum by (pool, tier) (rate("
                        f"epcluster_kv_tier_reads_total{K}[{RI}])) > 0)",
                        "{{pool}} {{tier}}",
                    )
                ],
            ),
            panel(
                "Re-forms",
                "short",
                "Pool re-forms after a rank failure (increase).",
                [
                    q(
                        f"sum by (target_pool) (increase(epcluster_pool_reforms_total{R}[{RI}]))",
                        "{{target_pool}}",
                    )
                ],
            ),
        ],  # fmt: skip
    )


DASHBOARDS = {"overview": overview, "pools": pools, "kv-transfer": kv_transfer, "moe": moe}
