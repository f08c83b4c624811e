"""The cached paths: chunked prefill into a paged latent cache, and decode with absorbed weights,
against the full-sequence forward (no cache) step by step."""

import torch

from moe import load_model
from moe.attention import PagedKV

BLOCK = 4


def run_step(model, caches, tables, seqs, new_counts, absorb):
    """Feed the last new_counts[i] tokens of each sequence; return last-token logits [N, V]."""
    ids, pos, slots, qlens, ctxs = [], [], [], [], []
    for i, (seq, n) in enumerate(zip(seqs, new_counts)):
        start = len(seq) - n
        for p in range(start, len(seq)):
            ids.append(seq[p])
            pos.append(p)
            slots.append(tables[i][p // BLOCK] * BLOCK + p % BLOCK)
        qlens.append(n)
        ctxs.append(len(seq))
    kv = PagedKV(caches, torch.tensor(slots), torch.tensor(tables), qlens, ctxs, absorb=absorb)
    with torch.inference_mode():
        hidden = model.forward_tokens(torch.tensor(ids), torch.tensor(pos), kv=kv)
        last = torch.tensor(qlens).cumsum(0) - 1
        return model.compute_logits(hidden[last])


def test_absorbed_decode_equals_naive_for_16_steps():
    model = load_model("tiny-random")
    c = model.config
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, c.vocab_size, (n,), generator=gen).tolist() for n in (5, 11, 1)]
    blocks_per_seq = 10  # room for 40 tokens
    tables = [[s * blocks_per_seq + b for b in range(blocks_per_seq)] for s in range(len(prompts))]

    def new_caches():
        return [
            torch.full((len(prompts) * blocks_per_seq, BLOCK, c.kv_cache_width), float("nan"))
            for _ in range(c.num_hidden_layers)
        ]

    caches = {True: new_caches(), False: new_caches()}
    seqs = [list(p) for p in prompts]
    # Prefill in two chunks to exercise attention over an already-cached prefix.
    for absorb in (True, False):
        first = [max(1, len(p) // 2) for p in prompts]
        run_step(
            model, caches[absorb], tables, [p[:f] for p, f in zip(prompts, first)], first, absorb
        )
    counts = [len(p) - max(1, len(p) // 2) or 1 for p in prompts]
    seqs_for_rest = [p if len(p) > 1 else p for p in prompts]
    logits = {
        a: run_step(model, caches[a], tables, seqs_for_rest, counts, a) for a in (True, False)
    }
    for step in range(16):
        full = torch.stack([model(torch.tensor([s]))[0, -1] for s in seqs])
        for absorb in (True, False):
            assert (logits[absorb] - full).abs().max().item() <= 1e-4, (step, absorb)
        nxt = full.argmax(-1).tolist()
        assert logits[True].argmax(-1).tolist() == nxt == logits[False].argmax(-1).tolist()
        for s, t in zip(seqs, nxt):
            s.append(t)
        logits = {
            a: run_step(model, caches[a], tables, seqs, [1] * len(seqs), a) for a in (True, False)
        }


def test_short_queries_take_the_absorbed_path_long_chunks_the_expanded_one():
    """Hand-computed: a decode token, a 64-token chunk over a 10-token prefix, a 65-token
    chunk: the first two go absorbed, each query with the keys up to itself."""
    from moe.attention import ABSORB_MAX_QUERY

    assert ABSORB_MAX_QUERY == 64
    tables = torch.tensor([[0, 1], [2, 3], [4, 5]])
    kv = PagedKV([], torch.zeros(130, dtype=torch.long), tables, [1, 64, 65], [7, 74, 65])
    assert kv.absorbed_tokens.tolist() == list(range(65))
    assert kv.absorbed_lens.tolist() == [7] + list(range(11, 75))
    assert torch.equal(kv.absorbed_tables, tables[[0] + [1] * 64])
    assert kv.prefill_seqs == [(2, 65, 130, 65)] and not kv.all_absorbed
    naive = PagedKV([], torch.zeros(2, dtype=torch.long), tables[:2], [1, 1], [3, 4], absorb=False)
    assert naive.absorbed_tokens.numel() == 0 and len(naive.prefill_seqs) == 2
    assert PagedKV([], torch.zeros(2, dtype=torch.long), tables[:2], [1, 1], [3, 4]).all_absorbed
