"""The MTP module (moe/mtp.py) against a plain-torch reference of DeepSeek-V3's description:
h' = eh_proj([enorm(Emb(t_{i+1})); hnorm(h_i)]), transformers' own decoder block (the oracle of
the other layers), shared_head.norm, then the shared head."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from moe import load_model
from tests.hf_oracle import make_hf_model

LAYERS = 2  # main layers; the MTP layer is model.layers.2 (an MoE layer: first_k_dense_replace 1)


def rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def build(path: Path, differ: bool = False) -> tuple[torch.nn.Module, torch.nn.Module, dict]:
    """A tiny V3 checkpoint with one MTP layer -> (main HF model, the HF model whose layer
    LAYERS is the MTP block, the MTP tensors as saved)."""
    main = make_hf_model("v3", path, seed=0, num_hidden_layers=LAYERS, n_group=4, topk_group=2)
    # a second random model supplies a decoder block with HF names at index LAYERS
    donor = make_hf_model(
        "v3", path / "donor", seed=1, num_hidden_layers=LAYERS + 1, n_group=4, topk_group=2
    )
    prefix = f"model.layers.{LAYERS}."
    g = torch.Generator().manual_seed(2)
    d = main.config.hidden_size
    tensors = {
        prefix + k: v.clone().contiguous()
        for k, v in donor.model.layers[LAYERS].state_dict().items()
    }
    tensors[prefix + "enorm.weight"] = 1 + 0.3 * torch.randn(d, generator=g)
    tensors[prefix + "hnorm.weight"] = 1 + 0.3 * torch.randn(d, generator=g)
    tensors[prefix + "shared_head.norm.weight"] = 1 + 0.3 * torch.randn(d, generator=g)
    tensors[prefix + "eh_proj.weight"] = 0.1 * torch.randn(d, 2 * d, generator=g)
    tensors[prefix + "embed_tokens.weight"] = main.model.embed_tokens.weight.detach().clone()
    head = main.lm_head.weight.detach().clone()
    tensors[prefix + "shared_head.head.weight"] = head + 0.5 if differ else head
    save_file(tensors, str(path / "mtp.safetensors"))
    config = json.loads((path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    return main, donor, tensors


def reference(main, donor, tensors, hidden, next_ids) -> torch.Tensor:
    """Plain torch from the description; the block is transformers' DeepseekV3DecoderLayer."""
    p = f"model.layers.{LAYERS}."
    eps = main.config.rms_norm_eps
    e = rms(main.model.embed_tokens.weight[next_ids], tensors[p + "enorm.weight"], eps)
    h = rms(hidden, tensors[p + "hnorm.weight"], eps)
    x = torch.cat([e, h], -1) @ tensors[p + "eh_proj.weight"].T  # [T, D]
    t = x.shape[0]
    positions = torch.arange(t)[None]
    cos_sin = donor.model.rotary_emb(x[None], positions)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    out = donor.model.layers[LAYERS](
        x[None], attention_mask=mask, position_ids=positions, position_embeddings=cos_sin
    )
    out = out[0] if isinstance(out, tuple) else out
    y = rms(out[0], tensors[p + "shared_head.norm.weight"], eps)
    return y @ tensors[p + "shared_head.head.weight"].T


@pytest.mark.parametrize("differ", [False, True], ids=["shared-head", "own-head"])
def test_mtp_logits_equal_reference(tmp_path: Path, differ: bool) -> None:
    main, donor, tensors = build(tmp_path, differ)
    model = load_model(tmp_path)
    assert len(model.mtp) == 1
    assert (model.mtp[0].shared_head.head is None) == (not differ)
    assert model.mtp[0].embed_tokens is None  # equal to the main model's: shared
    ids = torch.randint(
        0, main.config.vocab_size, (12,), generator=torch.Generator().manual_seed(3)
    )
    positions = torch.arange(11)
    with torch.no_grad():
        # the main model's last layer before its final norm (HF hidden_states[-1] is normed)
        hf = main(ids[None], output_hidden_states=True)
        pre = last_layer_pre_norm(main, hf.hidden_states[LAYERS - 1])
        ours = model.forward_tokens(ids, torch.arange(12), [12])
        want = reference(main, donor, tensors, pre[0, :11], ids[1:])
        got = model.mtp_logits(pre[0, :11], ids[1:], positions, [11])
    # the main path is unchanged by the MTP layer's presence
    torch.testing.assert_close(ours, hf.hidden_states[-1][0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(got, model.compute_logits(ours)[:11], atol=1e-2)


def last_layer_pre_norm(main, before_last: torch.Tensor) -> torch.Tensor:
    """The main model's last layer applied to hidden_states[LAYERS - 1]: the pre-norm output."""
    t = before_last.shape[1]
    positions = torch.arange(t)[None]
    cos_sin = main.model.rotary_emb(before_last, positions)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
    out = main.model.layers[LAYERS - 1](
        before_last, attention_mask=mask, position_ids=positions, position_embeddings=cos_sin
    )
    return out[0] if isinstance(out, tuple) else out


def test_mtp_weights_ignored_when_config_says_zero(tmp_path: Path) -> None:
    main, _, _ = build(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_nextn_predict_layers"] = 0
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = load_model(tmp_path)
    assert len(model.mtp) == 0
    ids = torch.arange(10)[None]
    torch.testing.assert_close(model(ids), main(ids).logits, atol=1e-4, rtol=1e-4)


def test_mtp_paged_kv_uses_its_own_cache_layer(tmp_path: Path) -> None:
    """With a PagedKV the MTP block writes and reads cache layer num_hidden_layers: a prefill of
    10 rows then a decode row give the no-cache call's logits, and the main layers' caches stay
    untouched."""
    from moe.attention import PagedKV

    build(tmp_path)
    model = load_model(tmp_path)
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(11, model.config.hidden_size, generator=g)
    next_ids = torch.randint(0, model.config.vocab_size, (11,), generator=g)
    positions = torch.arange(11)
    with torch.no_grad():
        want = model.mtp_logits(hidden, next_ids, positions, [11])
        block = 4
        caches = [torch.zeros(4, block, model.config.kv_cache_width) for _ in range(LAYERS + 1)]
        table = torch.tensor([[2, 0, 3, 1]])  # blocks out of order: the table is followed
        slots = table[0, positions // block] * block + positions % block

        def step(lo: int, hi: int) -> torch.Tensor:
            kv = PagedKV(caches, slots[lo:hi], table, [hi - lo], [hi])
            return model.mtp_logits(hidden[lo:hi], next_ids[lo:hi], positions[lo:hi], kv=kv)

        first, last = step(0, 10), step(10, 11)
    torch.testing.assert_close(torch.cat([first, last]), want, atol=1e-5, rtol=1e-5)
    assert all(not c.any() for c in caches[:LAYERS]) and caches[LAYERS].any()
