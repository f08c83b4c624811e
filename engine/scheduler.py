"""Continuous batching with chunked prefill and preemption by recompute.

Each step has a token budget (max_num_batched_tokens) and a cap on running requests
(max_num_seqs). Running requests go first, in arrival order: a decode costs one token, an
unfinished prompt a chunk of what is left. Then waiting requests are admitted, FCFS, while budget,
seats and KV blocks last. When a running request cannot get a block, the most recently arrived
running request is preempted: its blocks are freed and it recomputes later (same tokens: sampling
depends only on seed and position). With speculative decoding a decode verifies its drafts: it
costs 1 + k tokens, k capped by the drafts it has, the tokens it may still produce, the context
and the budget; a step that starts with more running requests than speculative.max_batch_size
decodes without drafts (and the MTP layer rests).
"""

from collections import deque
from dataclasses import dataclass

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.kv_tiers.link import TierLink
from engine.request import Request, Status


@dataclass(slots=True)
class ScheduledBatch:
    requests: list[Request]
    num_new_tokens: list[int]  # tokens each request computes this step
    speculate: bool = False  # the MTP layer drafts in this step (decodes may verify drafts)

    @property
    def is_empty(self) -> bool:
        return not self.requests


class Scheduler:
    def __init__(
        self,
        config: EngineConfig,
        block_manager: BlockManager,
        tiers: TierLink | None = None,
        max_model_len: int | None = None,
    ) -> None:
        """tiers: the KV tiers below the paged cache (None: off); max_model_len: the engine's
        context limit (caps the drafts a step verifies)."""
        self.config = config
        self.max_model_len = max_model_len
        self.block_manager = block_manager
        self.tiers = tiers
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_prefix_queried = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of them, found there

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def schedule(self) -> ScheduledBatch:
        budget = self.config.max_num_batched_tokens
        spec = self.config.speculative
        batch = ScheduledBatch([], [], spec is not None)
        if spec is not None and spec.max_batch_size is not None:
            batch.speculate = len(self.running) <= spec.max_batch_size
        # 1. Running requests, oldest first; preempt the youngest when blocks run out.
        queue = sorted(self.running, key=lambda r: r.arrival)
        kept: list[Request] = []
        while queue and budget > 0:
            req = queue.pop(0)
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n == req.num_tokens - req.num_computed_tokens == 1 and batch.speculate:
                n += self._num_drafts(req, budget - 1)  # a decode that verifies drafts
            # NOTE: `while ... else`: the else runs only when append_slots succeeded (the loop
            # ended without a break); a request that had to preempt itself breaks out and is
            # neither kept nor batched. Preempting the youngest first keeps FCFS order.
            while not self.block_manager.append_slots(req.block_table, req.num_computed_tokens + n):
                victim = queue.pop() if queue else req
                self._preempt(victim)
                if victim is req:
                    break
            else:
                kept.append(req)
                batch.requests.append(req)
                batch.num_new_tokens.append(n)
                budget -= n
        self.running = kept + queue  # requests left over when the budget ran out keep their seat
        # 2. Admit waiting requests, FCFS, while there is budget, a seat and blocks.
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            allocation = self.block_manager.allocate(req.all_token_ids)
            if allocation is None:
                break
            self.waiting.popleft()
            req.block_table, cached = allocation
            if self.tiers is not None:  # the prefix past the paged hits, from host or disk
                cached = self.tiers.load_prefix(req.all_token_ids, req.block_table, cached)
            req.num_computed_tokens = cached
            if req.num_preemptions == 0:
                req.num_cached_tokens = cached
                self.num_prefix_queried += len(req.prompt_token_ids)
                self.num_prefix_hits += cached
            req.status = Status.RUNNING
            n = min(req.num_tokens - cached, budget)
            self.running.append(req)
            batch.requests.append(req)
            batch.num_new_tokens.append(n)
            budget -= n
        return batch

    def _num_drafts(self, req: Request, budget: int) -> int:
        """Drafts a decode verifies: never one that could only be a token past max_tokens or
        the context (the step keeps at most k + 1 tokens)."""
        k = min(self.config.num_draft_tokens, budget)
        if k <= 0 or not req.draft_token_ids:
            return 0
        k = min(k, req.params.max_tokens - len(req.output_token_ids) - 1)
        if self.max_model_len is not None:
            k = min(k, self.max_model_len - req.num_tokens)
        return max(k, 0)

    def admit_running(self, req: Request) -> None:
        """A request that arrives with its KV already in place (from a prefill rank)."""
        req.status = Status.RUNNING
        self.running.append(req)

    def _preempt(self, req: Request) -> None:
        self.block_manager.free(req.block_table)
        req.block_table = []
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.draft_token_ids, req.draft_hidden = [], None  # the MTP layer drafts again
        self.num_preemptions += 1
        req.status = Status.WAITING
        if req in self.running:
            self.running.remove(req)
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: str | None) -> None:
        """End a request here however it ends; its blocks go back (cached blocks stay
        reusable). reason None: it was handed off and goes on elsewhere (a decode rank)."""
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        if req.block_table:
            self.block_manager.free(req.block_table)
            req.block_table = []
        req.status = Status.FINISHED
        req.finish_reason = reason
