"""Runs one scheduled batch through the model over the paged latent cache, then samples.

It chooses how each step's layers run, visibly, in one place (run and _stages): a decode step
that DecodeGraphs serves replays a CUDA graph (engine/decode_graphs.py); else, on CPU, the fused
layers where CpuDecode gives them (engine/cpu_decode.py: one compiled call per layer); else the
model's Python layers.

Legend (kernels/__init__.py): T tokens in the step, B requests, D hidden, V vocab, L layers,
NB cache blocks, BS block size, C latent width.
"""

import logging
from dataclasses import dataclass, field

import torch

from engine.config import EngineConfig
from engine.cpu_decode import CpuDecode
from engine.greedy_head import GreedyHead, greedy_head
from engine.messages import TokenLogprobs
from engine.request import Request
from engine.sampler import SampleOutput, sample
from engine.sampling_params import SamplingParams
from engine.speculative import MtpDrafter, MtpRows, num_accepted
from kernels.backend import serving_kernels
from kernels.cpu.build import cpu_kernels
from kernels.mla_attention import cache_slot
from moe.attention import PagedKV
from moe.model import DeepseekForCausalLM
from moe.overlap import Stages, run_interleaved

log = logging.getLogger(__name__)


class _PrepareFailed(Exception):
    """Building the step's input tensors raised (before any collective ran)."""


