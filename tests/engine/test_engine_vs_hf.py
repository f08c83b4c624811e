"""The engine, batched with chunked prefill and small blocks, against transformers' greedy
generate run on each prompt alone."""

import pytest
import torch

from engine import LLM, SamplingParams
from tests.hf_oracle import hf_greedy, make_hf_model

LENGTHS = [4, 7, 12, 19, 25, 33, 41, 50, 64, 77, 90, 111, 128, 150, 175, 200]
NEW_TOKENS = 12


@pytest.mark.parametrize("kind", ["v3", "v2"])
def test_batched_greedy_equals_transformers(kind, tmp_path):
    overrides = (
        dict(n_group=4, topk_group=2)
        if kind == "v3"
        else dict(topk_method="group_limited_greedy", n_group=4, topk_group=2)
    )
    hf = make_hf_model(kind, tmp_path, **overrides)
    gen = torch.Generator().manual_seed(3)
    prompts = [
        torch.randint(0, hf.config.vocab_size, (n,), generator=gen).tolist() for n in LENGTHS
    ]
    llm = LLM(str(tmp_path), block_size=4, max_num_batched_tokens=96, max_num_seqs=16)
    outs = llm.generate(
        prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    )
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(hf, prompt, NEW_TOKENS), len(prompt)
        assert out.finish_reason == "length"
    llm.engine.assert_no_leaks()
