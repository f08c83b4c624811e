"""Acceptance of a checkpoint's MTP head, offline and exact (issue 29): how often speculative
decoding with k draft tokens would keep them, counted, not timed.

Greedy: the main model continues each prompt greedily (full forwards, no cache); then at every
position i of the continuation, with h_i the main model's last hidden state BEFORE its final norm
and s_{i+1} the main model's greedy token, the MTP layer drafts d_1 = argmax MTP(h_i, s_{i+1}), and
chained as docs/mtp.md says (the layer fed its own output hidden state and draft, at the next
position, over its own stream of the sequence so far) d_2, d_3. d_j is accepted when d_1 .. d_j
all equal the main model's greedy tokens s_{i+2} .. s_{i+j+1}: acceptance[j] is that fraction,
conditional[j] = acceptance[j] / acceptance[j - 1], and a verify step with k drafts yields
1 + sum_{j <= k} acceptance[j] tokens on average. Teacher-forced: on held-out text, the top-1
accuracy of the MTP head on the real token after next (and the main model's on the next).

    .venv/bin/python -m bench.mtp_acceptance                 (tiny, its held-out topics)
    .venv/bin/python -m bench.mtp_acceptance --model DIR --prompts random   (e.g. small's build)

Legend: B prompts, P prompt tokens, N tokens per sequence, T rows, D hidden, V vocab.
"""

import argparse
import json
from pathlib import Path

import torch

from moe import DeepseekForCausalLM, load_model

MAX_DEPTH = 3


def prenorm_forward(
    model: DeepseekForCausalLM, ids: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [B, N] (whole sequences) -> (hidden before the final norm [B, N, D],
    logits [B, N, V])."""
    batch, length = ids.shape
    seen: list[torch.Tensor] = []
    hook = model.model.norm.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
    try:
        with torch.inference_mode():
            positions = torch.arange(length).repeat(batch)
            normed = model.forward_tokens(ids.reshape(-1), positions, [length] * batch)
            logits = model.compute_logits(normed)
    finally:
        hook.remove()
    return seen[0].view(batch, length, -1), logits.view(batch, length, -1)


@torch.inference_mode()
def greedy_continue(model: DeepseekForCausalLM, prompts: torch.Tensor, new: int) -> torch.Tensor:
    """prompts [B, P] -> [B, P + new]: the main model's greedy continuation."""
    seqs = prompts
    for _ in range(new):
        nxt = model(seqs)[:, -1].argmax(-1)  # [B]
        seqs = torch.cat([seqs, nxt[:, None]], dim=1)
    return seqs


def draft_logits(model: DeepseekForCausalLM, out: torch.Tensor) -> torch.Tensor:
    """The MTP layer's block outputs [T, D] through its shared head -> logits [T, V] fp32."""
    head = model.mtp[0].shared_head
    lm_head = head.head if head.head is not None else model.lm_head
    return lm_head(head.norm(out)).float()


@torch.inference_mode()
def chained_drafts(
    model: DeepseekForCausalLM, hidden: torch.Tensor, seq: torch.Tensor, starts: list[int], k: int
) -> torch.Tensor:
    """One sequence: hidden [N, D] (pre-norm), seq [N] -> drafts [S, k], S = len(starts).

    The MTP stream has row j = (h_{j-1}, s_j) at position j; the step at i drafts d_1 from row
    i + 1, then row i + 1 + m = (g_m, d_m) at position i + 1 + m drafts d_{m+1}, g_m the output
    of the row before it: one MTP layer reused per depth, over its own stream so far."""
    n = len(seq)
    rows_h, rows_t = hidden[: n - 1], seq[1:]  # stream rows 1 .. N - 1
    out = model.mtp_hidden(rows_h, rows_t, torch.arange(1, n), [n - 1])  # [N - 1, D]
    outs = [out[starts]]  # g_1 per start, [S, D]
    drafts = [draft_logits(model, outs[0]).argmax(-1)]  # d_1, [S]
    for depth in range(1, k):
        chain_h, chain_t = torch.stack(outs, 1), torch.stack(drafts, 1)  # [S, m, D], [S, m]
        h = torch.cat([torch.cat([rows_h[: i + 1], chain_h[s]]) for s, i in enumerate(starts)])
        t = torch.cat([torch.cat([rows_t[: i + 1], chain_t[s]]) for s, i in enumerate(starts)])
        lens = [i + 1 + depth for i in starts]
        pos = torch.cat([torch.arange(1, length + 1) for length in lens])
        out = model.mtp_hidden(h, t, pos, lens)  # [sum(lens), D]
        outs.append(out[torch.tensor(lens).cumsum(0) - 1])  # each sequence's last row
        drafts.append(draft_logits(model, outs[-1]).argmax(-1))
    return torch.stack(drafts, dim=1)


def greedy_acceptance(
    model: DeepseekForCausalLM, prompts: torch.Tensor, new: int, k: int = MAX_DEPTH
) -> dict:
    """prompts [B, P] -> acceptance per depth of chained drafts against greedy decoding."""
    return acceptance_on(model, greedy_continue(model, prompts, new), prompts.shape[1], k)


def acceptance_on(
    model: DeepseekForCausalLM, seqs: torch.Tensor, plen: int, k: int = MAX_DEPTH
) -> dict:
    """seqs [B, N]: prompts of plen tokens and the main model's greedy continuations -> the
    acceptance per depth of chained drafts (see the module doc)."""
    hidden = torch.cat([prenorm_forward(model, c)[0] for c in seqs.split(8)])  # [B, N, D]
    n, new = seqs.shape[1], seqs.shape[1] - plen
    starts = list(range(plen - 1, n - 1 - k))  # steps whose k targets are greedy tokens
    hits = torch.zeros(k)  # [k] prefixes of accepted drafts
    for b in range(len(seqs)):
        drafts = chained_drafts(model, hidden[b], seqs[b], starts, k)  # [S, k]
        targets = torch.stack([seqs[b, i + 2 : i + 2 + k] for i in starts])  # [S, k]
        hits += (drafts == targets).long().cumprod(dim=1).sum(0)
    steps = len(seqs) * len(starts)
    acc = (hits / steps).tolist()
    return {
        "prompts": len(seqs),
        "prompt_tokens": plen,
        "greedy_tokens": new,
        "draft_positions": steps,
        "acceptance": [round(a, 4) for a in acc],  # d_1 .. d_j all kept
        "conditional": [round(acc[0], 4)]
        + [round(acc[j] / acc[j - 1], 4) if acc[j - 1] else 0.0 for j in range(1, k)],
        "tokens_per_verify_step": {
            str(j): round(1 + sum(acc[:j]), 4) for j in range(0, k + 1)
        },  # k drafts -> the bonus token plus the accepted drafts
    }


@torch.inference_mode()
def teacher_forced(model: DeepseekForCausalLM, data: torch.Tensor, seq_len: int = 128) -> dict:
    """data [N] real text -> over consecutive windows of seq_len + 1 tokens (as the tiny recipe
    evaluates): top-1 accuracy of the MTP head on t_{i+2} from (h_i, t_{i+1}), and of the main
    model on t_{i+1}."""
    n = (len(data) - 1) // seq_len
    windows = torch.stack([data[i * seq_len : (i + 1) * seq_len + 1] for i in range(n)])
    mtp_hits = main_hits = 0
    for chunk in windows.split(16):  # [b, L + 1]
        b = len(chunk)
        hidden, logits = prenorm_forward(model, chunk[:, :seq_len])  # [b, L, D], [b, L, V]
        main_hits += int((logits.argmax(-1) == chunk[:, 1:]).sum())
        h = hidden[:, : seq_len - 1].reshape(-1, hidden.shape[-1])  # rows i = 0 .. L - 2
        t = chunk[:, 1:seq_len].reshape(-1)
        pos = torch.arange(1, seq_len).repeat(b)
        draft = model.mtp_logits(h, t, pos, [seq_len - 1] * b).argmax(-1)  # [b * (L - 1)]
        mtp_hits += int((draft == chunk[:, 2:].reshape(-1)).sum())
    return {
        "windows": n,
        "seq_len": seq_len,
        "mtp_top1_token_after_next": round(mtp_hits / (n * (seq_len - 1)), 4),
        "main_top1_next_token": round(main_hits / (n * seq_len), 4),
    }


def tiny_held_out() -> torch.Tensor:
    """The tiny recipe's held-out topics, tokenized as in training -> [N]."""
    from tokenizers import Tokenizer

    from moe.presets import TRAINED
    from tools.tiny.train import TrainConfig, corpus, token_stream

    _, held_docs = corpus(TrainConfig())
    tok = Tokenizer.from_file(str(TRAINED["tiny"] / "tokenizer.json"))
    return token_stream(tok, held_docs)


def prompts_from(data: torch.Tensor, count: int, length: int) -> torch.Tensor:
    """`count` windows of `length` tokens spread evenly over data [N] -> [count, length]."""
    step = (len(data) - length) // count
    return torch.stack([data[i * step : i * step + length] for i in range(count)])


def random_prompts(vocab: int, count: int, length: int, seed: int) -> torch.Tensor:
    """Seeded uniform token ids (not 0 / 1, bos / eos) -> [count, length]."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab, (count, length), generator=gen)


def engine_continue(model: str, prompts: torch.Tensor, new: int) -> torch.Tensor:
    """prompts [B, P] -> [B, P + new], greedy in the engine (a KV cache: for larger models)."""
    from engine import LLM, SamplingParams

    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    outs = LLM(model).generate([p.tolist() for p in prompts], params)
    return torch.cat([prompts, torch.tensor([o.token_ids for o in outs])], dim=1)


def main(argv: list[str] | None = None) -> None:
    from bench.common import record

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny", help="a preset name or a checkpoint folder")
    ap.add_argument("--prompts", choices=["held-out", "random"], default="held-out")
    ap.add_argument("--count", type=int, default=64, help="prompts")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new", type=int, default=64, help="greedy tokens per prompt")
    ap.add_argument("--seed", type=int, default=1, help="of random prompts")
    ap.add_argument("--name", default=None, help="result file name (default from the model)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--engine", action="store_true", help="greedy continuations in the engine")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model)
    assert model.config.num_nextn_predict_layers >= 1, f"{args.model} has no MTP layer"
    result: dict = {"model": args.model, "prompts_from": args.prompts}
    if args.prompts == "held-out":
        held = tiny_held_out()
        prompts = prompts_from(held, args.count, args.prompt_len)
        result["teacher_forced_held_out"] = teacher_forced(model, held)
    else:
        prompts = random_prompts(model.config.vocab_size, args.count, args.prompt_len, args.seed)
        result["seed"] = args.seed
    build = Path(args.model) / "build_meta.json"  # tools/small_mtp.py's record of the head
    if build.exists():
        result["build"] = json.loads(build.read_text())
    if args.engine:
        seqs = engine_continue(args.model, prompts, args.new)
        result["greedy"] = acceptance_on(model, seqs, args.prompt_len)
        result["greedy"]["continued_by"] = "engine"
    else:
        result["greedy"] = greedy_acceptance(model, prompts, args.new)
    name = args.name or f"mtp_acceptance_{Path(args.model).name}"
    print(record(name, result))
    print(result)


if __name__ == "__main__":
    main()
