"""Cluster: Ray, the prefill and decode pools, and the gRPC router, started and stopped together."""

import asyncio
import logging
import os
import time

import ray

from cluster.config import ClusterConfig
from cluster.handles import DecodeHandle, PrefillHandle
from cluster.pool import Pool
from engine.model_info import build_model_info
from engine.tokenizer import load_tokenizer
from moe.config import ModelConfig
from moe.loader import resolve_model_path
from router.admission import AdmissionConfig
from router.cluster_backend import ClusterBackend, RoutingConfig
from router.server import RouterServer, serve

log = logging.getLogger(__name__)


class Cluster:
    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.pools: dict[str, Pool] = {}
        self.server: RouterServer | None = None
        self.backend: ClusterBackend | None = None
        self._owns_ray = False

    @property
    def address(self) -> str:
        assert self.server is not None
        return self.server.address

    def start(self) -> "Cluster":
        """Start (or join) Ray, start both pools, open the router; returns once both pools are
        ready and the health service says SERVING. Raises (after cleaning up) on failure."""
        c = self.config
        try:
            started = time.monotonic()
            self.start_ray()
            path = resolve_model_path(c.model)  # presets are written before the ranks race
            mc = ModelConfig.from_file(path)
            self.pools = {name: Pool(name, c) for name in ("prefill", "decode")}
            self.backend = ClusterBackend(
                [PrefillHandle(a) for a in self.pools["prefill"].actors],
                [
                    DecodeHandle(a, self.pools["decode"].kv_offset + i)
                    for i, a in enumerate(self.pools["decode"].actors)
                ],
                build_model_info(
                    c.model, mc, mc.max_position_embeddings, c.engine_config("decode").torch_dtype
                ),
                load_tokenizer(path, mc.vocab_size, mc.eos_token_id, mc.bos_token_id),
                c.block_size,
                RoutingConfig(kv_transfer_timeout_s=c.kv_transfer_timeout_s),
            )
            self.server = serve(
                self.backend,
                c.host,
                c.port,
                admission=AdmissionConfig(c.max_queued_requests, c.max_queued_tokens),
            )
            self.server.call(asyncio.wait_for(self._start_pools(), c.start_timeout_s))
            if not self.server.wait_ready(30):
                raise RuntimeError("the pools started but the router never became ready")
            log.info("cluster ready in %.1f s", time.monotonic() - started)
            return self
        except BaseException:
            self.shutdown()
            raise

    async def _start_pools(self) -> None:
        kv_master = None
        if self.config.kv_transport == "p2p":
            kv_master = await self.pools["prefill"].kv_master()
        await asyncio.gather(*(pool.start(kv_master) for pool in self.pools.values()))
        await self.backend.start()

    def start_ray(self) -> None:
        """Start a local Ray (or join config.ray_address); start() does this first."""
        if ray.is_initialized():
            return
        c = self.config
        if c.ray_address is None:
            # NOTE: a local Ray listens on every interface unless told otherwise; a development
            # or test cluster stays on loopback.
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
            ranks = c.prefill.num_ranks + c.decode.num_ranks
            ray.init(
                num_cpus=max(os.cpu_count() or 1, ranks * c.cpus_per_rank),
                include_dashboard=False,
                _node_ip_address="127.0.0.1",
                log_to_driver=False,
                configure_logging=False,
            )
        else:
            ray.init(address=c.ray_address, log_to_driver=False)
        self._owns_ray = True

    def shutdown(self) -> None:
        """Stop the router (in-flight requests are aborted), kill the ranks, free the placement
        groups, and stop Ray if this cluster started it. Idempotent."""
        if self.server is not None:
            if self.backend is not None:
                self.server.call(self.backend.close())
            self.server.stop(grace=1.0)
            self.server = None
        for pool in self.pools.values():
            pool.shutdown()
        self.pools = {}
        if self._owns_ray:
            ray.shutdown()
            self._owns_ray = False

    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
