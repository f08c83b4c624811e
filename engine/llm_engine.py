"""LLMEngine: one rank's requests, scheduler, paged cache and model. The loop is
schedule -> run -> postprocess; `step()` returns what each request gained in that step."""

import itertools
import random

import torch
import torch.distributed as dist

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import update_text
from engine.kv_transfer import KVPayload, KVTransferError, export_kv, import_kv
from engine.messages import RankStatus
from engine.model_runner import ModelRunner
from engine.request import PREFILLED, Request, RequestOutput
from engine.sampler import SampleOutput
from engine.sampling_params import SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from moe.loader import load_model, resolve_model_path
from moe.model import DeepseekForCausalLM
from moe.tokenizer import Tokenizer, load_tokenizer


class LLMEngine:
    """One rank. With an expert-parallel `ep_group`, every step is a collective: the ranks agree
    (one small all-reduce) on whether any has work and whether to split into two micro-batches,
    and a rank with nothing to do steps with an empty batch."""

    def __init__(
        self,
        config: EngineConfig,
        model: DeepseekForCausalLM | None = None,
        ep_group: "dist.ProcessGroup | None" = None,
        ep_size: int = 1,
    ) -> None:
        path = resolve_model_path(config.model)
        self.config = config
        self.ep_group, self.ep_size = ep_group, ep_size
        self.pool_has_unfinished = False  # from the last agreement: any rank with requests
        self.last_step_tokens = 0  # tokens the last step ran (the pool's largest batch, in EP)
        self.model = model or load_model(path, dtype=config.torch_dtype, device=config.device)
        mc = self.model.config
        self.tokenizer: Tokenizer = load_tokenizer(
            path, mc.vocab_size, mc.eos_token_id, mc.bos_token_id
        )
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.runner = ModelRunner(config, self.model)
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self.requests: dict[str, Request] = {}
        self.exported: dict[str, KVPayload] = {}  # prefill side: KV of finished prompts
        # decode side: request id -> (block table, cached prompt tokens, deadline)
        self.reserved: dict[str, tuple[list[int], int, float]] = {}
        self._rng = random.Random(config.seed)
        self._arrivals = itertools.count()
        self.num_computed_tokens = 0  # tokens run through the model (prefill + decode), lifetime

    # ---- requests ----

    def validate_prompt(self, prompt: str | list[int]) -> list[int]:
        """-> token ids, or ValueError saying what to fix."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise ValueError("prompt is empty: give at least one token")
        vocab = self.model.config.vocab_size
        bad = [
            t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab
        ]
        if bad:
            raise ValueError(
                f"prompt token id {bad[0]!r} is out of range: ids must be in [0, {vocab})"
            )
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens but the model's context is "
                f"{self.max_model_len}: shorten it to at most {self.max_model_len - 1}"
            )
        blocks = -(-(len(ids) + 1) // self.config.block_size)
        if blocks > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt needs {blocks} KV blocks but this engine's cache has "
                f"{self.block_manager.num_blocks}: shorten it or raise kv_cache_bytes"
            )
        return ids

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        seed: int | None = None,
        prefill_only: bool = False,
    ) -> Request:
        """Queue a request. seed: overrides params.seed (the router resolves it); prefill_only:
        stop after the first token and export the prompt's KV (a prefill rank's job)."""
        if request_id in self.requests or request_id in self.reserved:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        ids = self.validate_prompt(prompt)
        if seed is None:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(
            request_id, ids, params, seed, next(self._arrivals), prefill_only=prefill_only
        )
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request however far it got (queued, running, or holding a reservation)."""
        self.release_reservation(request_id)
        req = self.requests.pop(request_id, None)
        if req is None or req.is_finished:
            return None
        self.scheduler.finish(req, "abort")
        return req.take_delta()

    # ---- disaggregation: the decode side ----

    def reserve(self, request_id: str, prompt_token_ids: list[int], deadline: float) -> bool:
        """Hold KV blocks for a prompt whose KV a prefill rank will send, so it never arrives to
        a full cache. False when there is no room now. Released by start_prefilled, abort, or
        expire_reservations after `deadline` (time.monotonic())."""
        if request_id in self.requests or request_id in self.reserved:
            raise ValueError(f"request id {request_id!r} is already in use")
        allocation = self.block_manager.allocate(prompt_token_ids)
        if allocation is None:
            return False
        self.reserved[request_id] = (allocation[0], allocation[1], deadline)
        return True

    def release_reservation(self, request_id: str) -> bool:
        held = self.reserved.pop(request_id, None)
        if held is not None:
            self.block_manager.free(held[0])
        return held is not None

    def expire_reservations(self, now: float) -> list[str]:
        expired = [rid for rid, (_, _, deadline) in self.reserved.items() if deadline < now]
        for rid in expired:
            self.release_reservation(rid)
        return expired

    def start_prefilled(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        seed: int,
        first: RequestOutput,
        kv: KVPayload,
    ) -> Request:
        """Continue a request a prefill rank started: import its prompt KV into the reserved
        blocks and join the running batch with its first token."""
        if request_id not in self.reserved:
            raise KVTransferError(f"request {request_id!r} holds no reservation (expired?)")
        block_table, cached, _ = self.reserved[request_id]
        if kv.num_tokens != len(prompt_token_ids):
            self.release_reservation(request_id)
            raise KVTransferError(
                f"request {request_id!r}: KV for {kv.num_tokens} tokens, "
                f"the prompt has {len(prompt_token_ids)}"
            )
        try:
            import_kv(self.runner.kv_caches, block_table, kv.data, start=cached)
        except Exception:
            self.release_reservation(request_id)
            raise
        del self.reserved[request_id]
        req = Request(
            request_id,
            list(prompt_token_ids),
            params,
            seed,
            next(self._arrivals),
            output_token_ids=list(first.token_ids),
            block_table=block_table,
            num_computed_tokens=len(prompt_token_ids),
            num_cached_tokens=kv.num_cached_tokens,
        )
        if first.logprobs:
            req.logprobs = list(first.logprobs)
        update_text(req, self.tokenizer, finished=False)  # what the prefill rank already sent
        req.num_tokens_sent, req.num_text_sent = len(req.output_token_ids), len(req.text)
        self.block_manager.commit(block_table, req.all_token_ids, req.num_computed_tokens)
        self.requests[request_id] = req
        self.scheduler.admit_running(req)
        return req

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the loop ----

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
        self.last_step_tokens = sum(batch.num_new_tokens)
        if self.ep_size == 1:
            if batch.is_empty:
                return []
            return self.postprocess(batch, self.runner.run(batch.requests, batch.num_new_tokens))
        num_tokens = sum(batch.num_new_tokens)
        # NOTE: every rank of the pool reaches this all-reduce once per step, work or not.
        flags = torch.tensor([num_tokens, self.scheduler.num_unfinished], device=self.config.device)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.ep_group)
        max_tokens, max_unfinished = flags.tolist()
        self.pool_has_unfinished = max_unfinished > 0
        self.last_step_tokens = max_tokens
        if max_tokens == 0:
            return []
        mode = self.config.two_batch_overlap
        split = mode == "on" or (mode == "auto" and max_tokens >= self.config.tbo_min_tokens)
        sampled = self.runner.run(batch.requests, batch.num_new_tokens, split)
        return self.postprocess(batch, sampled) if batch.requests else []

    def postprocess(
        self, batch: ScheduledBatch, sampled: SampleOutput | None
    ) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        tokens = sampled.token_ids.tolist() if sampled is not None else []
        j = 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            req.num_computed_tokens += n
            self.num_computed_tokens += n
            self.block_manager.commit(req.block_table, req.all_token_ids, req.num_computed_tokens)
            if req.num_computed_tokens < req.num_tokens:
                continue  # a prompt chunk: nothing sampled yet
            req.output_token_ids.append(tokens[j])
            if sampled.logprobs[j] is not None:
                req.logprobs.append(sampled.logprobs[j])
            j += 1
            reason = self._finish_reason(req)
            if reason is None and req.prefill_only:
                self.exported[req.request_id] = KVPayload(
                    req.request_id,
                    export_kv(self.runner.kv_caches, req.block_table, len(req.prompt_token_ids)),
                    req.num_cached_tokens,
                )
                reason = PREFILLED
            if reason is not None:
                self.scheduler.finish(req, reason)
                self.requests.pop(req.request_id, None)
            outputs.append(req.take_delta())
        return outputs

    def _finish_reason(self, req: Request) -> str | None:
        p, token = req.params, req.output_token_ids[-1]
        if token in p.stop_token_ids or (token == self.tokenizer.eos_token_id and not p.ignore_eos):
            update_text(req, self.tokenizer, finished=True)
            return "stop"
        length = len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len
        if update_text(req, self.tokenizer, finished=length):
            return "stop"
        return "length" if length else None

    def rank_status(self, pool: str, rank: int, ready: bool) -> RankStatus:
        """This engine's load, for routing and GetClusterStatus (a snapshot: when read from
        another thread, the counters may be a step apart)."""
        bm = self.block_manager
        return RankStatus(
            pool,
            rank,
            ready,
            len(self.scheduler.running),
            len(self.scheduler.waiting),
            bm.num_used_blocks,
            bm.num_blocks,
            bm.num_cached_blocks,
            len(self.reserved),
            bm.block_size,
            {
                layer: list(m.experts.expert_ids)
                for layer, m in zip(self.model.config.moe_layers, self.model.moe_layers())
            },
        )

    def assert_no_leaks(self) -> None:
        """With no request alive, every KV block is free or cached and unreferenced."""
        assert not self.has_unfinished(), "requests are still alive"
        assert not self.reserved, f"reservations still held: {sorted(self.reserved)}"
        self.block_manager.assert_idle()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions
