"""moe.load_model against transformers' own DeepSeek models: logits and greedy continuations."""

import pytest
import torch

from moe import load_model
from moe.layers import MoE
from moe.model import DeepseekForCausalLM
from tests.hf_oracle import hf_greedy, make_hf_model

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "rope_theta": 10000.0,
}

CASES = {
    # V3: sigmoid + e_score_correction_bias, group-limited (noaux_tc), normalised top-k weights.
    "v3-qlora-groups-yarn": (
        "v3",
        dict(
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            rope_parameters=YARN,
            rope_interleave=True,
        ),
    ),
    "v3-no-qlora-no-norm": (
        "v3",
        dict(
            q_lora_rank=None,
            n_group=2,
            topk_group=1,
            norm_topk_prob=False,
            routed_scaling_factor=1.5,
            first_k_dense_replace=2,
            num_hidden_layers=4,
        ),
    ),
    "v3-rope-halves": ("v3", dict(n_group=1, topk_group=1, rope_interleave=False)),
    # V2: softmax gate, plain greedy and group-limited greedy top-k.
    "v2-greedy": ("v2", dict(q_lora_rank=None, topk_method="greedy", routed_scaling_factor=1.0)),
    "v2-group-limited-yarn": (
        "v2",
        dict(
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=16.0,
            rope_parameters=YARN,
        ),
    ),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    kind, overrides = CASES[request.param]
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(kind, path, **overrides)
    return hf, load_model(path, dtype=torch.float32)


def test_logits_match(pair):
    hf, ours = pair
    ids = torch.randint(
        0, hf.config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(1)
    )
    with torch.no_grad():
        expected = hf(ids).logits
    got = ours(ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-4


def test_greedy_continuations_match(pair):
    hf, ours = pair
    gen = torch.Generator().manual_seed(2)
    for length in (3, 9, 17, 30):
        prompt = torch.randint(0, hf.config.vocab_size, (length,), generator=gen).tolist()
        expected = hf_greedy(hf, prompt, 32)
        tokens = list(prompt)
        for _ in range(32):
            tokens.append(int(ours(torch.tensor([tokens]))[0, -1].argmax()))
        assert tokens[length:] == expected


def test_the_oracle_runs_the_engines_forward_path(pair, monkeypatch):
    """`ours(ids)` goes through DeepseekForCausalLM.stages and MoE.stages, the generator the
    engine's ModelRunner drives (there is no second forward path)."""
    hf, ours = pair
    calls = {"model": 0, "moe": 0}
    model_stages, moe_stages = DeepseekForCausalLM.stages, MoE.stages

    def count(key, fn):
        def wrapped(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)

        return wrapped

    monkeypatch.setattr(DeepseekForCausalLM, "stages", count("model", model_stages))
    monkeypatch.setattr(MoE, "stages", count("moe", moe_stages))
    ours(torch.tensor([[1, 2, 3]]))
    assert calls == {"model": 1, "moe": len(ours.config.moe_layers)}
