"""Counters of one tier, ready to export as Prometheus metrics (monotonic, except `blocks` and
`bytes_held`, which are gauges)."""

from dataclasses import dataclass


@dataclass(slots=True)
class TierStats:
    hits: int = 0
    misses: int = 0
    bytes_written: int = 0
    bytes_read: int = 0
    read_seconds_sum: float = 0.0  # latency of the reads that hit
    read_count: int = 0
    evictions: int = 0
    errors: int = 0  # failed writes or reads (a disabled disk tier counts the one that disabled it)
    disabled: int = 0  # 1 once the tier turned itself off (a full disk, an unwritable directory)
    blocks: int = 0
    bytes_held: int = 0

    def record_read(self, nbytes: int, seconds: float) -> None:
        self.hits += 1
        self.bytes_read += nbytes
        self.read_seconds_sum += seconds
        self.read_count += 1
