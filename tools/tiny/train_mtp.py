"""Train `tiny`'s multi-token-prediction (MTP) module, DeepSeek-V3's layout, on the main model
frozen: the second stage of the tiny recipe.

    python -m tools.tiny.train && python -m tools.tiny.train_mtp   (from the repository root)

Reads the main model from the checkpoint folder (transformers' DeepseekV3ForCausalLM, fp32 from
the committed bf16, so exactly the weights served) and trains one MTP layer: enorm, hnorm,
eh_proj, a decoder block at layer index num_hidden_layers (an MoE block, as DeepSeek-V3's layer
61 is), shared_head.norm; the embedding and the head are the main model's, frozen. Row i predicts
token i + 2 from (h_i, t_{i+1}), h_i the main model's last hidden state BEFORE its final norm
(docs/mtp.md): x = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)]) -> block -> shared_head.norm ->
lm_head; loss = cross-entropy. The same text, windows (batch_at), schedule shape, optimizer and
aux-loss-free gate-bias update as tools/tiny/train.py.

Writes back model.safetensors with the MTP layer as model.layers.{num_hidden_layers}.* (HF layout,
as DeepSeek-V3 ships model.layers.61.*; no copies of the embedding and head: the loader shares
the main model's), config.json with num_nextn_predict_layers 1, and an "mtp" entry in
training_meta.json (inputs hash, loss curve, held-out loss and teacher-forced accuracy). The main
model's tensors are written back byte for byte (checked).

Legend: B batch, T tokens per sequence, D hidden, V vocab, E routed experts.
"""

import argparse
import hashlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tools.tiny.routing import RouterLoad
from tools.tiny.train import (
    DEFAULT_OUT,
    MODEL_CONFIG,
    TrainConfig,
    _randn,
    corpus,
    hf_tensors,
    inputs_sha256,
    lr_at,
    text_sha256,
    token_stream,
)

MTP_LAYER = MODEL_CONFIG["num_hidden_layers"]  # its index in the checkpoint
CHECKPOINT_CONFIG: dict[str, Any] = dict(MODEL_CONFIG, num_nextn_predict_layers=1)


@dataclass(frozen=True, slots=True)
class MtpTrainConfig:
    """The MTP stage's schedule; windows come from TrainConfig's batch_at with `seed`."""

    seed: int = 0
    steps: int = 1000
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bias_update_rate: float = 1e-4
    eval_every: int = 50
    threads: int = 1
    version: int = 1  # bump when this script's behaviour changes

    def __post_init__(self) -> None:
        assert self.steps > self.warmup_steps >= 1, (self.steps, self.warmup_steps)
        assert self.batch_size >= 1 and self.seq_len >= 3 and self.threads >= 1
        assert 0 < self.min_lr <= self.lr

    @property
    def schedule(self) -> TrainConfig:
        """The same windows and learning-rate shape as the main recipe, at this length."""
        return TrainConfig(
            seed=self.seed,
            steps=self.steps,
            batch_size=self.batch_size,
            seq_len=self.seq_len,
            lr=self.lr,
            min_lr=self.min_lr,
            warmup_steps=self.warmup_steps,
        )


def mtp_optimizer(layer: nn.Module, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW for an MTP layer: weight decay on its matrices only (not norms or biases)."""
    decay = [p for p in layer.parameters() if p.dim() >= 2]
    no_decay = [p for p in layer.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay}],
        lr=lr,
        betas=(0.9, 0.95),
        weight_decay=0.0,
    )


def mtp_inputs_sha256(cfg: MtpTrainConfig) -> str:
    """What the MTP layer is a function of: the main model's inputs and this stage's config."""
    blob = json.dumps({"main": inputs_sha256(TrainConfig()), "mtp": asdict(cfg)}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()


def load_main(path: Path) -> nn.Module:
    """The checkpoint's main model in transformers (fp32, eval, frozen); its MTP layer's keys,
    which transformers does not model, are declared ignorable rather than warned about."""
    import transformers

    class MainOnly(transformers.DeepseekV3ForCausalLM):
        _keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{MTP_LAYER}\..*"]

    model = MainOnly.from_pretrained(path, dtype=torch.float32).eval()
    model.requires_grad_(False)
    return model


def build_mtp(config: Any, seed: int) -> nn.Module:
    """transformers' DeepseekV3DecoderLayer at index num_hidden_layers of `config` (a
    DeepseekV3Config) plus enorm, hnorm, eh_proj and shared_head.norm (the HF names under
    model.layers.{num_hidden_layers}), weights drawn from a seed per tensor name as
    tools/tiny/train.py draws them."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
        DeepseekV3DecoderLayer,
        DeepseekV3RMSNorm,
    )

    size, eps = config.hidden_size, config.rms_norm_eps
    torch.manual_seed(seed)
    layer = DeepseekV3DecoderLayer(config, config.num_hidden_layers)
    layer.enorm = DeepseekV3RMSNorm(size, eps=eps)
    layer.hnorm = DeepseekV3RMSNorm(size, eps=eps)
    layer.eh_proj = nn.Linear(2 * size, size, bias=False)
    layer.shared_head = nn.Module()
    layer.shared_head.norm = DeepseekV3RMSNorm(size, eps=eps)
    std = config.initializer_range
    with torch.no_grad():
        for name, param in layer.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            else:
                param.copy_(_randn(f"mtp:{seed}:{name}", param.shape) * std)
        for name, buf in layer.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.zero_()
    return layer


