"""The monitoring files: generated ones equal what deploy/monitoring/generate.py builds and pass
its checks (which catch a bad panel), the rules pass `promtool check rules` and `promtool test
rules` (a firing and a silent case for every alert), the PrometheusRule carries exactly the
plain rule file's groups, and the scrape configuration passes `promtool check config`."""

import json
import re
from pathlib import Path

import pytest
import yaml

from deploy.monitoring import checks, generate
from tests.prometheus import REPO, binary, promtool

MONITORING = REPO / "deploy" / "monitoring"

pytestmark = pytest.mark.skipif(
    binary("promtool") is None, reason="promtool missing: run `make prometheus`"
)


def test_generated_files_are_current_and_pass_the_checks():
    assert generate.main(["--check"]) == 0


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        ("sum(rate(epcluster_no_such_metric_total[$__rate_interval]))", "unknown metric"),
        ("sum(epcluster_requests_total)", "counter epcluster_requests_total outside rate"),
        ("sum(rate(epcluster_requests_total[5m]))", "use [$__rate_interval]"),
        ("sum(rate(epcluster_requests_total[5m:1m]))", "use [$__rate_interval]"),
        ("epcluster_step_tokens_sum / epcluster_step_tokens_count", "outside rate"),
        (
            "histogram_quantile(0.9, sum by (le) (rate("
            "epcluster_step_tokens_count[$__rate_interval])))",
            "histogram_quantile over ['epcluster_step_tokens_count']: only _bucket",
        ),
        (
            "sum(rate(epcluster_step_tokens_bucket[$__rate_interval]))",
            "outside histogram_quantile and without an le matcher",
        ),
        (
            'sum(rate(epcluster_step_tokens_bucket{le="64"}[$__rate_interval]))',
            'le="64" on epcluster_step_tokens_bucket is not a bucket as exported',
        ),
    ],
)
def test_the_check_catches_a_bad_panel(expr, expected):
    board = json.loads((MONITORING / "dashboards" / "overview.json").read_text())
    assert generate.problems({"overview": board}) == []
    found = generate.problems({"overview": generate.with_panel(board, expr)})
    assert any(expected in p for p in found), found


@pytest.mark.parametrize(
    "expr",
    [
        'sum(rate(epcluster_step_tokens_bucket{le="64.0"}[$__rate_interval])) / '
        "(sum(rate(epcluster_step_tokens_count[$__rate_interval])) > 0)",
        "histogram_quantile(0.99, sum by (le, pool) (rate("
        'epcluster_step_duration_seconds_bucket{pool=~"$pool"}[$__rate_interval]))) > 0.3',
        "changes(epcluster_eplb_rebalances_total[$__rate_interval]) > 0",
        'absent(up{pool="router"})',
        "count by (pool) (up offset 15m) unless count by (pool) (up)",
    ],
)
def test_the_check_passes_what_follows_the_rules(expr):
    assert checks.expr_problems(expr) == []


@pytest.mark.parametrize(
    ("expr", "expected"),
    [
        (
            "histogram_quantile(0.99, sum by (le) (rate("
            "epcluster_time_to_first_token_seconds_bucket[5m]))) > bool 3",
            "threshold 3 on histogram_quantile",
        ),
        ("epcluster_preemptions_total > 0", "outside rate"),
        ("sum by (pool) (epcluster_no_such_ratio) < 0.5", "unknown metric"),
    ],
)
def test_the_check_catches_a_bad_rule(expr, expected):
    found = checks.expr_problems(expr)
    assert any(expected in p for p in found), found


def test_the_check_catches_a_hard_coded_datasource():
    board = json.loads((MONITORING / "dashboards" / "pools.json").read_text())
    board["panels"][0]["datasource"] = {"type": "prometheus", "uid": "abc123"}
    del board["panels"][1]["description"]
    found = generate.problems({"pools": board})
    assert any("datasource is not" in p for p in found), found
    assert any("no description" in p for p in found), found


def test_promtool_checks_the_rules_and_runs_a_test_per_alert():
    check = promtool("check", "rules", str(MONITORING / "rules.yml"))
    assert check.returncode == 0, check.stdout + check.stderr
    tests = yaml.safe_load((MONITORING / "tests" / "alerts.test.yml").read_text())["tests"]
    alerts = {r["alert"] for g in generate.rule_groups() for r in g["rules"]}
    for case in ("firing", "silent"):
        assert {t["name"] for t in tests if t["name"].endswith(case)} == {
            f"{a} {case}" for a in alerts
        }
    run = promtool("test", "rules", str(MONITORING / "tests" / "alerts.test.yml"))
    assert run.returncode == 0, run.stdout + run.stderr
    assert "SUCCESS" in run.stdout + run.stderr


def test_a_broken_threshold_fails_its_unit_test(tmp_path):
    """The unit tests can fail: with one alert's threshold moved, promtool reports it."""
    rules = yaml.safe_load((MONITORING / "rules.yml").read_text())
    for group in rules["groups"]:
        for r in group["rules"]:
            if r["alert"] == "EpclusterKVCacheFull":
                r["expr"] = r["expr"].replace("0.95", "0.98")
    (tmp_path / "rules.yml").write_text(yaml.safe_dump(rules))
    tests = yaml.safe_load((MONITORING / "tests" / "alerts.test.yml").read_text())
    tests["rule_files"] = [str(tmp_path / "rules.yml")]
    (tmp_path / "t.yml").write_text(yaml.safe_dump(tests))
    run = promtool("test", "rules", str(tmp_path / "t.yml"))
    assert run.returncode != 0
    assert "EpclusterKVCacheFull firing" in run.stdout + run.stderr


def test_the_prometheusrule_holds_the_rule_files_groups():
    rule = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    plain = yaml.safe_load((MONITORING / "rules.yml").read_text())
    assert rule["kind"] == "PrometheusRule" and rule["spec"]["groups"] == plain["groups"]
    for group in plain["groups"]:
        for r in group["rules"]:
            assert r["labels"]["severity"] in ("warning", "critical")
            assert {"summary", "description", "runbook_url"} <= set(r["annotations"])


def test_every_runbook_url_leads_to_its_notes():
    """runbook_url ends in #alertname, a heading of deploy/README.md (GitHub's anchors: lower
    case, spaces to hyphens, punctuation dropped)."""
    readme = (REPO / "deploy" / "README.md").read_text()
    anchors = {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", readme, re.M)
    }
    for group in generate.rule_groups():
        for r in group["rules"]:
            page, _, anchor = r["annotations"]["runbook_url"].partition("#")
            assert page.endswith("/deploy/README.md") and anchor == r["alert"].lower()
            assert anchor in anchors, f"no runbook notes for {r['alert']} in deploy/README.md"


def test_promtool_checks_the_scrape_configuration():
    run = promtool("check", "config", str(MONITORING / "prometheus.yml"))
    assert run.returncode == 0, run.stdout + run.stderr
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["http_sd_configs"][0]["url"].endswith("/sd/targets")
    assert "static_configs" not in job  # discovered, not a hand-typed list


def test_grafana_provisioning_points_at_prometheus():
    ds = yaml.safe_load((MONITORING / "grafana" / "datasource.yaml").read_text())
    assert ds["datasources"][0]["type"] == "prometheus"
    providers = yaml.safe_load((MONITORING / "grafana" / "dashboards.yaml").read_text())
    assert providers["providers"][0]["type"] == "file"
    assert Path(providers["providers"][0]["options"]["path"]).is_absolute()