@dataclass(slots=True)
class RunOutput:
    """What one step sampled: per request whose prompt is complete, in batch order, its new
    tokens (one; with speculation the accepted drafts and the bonus token) and their logprobs,
    and the requests whose rows failed (left out of token_ids)."""

    token_ids: list[list[int]] = field(default_factory=list)
    logprobs: list[list[TokenLogprobs | None]] = field(default_factory=list)
    # request id -> (the stage that raised: "preparing" | "sampling", the exception)
    failed: dict[str, tuple[str, BaseException]] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: DeepseekForCausalLM) -> None:
        self.config = config
        self.model = model
        if torch.device(config.device).type == "cpu":
            # NOTE: built (or loaded) now, while the engine starts: the first build takes
            # 20-30 s, which must not land inside a request's deadline.
            cpu_kernels()
        # which kernels serve (GetModelInfo, the ranks' metrics); a fallback warns once, now
        self.kernels = serving_kernels(config.device, config.torch_dtype)
        c = model.config
        # speculation: one more cache layer, the MTP layer's (index num_hidden_layers)
        num_layers = c.num_hidden_layers + (1 if config.speculative is not None else 0)
        itemsize = torch.empty((), dtype=config.torch_dtype).element_size()
        bytes_per_block = num_layers * config.block_size * c.kv_cache_width * itemsize
        self.num_blocks = config.kv_cache_bytes // bytes_per_block
        if self.num_blocks < 1:
            raise ValueError(
                f"kv_cache_bytes={config.kv_cache_bytes} holds no block of {bytes_per_block} bytes"
            )
        self.num_split_steps = 0  # steps run as two micro-batches (two-batch overlap)
        # None: the Python layers (a GPU, or bench's --python-layers)
        on_cpu = torch.device(config.device).type == "cpu"
        self.cpu_decode: CpuDecode | None = CpuDecode(model) if on_cpu else None
        self.graphs = None  # DecodeGraphs (enable_graphs)
        # NOTE: zeros, not empty: attention masks rows past a sequence's end, but a NaN there
        # would still poison the sum.
        self.kv_caches = [
            torch.zeros(
                self.num_blocks,
                config.block_size,
                c.kv_cache_width,
                dtype=config.torch_dtype,
                device=config.device,
            )
            for _ in range(num_layers)
        ]  # L x [NB, BS, C]
        self.drafter: MtpDrafter | None = None
        if config.speculative is not None:
            self.drafter = MtpDrafter(
                model, self.kv_caches, config.block_size, config.speculative.draft_head
            )
        shared = None  # the drafts' int8 head, which the screen reuses when it is lm_head's
        if self.drafter is not None and self.drafter.head_int8 is not None:
            shared = (self.drafter.head_weight, self.drafter.head_int8)
        self.greedy_head: GreedyHead | None = greedy_head(
            model.lm_head.weight, config.greedy_head, shared
        )

    def enable_graphs(self, max_model_len: int, capture: bool = True) -> None:
        """Run decode steps through DecodeGraphs (engine/decode_graphs.py): one more cache
        block for its padding rows, then (capture) a CUDA graph per batch-size bucket."""
        from engine.decode_graphs import DecodeGraphs

        for i, cache in enumerate(self.kv_caches):  # NOTE: in place: others hold the list
            self.kv_caches[i] = torch.cat([cache, torch.zeros_like(cache[:1])])
        max_blocks = -(-max_model_len // self.config.block_size)
        self.graphs = DecodeGraphs(
            self.model, self.kv_caches, self.config.block_size, max_blocks,
            self.config.cuda_graph_max_batch, capture,
        )  # fmt: skip
        if not self.graphs.experts_local():
            log.warning(
                "cuda_graph: this rank shares its experts (expert parallelism), whose all-to-all "
                "reads counts on the host: decode steps run eagerly"
            )
        self.graphs.capture_all()

    def prepare(
        self, requests: list[Request], num_new: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, PagedKV]:
        """-> input_ids [T], positions [T], and where those tokens live in the cache."""
        bs, device = self.config.block_size, self.config.device
        # NOTE: Python lists and one tensor each: per-request tensor ops cost ~10 ops x B a step
        ids, positions, slots, context_lens = [], [], [], []
        for req, n in zip(requests, num_new):
            start, end = req.num_computed_tokens, req.num_computed_tokens + n
            table = req.block_table
            tokens = req.all_token_ids
            if end > len(tokens):  # a verify: the last token, then the drafts
                tokens = tokens + req.draft_token_ids
                assert end <= len(tokens), (req.request_id, end, len(tokens))
            ids.extend(tokens[start:end])
            positions.extend(range(start, end))
            slots.extend(cache_slot(table, p, bs) for p in range(start, end))
            context_lens.append(end)
        width = max((len(req.block_table) for req in requests), default=0)
        block_tables = torch.tensor(
            [req.block_table + [0] * (width - len(req.block_table)) for req in requests],
            dtype=torch.long,
        ).view(len(requests), width)  # [B, M], padded with block 0 (never read)
        kv = PagedKV(
            self.kv_caches,
            torch.tensor(slots, dtype=torch.long).to(device),
            block_tables.to(device),
            list(num_new),
            context_lens,
            absorb=self.config.mla_absorb,
        )
        ids_t = torch.tensor(ids, dtype=torch.long).to(device)
        return ids_t, torch.tensor(positions, dtype=torch.long).to(device), kv

    def _stages(
        self, requests: list[Request], num_new: list[int], pre_norm: list[torch.Tensor] | None
    ) -> Stages:
        if not requests:  # an empty batch still joins every collective of an EP step
            empty = torch.empty(0, dtype=torch.long, device=self.config.device)
            return self.model.stages(empty, empty, [], pre_norm_out=pre_norm)
        try:
            input_ids, positions, kv = self.prepare(requests, num_new)
        except Exception as e:
            raise _PrepareFailed(repr(e)) from e
        fused = None
        if self.cpu_decode is not None:  # the step's hidden states take the embedding's dtype
            fused = self.cpu_decode.layers(self.model.model.embed_tokens.weight, kv)
        return self.model.stages(input_ids, positions, kv=kv, fused=fused, pre_norm_out=pre_norm)

    def _preparable(
        self,
        requests: list[Request],
        num_new: list[int],
        failed: dict[str, tuple[str, BaseException]],
    ) -> tuple[list[Request], list[int]]:
        """The requests whose inputs build alone (the others go into `failed`). Only after the
        batch's prepare raised: one request's bad rows must not fail the whole step."""
        kept, kept_new = [], []
        for req, n in zip(requests, num_new, strict=True):
            try:
                self.prepare([req], [n])
            except Exception as e:
                failed[req.request_id] = ("preparing", e)
                continue
            kept.append(req)
            kept_new.append(n)
        return kept, kept_new

    def forward(
        self,
        requests: list[Request],
        num_new: list[int],
        split: bool,
        pre_norm: list[torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """-> hidden [T, D] of the step's tokens, in order. With split, two micro-batches of
        about equal token counts run interleaved (two-batch overlap). pre_norm: the hidden
        states before the final norm [T, D] are appended there (one tensor)."""
        if not split:
            return run_interleaved([self._stages(requests, num_new, pre_norm)])[0]
        self.num_split_steps += 1
        half, acc, cut = sum(num_new) / 2, 0, 0
        while cut < len(requests) and acc + num_new[cut] / 2 <= half:
            acc += num_new[cut]
            cut += 1
        parts = [(requests[:cut], num_new[:cut]), (requests[cut:], num_new[cut:])]
        pres: list[list[torch.Tensor] | None] = [None, None] if pre_norm is None else [[], []]
        out = run_interleaved([self._stages(r, n, p) for (r, n), p in zip(parts, pres)])
        if pre_norm is not None:  # in batch order, whichever part finished first
            pre_norm.append(torch.cat([p[0] for p in pres]))
        return torch.cat(out)

    @torch.inference_mode()
    def run(
        self,
        requests: list[Request],
        num_new: list[int],
        split: bool = False,
        speculate: bool = True,
    ) -> RunOutput:
        """Compute the step; sample for requests whose prompt is complete after it (in order of
        `requests`, skipping unfinished prefill chunks). speculate False: a step without drafts
        (the scheduler gave none) whose MTP layer rests; the requests' old drafts are dropped.

        NOTE: a request whose inputs cannot be built, or whose row cannot be sampled, fails
        alone (RunOutput.failed): the step goes on for the others, with the same tokens they
        would have had without it (sampling is a function of seed and position, row by row).
        An exception in the forward pass itself (a collective, the model) still ends the step.
        """
        out = RunOutput()
        spec = self.drafter is not None and speculate
        if self.drafter is not None and not speculate:  # stale by the next speculating step
            for req in requests:
                req.draft_token_ids, req.draft_hidden = [], None
        if spec:  # d_2 .. d_k: the verify's input
            self.drafter.chain(requests, _num_drafts(requests, num_new))
        # NOTE: the decode graphs give normed states of one row per request: not a verify's
        pre_norm: list[torch.Tensor] | None = [] if spec else None
        if (
            self.graphs is not None
            and not spec
            and not split
            and self.graphs.serves(requests, num_new)
        ):
            hidden = self.graphs.run(requests)  # [B, D]
        else:
            try:
                hidden = self.forward(requests, num_new, split, pre_norm)  # [T, D]
            except _PrepareFailed:  # raised before any collective: build the others' alone
                requests, num_new = self._preparable(requests, num_new, out.failed)
                pre_norm = [] if spec else None
                hidden = self.forward(requests, num_new, split, pre_norm)
        if not requests:
            return out
        drafts = _num_drafts(requests, num_new)
        ends = torch.tensor(num_new).cumsum(0).tolist()  # [B] each request's end in the batch
        samplers = [
            i
            for i, (r, n) in enumerate(zip(requests, num_new))
            if r.num_computed_tokens + n >= r.num_tokens
        ]
        # the rows sampled: a request's last, or with k drafts its last k + 1 (the verify)
        groups = [range(ends[i] - 1 - drafts[i], ends[i]) for i in samplers]
        targets = self._sample_groups(hidden, [requests[i] for i in samplers], groups, out.failed)
        accepted: dict[int, int] = {}  # batch index -> drafts kept
        for i, got in zip(samplers, targets):
            if got is None:
                continue
            tokens, logprobs = got
            a = num_accepted(requests[i].draft_token_ids[: drafts[i]], tokens)
            accepted[i] = a
            out.token_ids.append(tokens[: a + 1])
            out.logprobs.append(logprobs[: a + 1])
        if spec and pre_norm:
            self.drafter.after_step(
                _mtp_rows(requests, num_new, drafts, accepted, out, pre_norm[0], ends)
            )
        return out

    def _sample_groups(
        self,
        hidden: torch.Tensor,
        chosen: list[Request],
        groups: list[range],
        failed: dict[str, tuple[str, BaseException]],
    ) -> list[tuple[list[int], list[TokenLogprobs | None]] | None]:
        """Sample rows `groups[i]` of hidden [T, D] for chosen[i], row j at position
        num_tokens + j -> per request (tokens, logprobs), or None where its rows failed (then
        in `failed`; the others sample as they would have alone)."""
        if not chosen:
            return []
        x = hidden[[r for g in groups for r in g]]  # [n, D]
        params = [req.params for req, g in zip(chosen, groups) for _ in g]
        seeds = [req.seed for req, g in zip(chosen, groups) for _ in g]
        positions = [req.num_tokens + j for req, g in zip(chosen, groups) for j in range(len(g))]
        bounds = torch.tensor([0] + [len(g) for g in groups]).cumsum(0).tolist()
        # A greedy row that needs nothing else of its logits (no logprobs: the sampler reads a
        # greedy row's logits for its argmax and logprobs only) takes the screen's argmax where
        # it serves (engine/greedy_head.py: the full head's token, bit for bit); the other
        # rows, `rest`, the full head's logits, computed once for the batch.
        picked: list[int | None] = [None] * len(params)
        eligible = [i for i, p in enumerate(params) if p.greedy and p.logprobs is None]
        if self.greedy_head is not None and eligible:
            for i, t in zip(eligible, self.greedy_head.argmax(x[eligible]), strict=True):
                picked[i] = t
        rest = [i for i, t in enumerate(picked) if t is None]
        logits = None  # [len(rest), V]
        if rest:
            logits = self.model.compute_logits(x[rest] if len(rest) < len(params) else x)

        def sample_rows(lo: int, hi: int) -> SampleOutput:
            """Rows lo .. hi - 1: the screen's tokens, the sampler's over the others."""
            sub = [j for j, i in enumerate(rest) if lo <= i < hi]  # rows of logits
            rows = [rest[j] for j in sub]
            out = None
            if logits is not None and rows:
                out = self.sample(
                    logits if len(sub) == logits.shape[0] else logits[sub],
                    [params[i] for i in rows],
                    [seeds[i] for i in rows],
                    [positions[i] for i in rows],
                )
                if len(rows) == hi - lo:  # nothing screened (every row off the CPU kernels)
                    return out
            token_ids = torch.tensor([t or 0 for t in picked[lo:hi]], dtype=torch.long)
            logprobs: list[TokenLogprobs | None] = [None] * (hi - lo)
            if out is not None:
                token_ids[[i - lo for i in rows]] = out.token_ids.cpu()
                for i, lp in zip(rows, out.logprobs, strict=True):
                    logprobs[i - lo] = lp
            return SampleOutput(token_ids, logprobs)

        try:
            sampled = sample_rows(0, len(params))
            ids = sampled.token_ids.tolist()
            return [(ids[lo:hi], sampled.logprobs[lo:hi]) for lo, hi in zip(bounds, bounds[1:])]
        except Exception:  # find the requests that fail alone
            pass
        result: list[tuple[list[int], list[TokenLogprobs | None]] | None] = []
        for req, lo, hi in zip(chosen, bounds, bounds[1:]):
            try:
                one = sample_rows(lo, hi)
            except Exception as e:
                failed[req.request_id] = ("sampling", e)
                result.append(None)
                continue
            result.append((one.token_ids.tolist(), one.logprobs))
        return result

    def sample(
        self,
        logits: torch.Tensor,
        params: list[SamplingParams],
        seeds: list[int],
        positions: list[int],
    ) -> SampleOutput:
        """engine.sampler.sample over logits [B, V] (a method, so that a test can make one
        request's sampling fail on a live rank)."""
        return sample(logits, params, seeds, positions)


def _num_drafts(requests: list[Request], num_new: list[int]) -> list[int]:
    """The drafts each request verifies this step (the rows past its known tokens)."""
    return [max(0, r.num_computed_tokens + n - r.num_tokens) for r, n in zip(requests, num_new)]


def _mtp_rows(
    requests: list[Request],
    num_new: list[int],
    drafts: list[int],
    accepted: dict[int, int],
    out: RunOutput,
    pre_norm: torch.Tensor,
    ends: list[int],
) -> list[MtpRows]:
    """The rows whose main-model KV the step keeps, for the MTP layer: a prompt chunk's all, a
    verify's first a + 1 (the last token and the accepted drafts); none of a failed request."""
    rows, j = [], 0
    for i, (req, n) in enumerate(zip(requests, num_new)):
        if req.request_id in out.failed:
            continue
        start, ext = req.num_computed_tokens, req.all_token_ids
        sampler = start + n >= req.num_tokens
        kept = n
        if sampler:
            ext = ext + out.token_ids[j]
            kept = n - drafts[i] + accepted[i]
            j += 1
        lo = ends[i] - n
        next_ids = ext[start + 1 : start + kept + 1]  # the token after each kept row
        rows.append(MtpRows(req, start, pre_norm[lo : lo + kept], next_ids, sampler))
    return rows
