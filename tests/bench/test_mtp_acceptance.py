"""bench/mtp_acceptance.py on tiny's trained MTP head: its chained drafts equal a step-by-step
oracle (the layer as trained, in transformers' blocks, fed its own output and draft one row at a
time), and its acceptance counts are those drafts checked against the greedy tokens."""

import torch

from bench.mtp_acceptance import (
    chained_drafts,
    greedy_acceptance,
    greedy_continue,
    prenorm_forward,
    prompts_from,
    tiny_held_out,
)
from moe import load_model
from moe.presets import TRAINED
from tests.hf_oracle import hf_greedy, hf_v3_main_model
from tools.tiny import train_mtp

PATH = TRAINED["tiny"]
K = 3


@torch.no_grad()
def oracle_drafts(main, layer, seq: torch.Tensor, start: int) -> list[int]:
    """seq [N]: the K chained drafts of the step at `start`, one row appended per depth."""
    hidden = train_mtp.main_hidden(main, seq[None])  # [1, N, D]
    rows_h, rows_t = hidden[:, : start + 1], seq[None, 1 : start + 2]
    drafts = []
    for _ in range(K):
        g = train_mtp.mtp_block(main, layer, rows_h, rows_t)[:, -1:]  # [1, 1, D]
        d = main.lm_head(layer.shared_head.norm(g)).argmax(-1)  # [1, 1]
        drafts.append(int(d))
        rows_h, rows_t = torch.cat([rows_h, g], 1), torch.cat([rows_t, d], 1)
    return drafts


def test_chained_drafts_and_acceptance_equal_a_step_by_step_oracle():
    model = load_model("tiny")
    main = hf_v3_main_model(PATH)
    layer = train_mtp.load_mtp(PATH, main)
    prompts = prompts_from(tiny_held_out(), 2, 16)  # [2, 16]
    new = 14
    seqs = greedy_continue(model, prompts, new)  # [2, 30]
    for prompt, seq in zip(prompts, seqs):
        assert seq[16:].tolist() == hf_greedy(main, prompt.tolist(), new)
    starts = list(range(15, 30 - 1 - K))
    hits = torch.zeros(K)
    for seq in seqs:
        hidden, _ = prenorm_forward(model, seq[None])
        got = chained_drafts(model, hidden[0], seq, starts, K)  # [S, K]
        want = [oracle_drafts(main, layer, seq, i) for i in starts]
        assert got.tolist() == want
        for i, drafts in zip(starts, want):
            for j in range(K):  # d_1 .. d_j all equal the greedy tokens after s_{i+1}
                if drafts[j] != int(seq[i + 2 + j]):
                    break
                hits[j] += 1
    result = greedy_acceptance(model, prompts, new, K)
    steps = len(seqs) * len(starts)
    assert result["draft_positions"] == steps
    assert result["acceptance"] == [round(h / steps, 4) for h in hits.tolist()]
    assert hits[0] > 0  # the head drafts some greedy tokens right: the check compares something
    assert result["tokens_per_verify_step"]["1"] == round(1 + hits[0].item() / steps, 4)