def load_mtp(path: Path, main: nn.Module) -> nn.Module:
    """The checkpoint's MTP layer as `build_mtp` makes it (fp32, eval): the oracle for moe/'s."""
    return load_mtp_file(path / "model.safetensors", main.config)


def block_state(tensors: dict[str, torch.Tensor], layer: int, experts: int) -> dict:
    """Layer `layer`'s tensors of a checkpoint (HF names, per expert) -> the state dict of
    transformers' decoder block (fused experts [E, 2I, D] and [E, D, I]) and, for an MTP layer,
    its enorm, hnorm, eh_proj and shared_head."""
    prefix = f"model.layers.{layer}."
    saved = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    state = {k: v for k, v in saved.items() if ".experts." not in k}
    state["mlp.experts.gate_up_proj"] = torch.stack(
        [
            torch.cat([saved[f"mlp.experts.{e}.{p}_proj.weight"] for p in ("gate", "up")])
            for e in range(experts)
        ]
    )  # [E, 2I, D]
    state["mlp.experts.down_proj"] = torch.stack(
        [saved[f"mlp.experts.{e}.down_proj.weight"] for e in range(experts)]
    )
    return state


def load_mtp_file(file: Path, config: Any) -> nn.Module:
    """The MTP layer model.layers.{num_hidden_layers}.* of a safetensors file, as `build_mtp`
    makes it for `config` (a DeepseekV3Config; fp32, eval, frozen)."""
    from safetensors.torch import load_file

    tensors = {k: v.float() for k, v in load_file(str(file)).items()}
    state = block_state(tensors, config.num_hidden_layers, config.n_routed_experts)
    layer = build_mtp(config, 0)
    layer.load_state_dict(state, strict=True)
    return layer.eval().requires_grad_(False)


def main_hidden(main: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, T] -> the main model's last hidden state before its final norm [B, T, D]."""
    seen: list[torch.Tensor] = []
    hook = main.model.norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        with torch.no_grad():
            main.model(ids)
    finally:
        hook.remove()
    return seen[0]


def mtp_block(
    main: nn.Module, layer: nn.Module, hidden: torch.Tensor, next_ids: torch.Tensor
) -> torch.Tensor:
    """hidden [B, T, D] (h_i, pre-norm, or the layer's own output when chained), next_ids
    [B, T] (t_{i+1}) -> the block's output [B, T, D], before shared_head.norm. The rows sit at
    the positions of t_{i+1} (1 .. T); RoPE is relative, so any common offset gives the same
    scores."""
    batch, length = next_ids.shape
    e = layer.enorm(main.model.embed_tokens(next_ids))
    x = layer.eh_proj(torch.cat([e, layer.hnorm(hidden)], dim=-1))  # [B, T, D]
    positions = torch.arange(1, length + 1)[None].expand(batch, -1)
    cos_sin = main.model.rotary_emb(x, positions)
    mask = torch.full((length, length), torch.finfo(x.dtype).min).triu(1)[None, None]
    return layer(x, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin)


def mtp_logits(
    main: nn.Module, layer: nn.Module, hidden: torch.Tensor, next_ids: torch.Tensor
) -> torch.Tensor:
    """`mtp_block` through shared_head.norm and the main model's head -> logits [B, T, V] for
    t_{i+2}."""
    x = mtp_block(main, layer, hidden, next_ids)
    return main.lm_head(layer.shared_head.norm(x)).float()


