"""A rank's metrics: plain counters the engine thread (and the rank's asyncio side) update as
work happens, and a prometheus-client Collector that reads a snapshot of them at scrape time.

Recording never slows a step: an observation is an integer add and a bisect into a short list;
no lock is taken on the engine thread and nothing touches the device. Prometheus' registry lock
is only held by the scraping thread. Which series exist is engine/metrics/catalog.py's catalog.
"""

import bisect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from engine.metrics.catalog import RANK, Spec, label_values, specs


@dataclass(slots=True)
class HistogramStats:
    """Observations counted into fixed buckets (bucket i counts values <= bounds[i]; the
    last counts the rest)."""

    bounds: tuple[float, ...]
    counts: list[int] = field(init=False)
    sum: float = 0.0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.bounds) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def buckets(self) -> list[tuple[str, int]]:
        """Cumulative (upper bound, count) pairs, +Inf last, as Prometheus exposes them."""
        total, out = 0, []
        for bound, n in zip([*self.bounds, float("inf")], self.counts, strict=True):
            total += n
            out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
        return out


class RankStats:
    """Every value a rank exports that code has to count (gauges read live state instead).
    NOTE: each field has one writer thread (the engine thread, or the rank's asyncio loop)."""

    def __init__(self) -> None:
        by_name = {s.name: s for s in specs(RANK)}
        self.counters: dict[tuple[str, tuple[str, ...]], float] = {}
        self.histograms: dict[tuple[str, tuple[str, ...]], HistogramStats] = {}
        for spec in by_name.values():  # pre-create every enumerable child at 0
            for values in _children(spec):
                if spec.kind == "counter":
                    self.counters[spec.name, values] = 0.0
                elif spec.kind == "histogram":
                    self.histograms[spec.name, values] = HistogramStats(spec.buckets)

    def inc(self, name: str, amount: float = 1.0, *labels: str) -> None:
        key = (name, labels)
        self.counters[key] = self.counters.get(key, 0.0) + amount

    def observe(self, name: str, value: float, *labels: str) -> None:
        key = (name, labels)
        hist = self.histograms.get(key)
        if hist is None:
            spec = next(s for s in specs(RANK) if s.name == name)
            hist = self.histograms[key] = HistogramStats(spec.buckets)
        hist.observe(value)

    def set(self, name: str, value: float, *labels: str) -> None:
        """A counter the engine already counts (monotonic): take its current total."""
        self.counters[name, labels] = float(value)


def _children(spec: Spec) -> list[tuple[str, ...]]:
    """Every combination of the spec's enumerable label values (one empty tuple if none)."""
    combos: list[tuple[str, ...]] = [()]
    for label in spec.labels:
        values = label_values(spec, label) or ()
        combos = [c + (v,) for c in combos for v in values]
    return combos


Gauges = Callable[[], dict[tuple[str, tuple[str, ...]], float]]


class RankCollector(Collector):
    """The rank's series: the counters and histograms of a RankStats, and the gauges `gauges()`
    reads from the engine's live state at scrape time (with the counters counted outside the
    RankStats: a value there for a counter's child replaces the RankStats' one). Every series
    gets model_name, pool and rank."""

    def __init__(self, stats: RankStats, gauges: Gauges, model: str, pool: str, rank: int):
        self.stats, self.gauges = stats, gauges
        self.const = {"model_name": model, "pool": pool, "rank": str(rank)}

    def collect(self) -> Iterator[Metric]:
        const_names, const_values = list(self.const), list(self.const.values())
        counters = dict(self.stats.counters)  # a snapshot: the engine thread goes on
        histograms = {k: (list(h.buckets()), h.sum) for k, h in self.stats.histograms.items()}
        gauges = self.gauges()
        for spec in specs(RANK):
            labels = const_names + list(spec.labels)
            name = spec.name.removesuffix("_total")
            if spec.kind == "counter":
                family = CounterMetricFamily(name, spec.help, labels=labels)
                # NOTE: a counter another part counts (the KV tiers) comes live, over its 0
                live = {k: v for k, v in gauges.items() if k[0] == spec.name}
                for (n, values), value in {**counters, **live}.items():
                    if n == spec.name:
                        family.add_metric(const_values + list(values), value)
            elif spec.kind == "histogram":
                family = HistogramMetricFamily(spec.name, spec.help, labels=labels)
                for (n, values), (buckets, total) in histograms.items():
                    if n == spec.name:
                        family.add_metric(const_values + list(values), buckets, total)
            else:
                family = GaugeMetricFamily(spec.name, spec.help, labels=labels)
                for (n, values), value in gauges.items():
                    if n == spec.name:
                        family.add_metric(const_values + list(values), value)
            yield family
