"""A real Prometheus (the Debian package, `make prometheus`) with the project's scrape
configuration (deploy/monitoring/prometheus.yml: http_sd from the router, no port list) and its
rules, against a running local cluster (2 prefill + 2 decode ranks): the router and every rank
are discovered and `up`; TTFT, inter-token latency, KV usage, all-to-all and KV-transfer series
have data after a few requests; `promtool check metrics` passes on every target's scrape; every
PromQL expression of the dashboards and the rules evaluates without error."""

import json
import re
import urllib.request

import pytest
import yaml

from deploy.monitoring import generate
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
    cluster = start_cluster(model="tiny")
    try:
        with Prometheus(scrape_config(cluster.metrics_server.endpoint)) as prom:
            yield cluster, prom
    finally:
        cluster.shutdown()


def test_prometheus_scrapes_every_process_of_the_cluster(stack):
    cluster, prom = stack
    with InferenceClient(cluster.address, timeout=120) as client:
        for i in range(6):
            params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
            client.complete(f"Prompt number {i} about the language reference", params)

    def all_up():
        up = prom.query("up")
        return len(up) == 5 and all(r["value"][1] == "1" for r in up) and up

    up = prom.wait_for(all_up, 60, "5 targets up")
    pools = sorted((r["metric"]["pool"], r["metric"].get("rank", "")) for r in up)
    assert pools == [("decode", "0"), ("decode", "1"), ("prefill", "0"), ("prefill", "1"),
                     ("router", "")]  # fmt: skip
    assert all(r["metric"]["model_name"] == "tiny" for r in up)

    with_data = {
        "TTFT": "epcluster_time_to_first_token_seconds_count",
        "inter-token latency": "epcluster_inter_token_latency_seconds_count",
        "all-to-all": 'epcluster_alltoall_duration_seconds_count{pool="decode"}',
        "KV transfer": "epcluster_kv_transfer_duration_seconds_count",
        "tokens": "epcluster_generation_tokens_total",
    }
    for what, expr in with_data.items():
        prom.wait_for(lambda e=expr: total(prom, e) > 0, 60, f"{what} data ({expr})")
    assert total(prom, "epcluster_generation_tokens_total") == 6 * 12
    usage = prom.query("epcluster_kv_cache_usage_ratio")
    assert sorted((r["metric"]["pool"], r["metric"]["rank"]) for r in usage) == [
        ("decode", "0"), ("decode", "1"), ("prefill", "0"), ("prefill", "1")
    ]  # fmt: skip

    for target in prom.targets():
        with urllib.request.urlopen(target["scrapeUrl"], timeout=10) as r:
            text = r.read().decode()
        check = promtool("check", "metrics", stdin=text)
        assert check.returncode == 0, (target["labels"], check.stdout + check.stderr)


def test_every_dashboard_and_rule_expression_evaluates(stack):
    _, prom = stack
    exprs = [
        concrete(e)
        for path in sorted((MONITORING / "dashboards").glob("*.json"))
        for e in generate.dashboard_exprs(json.loads(path.read_text()))
    ] + generate.rule_exprs()
    assert len(exprs) > 60
    for expr in exprs:
        prom.query(expr)  # raises with Prometheus' error on a bad expression
    groups = prom.wait_for(lambda: prom.api("rules")["groups"], 30, "the rules to load")
    assert sorted(g["name"] for g in groups) == sorted(generate.GROUPS)
    assert all(r["health"] != "err" for g in groups for r in g["rules"]), groups