def mtp_loss(
    main: nn.Module, layer: nn.Module, windows: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """windows [B, T + 1] -> (mean cross-entropy of t_{i+2}, top-1 hits [B, T - 1] bool)."""
    length = windows.shape[1] - 1
    hidden = main_hidden(main, windows[:, :length])[:, : length - 1]  # [B, T - 1, D]
    logits = mtp_logits(main, layer, hidden, windows[:, 1:length])  # [B, T - 1, V]
    target = windows[:, 2:]
    loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
    return loss, logits.argmax(-1) == target


@torch.no_grad()
def evaluate(
    main: nn.Module, layer: nn.Module, data: torch.Tensor, seq_len: int
) -> tuple[float, float]:
    """(mean loss, top-1 accuracy of the token after next) over consecutive windows of data."""
    n = (len(data) - 1) // seq_len
    windows = torch.stack([data[i * seq_len : (i + 1) * seq_len + 1] for i in range(n)])
    layer.eval()
    loss_sum, hits, rows = 0.0, 0, 0
    for chunk in windows.split(32):
        loss, hit = mtp_loss(main, layer, chunk)
        loss_sum += loss.item() * hit.numel()
        hits, rows = hits + int(hit.sum()), rows + hit.numel()
    layer.train()
    return loss_sum / rows, hits / rows


def train_mtp(
    main: nn.Module, data: torch.Tensor, held: torch.Tensor, cfg: MtpTrainConfig, progress: bool
) -> tuple[nn.Module, dict[str, Any]]:
    """-> (the trained MTP layer, record of per-step losses and held-out (step, loss, acc))."""
    from tqdm import tqdm

    from tools.tiny.train import batch_at

    sched = cfg.schedule
    layer = build_mtp(main.config, cfg.seed)
    layer.train()
    opt = mtp_optimizer(layer, cfg.lr, cfg.weight_decay)
    router = RouterLoad(layer, MODEL_CONFIG["n_routed_experts"])
    record: dict[str, Any] = {"losses": [], "held_out": []}
    start = time.perf_counter()
    for step in tqdm(
        range(cfg.steps), desc="train tiny MTP", disable=not progress, file=sys.stderr
    ):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, sched)
        loss, _ = mtp_loss(main, layer, batch_at(step, data, sched))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(layer.parameters(), cfg.grad_clip)
        opt.step()
        router.update_biases(cfg.bias_update_rate)
        record["losses"].append(round(loss.item(), 5))
        if (step + 1) % cfg.eval_every == 0 or step + 1 == cfg.steps:
            router.reset()
            held_loss, acc = evaluate(main, layer, held, cfg.seq_len)
            record["held_out"].append([step + 1, round(held_loss, 5), round(acc, 5)])
            router.reset()
    record["train_seconds"] = round(time.perf_counter() - start, 1)
    router.close()
    layer.eval()
    return layer, record


def tensors_sha256(tensors: dict[str, torch.Tensor]) -> str:
    """A hash of named tensors' names, dtypes, shapes and bytes, in name order."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def write_checkpoint(out: Path, layer: nn.Module) -> dict[str, str]:
    """Adds the MTP layer to out/model.safetensors (replacing any), writes config.json; rounds
    `layer` to the saved bf16 values. -> the main tensors' hash and the file's hash."""
    from safetensors.torch import load_file, save_file

    prefix = f"model.layers.{MTP_LAYER}."
    old = load_file(str(out / "model.safetensors"))
    main = {k: v for k, v in old.items() if not k.startswith(prefix)}
    tensors = dict(main, **hf_tensors(layer.state_dict(), prefix))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    written = load_file(str(out / "model.safetensors"))
    main_hash = tensors_sha256(main)
    # NOTE: the main model must stay bit-identical: the MTP stage only adds keys.
    assert tensors_sha256({k: written[k] for k in main}) == main_hash
    (out / "config.json").write_text(json.dumps(CHECKPOINT_CONFIG, indent=2) + "\n")
    file_hash = hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    return {"main_tensors_sha256": main_hash, "model_sha256": file_hash}


def main(argv: list[str] | None = None) -> None:
    from tokenizers import Tokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the tiny checkpoint folder")
    ap.add_argument("--steps", type=int, default=MtpTrainConfig().steps)
    args = ap.parse_args(argv)
    cfg = MtpTrainConfig(steps=args.steps)
    threads = torch.get_num_threads()
    torch.set_num_threads(cfg.threads)
    try:
        start = time.perf_counter()
        train_docs, held_docs = corpus(TrainConfig())
        tok = Tokenizer.from_file(str(args.out / "tokenizer.json"))
        data, held = token_stream(tok, train_docs), token_stream(tok, held_docs)
        main_model = load_main(args.out)
        layer, record = train_mtp(main_model, data, held, cfg, progress=True)
        hashes = write_checkpoint(args.out, layer)  # rounds layer to bf16
        held_loss, acc = evaluate(main_model, layer, held, cfg.seq_len)
    finally:
        torch.set_num_threads(threads)
    meta_path = args.out / "training_meta.json"
    meta = json.loads(meta_path.read_text())
    meta["model_sha256"] = hashes["model_sha256"]
    meta["mtp"] = {
        "recipe": "python -m tools.tiny.train_mtp (after python -m tools.tiny.train)",
        "inputs_sha256": mtp_inputs_sha256(cfg),
        "text_sha256": text_sha256(TrainConfig()),
        "train_config": asdict(cfg),
        "main_tensors_sha256": hashes["main_tensors_sha256"],
        "train_seconds": record["train_seconds"],
        "wall_seconds": round(time.perf_counter() - start, 1),
        "final_train_loss": round(sum(last := record["losses"][-50:]) / len(last), 4),
        "held_out_loss": round(held_loss, 5),
        "held_out_top1_accuracy": round(acc, 5),  # teacher-forced: the real token after next
        "held_out_curve": record["held_out"],  # [step, loss, top-1 accuracy] before bf16
        "losses": record["losses"],
    }
    lines = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in meta.items()]  # a key a line
    meta_path.write_text("{\n" + ",\n".join(lines) + "\n}\n")
    print(
        f"{args.out}: MTP layer {MTP_LAYER}, {record['train_seconds']} s, held-out loss "
        f"{held_loss:.4f}, top-1 accuracy of the token after next {acc:.4f}"
    )


if __name__ == "__main__":
    main()
