"""Train the `tiny` preset: a DeepSeek-V3-layout MoE that has read Python's language reference.

    python -m tools.tiny.train            (from the repository root; writes moe/weights/tiny)
    python -m tools.tiny.train --out /tmp/tiny --stop-after 3   (the first steps only)

The text is `pydoc_data.topics` (the reference topics behind `help()`, about 465k characters of
English, PSF License), which ships with every Python. The tokenizer is a byte-level BPE built from
the training topics by `tokenizers`; the model is transformers' `DeepseekV3ForCausalLM` (an
implementation independent of moe/, so the saved checkpoint is also an oracle for it). The gate's
e_score_correction_bias gets no gradient: DeepSeek-V3's aux-loss-free update nudges it after every
step (bias += u * sign(mean load - load)), with a small u so routing stays skewed.

Deterministic: the text, the BPE, the initial weights (a seed per tensor name), the batches and the
bias updates are functions of MODEL_CONFIG and TrainConfig; torch runs on `threads` threads.
training_meta.json records the hash of those inputs (`inputs_sha256`) with the loss curve, so a
test can check that the committed checkpoint is this script's output without a full retraining.
Weights are stored in bf16 (the gate bias in fp32); the metrics and samples are taken after that
rounding, on the weights as committed.

Legend: B batch, T tokens per sequence, V vocab, E routed experts, K experts per token.
"""

import argparse
import hashlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

import moe
from moe.presets import V3_DEFAULTS
from tools.tiny.report import greedy, plot_losses
from tools.tiny.routing import RouterLoad, load_stats

TEXT_SOURCE = "pydoc_data.topics (Python language reference topics, PSF License)"

MODEL_CONFIG: dict[str, Any] = dict(
    V3_DEFAULTS,
    vocab_size=2048,
    hidden_size=128,
    intermediate_size=384,
    moe_intermediate_size=48,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=64,
    kv_lora_rank=64,
    qk_nope_head_dim=32,
    qk_rope_head_dim=16,
    v_head_dim=32,
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_shared_experts=1,
    n_group=4,
    topk_group=2,
    routed_scaling_factor=2.5,
    max_position_embeddings=1024,
    initializer_range=0.02,
    torch_dtype="bfloat16",
)
BOS, EOS = "<|bos|>", "<|eos|>"  # ids 0 and 1, as the config says


@dataclass(frozen=True, slots=True)
class TrainConfig:
    seed: int = 0
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bias_update_rate: float = 1e-4  # u of the aux-loss-free balancing
    holdout_every: int = 10  # every 10th topic (sorted by name) is held out
    eval_every: int = 50
    # NOTE: 1 thread, not 2: on a 2-core machine shared with other jobs, 2 threads ran 7-10x
    # slower than 1 (each op waits at a barrier for the descheduled thread); alone, 1.6x faster.
    threads: int = 1
    version: int = 1  # bump when this script's behaviour changes

    def __post_init__(self) -> None:
        assert self.steps > self.warmup_steps >= 1, (self.steps, self.warmup_steps)
        assert self.batch_size >= 1 and self.seq_len >= 2 and self.threads >= 1
        assert 0 < self.min_lr <= self.lr and self.holdout_every >= 2


def corpus(cfg: TrainConfig) -> tuple[list[str], list[str]]:
    """(training topics, held-out topics) of pydoc_data.topics, in sorted-key order."""
    from pydoc_data.topics import topics

    keys = sorted(topics)
    train = [topics[k] for i, k in enumerate(keys) if i % cfg.holdout_every != 1]
    held_out = [topics[k] for i, k in enumerate(keys) if i % cfg.holdout_every == 1]
    return train, held_out


def text_sha256(cfg: TrainConfig) -> str:
    """Hash of the whole text (it changes with the Python version)."""
    train, held_out = corpus(cfg)
    return hashlib.sha256("\0".join(train + ["\1"] + held_out).encode()).hexdigest()


def inputs_sha256(cfg: TrainConfig, text_hash: str | None = None) -> str:
    """What the checkpoint is a function of: the text, the model config and TrainConfig."""
    blob = json.dumps(
        {"text": text_hash or text_sha256(cfg), "model": MODEL_CONFIG, "train": asdict(cfg)},
        sort_keys=True,
    )
    return hashlib.sha256(blob.encode()).hexdigest()


def build_tokenizer(docs: list[str], vocab_size: int):
    """A byte-level BPE (tokenizers.Tokenizer) learned from `docs`; ids 0/1 are bos/eos."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(docs, trainer=trainer)
    return tok


def token_stream(tok, docs: list[str]) -> torch.Tensor:
    """The documents encoded and joined, each followed by eos -> [N] int64."""
    eos = tok.token_to_id(EOS)
    ids: list[int] = []
    for enc in tok.encode_batch(docs, add_special_tokens=False):
        ids += enc.ids + [eos]
    return torch.tensor(ids, dtype=torch.long)


def build_model(cfg: TrainConfig):
    """transformers' DeepseekV3ForCausalLM with weights drawn from a seed per tensor name (so they
    do not depend on transformers' own initialisation order)."""
    import transformers

    config = transformers.DeepseekV3Config(**MODEL_CONFIG)
    torch.manual_seed(cfg.seed)
    model = transformers.DeepseekV3ForCausalLM(config)
    std = MODEL_CONFIG["initializer_range"]
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(_randn(f"{cfg.seed}:{name}", param.shape) * std)
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.zero_()
    return model


def _randn(key: str, shape: torch.Size) -> torch.Tensor:
    digest = hashlib.sha256(key.encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & (2**63 - 1))
    return torch.randn(shape, generator=gen)


def lr_at(step: int, cfg: TrainConfig) -> float:
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / (cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


def batch_at(step: int, data: torch.Tensor, cfg: TrainConfig) -> torch.Tensor:
    """The step's random windows [B, T + 1]: a function of (seed, step) alone."""
    gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen)
    return torch.stack([data[s : s + cfg.seq_len + 1] for s in starts.tolist()])


def lm_loss(model, windows: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy (nats) of windows [B, T + 1]."""
    logits = model(windows[:, :-1]).logits  # [B, T, V]
    return F.cross_entropy(logits.flatten(0, 1).float(), windows[:, 1:].flatten())


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq_len: int) -> float:
    """Mean loss over data cut into consecutive windows [n, T + 1]."""
    n = (len(data) - 1) // seq_len
    windows = torch.stack([data[i * seq_len : (i + 1) * seq_len + 1] for i in range(n)])
    model.eval()
    losses = [lm_loss(model, chunk).item() * len(chunk) for chunk in windows.split(32)]
    model.train()
    return sum(losses) / n


def train(
    cfg: TrainConfig, stop_after: int | None = None, progress: bool = True
) -> tuple[Any, Any, dict[str, Any]]:
    """-> (model, tokenizer, record). Runs the first `stop_after` steps only when given (the
    reproducibility test); record has the per-step losses and the held-out losses."""
    from tqdm import tqdm

    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        train_docs, held_docs = corpus(cfg)
        tok = build_tokenizer(train_docs, MODEL_CONFIG["vocab_size"])
        data, held = token_stream(tok, train_docs), token_stream(tok, held_docs)
        model = build_model(cfg)
        model.train()
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay}],
            lr=cfg.lr,
            betas=(0.9, 0.95),
            weight_decay=0.0,
        )
        router = RouterLoad(model, MODEL_CONFIG["n_routed_experts"])
        record: dict[str, Any] = {"losses": [], "held_out": [], "train_tokens": len(data)}
        steps = cfg.steps if stop_after is None else min(stop_after, cfg.steps)
        bar = tqdm(range(steps), desc="train tiny", disable=not progress, file=sys.stderr)
        start = time.perf_counter()
        for step in bar:
            for group in opt.param_groups:
                group["lr"] = lr_at(step, cfg)
            loss = lm_loss(model, batch_at(step, data, cfg))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            opt.step()
            router.update_biases(cfg.bias_update_rate)
            record["losses"].append(round(loss.item(), 5))
            if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
                router.reset()
                record["held_out"].append([step + 1, round(evaluate(model, held, cfg.seq_len), 5)])
                router.reset()  # held-out tokens do not move the biases
            bar.set_postfix(loss=f"{loss.item():.3f}")
        record["train_seconds"] = round(time.perf_counter() - start, 1)
        router.close()
        model.eval()
        return model, tok, record
    finally:
        torch.set_num_threads(threads)


def hf_tensors(
    state: dict[str, torch.Tensor],
    prefix: str = "",
    inter: int = MODEL_CONFIG["moe_intermediate_size"],
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    """transformers' state dict -> the checkpoint's tensors, names prefixed: `dtype` (the gate
    bias fp32), the fused experts [E, 2 * inter, H] split per expert as DeepSeek publishes them.
    Rounds `state`'s tensors in place to the saved values, so a model that owns them holds what
    is committed."""
    tensors: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, t in state.items():
            if "rotary_emb" in name:
                continue
            if not name.endswith("e_score_correction_bias"):
                t.copy_(t.to(dtype).float())  # the model now holds what is committed
                t = t.to(dtype)
            name = prefix + name
            stem = name.rsplit(".", 1)[0]
            if name.endswith("experts.gate_up_proj"):  # [E, 2I, H]
                for e, w in enumerate(t):
                    tensors[f"{stem}.{e}.gate_proj.weight"] = w[:inter].contiguous()
                    tensors[f"{stem}.{e}.up_proj.weight"] = w[inter:].contiguous()
            elif name.endswith("experts.down_proj"):  # [E, H, I]
                for e, w in enumerate(t):
                    tensors[f"{stem}.{e}.down_proj.weight"] = w.contiguous()
            else:
                tensors[name] = t.contiguous()
    return tensors


def save(model, tok, out: Path) -> None:
    """config.json, model.safetensors (bf16, per-expert keys as DeepSeek publishes them; the gate
    bias fp32) and tokenizer.json. Rounds `model` in place to the saved weights."""
    from safetensors.torch import save_file

    tensors = hf_tensors(model.state_dict())
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(MODEL_CONFIG, indent=2) + "\n")
    tok.save(str(out / "tokenizer.json"))


SAMPLE_PROMPTS = ("The", "A list", "In Python,", "A class", "Hello")
# NOTE: where the package installs the weights (package-data of moe), not beside this tool.
DEFAULT_OUT = Path(moe.__file__).parent / "weights" / "tiny"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="checkpoint folder")
    ap.add_argument("--steps", type=int, default=TrainConfig().steps, help="the schedule's length")
    ap.add_argument(
        "--stop-after",
        type=int,
        default=None,
        help="run only the schedule's first N steps (a smoke run; the checkpoint is not `tiny`)",
    )
    args = ap.parse_args(argv)
    cfg = TrainConfig(steps=args.steps)
    start, load_at_start = time.perf_counter(), os.getloadavg()[0]

    model, tok, record = train(cfg, stop_after=args.stop_after)
    save(model, tok, args.out)
    counts = RouterLoad(model, MODEL_CONFIG["n_routed_experts"])
    _, held_docs = corpus(cfg)
    held = token_stream(tok, held_docs)
    record["held_out_final"] = round(evaluate(model, held, cfg.seq_len), 5)
    expert_load = load_stats(counts.reset())
    counts.close()
    text_hash = text_sha256(cfg)
    meta = {
        "text_source": TEXT_SOURCE,
        "python_version": sys.version.split()[0],
        "text_sha256": text_hash,
        "inputs_sha256": inputs_sha256(cfg, text_hash),
        "train_config": asdict(cfg),
        "torch_version": torch.__version__,
        "train_seconds": record["train_seconds"],  # the training loop
        "wall_seconds": None,  # the whole run, set below
        "load_average_at_start": round(load_at_start, 2),  # the machine is shared
        "train_tokens": record["train_tokens"],
        "held_out_tokens": len(held),
        "final_train_loss": round(sum(last := record["losses"][-50:]) / len(last), 4),
        "held_out_loss": record["held_out_final"],
        "held_out_curve": record["held_out"],
        "expert_load_held_out": expert_load,
        "samples": {p: greedy(args.out, p) for p in SAMPLE_PROMPTS},
        "losses": record["losses"],
        "model_sha256": hashlib.sha256((args.out / "model.safetensors").read_bytes()).hexdigest(),
    }
    meta["wall_seconds"] = round(time.perf_counter() - start, 1)
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in meta.items()]  # a key a line
    (args.out / "training_meta.json").write_text("{\n" + ",\n".join(lines) + "\n}\n")
    plot_losses(record, args.out / "loss.png")
    print(
        f"{args.out}: {record['train_seconds']} s, final train loss {meta['final_train_loss']}, "
        f"held-out {meta['held_out_loss']}"
    )
    for i, s in enumerate(expert_load):
        layer = MODEL_CONFIG["first_k_dense_replace"] + i
        print(
            f"  MoE layer {layer}: max/mean {s['max_over_mean']}, top-2 share {s['top2_share']}, "
            f"gini {s['gini']}"
        )
    for p, text in meta["samples"].items():
        print(f"  {p!r} -> {text!r}")


if __name__ == "__main__":
    main()
