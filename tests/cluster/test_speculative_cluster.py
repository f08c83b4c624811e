"""Speculative decoding in a cluster (local Ray): the decode pool, 2 expert-parallel ranks set
from the config with speculative {mtp, k 2}, verifies in lockstep (the MTP layer's MoE held whole
on every rank, no all-to-all) and returns, greedy, the in-process engine's tokens without
speculation; the prefill pool runs without it (its KV carries no MTP layer); the ranks' status
counts the drafts, and no block is held afterwards."""

import pytest
import torch

from engine import LLM, SamplingParams
from router.client import InferenceClient
from tests.cluster.conftest import start_cluster, wait_quiet
from tests.mtp_checkpoint import write_mtp_random

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_decode_pool_speculates_and_equals_the_engine_without(tmp_path):
    model = str(write_mtp_random(tmp_path / "mtp-random"))
    cluster = start_cluster(
        {
            "model": model,
            "prefill.num_ranks": 1,
            "decode.num_ranks": 2,
            "decode.engine.speculative": {"method": "mtp", "num_draft_tokens": 2},
        }
    )
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 512, (int(n),), generator=gen).tolist() for n in (5, 17, 33, 9)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    try:
        with InferenceClient(cluster.address, timeout=120) as client:
            got = []
            for prompt in prompts:
                messages = list(client.generate(prompt, params))
                got.append(sum((list(m.token_ids) for m in messages), []))
            status = wait_quiet(client)
        want = [o.token_ids for o in LLM(model).generate(prompts, params)]
        assert got == want
        decode = [r for p in status.pools if p.name == "decode" for r in p.ranks]
        prefill = [r for p in status.pools if p.name == "prefill" for r in p.ranks]
        assert sum(r.spec_draft_tokens for r in decode) > 0
        assert all(r.spec_accepted_tokens <= r.spec_draft_tokens for r in decode)
        assert all(r.spec_draft_tokens == 0 for r in prefill)
        assert all(r.kv_used_blocks == 0 for r in decode + prefill)
    finally:
        cluster.shutdown()
