"""LLMEngine: one rank's requests, scheduler, paged cache and model. The loop is
schedule -> run -> postprocess; `step()` returns what each request gained in that step."""

import itertools
import random

import torch
import torch.distributed as dist

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import update_text
from engine.model_runner import ModelRunner
from engine.request import Request, RequestOutput
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
        self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None
    ) -> Request:
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        params = params or SamplingParams()
        ids = self.validate_prompt(prompt)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        req = Request(request_id, ids, params, seed, next(self._arrivals))
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def abort_request(self, request_id: str) -> RequestOutput | None:
        req = self.requests.pop(request_id, None)
        if req is None or req.is_finished:
            return None
        self.scheduler.finish(req, "abort")
        return req.take_delta()

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the loop ----

    def step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule()
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

    def assert_no_leaks(self) -> None:
        """With no request alive, every KV block is free or cached and unreferenced."""
        assert not self.has_unfinished(), "requests are still alive"
        self.block_manager.assert_idle()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions
