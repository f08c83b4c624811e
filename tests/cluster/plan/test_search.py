"""The search finds the known optimum of a small hand-made grid (step costs stubbed)."""

import pytest

from cluster.plan.planner import redundant_experts
from cluster.plan.search import Grid, search
from cluster.plan.workload import Workload


class Stub:
    """Prefill: 0.05 s + 0.1 ms a token whatever the EP size. Decode: 10 ms + 1 ms a request,
    twice that per request on one GPU (no EP to spread the experts). The cache holds 30,000
    positions per GPU, so batch 40 (44,040 positions) never fits."""

    price_per_gpu_hour = 2.0

    def prefill_s(self, ep: int, tokens: int, seqs: int, cached: float) -> float:
        return 0.05 + tokens * 1e-4

    def decode_s(self, ep: int, batch: int, context: float) -> float:
        return 0.01 + 0.001 * batch * (2 if ep == 1 else 1)

    def fits(self, ep: int, step_tokens: int, kv_tokens: float) -> bool:
        return kv_tokens <= 30_000


GRID = Grid(prefill_nodes=(1, 2), decode_nodes=(1, 2), chunks=(1000, 2000),
            batches=(10, 20, 40), gpus_per_node=1)  # fmt: skip
WORK = Workload("hand", rate=10.0, prompt_mean=1000, output_mean=101)


def test_known_optimum():
    """By hand. Prefill: chunk 1000 steps 0.15 s (6,667 tok/s), its M/D/1 utilisation for a
    1 s TTFT is min(0.9, 1.7 / 1.85) = 0.9, so 10,000 tok/s need 1.67 GPUs -> 2; chunk 2000 also
    needs 2, at a longer step: EP1 x 2 units of chunk 1000 wins (first, shortest step).
    Decode (TPOT 50 ms, mean context 1,050.5): EP1 batch 20 = 50 ms, 400 tok/s/GPU -> 1,010
    tok/s / (400 x 0.9) = 2.8 -> 3 GPUs; EP2 batch 20 = 30 ms, 667 -> 1.68 -> one unit of 2;
    EP2 batch 40 would be 800 but does not fit. Optimum: 2 + 2 GPUs, $192 a day."""
    dep = search(Stub(), WORK, GRID, slo_ttft=1.0, slo_tpot=0.05)
    p, d = dep.prefill, dep.decode
    assert (p.ep, p.units, p.size) == (1, 2, 1000)
    assert p.step_s == pytest.approx(0.15) and p.utilisation == pytest.approx(0.9)
    assert (d.ep, d.units, d.size) == (2, 1, 20)
    assert d.step_s == pytest.approx(0.03)
    assert dep.cost_per_day == pytest.approx(4 * 2.0 * 24)


def test_nothing_meets_the_slo():
    with pytest.raises(ValueError, match="no decode configuration"):
        search(Stub(), WORK, GRID, slo_ttft=1.0, slo_tpot=0.005)
    with pytest.raises(ValueError, match="no prefill configuration"):
        search(Stub(), WORK, GRID, slo_ttft=0.1, slo_tpot=0.05)


def test_redundant_experts_match_deepseek():
    assert redundant_experts(256, 32) == 32 and redundant_experts(256, 144) == 32
    assert redundant_experts(256, 1) == 0
    assert (256 + redundant_experts(256, 64)) % 64 == 0
