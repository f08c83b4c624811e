"""What a prefill or a decode rank has in common, without Ray: the pool's torch.distributed group,
an expert-parallel engine running on an EngineLoop thread, and the bridge from that thread to
the asyncio loop the rank's calls arrive on. Ray actors are thin shells around subclasses."""

import abc
import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from prometheus_client import CollectorRegistry

from engine.config import EngineConfig
from engine.ep import build_ep_engine
from engine.kv_transfer import KVTransport, ObjectStoreTransport
from engine.llm_engine import LLMEngine
from engine.loop import EngineLoop
from engine.messages import RankStatus, StepResult
from engine.metrics.rank import RankCollector
from engine.metrics.server import MetricsServer, serve_metrics
from engine.metrics.tiers import tier_series
from engine.rendezvous import Rendezvous, interface_of, remove_store_files, rendezvous_store
from engine.wake import PoolWaker
from moe.placement import Placement

if TYPE_CHECKING:
    from engine.kv_p2p import TorchP2PTransport

log = logging.getLogger(__name__)


def _close_quietly(close: Callable[[], None]) -> None:
    try:
        close()
    except Exception as e:  # a group whose peers are gone may not shut down cleanly
        log.warning("closing an old KV transport group failed: %r", e)


@dataclass(frozen=True, slots=True)
class RankConfig:
    pool: str  # "prefill" | "decode"
    rank: int
    num_ranks: int
    engine: EngineConfig
    # NOTE: the names below are the cluster config's (cluster/config.py), so that one name runs
    # from the YAML to here: ray.torch_threads, ray.collective_timeout_s, routing.kv_p2p,
    # routing.kv_lease_s, ports.rank_metrics_port.
    torch_threads: int = 1  # CPU ranks share the machine's cores
    collective_timeout_s: float = 60.0  # collectives of the pool (and the p2p KV group)
    kv_p2p: bool = False  # KV goes torch.distributed point to point (else the object store)
    kv_rank: int = 0  # this rank's index in the cluster-wide KV transport group (p2p)
    kv_world: int = 1
    # a p2p KV transfer (and its turn) before it counts as failed: the decode reservation's lease
    kv_lease_s: float = 30.0
    rank_metrics_port: int | None = 0  # the first port /metrics tries (0: any free; None: off)
    placement: dict | None = None  # the expert placement to start with (Placement.to_dict)

    def __post_init__(self) -> None:
        if self.pool not in ("prefill", "decode"):
            raise ValueError(f"pool must be prefill or decode, got {self.pool!r}")
        if not 0 <= self.rank < self.num_ranks:
            raise ValueError(f"rank {self.rank} is outside a pool of {self.num_ranks}")

    @property
    def dist_backend(self) -> str:
        return "nccl" if self.engine.device.startswith("cuda") else "gloo"


