"""Hardware as data: one GPU (or this machine's CPU, measured by probe.py) per entry, every
number with where it comes from.

Bandwidths are per GPU and per direction. FLOP/s are dense (no 2:4 sparsity). `efficiency` is
the fraction of a peak that real kernels reach: an assumption, taken from published kernel
benchmarks (never from fleet throughput), the same for every GPU unless a source says otherwise.
"""

from dataclasses import dataclass, field

GB = 1e9
TB = 1e12
TFLOP = 1e12
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp8": 1}


@dataclass(frozen=True, slots=True)
class Efficiency:
    """Fractions of peak that kernels reach (assumptions, each with its reason)."""

    # STREAM-like reads on Hopper reach ~80-90% of HBM peak (NVIDIA's babelstream numbers).
    memory: float = 0.85
    # DeepGEMM (deepseek-ai/DeepGEMM README) reaches up to ~1550 of 1979 FP8 TFLOP/s on H800
    # in its best shapes, less in small ones: 0.7 of peak.
    compute: float = 0.7
    # DeepEP (deepseek-ai/DeepEP README) measures ~153 GB/s over NVLink (of 160 usable) and
    # ~43-58 GB/s over 400 Gb/s RDMA on H800: 0.9 of the per-direction link rate.
    link: float = 0.9

    def __post_init__(self) -> None:
        for name in ("memory", "compute", "link"):
            if not 0 < getattr(self, name) <= 1:
                raise ValueError(f"efficiency.{name} must be in (0, 1]")


@dataclass(frozen=True, slots=True)
class Hardware:
    """One accelerator (or CPU): memory, bandwidths, peaks per dtype, price, sources."""

    name: str
    memory_bytes: float
    memory_bw: float  # bytes/s, HBM (or DRAM) read
    flops: dict[str, float]  # dense FLOP/s per dtype: fp32, bf16, fp8
    intra_node_bw: float  # bytes/s per GPU per direction (NVLink)
    inter_node_bw: float  # bytes/s per GPU per direction (RDMA NIC)
    price_per_hour: float  # USD per GPU-hour
    sources: dict[str, str] = field(default_factory=dict)
    efficiency: Efficiency = Efficiency()
    # what the software adds to a step beyond the roofline, where measured (cost.Unit's
    # fields): None / 0 leave the Unit's assumptions (a GPU's 0.5 ms per step)
    step_overhead_s: float | None = None
    sequence_overhead_s: float = 0.0
    exchange_latency_s: float = 0.0
    ep_step_overhead_s: float = 0.0
    ep_sequence_overhead_s: float = 0.0
    prefill_token_overhead_s: float = 0.0

    def __post_init__(self) -> None:
        if self.memory_bytes <= 0 or self.memory_bw <= 0:
            raise ValueError(f"{self.name}: memory and bandwidth must be > 0")
        if set(self.flops) != set(DTYPE_BYTES) or min(self.flops.values()) <= 0:
            raise ValueError(f"{self.name}: flops needs positive {sorted(DTYPE_BYTES)}")
        if self.intra_node_bw <= 0 or self.inter_node_bw <= 0 or self.price_per_hour < 0:
            raise ValueError(f"{self.name}: link bandwidths must be > 0, price >= 0")
        overheads = (self.step_overhead_s or 0.0, self.sequence_overhead_s, self.exchange_latency_s,
                     self.ep_step_overhead_s, self.ep_sequence_overhead_s,
                     self.prefill_token_overhead_s)  # fmt: skip
        if min(overheads) < 0:
            raise ValueError(f"{self.name}: overheads must be >= 0")

    def peak(self, dtype: str) -> float:
        """FLOP/s that kernels reach in `dtype` (peak x efficiency)."""
        return self.flops[dtype] * self.efficiency.compute

    @property
    def read_bw(self) -> float:
        return self.memory_bw * self.efficiency.memory


