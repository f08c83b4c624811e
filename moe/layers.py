"""Feed-forward layers: the dense MLP, the gate, the routed experts and the MoE block.

Legend (kernels/__init__.py): T tokens, D hidden, I intermediate, E logical routed experts,
S_r expert slots on this rank, K experts per token, N rows (token x k pairs).
"""

from collections.abc import Sequence

import torch
from torch import nn

from kernels.fp8 import BLOCK as FP8_BLOCK
from kernels.gate import grouped_topk
from kernels.linear import Linear, fuse_rows, linear
from kernels.moe_mlp import dense_mlp, grouped_expert_mlp, grouped_expert_mlp_fp8, silu_and_mul
from moe.config import ModelConfig
from moe.dispatch import Dispatcher, LocalDispatcher
from moe.overlap import Stages, run_to_end


class MLP(nn.Module):
    """SiLU-gated MLP: the dense layers and the shared experts."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

        self.w13: torch.Tensor | None = None  # [2I, D]: gate_proj then up_proj rows (fuse())

    def fuse(self) -> None:
        """After loading: gate_proj and up_proj in one weight (theirs become views of it)."""
        self.w13 = fuse_rows(self.gate_proj, self.up_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w13 is None:
            gate_up = torch.cat([self.gate_proj(x), self.up_proj(x)], dim=-1)
            return self.down_proj(silu_and_mul(gate_up))
        return dense_mlp(x, self.w13, self.down_proj.weight)  # one kernel call on CPU


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
        """x [T, D] -> (topk_weights [T, K] fp32, topk_idx [T, K] int64), logical expert ids."""
        c = self.config
        logits = linear(x.float(), self.weight.float())  # [T, E]
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

    Weights are stacked per slot: w13 [S_r, 2I, D] (gate rows, then up rows), w2 [S_r, D, I], in
    the model's dtype; or, after keep_fp8, float8_e4m3fn with fp32 block scales
    w13_scale_inv [S_r, 2 * ceil(I/128), ceil(D/128)] (gate blocks, then up blocks) and
    w2_scale_inv [S_r, ceil(D/128), ceil(I/128)].
    """

    def __init__(self, config: ModelConfig, expert_ids: Sequence[int]) -> None:
        super().__init__()
        assert all(0 <= e < config.n_routed_experts for e in expert_ids), expert_ids
        self.expert_ids = list(expert_ids)
        num_slots, hidden, inter = len(expert_ids), config.hidden_size, config.moe_intermediate_size
        self.w13 = nn.Parameter(torch.empty(num_slots, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(num_slots, hidden, inter))
        self.register_buffer("w13_scale_inv", None)
        self.register_buffer("w2_scale_inv", None)

    @property
    def fp8(self) -> bool:
        return self.w13_scale_inv is not None

    def keep_fp8(self) -> None:
        """Hold the weights as block-quantized FP8 (the loader calls this before it allocates:
        on the meta device, after the model's dtype is set)."""
        num_slots, two_inter, hidden = self.w13.shape
        inter, device, fp8 = two_inter // 2, self.w13.device, torch.float8_e4m3fn
        bi, bh = -(-inter // FP8_BLOCK), -(-hidden // FP8_BLOCK)
        w13 = torch.empty(num_slots, two_inter, hidden, dtype=fp8, device=device)
        w2 = torch.empty(num_slots, hidden, inter, dtype=fp8, device=device)
        self.w13 = nn.Parameter(w13, requires_grad=False)
        self.w2 = nn.Parameter(w2, requires_grad=False)
        self.w13_scale_inv = torch.empty(num_slots, 2 * bi, bh, device=device)
        self.w2_scale_inv = torch.empty(num_slots, bh, bi, device=device)

    def slot_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor with one entry per slot, by attribute name: what a live re-placement
        moves (moe/replacement.py), in the order moe.loader.read_expert returns them."""
        names = ("w13", "w2", "w13_scale_inv", "w2_scale_inv") if self.fp8 else ("w13", "w2")
        return {name: getattr(self, name) for name in names}

    def forward(self, x: torch.Tensor, counts: list[int] | torch.Tensor) -> torch.Tensor:
        """x [N, D] rows grouped by local slot (counts [S_r], a list or a tensor) -> [N, D]
        unweighted outputs."""
        if self.fp8:
            return grouped_expert_mlp_fp8(
                x, counts, self.w13, self.w13_scale_inv, self.w2, self.w2_scale_inv
            )
        return grouped_expert_mlp(x, counts, self.w13, self.w2)


class MoE(nn.Module):
    """Gate, routed experts and shared experts. The dispatcher moves the token rows to the
    routed experts and back: a LocalDispatcher when this rank holds every expert, an
    AllToAllDispatcher (DeepseekForCausalLM.install_expert_parallel) when the pool shares them."""

    def __init__(self, config: ModelConfig, expert_ids: Sequence[int]) -> None:
        super().__init__()
        self.gate = Gate(config)
        self.experts = Experts(config, expert_ids)
        shared = config.moe_intermediate_size * config.n_shared_experts
        self.shared_experts = MLP(config.hidden_size, shared) if shared else None
        self.dispatcher: Dispatcher = LocalDispatcher(expert_ids, config.n_routed_experts)

    def stages(
        self, x: torch.Tensor, topk_out: list[torch.Tensor] | None = None
    ) -> Stages[torch.Tensor]:
        """x [T, D] -> routed + shared output [T, D], yielding while the rows travel (after the
        dispatch starts, and after the combine starts). The shared expert runs while the
        dispatch is in flight. With topk_out, the routing topk_idx [T, K] is appended there and
        the dispatcher counts no load (the caller counts it)."""
        topk_weights, topk_idx = self.gate(x)  # [T, K]
        if topk_out is not None:
            topk_out.append(topk_idx)
        handle = self.dispatcher.dispatch(
            x, topk_idx, topk_weights, async_op=True, count_load=topk_out is None
        )
        handle.launch_rows()  # another micro-batch's attention runs while the rows travel
        shared = self.shared_experts(x) if self.shared_experts is not None else None  # [T, D]
        yield
        handle.wait()
        y = self.experts(handle.recv_x, handle.recv_counts)  # [N, D]
        combine = self.dispatcher.combine(y, handle, async_op=True)
        yield
        out = combine.output()  # [T, D]
        return out if shared is None else out + shared

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, D] -> [T, D]: the stages run to the end."""
        return run_to_end(self.stages(x))
