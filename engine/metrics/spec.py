"""The shape of a metric in the catalog (engine/metrics/catalog.py): Spec, and the histogram
buckets and label values the catalog's parts share."""

from dataclasses import dataclass

# vLLM v1 (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip
# ours
STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
                0.75, 1.0, 2.5, 5.0, 10.0)  # fmt: skip
COUNT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
BYTES_BUCKETS = tuple(float(1 << k) for k in range(10, 32, 2))  # 1 KiB .. 1 GiB

ROUTER, RANK = "router", "rank"
FINISHED_REASONS = ("stop", "length", "abort", "error")
POOLS = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class Spec:
    name: str  # as scraped; counters end in _total
    kind: str  # counter | gauge | histogram
    help: str
    labels: tuple[str, ...] = ()  # beyond model_name (and pool, rank on ranks)
    buckets: tuple[float, ...] | None = None
    where: str = RANK  # which process exports it: router or rank

    @property
    def series_names(self) -> tuple[str, ...]:
        """Names as they appear in a scrape (what PromQL can select)."""
        if self.kind == "histogram":
            return tuple(f"{self.name}_{s}" for s in ("bucket", "sum", "count"))
        return (self.name,)
