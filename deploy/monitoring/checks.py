"""The house rules for epcluster's boards and alerts (../../shared/OPERATIONS.md "Grafana" and
"Alerts"), checked on the generated JSON and rule expressions by `generate.py --check`:

- a panel or rule selects only series that engine/metrics/catalog.py's catalog defines (or `up`);
- counters, and a histogram's _bucket/_sum/_count series (counters too), appear only inside
  rate/increase/changes: a raw counter's value means nothing across restarts;
- a _bucket series feeds histogram_quantile, or is picked by an `le` matcher for an SLO ratio;
  histogram_quantile reads only _bucket series;
- an `le` matcher names a catalog bucket spelled as the exporters write it ("10.0", not "10":
  Prometheus compares label values as strings, so `le="10"` selects nothing);
- a threshold on a histogram_quantile is one of that histogram's bucket boundaries (between two
  boundaries the quantile is an interpolation, not a measurement);
- on the boards: every range is `$__rate_interval`, every panel and target uses the
  `datasource` variable, every panel has a unit and a description.

A small scanner, not a PromQL parser: it tracks the function calls around each selector, which
is all these rules need, and it is tested on expressions that break each of them.
"""

import re
from dataclasses import dataclass

from deploy.monitoring.panels import DS
from engine.metrics.catalog import SPECS

RATE_FUNCS = {"rate", "irate", "increase", "changes", "resets", "absent", "absent_over_time"}
LABEL_LISTS = {"by", "without", "on", "ignoring", "group_left", "group_right"}
KEYWORDS = {"and", "or", "unless", "bool", "offset"}  # a "(" after these only groups
COMPARISONS = (">", ">=", "<", "<=")
TOKEN = re.compile(
    r'\s+|(?P<str>"(?:[^"\\]|\\.)*")|(?P<sel>\{[^}]*\})|(?P<range>\[[^\]]*\])'
    r"|(?P<word>[A-Za-z_][\w:]*)|(?P<num>\d+(?:\.\d*)?(?:e[+-]?\d+)?)|(?P<op>[()><=!]=?|.)"
)
LE = re.compile(r'\ble\s*=\s*"([^"]*)"')


def _le_text(bound: float) -> str:
    """A bucket bound as the exporters write it (prometheus-client's Go-style float)."""
    return "+Inf" if bound == float("inf") else repr(float(bound))


def catalog() -> dict[str, tuple[str, tuple[float, ...]]]:
    """Series name -> (kind, buckets): kind counter, gauge or bucket (a histogram's _bucket);
    a histogram's _sum and _count are counters."""
    out: dict[str, tuple[str, tuple[float, ...]]] = {"up": ("gauge", ())}
    for s in SPECS:
        if s.kind == "histogram":
            out[f"{s.name}_bucket"] = ("bucket", (*s.buckets, float("inf")))
            out[f"{s.name}_sum"] = out[f"{s.name}_count"] = ("counter", ())
        else:
            out[s.name] = (s.kind, ())
    return out


@dataclass(frozen=True, slots=True)
class Selector:
    name: str
    matchers: str  # "{...}" or ""
    calls: tuple[tuple[str, int], ...]  # the enclosing calls, outermost first: (function, id)


def scan(expr: str) -> tuple[list[Selector], list[str], dict[int, str]]:
    """-> the selectors of `expr`, its ranges ("[...]" contents), and for each
    histogram_quantile call (by id) the threshold it is compared with (`> x`), if any."""
    tokens = [(m.lastgroup, m.group()) for m in TOKEN.finditer(expr) if m.lastgroup]
    selectors, ranges, thresholds = [], [], {}
    stack: list[tuple[str, int]] = []
    for i, (kind, text) in enumerate(tokens):
        prev = tokens[i - 1][1] if i else ""
        nxt = tokens[i + 1] if i + 1 < len(tokens) else ("", "")
        if kind == "range":
            ranges.append(text[1:-1])
        elif text == "(":
            name = prev if i and tokens[i - 1][0] == "word" and prev not in KEYWORDS else ""
            stack.append(("#labels" if name in LABEL_LISTS else name, i))
        elif text == ")" and stack:
            name, ident = stack.pop()
            rest = [t for _, t in tokens[i + 1 : i + 4] if t != "bool"]
            if name == "histogram_quantile" and len(rest) > 1 and rest[0] in COMPARISONS:
                thresholds[ident] = rest[1]
        elif kind == "word" and nxt[1] != "(" and (text.startswith("epcluster_") or text == "up"):
            matchers = nxt[1] if nxt[0] == "sel" else ""
            selectors.append(Selector(text, matchers, tuple(stack)))
    return selectors, ranges, thresholds


def expr_problems(expr: str) -> list[str]:
    """What breaks the rules in one PromQL expression (Grafana variables allowed)."""
    known, found = catalog(), []
    selectors, _, thresholds = scan(expr)
    quantile_inputs: dict[int, list[Selector]] = {}
    for s in selectors:
        if s.name not in known:
            found.append(f"unknown metric {s.name}")
            continue
        kind, buckets = known[s.name]
        funcs = [f for f, _ in s.calls if f]
        if kind in ("counter", "bucket") and (not funcs or funcs[-1] not in RATE_FUNCS):
            found.append(f"counter {s.name} outside rate/increase")
        quantile = [ident for f, ident in s.calls if f == "histogram_quantile"]
        if quantile:
            quantile_inputs.setdefault(quantile[-1], []).append(s)
        elif kind == "bucket" and not LE.search(s.matchers):
            found.append(f"{s.name} outside histogram_quantile and without an le matcher")
        for le in LE.findall(s.matchers):
            spelled = [_le_text(b) for b in buckets]
            if le not in spelled:
                found.append(f'le="{le}" on {s.name} is not a bucket as exported: {spelled}')
    for ident, inputs in quantile_inputs.items():
        names = {s.name for s in inputs}
        if any(known[n][0] != "bucket" for n in names):
            found.append(f"histogram_quantile over {sorted(names)}: only _bucket series")
            continue
        threshold = thresholds.get(ident)
        bounds = {b for n in names for b in known[n][1]}
        if threshold is not None and float(threshold) not in bounds:
            found.append(f"threshold {threshold} on histogram_quantile of {sorted(names)} is "
                         "not a bucket boundary")  # fmt: skip
    return [f"{p} in {expr!r}" for p in found]


def board_problems(name: str, board: dict, exprs: list[str]) -> list[str]:
    """What breaks the rules in one dashboard (its JSON, and the PromQL of its panels and
    annotations)."""
    found = []
    variables = {v["name"]: v for v in board["templating"]["list"]}
    if variables.get("datasource", {}).get("type") != "datasource":
        found.append(f"{name}: no `datasource` variable of type datasource")
    for p in board["panels"]:
        where = f"{name}: panel {p['title']!r}"
        if p.get("datasource") != DS:
            found.append(f"{where}: datasource is not ${{datasource}}")
        if not p.get("description"):
            found.append(f"{where}: no description")
        if not p.get("fieldConfig", {}).get("defaults", {}).get("unit"):
            found.append(f"{where}: no unit")
        for t in p["targets"]:
            if t.get("datasource") != DS:
                found.append(f"{where}: a target's datasource is not ${{datasource}}")
    for expr in exprs:
        found += [f"{name}: {e}" for e in expr_problems(expr)]
        found += [
            f"{name}: range [{r}] in {expr!r}: use [$__rate_interval]"
            for r in scan(expr)[1]
            if r != "$__rate_interval"
        ]
    return found
