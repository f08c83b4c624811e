"""Build an MTP head for `small` (random weights: no text to learn) by self-distillation: one
DeepSeek-V3 MTP layer trained to predict the main model's own next token after next, written with
the main checkpoint into a directory that loads like any checkpoint.

    .venv/bin/python -m tools.small_mtp --out /tmp/small-mtp     (then bench.mtp_acceptance)
    ensure_small_mtp()                                            (the cached build, v{version})

Step 1: `prompts` seeded random prompts of `prompt_len` tokens, each continued greedily by `new`
tokens in the engine (temperature 0, ignore_eos): the sequences speculation sees. Step 2: one
teacher-forced forward of the main model over every sequence (moe/) gives, at every position i,
h_i (its last hidden state before the final norm) and the target y_i = argmax(logits_i), the main
model's own next token after t_i: row i of the MTP layer, (h_i, t_{i+1}), learns y_{i+1}, which
is what a draft must match at decode time. Every row counts, the prompt's too (its targets are
the main model's guesses, not the random prompt's next token). Step 3: the MTP layer
(tools/tiny/train_mtp.py's: transformers' decoder block plus enorm, hnorm, eh_proj,
shared_head.norm; embedding and head the main model's, frozen) starts as `init` says and learns
by cross-entropy on y. Step 4: out/ holds config.json (num_nextn_predict_layers 1),
tokenizer.json, mtp.safetensors (the layer, fp32 as small is) and model.safetensors.index.json
mapping the main tensors to a link to the preset's own file. Deterministic for a config: the
prompts, initial weights and batches are seeded.

Inits (docs/mtp.md has what each gave on held-out prompts): "random" (std 0.02, the tiny
recipe's), "identity" (eh_proj passes hnorm(h_i) through and the block's residual branches start
at zero: the head starts as the main model's own guess at i, i.e. a draft that repeats t_{i+1}),
"layer" (the block a copy of main layer `init_layer`, eh_proj passing hnorm(h_i) through).
The default, v3, is "identity" with steps 0 (no data, no training): held out, no training tried
beat it at depths 2-3; `--steps 130` is v2, the self-distilled head.

Legend: B sequences, N tokens per sequence, D hidden, V vocab, E routed experts.
"""

import argparse
import hashlib
import json
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from bench.mtp_acceptance import engine_continue, prenorm_forward, random_prompts
from moe import DeepseekForCausalLM, load_model
from moe.presets import PRESETS, cache_root, ensure_preset
from tools.tiny.routing import RouterLoad
from tools.tiny.train import hf_tensors
from tools.tiny.train_mtp import block_state, build_mtp, mtp_block, mtp_optimizer

INITS = ("random", "identity", "layer")


@dataclass(frozen=True, slots=True)
class SmallMtpConfig:
    model: str = "small"
    seed: int = 0
    prompts: int = 1024
    prompt_len: int = 16
    new: int = 112
    init: str = "identity"
    init_layer: int = 7  # the main (MoE) layer the block copies when init is "layer"
    steps: int = 0  # none: held out, training did not beat the identity (docs/mtp.md); 130 = v2
    batch_size: int = 8  # sequences per step
    lr: float = 1e-4
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    bias_update_rate: float = 1e-4
    threads: int = 2
    version: int = 3  # bump when the recipe's output changes

    def __post_init__(self) -> None:
        assert self.model in PRESETS, self.model
        assert self.prompts >= self.batch_size >= 1 and self.prompt_len >= 1 and self.new >= 2
        assert self.steps >= 0 and self.lr > 0 and self.threads >= 1 and self.warmup_steps >= 0
        assert self.init in INITS, self.init
        raw = PRESETS[self.model]  # the block is an MoE layer: it copies an MoE layer
        moe_layers = range(raw["first_k_dense_replace"], raw["num_hidden_layers"])
        assert self.init != "layer" or self.init_layer in moe_layers, self.init_layer


def greedy_data(path: Path, cfg: SmallMtpConfig) -> torch.Tensor:
    """The engine's greedy continuations of seeded random prompts -> [B, prompt_len + new]."""
    vocab = PRESETS[cfg.model]["vocab_size"]
    prompts = random_prompts(vocab, cfg.prompts, cfg.prompt_len, cfg.seed)
    return engine_continue(str(path), prompts, cfg.new)


