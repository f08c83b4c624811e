"""What a prefill or a decode rank has in common, without Ray: the pool's torch.distributed group,
an expert-parallel engine running on an EngineLoop thread, and the bridge from that thread to
the asyncio loop the rank's calls arrive on. Ray actors are thin shells around subclasses."""

import abc
import asyncio
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from engine.config import EngineConfig
from engine.ep import build_ep_engine
from engine.kv_transfer import KVTransport, ObjectStoreTransport
from engine.llm_engine import LLMEngine
from engine.loop import EngineLoop
from engine.messages import RankStatus, StepResult


@dataclass(frozen=True, slots=True)
class RankConfig:
    pool: str  # "prefill" | "decode"
    rank: int
    num_ranks: int
    engine: EngineConfig
    torch_threads: int = 1  # CPU ranks share the machine's cores
    dist_timeout_s: float = 600.0
    kv_transport: str = "object_store"  # or "p2p": torch.distributed point-to-point
    kv_rank: int = 0  # this rank's index in the cluster-wide KV transport group (p2p)
    kv_world: int = 1

    def __post_init__(self) -> None:
        if self.pool not in ("prefill", "decode"):
            raise ValueError(f"pool must be prefill or decode, got {self.pool!r}")
        if not 0 <= self.rank < self.num_ranks:
            raise ValueError(f"rank {self.rank} is outside a pool of {self.num_ranks}")
        if self.kv_transport not in ("object_store", "p2p"):
            raise ValueError(f"kv_transport must be object_store or p2p, got {self.kv_transport!r}")

    @property
    def dist_backend(self) -> str:
        return "nccl" if self.engine.device.startswith("cuda") else "gloo"


class Rank(abc.ABC):
    def __init__(self, config: RankConfig, transport: KVTransport | None = None) -> None:
        """transport: how prompt KV travels (default: config.kv_transport, built at join)."""
        self.config = config
        self.engine: LLMEngine | None = None
        self.loop: EngineLoop | None = None
        self._aio: asyncio.AbstractEventLoop | None = None
        self.transport: KVTransport | None = transport

    # ---- start-up ----

    async def join(
        self, master_addr: str, master_port: int, kv_master: tuple[str, int] | None = None
    ) -> RankStatus:
        """Join the pool's process group (every rank of the pool calls this at once), load this
        rank's experts, and start stepping."""
        self._aio = asyncio.get_running_loop()
        await asyncio.to_thread(self._join, master_addr, master_port, kv_master)
        return self.status()

    def _join(self, master_addr: str, master_port: int, kv_master: tuple[str, int] | None) -> None:
        c = self.config
        torch.set_num_threads(c.torch_threads)
        if c.num_ranks > 1:
            init_method = f"tcp://{master_addr}:{master_port}"
            if master_addr.startswith("127."):
                # One machine: a file store (a TCP store would listen on every interface) and
                # gloo on loopback.
                init_method = f"file://{tempfile.gettempdir()}/epcluster-{c.pool}-{master_port}"
                os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
            dist.init_process_group(
                c.dist_backend,
                init_method=init_method,
                rank=c.rank,
                world_size=c.num_ranks,
                timeout=timedelta(seconds=c.dist_timeout_s),
            )
        if self.transport is None:
            p2p = c.kv_transport == "p2p"
            self.transport = self._p2p_transport(kv_master) if p2p else ObjectStoreTransport()
        self.engine = build_ep_engine(c.engine, None, c.rank, c.num_ranks)
        self.loop = EngineLoop(self.engine, self._step_from_engine_thread).start()

    def _p2p_transport(self, kv_master: tuple[str, int] | None):
        """Join the cluster-wide group that carries KV between prefill and decode ranks."""
        from engine.kv_p2p import TorchP2PTransport

        c = self.config
        if kv_master is None:
            raise ValueError("kv_transport p2p needs the KV group's address")
        addr, port = kv_master
        if addr.startswith("127."):  # one machine: a file store listens on no port
            store = dist.FileStore(f"{tempfile.gettempdir()}/epcluster-kv-{port}", c.kv_world)
        else:
            store = dist.TCPStore(
                addr,
                port,
                c.kv_world,
                is_master=c.kv_rank == 0,
                timeout=timedelta(seconds=c.dist_timeout_s),
            )
        return TorchP2PTransport(store, c.kv_rank, c.kv_world, c.dist_backend)

    def stop(self) -> None:
        if self.loop is not None:
            self.loop.stop()

    # ---- calls from the asyncio side ----

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) on the engine thread and await its result."""
        if self.loop is None:
            raise RuntimeError(f"{self.config.pool} rank {self.config.rank} has not started")
        return await asyncio.wrap_future(self.loop.submit(fn))

    async def abort(self, request_id: str) -> None:
        await self.call(lambda e: e.abort_request(request_id))

    def ready(self) -> bool:
        return self.loop is not None and self.loop.alive

    def status(self) -> RankStatus:
        c, e = self.config, self.engine
        if e is None:
            return RankStatus(c.pool, c.rank, False, 0, 0, 0, 0)
        return e.rank_status(c.pool, c.rank, self.ready())

    # ---- step results: engine thread -> asyncio loop ----

    def _step_from_engine_thread(self, result: StepResult) -> None:
        assert self._aio is not None
        self._aio.call_soon_threadsafe(self.on_step, result)

    @abc.abstractmethod
    def on_step(self, result: StepResult) -> None:
        """Runs on the asyncio loop with what one step produced; subclasses route it."""