class Rank(abc.ABC):
    def __init__(self, config: RankConfig, transport: KVTransport | None = None) -> None:
        """transport: how prompt KV travels (default: config.kv_p2p decides, built at join)."""
        self.config = config
        self.engine: LLMEngine | None = None
        self.loop: EngineLoop | None = None
        self._aio: asyncio.AbstractEventLoop | None = None
        self.transport: KVTransport | None = transport
        self.metrics: MetricsServer | None = None
        self.waker: PoolWaker | None = None  # an EP pool's partners wake each other
        self.rendezvous: list[Rendezvous] = []  # the groups joined: stop() removes their files

    # ---- start-up ----

    async def join(
        self, rdzv: Rendezvous, kv_rdzv: Rendezvous | None = None, node_addr: str = "127.0.0.1"
    ) -> RankStatus:
        """Join the pool's process group (every rank of the pool calls this at once), load this
        rank's experts, and start stepping."""
        self._aio = asyncio.get_running_loop()
        await asyncio.to_thread(self._join, rdzv, kv_rdzv, node_addr)
        self._serve_metrics(node_addr)
        return self.status()

    def _join(self, rdzv: Rendezvous, kv_rdzv: Rendezvous | None, node_addr: str) -> None:
        c = self.config
        torch.set_num_threads(c.torch_threads)
        # NOTE: gloo otherwise binds to the address the host name resolves to, which in
        # containers and network namespaces is often 127.0.x.1: peers on other nodes then dial
        # their own loopback. An operator's GLOO_SOCKET_IFNAME wins.
        ifname = "lo" if rdzv.addr.startswith("127.") else interface_of(node_addr)
        if ifname is not None:
            os.environ.setdefault("GLOO_SOCKET_IFNAME", ifname)
        if c.num_ranks > 1:
            store = rendezvous_store(rdzv, c.num_ranks, c.rank, c.collective_timeout_s)
            dist.init_process_group(
                c.dist_backend,
                store=store,
                rank=c.rank,
                world_size=c.num_ranks,
                timeout=timedelta(seconds=c.collective_timeout_s),
            )
            host = "127.0.0.1" if rdzv.addr.startswith("127.") else node_addr
            self.waker = PoolWaker(host, self._woken).connect(store, c.rank, c.num_ranks)
            self._joined(rdzv, c.rank)
        if self.transport is None:
            self.transport = self._p2p_transport(kv_rdzv) if c.kv_p2p else ObjectStoreTransport()
        placement = Placement.from_dict(c.placement) if c.placement else None
        self.engine = build_ep_engine(c.engine, None, c.rank, c.num_ranks, placement)
        self.loop = EngineLoop(
            self.engine,
            self._step_from_engine_thread,
            on_stop=self._stopped_on_engine_thread,
            on_work=self.waker.wake_peers if self.waker is not None else None,
        ).start()

    def _woken(self) -> None:
        """A partner rank got work while the pool rested (the waker's thread)."""
        if self.loop is not None:
            self.loop.wake()

    def _p2p_transport(self, kv_rdzv: Rendezvous | None) -> "TorchP2PTransport":
        """Join the cluster-wide group that carries KV between prefill and decode ranks."""
        from engine.kv_p2p import TorchP2PTransport

        c = self.config
        if kv_rdzv is None:
            raise ValueError("kv_p2p needs the KV group's rendezvous")
        store = rendezvous_store(kv_rdzv, c.kv_world, c.kv_rank, c.collective_timeout_s)
        # the store's port tells groups apart: a rebuilt group is a new epoch
        transport = TorchP2PTransport(
            store, c.kv_rank, c.kv_world, c.dist_backend, c.kv_lease_s, epoch=kv_rdzv.port
        )
        self._joined(kv_rdzv, c.kv_rank)
        return transport

    def _joined(self, rdzv: Rendezvous, rank: int) -> None:
        """A group formed: its owner removes the files of the group's earlier formings (their
        ranks were killed, or left them); stop() removes this one's."""
        self.rendezvous.append(rdzv)
        if rank == rdzv.owner:
            remove_store_files(rdzv, earlier_only=True)

    async def rejoin_kv(self, kv_rdzv: Rendezvous) -> None:
        """Join a new KV transport group (the old one lost a member: a pool was re-formed, or a
        transfer broke it). Every rank of both pools calls this, or joins with kv_rdzv, at
        once. The old group is closed in the background once its sends in flight are done
        (each within the transfer timeout), so no rebuild leaks its thread and links."""
        new = await asyncio.to_thread(self._p2p_transport, kv_rdzv)
        old, self.transport = self.transport, new
        close = getattr(old, "close", None)
        if close is not None:
            threading.Thread(target=_close_quietly, args=(close,), daemon=True).start()

    def stop(self, tiers_timeout_s: float = 10.0) -> None:
        """An orderly stop: the engine thread ends, then the KV tiers write what is queued (at
        most tiers_timeout_s) so a restart finds those blocks on disk."""
        if self.loop is not None:
            self.loop.stop()
        if self.waker is not None:
            self.waker.close()
        if self.engine is not None:
            self.engine.close(tiers_timeout_s)
        if self.metrics is not None:
            self.metrics.close()
        for rdzv in self.rendezvous:
            remove_store_files(rdzv)

    # ---- metrics ----

    def _serve_metrics(self, host: str) -> None:
        """/metrics on `host` (the rank's node address), from config.rank_metrics_port on: ranks
        that share a node take consecutive ports."""
        c = self.config
        if c.rank_metrics_port is None:
            return
        registry = CollectorRegistry()
        collector = RankCollector(self.engine.stats, self._gauges, c.engine.model, c.pool, c.rank)
        registry.register(collector)
        first = c.rank_metrics_port
        ports = [0] if first == 0 else list(range(first, first + 16))
        self.metrics = serve_metrics(registry, host, ports)

    def _gauges(self) -> dict[tuple[str, tuple[str, ...]], float]:
        """The rank's live state, read at scrape time (from the scraping thread)."""
        e, loop = self.engine, self.loop
        bm = e.block_manager
        return {
            ("epcluster_requests_running", ()): len(e.scheduler.running),
            ("epcluster_requests_waiting", ("capacity",)): len(e.scheduler.waiting),
            ("epcluster_requests_waiting", ("kv_reservation",)): len(e.reservations),
            ("epcluster_kv_cache_usage_ratio", ()): bm.usage,
            ("epcluster_kv_cache_blocks", ("used",)): bm.num_used_blocks,
            ("epcluster_kv_cache_blocks", ("free",)): len(bm.free_ids),
            ("epcluster_kv_cache_blocks", ("cached",)): bm.num_cached_blocks,
            ("epcluster_kv_cache_blocks", ("reserved",)): e.reservations.num_blocks,
            ("epcluster_engine_stalled_seconds", ()): loop.stalled_s() if loop else 0.0,
            ("epcluster_kernels_info", (e.runner.kernels,)): 1.0,
            ("epcluster_spec_acceptance_ratio", ()): (
                e.num_accepted_tokens / max(e.num_draft_tokens, 1)
            ),
            **self._balance_gauges(),
            **tier_series(e.kv_tier_stats()),
        }

    def _balance_gauges(self) -> dict[tuple[str, tuple[str, ...]], float]:
        balancer = self.engine.balancer
        if balancer is None:
            return {}
        mean, worst = balancer.balancedness
        return {
            ("epcluster_eplb_balancedness_ratio", ("mean",)): mean,
            ("epcluster_eplb_balancedness_ratio", ("worst",)): worst,
            ("epcluster_eplb_rebalance_in_progress", ()): float(balancer.last.moving),
        }

    # ---- calls from the asyncio side ----

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread and await its result."""
        if self.loop is None:
            raise RuntimeError(f"{self.config.pool} rank {self.config.rank} has not started")
        return await asyncio.wrap_future(self.loop.submit(fn))

    async def abort(self, request_id: str) -> None:
        await self.call(lambda e: e.abort_request(request_id))

    def request_rebalance(self) -> bool:
        """Ask the pool for an expert rebalance at its next agreed step; False when this pool
        has one rank (nothing to balance)."""
        if self.engine is None or self.engine.balancer is None:
            return False
        self.engine.balancer.request()
        return True

    async def expert_load(self) -> dict[int, tuple[list[int], list[int]]]:
        """MoE layer -> (tokens this rank routed to each physical slot, slot experts)."""
        return await self.call(lambda e: e.expert_load())

    def ready(self) -> bool:
        return self.loop is not None and self.loop.alive

    def status(self) -> RankStatus:
        c, e = self.config, self.engine
        if e is None or self.loop is None:
            return RankStatus.down(c.pool, c.rank)
        status = e.rank_status(c.pool, c.rank, self.ready())
        status.num_steps = self.loop.num_steps
        status.stalled_s = self.loop.stalled_s()
        status.num_pending = self.num_pending
        status.metrics_endpoint = self.metrics.endpoint if self.metrics else ""
        return status

    @property
    @abc.abstractmethod
    def num_pending(self) -> int:
        """Requests this rank's asyncio side is still tracking (waiting calls, owners)."""

    def debug_drop_kv_sends(self, n: int) -> None:
        """Test hook: the next n p2p KV sends of this rank are lost (never posted)."""
        self.transport.debug_drop_sends(n)

    def debug_block(self, seconds: float) -> None:
        """Test hook: the engine thread sleeps `seconds` (a hung rank, as a stuck collective
        would make it). Returns at once."""
        assert self.loop is not None
        self.loop.submit(lambda _: time.sleep(seconds))

    # ---- step results: engine thread -> asyncio loop ----

    def _step_from_engine_thread(self, result: StepResult) -> None:
        assert self._aio is not None
        self._aio.call_soon_threadsafe(self.on_step, result)

    def _stopped_on_engine_thread(self, error: BaseException | None) -> None:
        if self._aio is not None and not self._aio.is_closed():
            self._aio.call_soon_threadsafe(self.on_engine_stopped, error)

    @abc.abstractmethod
    def on_engine_stopped(self, error: BaseException | None) -> None:
        """Runs on the asyncio loop once the engine thread is gone: fail what waits on it."""

    @abc.abstractmethod
    def on_step(self, result: StepResult) -> None:
        """Runs on the asyncio loop with what one step produced; subclasses route it."""
