"""A worker pool on Ray: one placement group with a bundle per rank, one actor per rank, and the
ranks joined into one torch.distributed group (the pool's expert-parallel group)."""

import asyncio
import logging
import socket
import time

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import ClusterConfig
from decode_workers import DecodeWorker
from engine.messages import RankStatus
from engine.rank import RankConfig
from prefill_workers import PrefillWorker

log = logging.getLogger(__name__)
WORKERS = {"prefill": PrefillWorker, "decode": DecodeWorker}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Pool:
    def __init__(self, name: str, config: ClusterConfig) -> None:
        self.name, self.config = name, config
        self.num_ranks = getattr(config, name).num_ranks
        # Index of each rank in the cluster-wide KV transport group: prefill ranks, then decode.
        self.kv_offset = 0 if name == "prefill" else config.prefill.num_ranks
        kv_world = config.prefill.num_ranks + config.decode.num_ranks
        gpus = config.gpus_per_rank
        if gpus is None:
            gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
        self.gpus_per_rank = gpus
        bundle = {"CPU": config.cpus_per_rank, **({"GPU": gpus} if gpus else {})}
        self.placement_group = placement_group(
            [bundle] * self.num_ranks, strategy="PACK", name=f"epcluster-{name}"
        )
        actor_cls = ray.remote(WORKERS[name])
        env = {"OMP_NUM_THREADS": str(config.torch_threads), **config.env}
        engine = config.engine_config(name)
        self.actors = [
            actor_cls.options(
                num_cpus=config.cpus_per_rank,
                num_gpus=gpus,
                name=f"epcluster-{name}-{r}",
                max_concurrency=1000,
                runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=r
                ),
            ).remote(
                RankConfig(
                    name,
                    r,
                    self.num_ranks,
                    engine,
                    config.torch_threads,
                    kv_transport=config.kv_transport,
                    kv_rank=self.kv_offset + r,
                    kv_world=kv_world,
                )
            )
            for r in range(self.num_ranks)
        ]

    async def kv_master(self) -> tuple[str, int]:
        """An address for the cluster-wide KV transport group's store (on this pool's rank 0)."""
        return await self.actors[0].__ray_call__.remote(_node_address_and_port)

    async def start(self, kv_master: tuple[str, int] | None = None) -> list[RankStatus]:
        """Wait for the placement, form the process group, load the experts; -> per-rank
        readiness (every rank calls init at once: the group forms when all have joined)."""
        await self.placement_group.ready()
        master = await self.actors[0].__ray_call__.remote(_node_address_and_port)
        started = time.monotonic()
        statuses = await asyncio.gather(*(a.join.remote(*master, kv_master) for a in self.actors))
        for s in statuses:
            log.info(
                "%s rank %d ready (%d KV blocks) after %.1f s",
                self.name,
                s.rank,
                s.kv_total_blocks,
                time.monotonic() - started,
            )
        return statuses

    def shutdown(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        remove_placement_group(self.placement_group)


def _node_address_and_port(_self) -> tuple[str, int]:
    """Runs inside rank 0's actor: where the pool's torch.distributed store listens."""
    return ray.util.get_node_ip_address(), _free_port()