_HOPPER_FLOPS = {"fp32": 67 * TFLOP, "bf16": 989 * TFLOP, "fp8": 1979 * TFLOP}
_HOPPER_SRC = "NVIDIA H100 Tensor Core GPU datasheet (SXM5): FP32 67, BF16 989, FP8 1979 dense"
_NIC_400G = "one 400 Gb/s ConnectX-7 NIC per GPU (DGX/HGX H100 and DeepSeek's H800 nodes): 50 GB/s"
_PRICE_NOTE = "assumption: market prices range widely (gmicloud.ai, Apr 2026: $0.52-$14.90)"

CATALOG: dict[str, Hardware] = {
    "H800": Hardware(
        name="H800",
        memory_bytes=80 * GB,
        memory_bw=3.35 * TB,
        flops=_HOPPER_FLOPS,
        # DeepSeek-V3 technical report (arXiv 2412.19437, sec. 3.2.2): NVLink 160 GB/s, IB 50 GB/s
        intra_node_bw=160 * GB,
        inter_node_bw=50 * GB,
        price_per_hour=2.0,
        sources={
            "memory": "H800 SXM5: 80 GB HBM3, 3.35 TB/s (same memory system as H100 SXM5)",
            "flops": _HOPPER_SRC + " (the H800 keeps H100's tensor cores)",
            "links": "DeepSeek-V3 report sec. 3.2.2: NVLink 160 GB/s, InfiniBand 50 GB/s per GPU",
            "price": "DeepSeek's own assumption, $2 per H800 GPU-hour (Inference System "
            "Overview, Day 6 of Open Source Week, Mar 2025)",
        },
    ),
    "H100": Hardware(
        name="H100",
        memory_bytes=80 * GB,
        memory_bw=3.35 * TB,
        flops=_HOPPER_FLOPS,
        intra_node_bw=450 * GB,
        inter_node_bw=50 * GB,
        price_per_hour=2.69,
        sources={
            "memory": "NVIDIA H100 datasheet (SXM5): 80 GB HBM3, 3.35 TB/s",
            "flops": _HOPPER_SRC,
            "links": "NVLink 4: 900 GB/s per GPU both directions (450 each); " + _NIC_400G,
            "price": "RunPod H100 SXM $2.69/GPU-hour as listed by deploybase.ai (2026); "
            + _PRICE_NOTE,
        },
    ),
    "H200": Hardware(
        name="H200",
        memory_bytes=141 * GB,
        memory_bw=4.8 * TB,
        flops=_HOPPER_FLOPS,
        intra_node_bw=450 * GB,
        inter_node_bw=50 * GB,
        price_per_hour=4.54,
        sources={
            "memory": "NVIDIA H200 datasheet (SXM): 141 GB HBM3e, 4.8 TB/s",
            "flops": "NVIDIA H200 datasheet: same tensor cores as H100 SXM5 (67/989/1979)",
            "links": "NVLink 4: 900 GB/s per GPU both directions; " + _NIC_400G,
            "price": "Spheron on-demand H200 $4.54/GPU-hour (17 Mar 2026); " + _PRICE_NOTE,
        },
    ),
    "B200": Hardware(
        name="B200",
        memory_bytes=180 * GB,
        memory_bw=7.7 * TB,
        flops={"fp32": 75 * TFLOP, "bf16": 2250 * TFLOP, "fp8": 4500 * TFLOP},
        intra_node_bw=900 * GB,
        inter_node_bw=50 * GB,
        price_per_hour=6.03,
        sources={
            "memory": "NVIDIA HGX B200 spec table (per GPU): 180 GB HBM3e, 7.7 TB/s",
            "flops": "NVIDIA HGX B200 spec table (per GPU): FP8 9 PF and BF16 4.5 PF with "
            "sparsity (4.5 and 2.25 dense), FP32 75 TF",
            "links": "NVLink 5: 1.8 TB/s per GPU both directions; DGX B200 has one 400 Gb/s "
            "ConnectX-7 per GPU: 50 GB/s",
            "price": "Spheron on-demand B200 $6.03/GPU-hour (17 Mar 2026); " + _PRICE_NOTE,
        },
    ),
}
