"""Expert-parallel load balancing (EPLB): where each logical expert's replicas go.

The public surface, tensors in and tensors out (shapes in each function's docstring):
- rebalance_experts: DeepSeek's greedy, refined by local search (rebalance.py);
- rebalance_experts_with_moves, align_placement, count_moves: re-placement under a budget of
  moved slots (moves.py);
- gpu_loads: the load each GPU gets from a placement.

The rest are the algorithm's pieces: greedy.py (replicate, pack), groups.py (which groups share a
node), search.py (local search) and bound.py (a lower bound per layer, for tests and bench/eplb).
"""

from moe.eplb.moves import align_placement, count_moves, rebalance_experts_with_moves
from moe.eplb.rebalance import gpu_loads, rebalance_experts

__all__ = [
    "align_placement",
    "count_moves",
    "gpu_loads",
    "rebalance_experts",
    "rebalance_experts_with_moves",
]
