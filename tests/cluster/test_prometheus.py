"""A real Prometheus (the Debian package, `make prometheus`) with the project's scrape
configuration (deploy/monitoring/prometheus.yml: http_sd from the router, no port list) and its
rules, against a running local cluster (2 prefill + 2 decode ranks): the router and every rank
are discovered with their pool/rank labels and `up`; after a few requests the request, latency,
KV and all-to-all series hold exactly what the client saw (6 requests of 12 tokens); `promtool
check metrics` passes on every target's scrape; every PromQL expression of the dashboards and the
rules evaluates, and every series they select exists."""

import json
import re
import urllib.request

import pytest
import yaml

from deploy.monitoring import checks, generate
from engine import SamplingParams
from router.client import InferenceClient
from tests.cluster.conftest import start_cluster
from tests.prometheus import REPO, Prometheus, binary, promtool

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(600),
    pytest.mark.skipif(binary("prometheus") is None, reason="run `make prometheus`"),
]
MONITORING = REPO / "deploy" / "monitoring"
REQUESTS, MAX_TOKENS = 6, 12


def scrape_config(router_metrics: str) -> dict:
    """deploy/monitoring/prometheus.yml pointed at this router, scraping every second."""
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    config["rule_files"] = [str(MONITORING / "rules.yml")]
    (job,) = config["scrape_configs"]
    sd = job["http_sd_configs"][0]
    sd["url"] = sd["url"].replace("ROUTER_HOST:9400", router_metrics)
    sd["refresh_interval"] = "1s"
    return config


def concrete(expr: str) -> str:
    """A dashboard expression with Grafana's variables filled in."""
    return re.sub(r"\$\w+", ".*", expr.replace("$__rate_interval", "1m"))


def total(prom: Prometheus, expr: str) -> float:
    return sum(float(r["value"][1]) for r in prom.query(expr))


@pytest.fixture(scope="module")
def stack():
    """The cluster, Prometheus scraping it, and what the client was told of its requests."""
    cluster = start_cluster({"model": "tiny"})
    try:
        with Prometheus(scrape_config(cluster.metrics_server.endpoint)) as prom:
            params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
            with InferenceClient(cluster.address, timeout=120) as client:
                outputs = [
                    client.complete(f"Prompt number {i} about the language reference", params)
                    for i in range(REQUESTS)
                ]
            yield cluster, prom, outputs
    finally:
        cluster.shutdown()


def test_every_process_is_discovered_up_and_passes_promtool(stack):
    _, prom, _ = stack

    def all_up():
        up = prom.query("up")
        return len(up) == 5 and all(r["value"][1] == "1" for r in up) and up

    up = prom.wait_for(all_up, 60, "5 targets up")
    pools = sorted((r["metric"]["pool"], r["metric"].get("rank", "")) for r in up)
    assert pools == [("decode", "0"), ("decode", "1"), ("prefill", "0"), ("prefill", "1"),
                     ("router", "")]  # fmt: skip
    assert all(r["metric"]["model_name"] == "tiny" for r in up)
    assert {r["metric"]["job"] for r in up} == {"epcluster"}

    targets = prom.targets()
    assert len(targets) == 5
    for target in targets:
        with urllib.request.urlopen(target["scrapeUrl"], timeout=10) as r:
            text = r.read().decode()
        check = promtool("check", "metrics", stdin=text)
        assert check.returncode == 0, (target["labels"], check.stdout + check.stderr)


def test_the_series_hold_what_the_client_saw(stack):
    """Counts against the client's own record of its requests (the independent oracle), once
    a scrape after the last request has landed."""
    _, prom, outputs = stack
    assert [o.num_completion_tokens for o in outputs] == [MAX_TOKENS] * REQUESTS
    expected = {
        'epcluster_requests_total{finished_reason="length", code="OK"}': REQUESTS,
        "epcluster_time_to_first_token_seconds_count": REQUESTS,
        "epcluster_e2e_request_latency_seconds_count": REQUESTS,
        "epcluster_inter_token_latency_seconds_count": REQUESTS * (MAX_TOKENS - 1),
        "epcluster_request_time_per_output_token_seconds_count": REQUESTS,
        "epcluster_generation_tokens_total": REQUESTS * MAX_TOKENS,
        "epcluster_prompt_tokens_total": sum(o.num_prompt_tokens for o in outputs),
        'epcluster_kv_transfer_duration_seconds_count{pool="prefill", side="send"}': REQUESTS,
        'epcluster_kv_transfer_duration_seconds_count{pool="decode", side="receive"}': REQUESTS,
        "epcluster_kv_transfer_size_bytes_count": REQUESTS,
        'epcluster_router_requests_running{pool="router"}': 0,
    }
    for expr, want in expected.items():
        prom.wait_for(lambda e=expr, w=want: total(prom, e) == w, 60, f"{expr} == {want}")
    sent = total(prom, 'epcluster_kv_transfer_bytes_total{side="send"}')
    assert sent > 0
    assert total(prom, 'epcluster_kv_transfer_bytes_total{side="receive"}') == sent
    assert total(prom, "epcluster_kv_transfer_size_bytes_sum") == sent
    for pool in ("prefill", "decode"):  # every rank of both EP pools stepped through all-to-alls
        for what in ("epcluster_alltoall_duration_seconds_count", "epcluster_routed_tokens_total"):
            series = prom.query(f'sum by (rank) ({what}{{pool="{pool}"}}) > 0')
            assert sorted(r["metric"]["rank"] for r in series) == ["0", "1"], (what, pool)
    usage = prom.query("epcluster_kv_cache_usage_ratio")
    assert sorted((r["metric"]["pool"], r["metric"]["rank"]) for r in usage) == [
        ("decode", "0"), ("decode", "1"), ("prefill", "0"), ("prefill", "1")
    ]  # fmt: skip
    assert all(0 <= float(r["value"][1]) <= 1 for r in usage)


def test_every_dashboard_and_rule_expression_evaluates_on_real_series(stack):
    """No expression errors, and each selector picks at least one scraped series: a label or
    `le` value that no exporter writes would show "No data" forever (or never fire)."""
    _, prom, _ = stack
    exprs = [
        concrete(e)
        for path in sorted((MONITORING / "dashboards").glob("*.json"))
        for e in generate.dashboard_exprs(json.loads(path.read_text()))
    ] + generate.rule_exprs()
    assert len(exprs) > 60
    for expr in exprs:
        prom.query(expr)  # raises with Prometheus' error on a bad expression
    selectors = {s.name + s.matchers for e in exprs for s in checks.scan(e)[0]}
    prom.wait_for(lambda: total(prom, 'count(up{pool="router"})') == 1, 60, "the router scraped")
    empty = sorted(s for s in selectors if not prom.query(f"count({s})"))
    assert empty == [], f"selectors with no series: {empty}"
    groups = prom.wait_for(lambda: prom.api("rules")["groups"], 30, "the rules to load")
    assert sorted(g["name"] for g in groups) == sorted(generate.GROUPS)
    assert all(r["health"] != "err" for g in groups for r in g["rules"]), groups
