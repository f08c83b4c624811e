"""What an LLMEngine does with a step's samples: each request's new tokens (a verify's accepted
drafts and bonus, appended one by one up to a finish), its blocks after a verify's rollback,
the prefix cache's commit, the finish, the hand-off of a prefill-only request with its KV, and
the end of a request that failed alone. A mixin of LLMEngine (engine/llm_engine.py)."""

import logging

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.detokenizer import update_text
from engine.kv_tiers.link import TierLink
from engine.kv_transfer import export_kv
from engine.messages import (
    KVPayload,
    PrefillResult,
    RequestFailed,
    RequestOutput,
    StepResult,
    TokenLogprobs,
)
from engine.metrics.rank import RankStats
from engine.model_runner import ModelRunner, RunOutput
from engine.request import Request
from engine.scheduler import ScheduledBatch, Scheduler
from engine.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class EnginePostprocess:
    config: EngineConfig
    block_manager: BlockManager
    scheduler: Scheduler
    runner: ModelRunner
    tokenizer: Tokenizer
    stats: RankStats
    tiers: TierLink | None
    requests: dict[str, Request]
    max_model_len: int
    num_computed_tokens: int
    num_failed: int
    num_spec_verifies: int
    num_draft_tokens: int
    num_accepted_tokens: int

    def postprocess(self, batch: ScheduledBatch, sampled: RunOutput) -> StepResult:
        """Each request's new token, finish and hand-off. A request whose rows failed in the
        runner, or whose own postprocessing raises, ends alone with finish_reason "error"."""
        result = StepResult()
        j = 0
        for req, n in zip(batch.requests, batch.num_new_tokens):
            failed = sampled.failed.get(req.request_id)
            if failed is not None:
                result.outputs.append(self._fail(req, *failed))
                continue
            drafts = max(0, req.num_computed_tokens + n - req.num_tokens)
            self.num_computed_tokens += n
            if req.num_computed_tokens + n < req.num_tokens:
                req.num_computed_tokens += n
                self._commit(req)
                continue  # a prompt chunk: nothing sampled yet
            tokens, logprobs = sampled.token_ids[j], sampled.logprobs[j]
            j += 1
            if drafts:
                self._count_verify(drafts, len(tokens) - 1)
            try:
                self._advance(req, n - drafts, tokens, logprobs, result)
            except Exception as e:  # this request's text or KV export: it alone fails
                result.outputs.append(self._fail(req, "postprocessing", e))
        return result

    def _count_verify(self, drafted: int, accepted: int) -> None:
        self.num_spec_verifies += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if self.config.metrics:
            self.stats.observe("epcluster_spec_accepted_per_verify", accepted)

    def _advance(
        self,
        req: Request,
        num_known: int,
        tokens: list[int],
        logprobs: list[TokenLogprobs | None],
        result: StepResult,
    ) -> None:
        """req computed num_known of its known tokens and sampled `tokens` (with speculation the
        accepted drafts and the bonus): append them up to a finish, keep the KV of the rows whose
        tokens stay (a verify's rejected drafts' blocks go back), then finish, hand off or
        report the delta."""
        reason, kept = None, 0
        for token, lp in zip(tokens, logprobs, strict=True):
            kept += 1
            req.output_token_ids.append(token)
            if lp is not None:
                req.logprobs.append(lp)
            reason = self._finish_reason(req)
            if reason is not None:  # never a token past a stop or the limit
                break
        # the rows before each kept token: the known ones, then the accepted drafts
        req.num_computed_tokens += num_known + kept - 1
        if reason is None:
            self.block_manager.truncate(req.block_table, req.num_tokens)
        self._commit(req)
        if reason is None and req.prefill_only:  # hand off to a decode rank
            result.prefilled.append(self._export(req))
            return
        if reason is not None:
            self.scheduler.finish(req, reason)
            self.requests.pop(req.request_id, None)
        result.outputs.append(req.take_delta())

    def _fail(self, req: Request, stage: str, error: BaseException) -> RequestOutput:
        """End one request with an error (its blocks go back); the engine goes on."""
        log.warning("request %s failed in %s: %r", req.request_id, stage, error)
        self.num_failed += 1
        if not req.is_finished:
            self.scheduler.finish(req, "error")
        self.requests.pop(req.request_id, None)
        out = req.take_delta()
        out.finish_reason = "error"
        out.failure = RequestFailed.caused_by(req.request_id, stage, error)
        return out

    def _export(self, req: Request) -> PrefillResult:
        """A prefill-only request whose prompt is done: its first token and prompt KV leave the
        engine; its blocks go back (full ones stay in the prefix cache)."""
        kv = KVPayload(  # the prompt's rows, and a resumed request's earlier output's
            req.request_id,
            export_kv(self.runner.kv_caches, req.block_table, req.num_computed_tokens),
            req.num_cached_tokens,
        )
        first = req.take_delta()  # finish_reason None: the decode rank carries on
        self.scheduler.finish(req, None)
        self.requests.pop(req.request_id)
        return PrefillResult(first, kv)

    def _finish_reason(self, req: Request) -> str | None:
        p, token = req.params, req.output_token_ids[-1]
        if token in p.stop_token_ids or (token == self.tokenizer.eos_token_id and not p.ignore_eos):
            update_text(req, self.tokenizer, finished=True)
            return "stop"
        length = len(req.output_token_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len
        if update_text(req, self.tokenizer, finished=length):
            return "stop"
        return "length" if length else None

    def _commit(self, req: Request) -> None:
        """Hash req's newly full blocks (the prefix cache); the tiers get them after the step."""
        hashed = self.block_manager.commit(
            req.block_table, req.all_token_ids, req.num_computed_tokens
        )
        if self.tiers is not None:
            self.tiers.filled(hashed)
