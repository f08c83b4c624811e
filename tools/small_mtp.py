"""Build an MTP head for `small` (random weights: no text to learn) by self-distillation: one
DeepSeek-V3 MTP layer trained on the main model's own greedy continuations of seeded random
prompts, written with the main checkpoint into a directory that loads like any checkpoint.

    .venv/bin/python -m tools.small_mtp --out /tmp/small-mtp     (then bench.mtp_acceptance)

Step 1: `prompts` seeded random prompts of `prompt_len` tokens, each continued greedily by
`new` tokens in the engine (temperature 0, ignore_eos). Step 2: the main model's last hidden
state before its final norm over every sequence (moe/, one forward). Step 3: the MTP layer
(tools/tiny/train_mtp.py's: transformers' decoder block plus enorm, hnorm, eh_proj,
shared_head.norm; embedding and head the main model's, frozen) learns t_{i+2} from
(h_i, t_{i+1}) on the rows whose target is a greedy token (cross-entropy: the greedy token is
the main model's argmax, so this is distillation of its top choice). Step 4: out/ holds
config.json (num_nextn_predict_layers 1), tokenizer.json, mtp.safetensors (the layer, fp32 as
small is) and model.safetensors.index.json mapping the main tensors to a link to the preset's
own file. Deterministic for a config: the prompts, initial weights and batches are seeded.

Legend: B sequences, N tokens per sequence, D hidden, V vocab.
"""

import argparse
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from bench.mtp_acceptance import engine_continue, prenorm_forward, random_prompts
from moe import load_model
from moe.presets import PRESETS, ensure_preset
from tools.tiny.routing import RouterLoad
from tools.tiny.train import hf_tensors
from tools.tiny.train_mtp import build_mtp, mtp_block


@dataclass(frozen=True, slots=True)
class SmallMtpConfig:
    model: str = "small"
    seed: int = 0
    prompts: int = 32
    prompt_len: int = 16
    new: int = 96
    steps: int = 60
    batch_size: int = 8  # sequences per step
    lr: float = 2e-3
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bias_update_rate: float = 1e-4
    threads: int = 2
    version: int = 1

    def __post_init__(self) -> None:
        assert self.model in PRESETS, self.model
        assert self.prompts >= self.batch_size >= 1 and self.prompt_len >= 1 and self.new >= 2
        assert self.steps >= 1 and self.lr > 0 and self.threads >= 1


def greedy_data(path: Path, cfg: SmallMtpConfig) -> torch.Tensor:
    """The engine's greedy continuations of seeded random prompts -> [B, prompt_len + new]."""
    vocab = PRESETS[cfg.model]["vocab_size"]
    prompts = random_prompts(vocab, cfg.prompts, cfg.prompt_len, cfg.seed)
    return engine_continue(str(path), prompts, cfg.new)


class FrozenShared(nn.Module):
    """The main model's embedding, rotary table and head, frozen, under the names mtp_block
    reads (main.model.embed_tokens, main.model.rotary_emb, main.lm_head)."""

    def __init__(self, hf_config: object, embed: torch.Tensor, head: torch.Tensor) -> None:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3RotaryEmbedding,
        )

        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = nn.Embedding.from_pretrained(embed, freeze=True)
        self.model.rotary_emb = DeepseekV3RotaryEmbedding(hf_config)
        self.lm_head = nn.Linear(head.shape[1], head.shape[0], bias=False)
        self.lm_head.weight = nn.Parameter(head, requires_grad=False)