def teacher(model: DeepseekForCausalLM, seqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """seqs [B, N] -> (h [B, N, D] the main model's last hidden state before its final norm,
    y [B, N] its argmax at every position: y_i is its own token after t_i), teacher-forced."""
    hidden, targets = [], []
    for chunk in seqs.split(8):
        h, logits = prenorm_forward(model, chunk)  # [b, N, D], [b, N, V]
        hidden.append(h.clone())
        targets.append(logits.argmax(-1))
    return torch.cat(hidden), torch.cat(targets)


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


@torch.no_grad()
def init_layer(layer: nn.Module, cfg: SmallMtpConfig, main_file: Path) -> None:
    """Sets `layer` (build_mtp's, random) as cfg.init says (see the module doc)."""
    if cfg.init == "random":
        return
    size = layer.eh_proj.weight.shape[0]
    # [enorm(e) | hnorm(h)] -> hnorm(h): the block starts from the main model's own state at i
    layer.eh_proj.weight.copy_(torch.cat([torch.zeros(size, size), torch.eye(size)], dim=1))
    if cfg.init == "identity":
        # NOTE: zero residual branches: the block's output is its input, so the head's first
        # guess is the main model's at i; their weights still get gradients (from the input)
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.experts.down_proj.zero_()
        layer.mlp.shared_experts.down_proj.weight.zero_()
        return
    from safetensors.torch import load_file

    experts = PRESETS[cfg.model]["n_routed_experts"]
    state = block_state(load_file(str(main_file)), cfg.init_layer, experts)
    missing, unexpected = layer.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert all(k.split(".")[0] in ("enorm", "hnorm", "eh_proj", "shared_head") for k in missing)


def train(
    shared: "FrozenShared",
    layer: nn.Module,
    hidden: torch.Tensor,
    seqs: torch.Tensor,
    targets: torch.Tensor,
    cfg: SmallMtpConfig,
) -> list[float]:
    """hidden [B, N, D] pre-norm, seqs [B, N], targets [B, N] (the main model's argmax at each
    position) -> per-step losses; trains `layer` in place: row i = (h_i, t_{i+1}) learns
    targets_{i+1}, every row of a sequence."""
    opt = mtp_optimizer(layer, cfg.lr, cfg.weight_decay)
    router = RouterLoad(layer, PRESETS[cfg.model]["n_routed_experts"])
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    losses = []
    layer.train()
    for step in range(cfg.steps):
        warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
        for group in opt.param_groups:  # warmup, then linear decay to a tenth
            group["lr"] = cfg.lr * warm * (1 - 0.9 * step / cfg.steps)
        pick = torch.randperm(len(seqs), generator=gen)[: cfg.batch_size]
        s, h, y = seqs[pick], hidden[pick], targets[pick]
        out = mtp_block(shared, layer, h[:, :-1], s[:, 1:])  # [b, N - 1, D]
        logits = shared.lm_head(layer.shared_head.norm(out)).float()  # [b, N - 1, V]
        loss = F.cross_entropy(logits.flatten(0, 1), y[:, 1:].flatten())
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
    """Steps 1-4 -> the build's record (config, losses, times, size); steps 0: the initial layer
    as it is, no data."""
    torch.manual_seed(cfg.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        start = time.perf_counter()
        src = ensure_preset(cfg.model)
        hf_config = block_config(cfg.model)
        layer = build_mtp(hf_config, cfg.seed)
        init_layer(layer, cfg, src / "model.safetensors")
        rows, losses, greedy_seconds, data_seconds = 0, [], 0.0, 0.0
        if cfg.steps:
            seqs = greedy_data(src, cfg)  # [B, N]
            greedy_seconds = time.perf_counter() - start
            model = load_model(str(src))
            hidden, targets = teacher(model, seqs)  # [B, N, D], [B, N]
            data_seconds = time.perf_counter() - start
            embed = model.model.embed_tokens.weight.detach().float().clone()
            head = model.lm_head.weight.detach().float().clone()
            del model
            shared = FrozenShared(hf_config, embed, head)
            losses = train(shared, layer, hidden, seqs, targets, cfg)
            rows = int(seqs.shape[0] * (seqs.shape[1] - 1))
        size = write(out, src, layer, cfg)
    finally:
        torch.set_num_threads(threads)
    return {
        "recipe": "python -m tools.small_mtp",
        "build_config": asdict(cfg),
        "rows": rows,
        "greedy_seconds": round(greedy_seconds, 1),
        "data_seconds": round(data_seconds, 1),
        "build_seconds": round(time.perf_counter() - start, 1),
        "mtp_bytes": size,
        "losses": losses,
        "final_loss": round(sum(losses[-10:]) / len(losses[-10:]), 4) if losses else None,
    }


def ensure_small_mtp(cfg: SmallMtpConfig | None = None) -> Path:
    """The build of `cfg` (default: SmallMtpConfig(), small's recipe) in the cache, made on first
    use (atomically: a rename, as moe.presets.ensure_preset) -> its directory:
    <cache>/{model}-mtp-v{version}, with the config's hash appended when it is not the default's
    for its model."""
    cfg = cfg or SmallMtpConfig()
    name = f"{cfg.model}-mtp-v{cfg.version}"
    if cfg != SmallMtpConfig(model=cfg.model):
        blob = json.dumps(asdict(cfg), sort_keys=True).encode()
        name += "-" + hashlib.sha256(blob).hexdigest()[:12]
    target = cache_root() / name
    if (target / "build_meta.json").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{cfg.model}-mtp-", dir=target.parent))
    try:
        record = build(tmp, cfg)
        (tmp / "build_meta.json").write_text(json.dumps(record, indent=1) + "\n")
        try:
            os.rename(tmp, target)
        except OSError:  # another process won the race
            if not (target / "build_meta.json").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def main(argv: list[str] | None = None) -> None:
    default = SmallMtpConfig()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, help="the directory to build (default: the cache's)")
    ap.add_argument("--model", default=default.model, help="a random preset")
    ap.add_argument("--steps", type=int, default=default.steps)
    ap.add_argument("--prompts", type=int, default=default.prompts)
    ap.add_argument("--new", type=int, default=default.new)
    ap.add_argument("--init", choices=INITS, default=default.init)
    ap.add_argument("--lr", type=float, default=default.lr)
    args = ap.parse_args(argv)
    cfg = SmallMtpConfig(
        model=args.model,
        steps=args.steps,
        prompts=args.prompts,
        new=args.new,
        init=args.init,
        lr=args.lr,
    )
    if args.out is None:
        print(ensure_small_mtp(cfg))
        return
    record = build(args.out, cfg)
    (args.out / "build_meta.json").write_text(json.dumps(record, indent=1) + "\n")
    print({k: v for k, v in record.items() if k != "losses"})


if __name__ == "__main__":
    main()
