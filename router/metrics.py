"""The router's metrics: requests as users see them (latencies measured at the gRPC edge),
admission, the pools' health as the router watches it, and build and config info. Built from
engine/metrics/catalog.py's catalog into a registry of the router's own; one instance per router."""

import importlib.metadata
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from engine.metrics.catalog import PRESET_CHILDREN, ROUTER, label_values, specs

_KINDS = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


class RouterMetrics:
    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        self._m: dict[str, Counter | Gauge | Histogram] = {}
        for spec in specs(ROUTER):
            kwargs = {"buckets": spec.buckets} if spec.buckets else {}
            name = spec.name.removesuffix("_total") if spec.kind == "counter" else spec.name
            metric = _KINDS[spec.kind](
                name,
                spec.help,
                ["model_name", "pool", *spec.labels],
                registry=self.registry,
                **kwargs,
            )
            self._m[spec.name] = metric
            combos: list[tuple[str, ...]] = [()]
            for label in spec.labels:  # pre-create enumerable children: no missing series
                values = label_values(spec, label)
                if values is None:
                    combos = list(PRESET_CHILDREN.get(spec.name, ()))
                    break
                combos = [c + (v,) for c in combos for v in values]
            for combo in combos:
                self.child(spec.name, *combo)
        self.child("epcluster_build_info", *build_info()).set(1)

    def child(self, name: str, *labels: str) -> Any:  # a labelled Counter, Gauge or Histogram
        """The series of `name` with these label values (model_name and pool are added)."""
        return self._m[name].labels(self.model_name, "router", *labels)

    def set_config(self, **labels: str) -> None:
        self.child("epcluster_config_info", *(str(labels[k]) for k in _CONFIG_LABELS)).set(1)

    # ---- one request, as the server streams it ----

    def request(self, arrival: float) -> "RequestTimer":
        """An admitted request that arrived at `arrival` (time.monotonic())."""
        return RequestTimer(self, arrival)

    def refused(self, code: str, admission: str | None = None) -> None:
        """A request that ended before it started: invalid, refused by admission, draining."""
        self.child("epcluster_requests_total", "error", code).inc()
        if admission is not None:
            self.child("epcluster_admission_rejections_total", admission).inc()


_CONFIG_LABELS = next(s.labels for s in specs(ROUTER) if s.name == "epcluster_config_info")


class RequestTimer:
    """One request's timeline at the router: arrival, first token, each token, the end."""

    def __init__(self, metrics: RouterMetrics, arrival: float) -> None:
        self.m = metrics
        self.arrival = arrival
        self.first: float | None = None
        self.last: float | None = None
        self.num_tokens = 0
        metrics.child("epcluster_router_requests_waiting").inc()

    def tokens(self, count: int) -> None:
        """A delta of `count` tokens reached the client now."""
        if count == 0:
            return
        now, m = time.monotonic(), self.m
        m.child("epcluster_generation_tokens_total").inc(count)
        if self.first is None:
            self.first = now
            m.child("epcluster_time_to_first_token_seconds").observe(now - self.arrival)
            m.child("epcluster_router_requests_waiting").dec()
            m.child("epcluster_router_requests_running").inc()
        else:  # a delta of several tokens (one per step each): they share the gap
            gap = (now - self.last) / count
            for _ in range(count):
                m.child("epcluster_inter_token_latency_seconds").observe(gap)
        self.num_tokens += count
        self.last = now

    def finish(self, reason: str, code: str, num_cached: int = 0) -> None:
        now, m = time.monotonic(), self.m
        m.child("epcluster_requests_total", reason, code).inc()
        m.child("epcluster_e2e_request_latency_seconds").observe(now - self.arrival)
        m.child("epcluster_prompt_tokens_cached_total").inc(num_cached)
        if self.first is None:
            m.child("epcluster_router_requests_waiting").dec()
            return
        m.child("epcluster_router_requests_running").dec()
        decode_s = (self.last or now) - self.first
        m.child("epcluster_request_decode_time_seconds").observe(decode_s)
        if self.num_tokens > 1:
            per_token = decode_s / (self.num_tokens - 1)
            m.child("epcluster_request_time_per_output_token_seconds").observe(per_token)


def build_info() -> tuple[str, str]:
    """(version, commit): the installed package's version; the commit from EPCLUSTER_COMMIT
    (set in images) or the checkout's git HEAD, else "unknown"."""
    try:
        version = importlib.metadata.version("epcluster")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    commit = os.environ.get("EPCLUSTER_COMMIT", "")
    if not commit:
        try:
            commit = subprocess.run(
                ["git", "rev-parse", "--short=12", "HEAD"],
                cwd=Path(__file__).resolve().parent,
                capture_output=True,
                text=True,
                timeout=5,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            commit = ""
    return version, commit or "unknown"
