"""Building blocks of epcluster's Grafana boards (dashboards.py): selectors with the boards'
variables, PromQL targets, quantile panels, the templating every board shares, and the board
JSON itself (schemaVersion 39, explicit uid, the `datasource` variable on every panel and
target)."""

DS = {"type": "prometheus", "uid": "${datasource}"}
R = '{job=~"$job", model_name=~"$model_name"}'  # router series
K = '{job=~"$job", model_name=~"$model_name", pool=~"$pool", instance=~"$instance"}'  # ranks
RI = "$__rate_interval"


def rank_sel(extra: str) -> str:
    """The rank selector K with one more matcher."""
    return K[:-1] + ", " + extra + "}"


def q(expr: str, legend: str = "") -> dict:
    return {"expr": expr, "legendFormat": legend}


def quantiles(metric: str, sel: str = R, by: str = "") -> list[dict]:
    group = f"le{', ' + by if by else ''}"
    return [
        q(
            f"histogram_quantile({p}, sum by ({group}) (rate({metric}_bucket{sel}[{RI}])))",
            f"p{int(p * 100)}{' {{' + by + '}}' if by else ''}",
        )
        for p in (0.5, 0.95, 0.99)
    ]


def panel(title: str, unit: str, description: str, targets: list[dict], kind="timeseries"):
    return {"title": title, "unit": unit, "description": description, "targets": targets,
            "type": kind}  # fmt: skip


def variable(name: str, query: str) -> dict:
    return {
        "name": name,
        "label": name,
        "type": "query",
        "datasource": DS,
        "query": {"query": query, "refId": f"{name}-var"},
        "definition": query,
        "refresh": 2,
        "includeAll": True,
        "multi": True,
        "allValue": ".*",
        "current": {"text": "All", "value": "$__all"},
        "sort": 1,
    }


def board(uid: str, title: str, description: str, panels: list[dict], annotations=()) -> dict:
    out = []
    for i, p in enumerate(panels):
        out.append(
            {
                "id": i + 1,
                "type": p["type"],
                "title": p["title"],
                "description": p["description"],
                "datasource": DS,
                "gridPos": {"h": 8, "w": 12, "x": 12 * (i % 2), "y": 8 * (i // 2)},
                "fieldConfig": {"defaults": {"unit": p["unit"]}, "overrides": []},
                "options": {"legend": {"displayMode": "table", "placement": "bottom"}},
                "targets": [
                    dict(t, refId=chr(ord("A") + j), datasource=DS)
                    for j, t in enumerate(p["targets"])
                ],
            }
        )
    return {
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["epcluster"],
        "schemaVersion": 39,
        "version": 1,
        "editable": True,
        "time": {"from": "now-1h", "to": "now"},
        "refresh": "30s",
        "timezone": "browser",
        "annotations": {"list": list(annotations)},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Data source",
                    "type": "datasource",
                    "query": "prometheus",
                },
                variable("job", "label_values(epcluster_build_info, job)"),
                variable(
                    "model_name", 'label_values(epcluster_build_info{job=~"$job"}, model_name)'
                ),
                variable("pool", 'label_values(epcluster_engine_steps_total{job=~"$job"}, pool)'),
                variable(
                    "instance",
                    "label_values(epcluster_engine_steps_total"
                    '{job=~"$job", pool=~"$pool"}, instance)',
                ),
            ]  # fmt: skip
        },
        "panels": out,
    }
