"""epcluster's alerting rules (../../shared/OPERATIONS.md "Alerts"), and for each alert the
series of a promtool unit test that makes it fire and a neighbouring case that keeps it silent.

Thresholds on histograms are bucket boundaries of engine/metrics/catalog.py (a quantile between two
boundaries is an interpolation, not a measurement). Ratios carry a traffic floor and divide by
`(x > 0)`, so an idle cluster is silent. Rank series carry `pool` and `rank`, router series
`pool="router"`; router series about a pool name it `target_pool`.
"""

# each alert's notes are a heading of that page: its anchor is the alert's name in lower case
RUNBOOK = "https://github.com/epcluster/epcluster/blob/main/deploy/README.md"

REQ = "epcluster_requests_total"
TTFT = "epcluster_time_to_first_token_seconds_bucket"


def rule(
    name, expr, severity, summary, description, for_="5m", firing=(), silent=(), labels=None,
    at=None,
):  # fmt: skip
    """An alert; firing/silent: promtool input series [(series, values)] for its unit test,
    `labels`: the labels the firing alert carries beyond severity, `at`: the minute both cases
    are evaluated (default: the last sample)."""
    return {
        "alert": name,
        "expr": expr,
        "for": for_,
        "labels": {"severity": severity},
        "annotations": {
            "summary": summary,
            "description": description,
            "runbook_url": f"{RUNBOOK}#{name.lower()}",
        },
        "_test": {
            "firing": list(firing),
            "silent": list(silent),
            "labels": labels or {},
            **({} if at is None else {"at": at}),
        },
    }


def burn(window: str) -> str:
    """Error-budget burn rate of the TTFT SLO (99% of requests' first token within 2.5 s)."""
    good = f'sum(rate({TTFT}{{le="2.5"}}[{window}]))'
    return f"(1 - {good} / ({traffic(window)} > 0)) / 0.01"


def traffic(window: str) -> str:
    """Requests per second that got (or will get) a first token, over `window`."""
    return f'sum(rate({TTFT}{{le="+Inf"}}[{window}]))'