def train(
    shared: FrozenShared,
    layer: nn.Module,
    hidden: torch.Tensor,
    seqs: torch.Tensor,
    cfg: SmallMtpConfig,
) -> list[float]:
    """hidden [B, N, D] pre-norm, seqs [B, N] -> per-step losses; trains `layer` in place."""
    opt = torch.optim.AdamW(layer.parameters(), lr=cfg.lr, betas=(0.9, 0.95))
    router = RouterLoad(layer, PRESETS[cfg.model]["n_routed_experts"])
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    first = cfg.prompt_len - 2  # row i's target s_{i+2} is a greedy token from here on
    losses = []
    layer.train()
    for step in range(cfg.steps):
        for group in opt.param_groups:  # linear decay to a tenth
            group["lr"] = cfg.lr * (1 - 0.9 * step / cfg.steps)
        pick = torch.randperm(len(seqs), generator=gen)[: cfg.batch_size]
        s, h = seqs[pick], hidden[pick]
        out = mtp_block(shared, layer, h[:, :-2], s[:, 1:-1])  # [b, N - 2, D]
        logits = shared.lm_head(layer.shared_head.norm(out[:, first:])).float()
        loss = F.cross_entropy(logits.flatten(0, 1), s[:, first + 2 :].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(layer.parameters(), cfg.grad_clip)
        opt.step()
        router.update_biases(cfg.bias_update_rate)
        losses.append(round(loss.item(), 5))
        print(f"step {step + 1}/{cfg.steps}: loss {losses[-1]}", flush=True)
    router.close()
    layer.eval()
    return losses


def write(out: Path, src: Path, layer: nn.Module, cfg: SmallMtpConfig) -> int:
    """The directory (see the module doc) -> mtp.safetensors' size in bytes."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    raw = PRESETS[cfg.model]
    prefix = f"model.layers.{raw['num_hidden_layers']}."
    tensors = hf_tensors(layer.state_dict(), prefix, raw["moe_intermediate_size"], torch.float32)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "mtp.safetensors"), metadata={"format": "pt"})
    main_file = out / "main.safetensors"
    main_file.unlink(missing_ok=True)
    main_file.symlink_to((src / "model.safetensors").resolve())
    with safe_open(str(main_file), "pt") as f:
        weight_map = {k: main_file.name for k in f.keys()}
    weight_map.update({k: "mtp.safetensors" for k in tensors})
    index = {"metadata": {}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(
        json.dumps(dict(config, num_nextn_predict_layers=1), indent=2) + "\n"
    )
    shutil.copyfile(src / "tokenizer.json", out / "tokenizer.json")
    return (out / "mtp.safetensors").stat().st_size


def block_config(model: str) -> object:
    """transformers' DeepseekV3Config of a random preset, for a standalone MTP block."""
    import transformers

    config = transformers.DeepseekV3Config(**PRESETS[model])
    config._attn_implementation = "sdpa"
    config._experts_implementation = "eager"  # a standalone block: no dispatch sets it
    return config


def build(out: Path, cfg: SmallMtpConfig) -> dict:
    """Steps 1-4 -> the build's record (config, losses, times, size)."""
    torch.manual_seed(cfg.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        start = time.perf_counter()
        src = ensure_preset(cfg.model)
        seqs = greedy_data(src, cfg)  # [B, N]
        model = load_model(str(src))
        hidden = torch.cat([prenorm_forward(model, c)[0] for c in seqs.split(8)])  # [B, N, D]
        data_seconds = time.perf_counter() - start
        hf_config = block_config(cfg.model)
        embed = model.model.embed_tokens.weight.detach().float().clone()
        head = model.lm_head.weight.detach().float().clone()
        del model
        shared = FrozenShared(hf_config, embed, head)
        layer = build_mtp(hf_config, cfg.seed)
        losses = train(shared, layer, hidden, seqs, cfg)
        size = write(out, src, layer, cfg)
    finally:
        torch.set_num_threads(threads)
    return {
        "recipe": "python -m tools.small_mtp",
        "build_config": asdict(cfg),
        "data_seconds": round(data_seconds, 1),
        "build_seconds": round(time.perf_counter() - start, 1),
        "mtp_bytes": size,
        "losses": losses,
        "final_loss": round(sum(losses[-10:]) / len(losses[-10:]), 4),
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="the directory to build")
    ap.add_argument("--model", default=SmallMtpConfig().model, help="a random preset")
    ap.add_argument("--steps", type=int, default=SmallMtpConfig().steps)
    ap.add_argument("--prompts", type=int, default=SmallMtpConfig().prompts)
    ap.add_argument("--new", type=int, default=SmallMtpConfig().new)
    args = ap.parse_args(argv)
    cfg = SmallMtpConfig(model=args.model, steps=args.steps, prompts=args.prompts, new=args.new)
    record = build(args.out, cfg)
    (args.out / "build_meta.json").write_text(json.dumps(record, indent=1) + "\n")
    print({k: v for k, v in record.items() if k != "losses"})


if __name__ == "__main__":
    main()
