"""What tools/tiny/train.py reports about the checkpoint it saved: greedy samples through the
project's own model, and the loss curve as a PNG."""

from pathlib import Path
from typing import Any

import torch


@torch.no_grad()
def greedy(path: Path, prompt: str, max_new_tokens: int = 40) -> str:
    """The project's own model (moe.load_model) on the saved checkpoint, greedy, full recompute."""
    from engine.tokenizer import load_tokenizer
    from moe.loader import load_model

    model = load_model(path)
    tok = load_tokenizer(path, model.config.vocab_size, model.config.eos_token_id)
    ids = tok.encode(prompt)
    new: list[int] = []
    for _ in range(max_new_tokens):
        nxt = int(model(torch.tensor([ids + new]))[0, -1].argmax())
        if nxt == tok.eos_token_id:
            break
        new.append(nxt)
    return tok.decode(new)


def plot_losses(record: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    losses = torch.tensor(record["losses"])
    window = min(20, len(losses))  # a smoke run (--stop-after) has fewer steps
    smooth = losses.unfold(0, window, 1).mean(dim=1)
    fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
    ax.plot(range(1, len(losses) + 1), losses, color="0.8", lw=0.6, label="train (per step)")
    ax.plot(range(window, len(losses) + 1), smooth, color="C0", label=f"train ({window}-step mean)")
    steps, held = zip(*record["held_out"]) if record["held_out"] else ((), ())
    ax.plot(steps, held, "o-", color="C1", ms=3, label="held-out topics")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/token)", title="tiny preset training")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, metadata={"Software": None})  # no version stamp: same bytes on rerun
    plt.close(fig)