GROUPS = {
    "epcluster-availability": [
        rule(
            "EpclusterRouterDown",
            'up{pool="router"} == 0',
            "critical",
            "The epcluster router {{ $labels.instance }} does not answer scrapes",
            "Prometheus cannot scrape the router: clients cannot reach the cluster through it.",
            "2m",
            firing=[('up{pool="router", instance="r:9400"}', "0x10")],
            silent=[('up{pool="router", instance="r:9400"}', "1x10")],
            labels={"pool": "router", "instance": "r:9400"},
        ),
        rule(
            "EpclusterRouterMetricsAbsent",
            'absent(up{pool="router"})',
            "warning",
            "No epcluster router is scraped",
            "No target has pool=router: the scrape configuration or the discovery is broken.",
            "10m",
            firing=[('up{pool="prefill", rank="0"}', "1x20")],
            silent=[('up{pool="router"}', "1x20")],
            labels={"pool": "router"},
        ),
        rule(
            "EpclusterPoolMetricsAbsent",
            'absent(up{pool="prefill"}) or absent(up{pool="decode"})',
            "warning",
            "No {{ $labels.pool }} rank is scraped",
            "The router's discovery lists no rank of the pool (ranks not started, or not "
            "reporting a metrics endpoint): every rank alert of that pool is blind.",
            "10m",
            firing=[('up{pool="router"}', "1x20"), ('up{pool="prefill", rank="0"}', "1x20")],
            silent=[
                ('up{pool="prefill", rank="0"}', "1x20"),
                ('up{pool="decode", rank="0"}', "1x20"),
            ],
            labels={"pool": "decode"},
        ),
        rule(
            "EpclusterPoolNotReady",
            "epcluster_pool_ready == 0",
            "critical",
            "The {{ $labels.target_pool }} pool cannot take work",
            "A rank of the pool failed and the pool has not re-formed: requests wait, then get "
            "UNAVAILABLE. Look at the router's log for the failure and the re-forming attempts.",
            "2m",
            firing=[('epcluster_pool_ready{target_pool="decode"}', "0x10")],
            silent=[('epcluster_pool_ready{target_pool="decode"}', "0 0 1x10")],
            labels={"target_pool": "decode"},
        ),
        rule(
            "EpclusterRankDown",
            'up{pool=~"prefill|decode"} == 0',
            "warning",
            "{{ $labels.pool }} rank {{ $labels.rank }} does not answer scrapes",
            "The rank's /metrics is unreachable: its process is gone or its node is cut off.",
            "2m",
            firing=[('up{pool="prefill", rank="1"}', "0x10")],
            silent=[('up{pool="prefill", rank="1"}', "1x10")],
            labels={"pool": "prefill", "rank": "1"},
        ),
        rule(
            "EpclusterRankStalled",
            "epcluster_engine_stalled_seconds > 10",
            "warning",
            "{{ $labels.pool }} rank {{ $labels.rank }} has work and makes no progress",
            "The engine thread has not stepped for over 10 s while holding requests (a stuck "
            "collective?); the router re-forms the pool at health.stall_timeout_s.",
            "1m",
            firing=[('epcluster_engine_stalled_seconds{pool="decode", rank="0"}', "20x10")],
            silent=[('epcluster_engine_stalled_seconds{pool="decode", rank="0"}', "0x10")],
            labels={"pool": "decode", "rank": "0"},
        ),
        rule(
            "EpclusterPoolShrank",
            'count by (pool, rank) (up{pool=~"prefill|decode"} offset 15m) unless count by '
            '(pool, rank) (up{pool=~"prefill|decode"})',
            "warning",
            "{{ $labels.pool }} rank {{ $labels.rank }} disappeared",
            "A rank scraped 15 minutes ago is no longer discovered: the pool is smaller.",
            "5m",
            firing=[('up{pool="decode", rank="1"}', "1x15 _x30")],
            silent=[('up{pool="decode", rank="1"}', "1x45")],
            labels={"pool": "decode", "rank": "1"},
            at=27,  # 15 minutes after the last sample of 0-15m, 5 into the alert's `for`
        ),
    ],
    "epcluster-errors": [
        rule(
            "EpclusterHighErrorRatio",
            f'sum(rate({REQ}{{finished_reason="error"}}[5m])) / (sum(rate({REQ}[5m])) > 0) '
            f"> 0.05 and sum(rate({REQ}[5m])) > 0.1",
            "critical",
            "Over 5% of requests end in an error",
            "Requests fail on the server side (not client cancels): look at the router's log.",
            "5m",
            firing=[
                (f'{REQ}{{finished_reason="error", code="INTERNAL"}}', "0+6x20"),
                (f'{REQ}{{finished_reason="stop", code="OK"}}', "0+60x20"),
            ],
            silent=[
                (f'{REQ}{{finished_reason="error", code="INTERNAL"}}', "0+1x20"),
                (f'{REQ}{{finished_reason="stop", code="OK"}}', "0+60x20"),
            ],
        ),
        rule(
            "EpclusterKVTransferFailures",
            "sum by (pool, rank) (increase(epcluster_kv_transfer_failures_total[10m])) > 0",
            "warning",
            "KV transfers fail on {{ $labels.pool }} rank {{ $labels.rank }}",
            "Prompt KV did not reach a decode rank; the requests were resumed through the "
            "object store, at the cost of a re-prefill.",
            "0m",
            firing=[
                (
                    'epcluster_kv_transfer_failures_total{pool="decode", rank="0", '
                    'stage="receive"}',
                    "0 0 1 1 1",
                )
            ],
            silent=[
                (
                    'epcluster_kv_transfer_failures_total{pool="decode", rank="0", '
                    'stage="receive"}',
                    "0x5",
                )
            ],
            labels={"pool": "decode", "rank": "0"},
        ),  # fmt: skip
        rule(
            "EpclusterKVReservationsExpire",
            'sum(increase(epcluster_kv_reservations_total{outcome="expired"}[10m])) > 0',
            "warning",
            "Decode KV reservations expire",
            "A reservation's lease ran out before its KV arrived: the router or a prefill rank "
            "is slow or lost.",
            "0m",
            firing=[
                (
                    'epcluster_kv_reservations_total{outcome="expired", pool="decode", rank="0"}',
                    "0 0 2 2 2",
                )
            ],
            silent=[
                (
                    'epcluster_kv_reservations_total{outcome="expired", pool="decode", rank="0"}',
                    "0x5",
                )
            ],
        ),  # fmt: skip
    ],
    "epcluster-latency": [
        rule(
            "EpclusterTTFTHigh",
            f"histogram_quantile(0.99, sum by (le) (rate({TTFT}[5m]))) > 2.5 and "
            f"{traffic('5m')} > 0.1",
            "warning",
            "p99 time to first token over 2.5 s",
            "Prompts wait or prefill slowly: look at the Pools board (prefill queue, KV usage) "
            "and the KV transfer board.",
            "10m",
            firing=[
                (f'{TTFT}{{le="2.5"}}', "0+60x20"),
                (f'{TTFT}{{le="5.0"}}', "0+100x20"),
                (f'{TTFT}{{le="+Inf"}}', "0+100x20"),
            ],
            silent=[
                (f'{TTFT}{{le="2.5"}}', "0+100x20"),
                (f'{TTFT}{{le="5.0"}}', "0+100x20"),
                (f'{TTFT}{{le="+Inf"}}', "0+100x20"),
            ],
        ),
        rule(
            "EpclusterITLHigh",
            "histogram_quantile(0.99, sum by (le) (rate("
            "epcluster_inter_token_latency_seconds_bucket[5m]))) > 0.2 and sum(rate("
            'epcluster_inter_token_latency_seconds_bucket{le="+Inf"}[5m])) > 1',
            "warning",
            "p99 inter-token latency over 200 ms",
            "Decode steps are slow: look at step time, batch size and all-to-all time.",
            "10m",
            firing=[
                ('epcluster_inter_token_latency_seconds_bucket{le="0.2"}', "0+900x20"),
                ('epcluster_inter_token_latency_seconds_bucket{le="0.3"}', "0+1000x20"),
                ('epcluster_inter_token_latency_seconds_bucket{le="+Inf"}', "0+1000x20"),
            ],
            silent=[
                ('epcluster_inter_token_latency_seconds_bucket{le="0.2"}', "0+1000x20"),
                ('epcluster_inter_token_latency_seconds_bucket{le="0.3"}', "0+1000x20"),
                ('epcluster_inter_token_latency_seconds_bucket{le="+Inf"}', "0+1000x20"),
            ],
        ),
        rule(
            "EpclusterTTFTBudgetFastBurn",
            f"{burn('1h')} > 14.4 and {burn('5m')} > 14.4 and {traffic('5m')} > 0.1",
            "critical",
            "The TTFT error budget burns 14x too fast",
            "At this rate the month's budget (1% of requests over 2.5 s to the first token) is "
            "gone in two days.",
            "2m",
            firing=[(f'{TTFT}{{le="2.5"}}', "0+50x80"), (f'{TTFT}{{le="+Inf"}}', "0+100x80")],
            # every request slow, but 5 a minute: under the traffic floor, no page
            silent=[(f'{TTFT}{{le="2.5"}}', "0x80"), (f'{TTFT}{{le="+Inf"}}', "0+5x80")],
        ),
        rule(
            "EpclusterTTFTBudgetSlowBurn",
            f"{burn('6h')} > 6 and {burn('30m')} > 6 and {traffic('30m')} > 0.1",
            "warning",
            "The TTFT error budget burns 6x too fast",
            "At this rate the month's budget is gone in five days.",
            "15m",
            firing=[(f'{TTFT}{{le="2.5"}}', "0+90x400"), (f'{TTFT}{{le="+Inf"}}', "0+100x400")],
            silent=[(f'{TTFT}{{le="2.5"}}', "0+99.9x400"), (f'{TTFT}{{le="+Inf"}}', "0+100x400")],
        ),
    ],
    "epcluster-saturation": [
        rule(
            "EpclusterKVCacheFull",
            "epcluster_kv_cache_usage_ratio > 0.95",
            "warning",
            "{{ $labels.pool }} rank {{ $labels.rank }}: KV cache over 95% full",
            "New requests wait for blocks and running ones may be preempted: add decode ranks "
            "or lower max_num_seqs.",
            "5m",
            firing=[('epcluster_kv_cache_usage_ratio{pool="decode", rank="1"}', "0.97x10")],
            silent=[('epcluster_kv_cache_usage_ratio{pool="decode", rank="1"}', "0.9x10")],
            labels={"pool": "decode", "rank": "1"},
        ),
        rule(
            "EpclusterQueueGrowing",
            "sum(epcluster_router_requests_waiting) > 0 and "
            "sum(delta(epcluster_router_requests_waiting[10m])) > 10",
            "warning",
            "The router's queue keeps growing",
            "More requests arrive than the pools finish: add ranks or lower the admission caps.",
            "5m",
            firing=[('epcluster_router_requests_waiting{pool="router"}', "0+2x20")],
            silent=[('epcluster_router_requests_waiting{pool="router"}', "5x20")],
        ),
        rule(
            "EpclusterReservationWaits",
            "histogram_quantile(0.9, sum by (le) (rate("
            "epcluster_kv_reservation_wait_seconds_bucket[5m]))) > 1 and sum(rate("
            'epcluster_kv_reservation_wait_seconds_bucket{le="+Inf"}[5m])) > 0.1',
            "warning",
            "Requests wait over 1 s for decode KV room",
            "The decode pool's caches are full: its ranks are the bottleneck.",
            "10m",
            firing=[
                ('epcluster_kv_reservation_wait_seconds_bucket{le="1.0"}', "0+50x20"),
                ('epcluster_kv_reservation_wait_seconds_bucket{le="2.5"}', "0+100x20"),
                ('epcluster_kv_reservation_wait_seconds_bucket{le="+Inf"}', "0+100x20"),
            ],
            silent=[
                ('epcluster_kv_reservation_wait_seconds_bucket{le="1.0"}', "0+100x20"),
                ('epcluster_kv_reservation_wait_seconds_bucket{le="2.5"}', "0+100x20"),
                ('epcluster_kv_reservation_wait_seconds_bucket{le="+Inf"}', "0+100x20"),
            ],
        ),
        rule(
            "EpclusterPreemptions",
            "sum by (pool, rank) (rate(epcluster_preemptions_total[5m])) > 0.5",
            "warning",
            "{{ $labels.pool }} rank {{ $labels.rank }} preempts requests",
            "The KV cache runs out mid-decode: preempted requests are recomputed later.",
            "10m",
            firing=[('epcluster_preemptions_total{pool="decode", rank="0"}', "0+60x20")],
            silent=[('epcluster_preemptions_total{pool="decode", rank="0"}', "0+1x20")],
            labels={"pool": "decode", "rank": "0"},
        ),
        rule(
            "EpclusterAdmissionRejections",
            "sum(rate(epcluster_admission_rejections_total[5m])) > 0.1",
            "warning",
            "The router refuses requests (RESOURCE_EXHAUSTED)",
            "Admission caps (max_queued_requests, max_queued_tokens) are reached.",
            "5m",
            firing=[('epcluster_admission_rejections_total{reason="requests"}', "0+60x20")],
            silent=[('epcluster_admission_rejections_total{reason="requests"}', "0x20")],
        ),
    ],
    "epcluster-moe": [
        rule(
            "EpclusterExpertImbalance",
            'min by (pool) (epcluster_eplb_balancedness_ratio{stat="mean"}) < 0.6',
            "warning",
            "{{ $labels.pool }}: expert load badly balanced",
            "The busiest rank sets every step's pace: run `epcluster rebalance` or set "
            "routing.eplb_interval_s.",
            "30m",
            firing=[
                (
                    'epcluster_eplb_balancedness_ratio{pool="prefill", rank="0", stat="mean"}',
                    "0.5x40",
                )
            ],
            silent=[
                (
                    'epcluster_eplb_balancedness_ratio{pool="prefill", rank="0", stat="mean"}',
                    "0.9x40",
                )
            ],
            labels={"pool": "prefill"},
        ),  # fmt: skip
        rule(
            "EpclusterRebalanceSlow",
            "sum by (pool) (increase(epcluster_eplb_rebalance_duration_seconds_bucket"
            '{le="+Inf"}[30m])) - sum by (pool) (increase('
            'epcluster_eplb_rebalance_duration_seconds_bucket{le="10.0"}[30m])) > 0',
            "warning",
            "{{ $labels.pool }}: a rebalance took over 10 s",
            "Moving expert weights was slow (links, or checkpoint reads): serving went on, but "
            "look at the weight bytes moved and the links.",
            "0m",
            firing=[
                (
                    'epcluster_eplb_rebalance_duration_seconds_bucket{pool="decode", le="10.0"}',
                    "0x5",
                ),
                (
                    'epcluster_eplb_rebalance_duration_seconds_bucket{pool="decode", le="+Inf"}',
                    "0 0 1 1 1",
                ),
            ],
            silent=[
                (
                    'epcluster_eplb_rebalance_duration_seconds_bucket{pool="decode", le="10.0"}',
                    "0 0 1 1 1",
                ),
                (
                    'epcluster_eplb_rebalance_duration_seconds_bucket{pool="decode", le="+Inf"}',
                    "0 0 1 1 1",
                ),
            ],
            labels={"pool": "decode"},
        ),  # fmt: skip
    ],
}
