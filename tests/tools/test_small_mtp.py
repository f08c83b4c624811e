"""tools/small_mtp.py at a few steps on tiny-random (the same path as small's build, in seconds):
the teacher's targets are the engine's greedy tokens, each init starts where it says, the
directory loads as a checkpoint with one MTP layer over the preset's own main weights, the
training lowers the loss, a rebuild writes the same bytes (seeded), and the cache builds once."""

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tools.small_mtp as small_mtp
from bench.mtp_acceptance import prenorm_forward, random_prompts
from moe import load_model
from moe.presets import ensure_preset
from tools.small_mtp import (
    FrozenShared,
    SmallMtpConfig,
    block_config,
    build,
    ensure_small_mtp,
    greedy_data,
    init_layer,
    teacher,
)
from tools.tiny.train_mtp import build_mtp, load_mtp_file, mtp_block

CFG = SmallMtpConfig(model="tiny-random", prompts=8, new=8, steps=4, batch_size=4, threads=1)


def shared_of(model: torch.nn.Module, config: object) -> FrozenShared:
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    return FrozenShared(config, embed.detach().float().clone(), head.detach().float().clone())


def test_teacher_targets_are_the_engines_greedy_tokens() -> None:
    cfg = replace(CFG, prompts=4, new=24)
    src = ensure_preset(cfg.model)
    seqs = greedy_data(src, cfg)  # [4, 40]
    model = load_model(str(src))
    hidden, targets = teacher(model, seqs)
    plen = cfg.prompt_len
    # the argmax at every greedy row is the token the engine chose next
    assert torch.equal(targets[:, plen - 1 : -1], seqs[:, plen:])
    # and at the prompt's rows the model's own guess, as a full forward gives it
    assert torch.equal(targets, model(seqs).argmax(-1))
    assert hidden.shape == (4, plen + 24, model.config.hidden_size)


def test_identity_init_drafts_the_main_models_own_guess() -> None:
    """init "identity": the block passes hnorm(h_i) through, so the head's logits at row i are
    the main model's at position i (both norms are ones in a random preset)."""
    cfg = replace(CFG, init="identity")
    src = ensure_preset(cfg.model)
    model, config = load_model(str(src)), block_config(cfg.model)
    layer = build_mtp(config, cfg.seed)
    init_layer(layer, cfg, src / "model.safetensors")
    ids = random_prompts(config.vocab_size, 2, 20, seed=5)  # [2, 20]
    hidden, logits = prenorm_forward(model, ids)
    shared = shared_of(model, config)
    with torch.no_grad():
        out = mtp_block(shared, layer, hidden[:, :-1], ids[:, 1:])
        got = shared.lm_head(layer.shared_head.norm(out))  # [2, 19, V]
    assert (got - logits[:, :-1]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("source", [1, 2])  # the MoE layers
def test_layer_init_copies_the_main_layer(source: int) -> None:
    cfg = replace(CFG, init="layer", init_layer=source)
    src = ensure_preset(cfg.model)
    config = block_config(cfg.model)
    layer = build_mtp(config, cfg.seed)
    init_layer(layer, cfg, src / "model.safetensors")
    main = load_file(str(src / "model.safetensors"))
    prefix, state, copied = f"model.layers.{source}.", layer.state_dict(), 0
    for name, tensor in main.items():
        if not name.startswith(prefix):
            continue
        key = name[len(prefix) :]
        if ".experts." in key:  # mlp.experts.{e}.{gate,up,down}_proj.weight
            _, _, e, proj, _ = key.split(".")
            inter = config.moe_intermediate_size
            if proj == "down_proj":
                mine = state["mlp.experts.down_proj"][int(e)]
            else:
                fused = state["mlp.experts.gate_up_proj"][int(e)]  # [2I, D]
                mine = fused[:inter] if proj == "gate_proj" else fused[inter:]
        else:
            mine = state[key]
        assert torch.equal(mine, tensor), key
        copied += 1
    assert copied == len([k for k in main if k.startswith(prefix)]) > 10
    size = config.hidden_size
    eye = torch.cat([torch.zeros(size, size), torch.eye(size)], dim=1)
    assert torch.equal(state["eh_proj.weight"], eye)


def test_build_loads_with_its_mtp_layer_and_is_reproducible(tmp_path: Path) -> None:
    record = build(tmp_path / "a", CFG)
    assert len(record["losses"]) == CFG.steps
    assert record["losses"][-1] < record["losses"][0]
    assert record["mtp_bytes"] == (tmp_path / "a" / "mtp.safetensors").stat().st_size
    assert record["rows"] == CFG.prompts * (CFG.prompt_len + CFG.new - 1)

    built, preset = load_model(str(tmp_path / "a")), load_model("tiny-random")
    assert built.config.num_nextn_predict_layers == 1 and len(built.mtp) == 1
    assert preset.config.num_nextn_predict_layers == 0
    for (name, mine), (_, theirs) in zip(
        built.model.state_dict().items(), preset.model.state_dict().items(), strict=True
    ):
        assert torch.equal(mine, theirs), name  # the main model is the preset's
    assert (tmp_path / "a" / "main.safetensors").resolve() == (
        ensure_preset("tiny-random") / "model.safetensors"
    ).resolve()

    # moe/'s MTP path on the build equals the layer as trained (transformers' block)
    config = block_config(CFG.model)
    layer = load_mtp_file(tmp_path / "a" / "mtp.safetensors", config)
    shared = shared_of(built, config)
    ids = random_prompts(config.vocab_size, 1, 30, seed=3)  # [1, 30]
    hidden, _ = prenorm_forward(built, ids)  # [1, 30, D]
    with torch.no_grad():
        out = mtp_block(shared, layer, hidden[:, :-1], ids[:, 1:])
        expected = shared.lm_head(layer.shared_head.norm(out))[0]  # [29, V]
    with torch.inference_mode():
        got = built.mtp_logits(hidden[0, :-1], ids[0, 1:], torch.arange(1, 30), [29])
    assert (got - expected).abs().max().item() <= 1e-4

    build(tmp_path / "b", CFG)
    first = (tmp_path / "a" / "mtp.safetensors").read_bytes()
    assert first == (tmp_path / "b" / "mtp.safetensors").read_bytes()


def test_a_build_of_no_steps_is_the_identity_init(tmp_path: Path) -> None:
    """steps 0 (the default): no data, the head drafts the main model's own guess at i."""
    record = build(tmp_path, replace(CFG, steps=0))
    assert record["rows"] == 0 and record["losses"] == [] and record["final_loss"] is None
    built = load_model(str(tmp_path))
    ids = random_prompts(built.config.vocab_size, 1, 25, seed=4)  # [1, 25]
    hidden, logits = prenorm_forward(built, ids)
    with torch.inference_mode():
        got = built.mtp_logits(hidden[0, :-1], ids[0, 1:], torch.arange(1, 25), [24])
    assert (got - logits[0, :-1]).abs().max().item() <= 1e-4


def test_ensure_small_mtp_builds_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EPCLUSTER_CACHE", str(tmp_path))
    path = ensure_small_mtp(CFG)
    assert path.parent == tmp_path and path.name.startswith(f"tiny-random-mtp-v{CFG.version}-")
    assert load_model(str(path)).config.num_nextn_predict_layers == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left

    def no_build(*_args: object) -> dict:
        raise AssertionError("rebuilt a cached head")

    monkeypatch.setattr(small_mtp, "build", no_build)
    assert ensure_small_mtp(CFG) == path
