"""Routing by expected prefix hits on a real local cluster (Ray, tiny-random, 2 prefill ranks):
two multi-turn conversations with one system prompt, turn by turn in turns; every turn after
the first finds the whole of its previous prompt (its full blocks; the answer's KV is the decode
rank's) in the prefill rank's cache, which it can only if it was sent to the rank its previous
turn ran on."""

import pytest

from engine import SamplingParams
from router.client import InferenceClient
from tests.cluster.conftest import start_cluster
from tests.cluster.test_kv_tiers_cluster import BS, tokens

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_a_conversations_turns_land_where_their_prefix_is():
    cluster = start_cluster({"prefill.num_ranks": 2, "decode.num_ranks": 1})
    system = tokens(1, 2 * BS, seed=1)[0]
    users = tokens(6, BS + 5, seed=2)  # 21 tokens a message: turns end mid-block
    prompts = {"a": list(system), "b": list(system)}
    sent = {"a": 0, "b": 0}  # the length of each conversation's last prompt
    try:
        with InferenceClient(cluster.address, timeout=120) as client:
            for turn in range(3):
                for i, c in enumerate("ab"):
                    prompts[c] += users[2 * turn + i]
                    messages = list(client.generate(prompts[c], GREEDY))
                    usage = messages[-1].usage
                    if turn == 0:
                        # a: nothing cached yet; b: the system prompt, wherever a ran
                        assert usage.cached_tokens == (0 if c == "a" else 2 * BS), c
                    else:
                        assert usage.cached_tokens == sent[c] // BS * BS, (c, turn)
                    sent[c] = len(prompts[c])
                    prompts[c] += sum((list(m.token_ids) for m in messages), [])
    finally:
        cluster.shutdown()
