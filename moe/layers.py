"""Feed-forward layers: RMSNorm, the dense MLP, the gate, the routed experts and the MoE block.

Legend: T tokens, H hidden, I intermediate, E logical routed experts, S local expert slots,
K experts per token.
"""

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kernels.gate import grouped_topk
from kernels.moe_mlp import grouped_expert_mlp, silu_and_mul
from kernels.rmsnorm import rms_norm
from moe.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class MLP(nn.Module):
    """SiLU-gated MLP: the dense layers and the shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
        return self.down_proj(silu_and_mul(gate_up))


class Gate(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        if config.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(config.n_routed_experts))
        else:
            self.e_score_correction_bias = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_weights [T, K] fp32, topk_idx [T, K] int64), logical expert ids."""
        c = self.config
        logits = F.linear(x.float(), self.weight.float())  # [T, E]
        return grouped_topk(
            logits,
            c.num_experts_per_tok,
            c.scoring_func,
            c.topk_method,
            c.n_group,
            c.topk_group,
            c.norm_topk_prob,
            c.routed_scaling_factor,
            self.e_score_correction_bias,
        )


class Experts(nn.Module):
    """The routed experts this rank holds: slot s holds logical expert expert_ids[s].

    Weights are stacked per slot: w13 [S, 2I, H] (gate rows, then up rows), w2 [S, H, I].
    """

    def __init__(self, config: ModelConfig, expert_ids: Sequence[int]) -> None:
        super().__init__()
        assert all(0 <= e < config.n_routed_experts for e in expert_ids), expert_ids
        self.expert_ids = list(expert_ids)
        num_slots, hidden, inter = len(expert_ids), config.hidden_size, config.moe_intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_slots, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(num_slots, hidden, inter))
        self.num_experts = config.n_routed_experts
        self.register_buffer("log2slot", self._log2slot(), persistent=False)

    def _log2slot(self) -> torch.Tensor:
        """[E] int64: a local slot of each logical expert, -1 where none."""
        # NOTE: explicit cpu: factory calls under a meta-device context import torch._dynamo (2 s).
        log2slot = torch.full((self.num_experts,), -1, dtype=torch.long, device="cpu")
        ids = torch.tensor(self.expert_ids, dtype=torch.long, device="cpu")
        log2slot[ids] = torch.arange(len(self.expert_ids), device="cpu")
        return log2slot

    def init_buffers(self) -> None:
        self.log2slot = self._log2slot().to(self.w13.device)

    def forward_sorted(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [N, H] rows grouped by local slot (counts [S]) -> [N, H] unweighted expert outputs."""
        return grouped_expert_mlp(x, counts, self.w13, self.w2)

    def forward(
        self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor:
        """All experts local: x [T, H], topk_idx [T, K], topk_weights [T, K] -> [T, H]."""
        num_tokens, top_k = topk_idx.shape
        slots = self.log2slot[topk_idx.reshape(-1)]  # [T*K]
        assert bool((slots >= 0).all()), "a token was routed to an expert this rank does not hold"
        order = torch.argsort(slots, stable=True)  # [T*K]
        counts = torch.bincount(slots, minlength=len(self.expert_ids)).tolist()
        token_of = order // top_k
        y = self.forward_sorted(x[token_of], counts)  # [T*K, H]
        y = y * topk_weights.reshape(-1)[order, None].to(y.dtype)
        return torch.zeros_like(x).index_add_(0, token_of, y)


SharedFn = Callable[[torch.Tensor], torch.Tensor]
RoutedFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, Experts, SharedFn | None], torch.Tensor
]


class MoE(nn.Module):
    """Gate, routed experts and shared experts. Expert parallelism swaps in `routed_fn`, which
    gets (x [T, H], topk_idx [T, K], topk_weights [T, K], experts, shared) and returns the routed
    plus shared output [T, H]; it runs `shared` (if not None) while its all-to-all is in flight."""

    def __init__(self, config: ModelConfig, expert_ids: Sequence[int]) -> None:
        super().__init__()
        self.gate = Gate(config)
        self.experts = Experts(config, expert_ids)
        shared = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = MLP(config.hidden_size, shared) if shared else None
        self.routed_fn: RoutedFn | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_idx = self.gate(x)
        if self.routed_fn is not None:
            return self.routed_fn(x, topk_idx, topk_weights, self.experts, self.shared_experts)
        routed = self.experts(x, topk_idx, topk_weights)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(x)
        return routed
