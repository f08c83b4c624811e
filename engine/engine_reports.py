"""What an LLMEngine reports about itself: the per-step counters of the rank's metrics, its
status for routing and GetClusterStatus, its expert load, and the no-leak check of the tests.
A mixin of LLMEngine (engine/llm_engine.py): it reads the engine's state and changes only the
metrics it keeps."""

import dataclasses
import time

from engine.balancer import Balancer
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.handoff import Reservations
from engine.kv_tiers.link import TierLink
from engine.messages import RankStatus
from engine.metrics.rank import RankStats
from engine.scheduler import ScheduledBatch, Scheduler
from moe.dispatch_handles import CommStats
from moe.model import DeepseekForCausalLM


class EngineReports:
    config: EngineConfig
    model: DeepseekForCausalLM
    block_manager: BlockManager
    scheduler: Scheduler
    reservations: Reservations
    balancer: Balancer | None
    stats: RankStats
    tiers: TierLink | None
    max_model_len: int
    num_steps: int
    num_spec_verifies: int
    num_draft_tokens: int
    num_accepted_tokens: int
    comm: CommStats
    _last_comm: tuple[float, float]

    def has_unfinished(self) -> bool: ...

    def _record_step(self, started: float, batch: ScheduledBatch, split: bool | None) -> None:
        """Counters for the rank's metrics (plain adds on this thread; read at scrape)."""
        if not self.config.metrics:
            return
        s, comm, last = self.stats, self.comm, self._last_comm
        s.observe("epcluster_step_duration_seconds", time.perf_counter() - started)
        s.observe("epcluster_step_tokens", sum(batch.num_new_tokens))
        s.observe("epcluster_step_batch_size", len(batch.requests))
        s.set("epcluster_engine_steps_total", self.num_steps)
        s.set("epcluster_preemptions_total", self.scheduler.num_preemptions)
        s.set("epcluster_prefix_cache_queries_total", self.scheduler.num_prefix_queried)
        s.set("epcluster_prefix_cache_hits_total", self.scheduler.num_prefix_hits)
        s.set("epcluster_routed_tokens_total", comm.rows)
        s.set("epcluster_spec_draft_tokens_total", self.num_draft_tokens)
        s.set("epcluster_spec_accepted_tokens_total", self.num_accepted_tokens)
        s.set("epcluster_spec_verifies_total", self.num_spec_verifies)
        if split is None:  # no expert parallelism: no all-to-all
            return
        s.inc("epcluster_tbo_steps_total", 1, "yes" if split else "no")
        s.observe("epcluster_alltoall_duration_seconds", comm.dispatch_s - last[0], "dispatch")
        s.observe("epcluster_alltoall_duration_seconds", comm.combine_s - last[1], "combine")
        self._last_comm = (comm.dispatch_s, comm.combine_s)
        s.set("epcluster_alltoall_exposed_seconds_total", comm.dispatch_wait_s, "dispatch")
        s.set("epcluster_alltoall_exposed_seconds_total", comm.combine_wait_s, "combine")
        s.set("epcluster_alltoall_bytes_total", comm.dispatch_bytes, "dispatch")
        s.set("epcluster_alltoall_bytes_total", comm.combine_bytes, "combine")

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
            len(self.reservations),
            bm.block_size,
            {
                layer: list(m.experts.expert_ids)
                for layer, m in zip(self.model.config.moe_layers, self.model.moe_layers())
            },
            max_model_len=self.max_model_len,
            kernels=self.runner.kernels,
            rebalance=dataclasses.replace(self.balancer.last) if self.balancer else None,
            spec_verifies=self.num_spec_verifies,
            spec_draft_tokens=self.num_draft_tokens,
            spec_accepted_tokens=self.num_accepted_tokens,
        )

    def expert_load(self) -> dict[int, tuple[list[int], list[int]]]:
        """MoE layer -> (tokens this rank routed to each physical slot [S], the logical expert
        in each slot [S]) since the start. One host sync: call it between steps, not per step."""
        out = {}
        for layer, moe in zip(self.model.config.moe_layers, self.model.moe_layers(), strict=True):
            d = moe.dispatcher
            experts = d.slot_experts
            load = d.load.peek()
            tokens = load.tolist() if load is not None else [0] * len(experts)
            out[layer] = (tokens, experts)
        return out

    def kv_tier_stats(self) -> dict[str, object]:
        """The KV tiers' counters, for metrics: per tier ("host", "disk") its TierStats, the
        engine's LinkStats under "link", the store's dropped offers; {} when the tiers are off."""
        if self.tiers is None:
            return {}
        store = self.tiers.store
        return {**store.stats(), "link": self.tiers.stats, "dropped_writes": store.dropped_writes}

    def assert_no_leaks(self) -> None:
        """With no request alive, every KV block is free or cached and unreferenced."""
        assert not self.has_unfinished(), "requests are still alive"
        assert not self.reservations, f"reservations still held: {self.reservations.ids()}"
        self.block_manager.assert_idle()

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions
