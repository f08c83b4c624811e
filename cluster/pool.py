"""A worker pool on Ray: one placement group with a bundle per rank, one actor per rank, and the
ranks joined into one torch.distributed group (the pool's expert-parallel group).

Re-forming a pool (after a rank died or hung) replaces every rank: the old actors are killed,
new ones take the same bundles, and they join a new process group at a new rendezvous (a
communicator cannot be repaired in place: NCCL's cannot, and gloo's has lost a peer), loading
the experts of the current placement.
"""

import asyncio
import json
import logging
import socket
import time
import uuid
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.config import ClusterConfig
from cluster.handles import DecodeHandle, PrefillHandle
from decode_workers import DecodeWorker
from engine.messages import RankStatus
from engine.rank import RankConfig, Rendezvous
from moe.placement import Placement
from prefill_workers import PrefillWorker

log = logging.getLogger(__name__)
WORKERS = {"prefill": PrefillWorker, "decode": DecodeWorker}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Pool:
    def __init__(self, name: str, config: ClusterConfig, cluster_id: str) -> None:
        """config: resolved (ClusterConfig.resolve_gpus); cluster_id: names its rendezvous."""
        assert config.gpus_per_rank is not None, "resolve gpus_per_rank first"
        self.name, self.config, self.cluster_id = name, config, cluster_id
        pool = getattr(config, name)
        self.num_ranks = pool.num_ranks
        # Index of each rank in the cluster-wide KV transport group: prefill ranks, then decode.
        self.kv_offset = 0 if name == "prefill" else config.prefill.num_ranks
        self.generation = 0
        self.placement = load_placement(pool.placement_file, name) if pool.placement_file else None
        bundle = {"CPU": config.cpus_per_rank, **pool.resources}
        if config.gpus_per_rank:
            bundle["GPU"] = config.gpus_per_rank
        self.placement_group = placement_group(
            [bundle] * self.num_ranks, strategy="PACK", name=f"epcluster-{cluster_id}-{name}"
        )
        self.actors = self._create_actors()

    def _create_actors(self) -> list:
        c = self.config
        actor_cls = ray.remote(WORKERS[self.name])
        env = {"OMP_NUM_THREADS": str(c.torch_threads), **c.env}
        engine = c.engine_config(self.name)
        kv_world = c.prefill.num_ranks + c.decode.num_ranks
        suffix = f"-g{self.generation}" if self.generation else ""
        return [
            actor_cls.options(
                num_cpus=c.cpus_per_rank,
                num_gpus=c.gpus_per_rank,
                resources=getattr(c, self.name).resources,
                name=f"epcluster-{self.cluster_id}-{self.name}-{r}{suffix}",
                max_concurrency=1000,
                runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=r
                ),
            ).remote(
                RankConfig(
                    self.name,
                    r,
                    self.num_ranks,
                    engine,
                    c.torch_threads,
                    dist_timeout_s=c.collective_timeout_s,
                    kv_transport=c.kv_transport,
                    kv_rank=self.kv_offset + r,
                    kv_world=kv_world,
                    kv_timeout_s=c.kv_transfer_timeout_s,
                    metrics_port=c.rank_metrics_port,
                    placement=self.placement,
                )
            )
            for r in range(self.num_ranks)
        ]

    def handles(self) -> list[PrefillHandle] | list[DecodeHandle]:
        timeout = self.config.rank_call_timeout_s
        if self.name == "prefill":
            return [PrefillHandle(a, self.name, r, timeout) for r, a in enumerate(self.actors)]
        return [
            DecodeHandle(a, self.name, r, timeout, self.kv_offset + r)
            for r, a in enumerate(self.actors)
        ]

    async def rendezvous(self, group: str, owner: int = 0) -> Rendezvous:
        """A new meeting point for a group, its store on this pool's rank 0's node; owner: the
        group rank whose process hosts the store."""
        addr, port = await self.actors[0].__ray_call__.remote(_node_address_and_port)
        return Rendezvous(f"{self.cluster_id}-{group}-{uuid.uuid4().hex[:8]}", addr, port, owner)

    async def kv_master(self) -> Rendezvous:
        """The cluster-wide KV transport group's rendezvous, hosted by this pool's rank 0."""
        return await self.rendezvous("kv", owner=self.kv_offset)

    async def start(self, kv_rdzv: Rendezvous | None = None) -> list[RankStatus]:
        """Wait for the placement, form the process group, load the experts; -> per-rank
        readiness (every rank calls init at once: the group forms when all have joined)."""
        await self.placement_group.ready()
        rdzv = await self.rendezvous(f"{self.name}-g{self.generation}")
        nodes = await asyncio.gather(*(a.__ray_call__.remote(_node_address) for a in self.actors))
        started = time.monotonic()
        statuses = await asyncio.gather(
            *(a.join.remote(rdzv, kv_rdzv, node) for a, node in zip(self.actors, nodes))
        )
        for s in statuses:
            log.info(
                "%s rank %d ready (%d KV blocks) after %.1f s",
                self.name,
                s.rank,
                s.kv_total_blocks,
                time.monotonic() - started,
            )
        return statuses

    async def reform(self, kv_rdzv: Rendezvous | None = None) -> None:
        """Replace every rank: kill the old actors, start new ones in the same bundles, and
        join them at a new rendezvous."""
        self.kill_actors()
        self.generation += 1
        self.actors = self._create_actors()
        await self.start(kv_rdzv)

    def kill_actors(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)

    def shutdown(self) -> None:
        self.kill_actors()
        remove_placement_group(self.placement_group)


def load_placement(path: str, pool: str) -> dict:
    """The pool's placement from a placement file (`epcluster rebalance --save` writes one with
    an entry per pool; a file with a single placement serves any pool)."""
    data = json.loads(Path(path).read_text())
    entry = data.get(pool, data) if isinstance(data, dict) else data
    Placement.from_dict(entry)  # fails here, at start, with what is wrong
    return entry


def _node_address(_self) -> str:
    """Runs inside a rank's actor: the address its node joined Ray with (where its /metrics
    and a rendezvous store listen). NOTE: not ray.util.get_node_ip_address(), which in a worker
    may answer the machine's outside address for a Ray that runs on loopback."""
    node_id = ray.get_runtime_context().get_node_id()
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)


def _node_address_and_port(self) -> tuple[str, int]:
    """Runs inside rank 0's actor: where the pool's torch.distributed store listens."""
    return _node_address(self), _free_port()
