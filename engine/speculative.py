"""Speculative decoding with the checkpoint's MTP layer (docs/mtp.md): the drafts and the MTP
layer's own paged cache. ModelRunner verifies; this module proposes.

Legend (kernels/__init__.py): T rows, D hidden, V vocab.

The MTP row at position i takes (h_i, t_{i+1}) (the main model's last layer before the final
norm, and the next token) and predicts t_{i+2}; it writes the MTP cache layer at position i
(moe/mtp.py's convention: the rows take the positions of their hidden states). Per step:
1. `chain` (before the verify): d_2 .. d_k, each from the MTP layer's own previous output and
   the previous draft (the MTP layer reused per depth, as vLLM does for DeepSeek), at
   positions num_computed .. num_computed + k - 2: slots the verify owns, overwritten by step 3.
2. the runner verifies [t_last, d_1 .. d_k] and keeps the a accepted drafts and the bonus.
3. `after_step`: the MTP layer over every kept row of the step (prefill chunks too, so its
   cache covers the prompt), and d_1 for the next step from the last one.
NOTE: drafts only decide how many tokens a step keeps, never which: every kept token is the
token the target model samples at its position (seeded per position), so a stale or missing MTP
cache entry (a prefix hit's last block boundary, a preempted request) costs acceptance only. So
may the drafts' head be approximate: SpeculativeConfig.draft_head "int8" (the default on the CPU
kernels) multiplies by an int8 copy of it, a quarter of the bytes a draft reads.
"""

import logging
from dataclasses import dataclass

import torch

from engine.cpu_decode import FusedLayer, fused_block
from engine.request import Request
from engine.sampler import argmax, sample
from kernels import hugepages
from kernels.backend import use_cpu_kernel
from kernels.mla_attention import cache_slot
from kernels.quantized import Int8Weight, int8_linear, quantize_rows
from kernels.rotary import rope_cos_sin
from moe.attention import PagedKV
from moe.model import DeepseekForCausalLM
from moe.mtp import eh_input

log = logging.getLogger(__name__)


def num_accepted(drafts: list[int], targets: list[int]) -> int:
    """The drafts kept: the length of the prefix where draft j equals the target's own token at
    its position (targets[j], sampled from verify row j). len(targets) == len(drafts) + 1."""
    assert len(targets) == len(drafts) + 1, (len(drafts), len(targets))
    a = 0
    while a < len(drafts) and drafts[a] == targets[a]:
        a += 1
    return a


@dataclass(slots=True)
class MtpRows:
    """One request's rows for the MTP layer: positions start .. start + len(next_ids) - 1, the
    main model's pre-norm hidden states there [n, D], and the token after each."""

    req: Request
    start: int
    hidden: torch.Tensor  # [n, D]
    next_ids: list[int]
    draft: bool  # propose d_1 from the last row (the request decodes next)


