"""The routed load while `tiny` trains (tools/tiny/train.py): tokens per expert counted from the
gates of transformers' DeepseekV3 model, DeepSeek-V3's aux-loss-free bias update on them, and how
skewed the load ends up.

Legend: L MoE layers, E routed experts, B batch, T tokens per sequence, K experts per token.
"""

import torch


class RouterLoad:
    """Counts tokens per routed expert in every MoE layer, from the gates' top-k indices."""

    def __init__(self, model, num_experts: int) -> None:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

        self.gates = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.counts = torch.zeros(len(self.gates), num_experts)  # [L, E]
        self._hooks = [g.register_forward_hook(self._hook(i)) for i, g in enumerate(self.gates)]

    def _hook(self, layer: int):
        def count(_module, _inputs, outputs) -> None:
            topk_idx = outputs[2]  # [B*T, K]
            self.counts[layer] += torch.bincount(
                topk_idx.flatten(), minlength=self.counts.shape[1]
            ).float()

        return count

    def reset(self) -> torch.Tensor:
        counts, self.counts = self.counts, torch.zeros_like(self.counts)
        return counts

    def update_biases(self, rate: float) -> None:
        """DeepSeek-V3's aux-loss-free balancing on the counts since the last reset."""
        counts = self.reset()  # [L, E]
        with torch.no_grad():
            for gate, load in zip(self.gates, counts):
                gate.e_score_correction_bias += rate * torch.sign(load.mean() - load)

    def close(self) -> None:
        for h in self._hooks:
            h.remove()


def load_stats(counts: torch.Tensor) -> list[dict[str, float]]:
    """Per MoE layer, from counts [L, E]: how skewed the routed load is (uniform: max/mean 1,
    top-2 share 2/E, Gini 0)."""
    out = []
    for load in counts:
        share = load / load.sum()  # [E]
        ranked = share.sort().values
        n = len(ranked)
        gini = float((2 * torch.arange(1, n + 1) - n - 1).float() @ ranked / (n - 1))
        out.append(
            {
                "max_over_mean": round(float(share.max() * n), 3),
                "min_over_mean": round(float(share.min() * n), 3),
                "top2_share": round(float(ranked[-2:].sum()), 3),
                "gini": round(gini, 3),
                "shares": [round(float(s), 4) for s in share],
            }
        )
    return out
