"""LLMEngine: one rank's requests, scheduler, paged cache and model. The loop is
schedule -> run -> postprocess; `step()` returns what each request gained in that step, and the
prefill-only requests it handed off (with their KV)."""

import dataclasses
import itertools
import logging
import random
import time

import torch
import torch.distributed as dist

from engine.balancer import Balancer
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.engine_reports import EngineReports
from engine.handoff import Reservations
from engine.kv_tiers.key import KeySpace, model_fingerprint
from engine.kv_tiers.link import TierLink
from engine.messages import (
    GenerateRequest,
    KVPayload,
    RequestOutput,
    Resume,
    StepResult,
)
from engine.metrics.rank import RankStats
from engine.model_info import PromptLimits, check_prompt
from engine.model_runner import ModelRunner
from engine.postprocess import EnginePostprocess
from engine.request import Request
from engine.sampling_params import MAX_SEED, SamplingParams
from engine.scheduler import Scheduler
from engine.tokenizer import Tokenizer, load_tokenizer
from moe.loader import load_model, resolve_model_path
from moe.model import DeepseekForCausalLM
from moe.placement import Placement

log = logging.getLogger(__name__)


class LLMEngine(EngineReports, EnginePostprocess):
    """One rank. With an expert-parallel `ep_group`, every step is a collective: the ranks agree
    (one small all-reduce) on whether any has work and whether to split into two micro-batches,
    and a rank with nothing to do steps with an empty batch."""

    def __init__(
        self,
        config: EngineConfig,
        model: DeepseekForCausalLM | None = None,
        ep_group: "dist.ProcessGroup | None" = None,
        ep_size: int = 1,
        placement: Placement | None = None,
        moves_group: "dist.ProcessGroup | None" = None,
    ) -> None:
        """ep_group / ep_size: the expert-parallel pool (None, 1: this engine alone);
        placement / moves_group: the pool's placement and the group that moves expert weights
        (live load balancing)."""
        path = resolve_model_path(config.model)
        self.ep_group, self.ep_size = ep_group, ep_size
        self.pool_has_unfinished = False  # from the last agreement: any rank with requests
        self.last_step_tokens = 0  # tokens the last step ran (the pool's largest batch, in EP)
        self.model = model or load_model(
            path, config.torch_dtype, config.device, keep_fp8_experts=config.keep_fp8_experts
        )
        if config.speculative is not None and len(self.model.mtp) == 0:
            log.warning(
                "speculative: %s has no MTP layer (num_nextn_predict_layers 0): decoding "
                "without speculation",
                config.model,
            )
            config = dataclasses.replace(config, speculative=None)
        self.config = config
        mc = self.model.config
        self.tokenizer: Tokenizer = load_tokenizer(
            path, mc.vocab_size, mc.eos_token_id, mc.bos_token_id
        )
        self.runner = ModelRunner(config, self.model)
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching
        )
        self.max_model_len = self._max_model_len()
        self.tiers = self._tiers()
        self.scheduler = Scheduler(config, self.block_manager, self.tiers, self.max_model_len)
        self.requests: dict[str, Request] = {}
        self.stats = RankStats()  # the rank's metrics, counted on this thread
        self.comm = self.model.share_comm_stats()
        self._last_comm = (0.0, 0.0)
        self.num_steps = 0
        self.reservations = Reservations(  # decode
            self.block_manager, self.runner.kv_caches, self.stats
        )
        self.balancer: Balancer | None = None
        if ep_size > 1 and placement is not None:
            rank = dist.get_rank(ep_group) if dist.is_initialized() else 0
            self.balancer = Balancer(
                self.model, placement, ep_group, moves_group, rank, config, self.stats
            )
        if config.cuda_graph and config.speculative is not None:
            # NOTE: a verify runs k + 1 rows a request and needs the pre-norm states: the
            # graphs (one row, normed) would never serve a step
            log.warning("cuda_graph: not captured, speculative decoding runs every step eagerly")
        elif config.cuda_graph:
            self.runner.enable_graphs(self.max_model_len)
        self._rng = random.Random(config.seed)
        self._arrivals = itertools.count()
        self.num_computed_tokens = 0  # tokens run through the model (prefill + decode), lifetime
        self.num_failed = 0  # requests failed alone (their rows raised), lifetime
        # speculative decoding, lifetime: verifies (a request's step with drafts), the drafts
        # they checked, and of them the accepted
        self.num_spec_verifies = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        # The requests of the step being run (empty between steps): if the step raises and the
        # engine stops, these are the suspects (RankStopped.suspects).
        self._stepping: list[Request] = []

    def _tiers(self) -> TierLink | None:
        """The KV tiers below the paged cache, keyed by this model, dtype, block size and layer
        count (None when config.kv_tiers is)."""
        if self.config.kv_tiers is None:
            return None
        caches = self.runner.kv_caches
        space = KeySpace(
            model_fingerprint(self.model.config, self.config.model),
            str(caches[0].dtype).removeprefix("torch."),
            self.config.block_size,
            len(caches),
        )
        return TierLink(self.config.kv_tiers, space, self.block_manager, caches)

    def close(self, timeout_s: float = 10.0) -> None:
        """An orderly stop: the tiers write what is queued (at most timeout_s)."""
        if self.tiers is not None:
            self.tiers.close(timeout_s)

    def _max_model_len(self) -> int:
        """The context limit: the config's or the model's, lowered (with a warning) to what this
        rank's KV cache holds, so that one request alone always fits and preemption cannot
        livelock."""
        trained = self.model.config.max_position_embeddings
        wanted = self.config.max_model_len or trained
        if wanted > trained:
            raise ValueError(
                f"engine option max_model_len: {wanted} is more than the model's "
                f"max_position_embeddings ({trained})"
            )
        capacity = self.block_manager.num_blocks * self.config.block_size
        if wanted > capacity:
            log.warning(
                "max_model_len lowered from %d to %d: the KV cache holds %d blocks of %d tokens "
                "(raise kv_cache_bytes for longer requests)",
                wanted,
                capacity,
                self.block_manager.num_blocks,
                self.config.block_size,
            )
            return capacity
        return wanted

    # ---- requests ----

    @property
    def prompt_limits(self) -> PromptLimits:
        return PromptLimits(
            self.model.config.vocab_size,
            self.max_model_len,
            self.config.block_size,
            self.block_manager.num_blocks,
        )

    def validate_prompt(self, prompt: str | list[int]) -> list[int]:
        """-> token ids, or ValueError saying what to fix."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        return check_prompt(ids, self.prompt_limits)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        seed: int | None = None,
        prefill_only: bool = False,
        resume: Resume | None = None,
    ) -> Request:
        """Queue a request. seed: overrides params.seed (the router resolves it); prefill_only:
        stop after the first token and export the prompt's KV (a prefill rank's job); resume:
        the output the client already has (a request resumed after a rank failure).

        NOTE: everything is validated again here, on the rank (ValueError), whatever the router
        checked: the params are copied (the copy runs SamplingParams' checks, which fields set
        after construction skipped), so no value reaches a tensor unchecked."""
        self._check_new_id(request_id)
        params = _checked(params or SamplingParams())
        ids = self.validate_prompt(prompt)
        if seed is None:
            seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        _check_seed(seed)
        req = Request(
            request_id, ids, params, seed, next(self._arrivals), prefill_only=prefill_only
        )
        if resume is not None:
            self._check_resume(ids, params, resume)
            req.resume_from(resume)
        self.requests[request_id] = req
        self.scheduler.add(req)
        return req

    def _check_resume(self, prompt: list[int], params: SamplingParams, resume: Resume) -> None:
        if len(resume.token_ids) >= params.max_tokens:
            raise ValueError(
                f"a resumed request has {len(resume.token_ids)} of its {params.max_tokens} "
                "tokens already: nothing is left to generate"
            )
        check_prompt(prompt + list(resume.token_ids), self.prompt_limits)

    def abort_request(self, request_id: str) -> RequestOutput | None:
        """End a request however far it got (queued, running, or holding a reservation)."""
        self.reservations.release(request_id)
        req = self.requests.pop(request_id, None)
        if req is None or req.is_finished:
            return None
        self.scheduler.finish(req, "abort")
        return req.take_delta()

    # ---- disaggregation: the decode side ----

    def reserve(self, request_id: str, prompt_token_ids: list[int], deadline: float) -> bool:
        """Hold KV blocks for a prompt whose KV a prefill rank will send, so it never arrives to
        a full cache. False when there is no room now. Released by start_prefilled, abort, or
        after `deadline` (time.monotonic()). ValueError for token ids outside the vocabulary or
        the context."""
        self._check_new_id(request_id)
        check_prompt(prompt_token_ids, self.prompt_limits)
        return self.reservations.reserve(request_id, prompt_token_ids, deadline)

    def start_prefilled(
        self, request: GenerateRequest, first: RequestOutput, kv: KVPayload
    ) -> Request:
        """Continue a request a prefill rank started: import its prompt KV into the reserved
        blocks and join the running batch with its first token. ValueError (the reservation
        released) for a request that does not pass the checks of add_request."""
        try:
            request = dataclasses.replace(request, params=_checked(request.params))
            _check_seed(request.seed)
            check_prompt(request.known_token_ids, self.prompt_limits)
            vocab = self.prompt_limits.vocab_size
            if not all(isinstance(t, int) and 0 <= t < vocab for t in first.token_ids):
                raise ValueError(f"first token ids {first.token_ids!r} are outside [0, {vocab})")
        except ValueError:
            self.reservations.release(request.request_id)
            raise
        req = self.reservations.start(request, first, kv, next(self._arrivals), self.tokenizer)
        self.requests[req.request_id] = req
        self.scheduler.admit_running(req)
        return req

    def _check_new_id(self, request_id: str) -> None:
        if request_id in self.requests or request_id in self.reservations:
            raise ValueError(f"request id {request_id!r} is already in use")

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # ---- the loop ----

    def step(self) -> StepResult:
        started = time.perf_counter()
        self.num_steps += 1
        batch = self.scheduler.schedule()
        self.last_step_tokens = sum(batch.num_new_tokens)
        if self.ep_size == 1:
            if batch.is_empty:
                return StepResult()
            self._stepping = batch.requests
            sampled = self.runner.run(batch.requests, batch.num_new_tokens, False, batch.speculate)
            result = self.postprocess(batch, sampled)
            self._stepping = []
            self._offer_filled()
            self._record_step(started, batch, None)
            return result
        num_tokens = sum(batch.num_new_tokens)
        # NOTE: every rank of the pool reaches this all-reduce once per step, work or not.
        balance = self.balancer.flags() if self.balancer is not None else [0, 0]
        flags = torch.tensor(
            [num_tokens, self.scheduler.num_unfinished, *balance], device=self.config.device
        )
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.ep_group)
        max_tokens, max_unfinished, rebalance, busy = flags.tolist()
        self.pool_has_unfinished = max_unfinished > 0
        self.last_step_tokens = max_tokens
        if self.balancer is not None:  # a plan or a switch: the same step on every rank
            self.balancer.on_agreement(bool(rebalance), bool(busy))
        if max_tokens == 0:
            return StepResult()
        mode = self.config.two_batch_overlap
        split = mode == "on" or (mode == "auto" and max_tokens >= self.config.tbo_min_tokens)
        # NOTE: set after the agreement: a rank whose all-reduce fails (a peer died) has no
        # suspects of its own.
        self._stepping = batch.requests
        sampled = self.runner.run(batch.requests, batch.num_new_tokens, split, batch.speculate)
        result = self.postprocess(batch, sampled) if batch.requests else StepResult()
        self._stepping = []
        self._offer_filled()
        self._record_step(started, batch, split)
        return result

    def _offer_filled(self) -> None:
        """Write-back: the blocks this step filled go to the tiers (copied now, written by the
        store's thread), before the next schedule can reuse them."""
        if self.tiers is not None:
            self.tiers.offer_filled()

    def suspects(self) -> tuple[str, ...]:
        """The ids of the requests in the step that is running, or that raised (none between
        steps): read when the step's exception stopped the engine."""
        return tuple(r.request_id for r in self._stepping)


def _checked(params: SamplingParams) -> SamplingParams:
    """A validated copy (dataclasses.replace runs __post_init__ again); ValueError if invalid."""
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
    return dataclasses.replace(params)


def _check_seed(seed: object) -> None:
    if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < MAX_SEED:
        raise ValueError(f"seed must be an int in [0, 2**63), got {type(seed).__name__}")