class MtpDrafter:
    """Runs the MTP layer (depth 0) over the runner's paged caches; cache layer
    num_hidden_layers is its own. On the CPU its block runs compiled where the main layers'
    do (engine/cpu_decode.py: the same numbers, one call instead of the Python layer's
    ~40 kernel calls). Its logits take the MTP layer's head, or an int8 copy of it made here
    (draft_head, SpeculativeConfig's: "int8", "exact", or "auto": int8 where the CPU kernels
    serve)."""

    def __init__(
        self,
        model: DeepseekForCausalLM,
        kv_caches: list[torch.Tensor],
        block_size: int,
        draft_head: str = "auto",
    ) -> None:
        assert len(model.mtp) >= 1, "speculative decoding needs an MTP layer"
        assert len(kv_caches) == model.config.num_hidden_layers + 1, len(kv_caches)
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.fused: FusedLayer | None = None
        if use_cpu_kernel(model.lm_head.weight):
            self.fused = fused_block(model.mtp[0])
        self.num_fused_calls = 0  # MTP calls the compiled block ran (the tests read it)
        own = model.mtp[0].shared_head.head
        weight = (model.lm_head if own is None else own).weight  # [V, D]
        self.head_weight = weight  # what head_int8 quantizes (the runner's screen may share it)
        self.head_int8: Int8Weight | None = None
        if draft_head == "int8" or (draft_head == "auto" and use_cpu_kernel(weight)):
            self.head_int8 = quantize_rows(weight)
            hugepages.collapse([self.head_int8.q])  # as the model's weights (moe/model.py)
            log.info(
                "MTP drafts: an int8 copy of the head, %.1f MB (fp32 %.1f MB)",
                self.head_int8.nbytes / 1e6,
                weight.nbytes / 1e6,
            )

    @property
    def draft_head_bytes(self) -> int:
        """Memory the drafts hold beside the model's weights: the int8 head (0: exact)."""
        return 0 if self.head_int8 is None else self.head_int8.nbytes

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP block's output [T, D] -> the drafts' logits [T, V] fp32: model.mtp_head, or
        the same shared_head.norm (fp32) then the int8 copy."""
        if self.head_int8 is None:
            return self.model.mtp_head(hidden)
        normed = self.model.mtp[0].shared_head.norm(hidden)  # [T, D]
        return int8_linear(normed, self.head_int8).float()

    def _kv(self, reqs: list[Request], starts: list[int], counts: list[int]) -> PagedKV:
        """The paged view for rows [start, start + count) of each request (its block table)."""
        device = self.kv_caches[0].device
        slots = [
            cache_slot(r.block_table, p, self.block_size)
            for r, s, n in zip(reqs, starts, counts)
            for p in range(s, s + n)
        ]
        width = max(len(r.block_table) for r in reqs)
        tables = torch.tensor(
            [r.block_table + [0] * (width - len(r.block_table)) for r in reqs], dtype=torch.long
        ).view(len(reqs), width)
        return PagedKV(
            self.kv_caches,
            torch.tensor(slots, dtype=torch.long).to(device),
            tables.to(device),
            list(counts),
            [s + n for s, n in zip(starts, counts)],
        )

    def _run(
        self,
        reqs: list[Request],
        starts: list[int],
        hidden: torch.Tensor,
        next_ids: list[int],
        counts: list[int],
    ) -> torch.Tensor:
        """hidden [T, D], next_ids [T] at each request's positions start .. start + count - 1 ->
        the MTP block's output [T, D] (its cache layer written there)."""
        device = hidden.device
        positions = [p for s, n in zip(starts, counts) for p in range(s, s + n)]
        ids = torch.tensor(next_ids, dtype=torch.long, device=device)
        pos = torch.tensor(positions, dtype=torch.long, device=device)
        kv = self._kv(reqs, starts, counts)
        if self.fused is None or not kv.all_absorbed:
            return self.model.mtp_hidden(hidden, ids, pos, kv=kv)
        # model.mtp_hidden's steps, the block compiled
        m = self.model
        x = eh_input(m.mtp[0], m.model.embed_tokens, hidden, ids)  # [T, D]
        cos, sin = rope_cos_sin(pos, m.inv_freq, m.rope_scaling)
        self.num_fused_calls += 1
        out, _ = self.fused.decode.forward(
            x.contiguous(), cos.contiguous(), sin.contiguous(), self.kv_caches[-1],
            kv.slot_mapping, kv.absorbed_tables, kv.absorbed_lens,
        )  # fmt: skip
        return out

    def chain(self, requests: list[Request], num_drafts: list[int]) -> None:
        """Extend each request's drafts to num_drafts[i] tokens (d_2 .. d_k from d_1 and
        draft_hidden), one MTP row per request and depth."""
        for j in range(2, max(num_drafts, default=0) + 1):
            reqs = [r for r, k in zip(requests, num_drafts) if k >= j]
            assert all(len(r.draft_token_ids) >= j - 1 for r in reqs)
            starts = [r.num_computed_tokens + j - 2 for r in reqs]
            hidden = torch.stack([r.draft_hidden for r in reqs])  # [B, D]
            prev = [r.draft_token_ids[j - 2] for r in reqs]
            out = self._run(reqs, starts, hidden, prev, [1] * len(reqs))  # [B, D]
            drafted = self.propose(self.head(out), reqs, [r.num_computed_tokens + j for r in reqs])
            for r, h, d in zip(reqs, out, drafted):
                del r.draft_token_ids[j - 1 :]
                r.draft_token_ids.append(d)
                r.draft_hidden = h

    def after_step(self, rows: list[MtpRows]) -> None:
        """The MTP layer over the step's kept rows; d_1 (and draft_hidden) for the requests
        that decode next, drafted at position start + n + 1 (the token after the last kept)."""
        rows = [r for r in rows if r.next_ids]
        if not rows:
            return
        counts = [len(r.next_ids) for r in rows]
        out = self._run(
            [r.req for r in rows],
            [r.start for r in rows],
            torch.cat([r.hidden for r in rows]),
            [t for r in rows for t in r.next_ids],
            counts,
        )  # [T, D]
        last = torch.tensor(counts).cumsum(0) - 1
        drafting = [i for i, r in enumerate(rows) if r.draft]
        for r in rows:
            r.req.draft_token_ids, r.req.draft_hidden = [], None
        if not drafting:
            return
        hidden = out[last[drafting]]  # [B, D]
        reqs = [rows[i].req for i in drafting]
        positions = [rows[i].start + counts[i] + 1 for i in drafting]
        drafted = self.propose(self.head(hidden), reqs, positions)
        for req, h, d in zip(reqs, hidden, drafted):
            req.draft_token_ids, req.draft_hidden = [d], h

    def propose(self, logits: torch.Tensor, reqs: list[Request], positions: list[int]) -> list[int]:
        """logits [B, V] of the MTP head -> the draft token at positions[i] of reqs[i]: the
        argmax for greedy requests, else the sampler's own seeded draw at that position (the same
        noise the target's token there will take: a close draft takes the same token)."""
        if all(r.params.greedy for r in reqs):
            return argmax(logits).tolist()
        params = [r.params for r in reqs]
        return sample(logits, params, [r.seed for r in reqs], positions).token_ids.tolist()
