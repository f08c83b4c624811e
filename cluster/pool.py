"""A worker pool on Ray: one placement group with a bundle per rank, one actor per rank, and the
ranks joined into one torch.distributed group (the pool's expert-parallel group).

The actors and the placement group are detached and named by the cluster's name
(cluster/registry.py): they outlive the router that started them, and a new router attaches to
them (Pool.attach) instead of loading the model again.

Re-forming a pool (after a rank died or hung) replaces every rank: the old actors are killed,
new ones (named ...-g<generation>) take the same bundles, and they join a new process group at
a new rendezvous (a communicator cannot be repaired in place: NCCL's cannot, and gloo's has
lost a peer), loading the experts of the current placement.
"""

import asyncio
import json
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster import registry
from cluster.config import ClusterConfig
from cluster.handles import CONTROL, CONTROL_CONCURRENCY, DecodeHandle, PrefillHandle
from decode_workers import DecodeWorker
from engine.messages import RankStatus
from engine.rank import RankConfig
from engine.rendezvous import Rendezvous
from moe.placement import Placement
from prefill_workers import PrefillWorker

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RankIdentity:
    """What a running rank actor is: how an attaching router checks it serves its config."""

    config: RankConfig
    generation: int
    cluster_id: str
    pid: int
    joined: bool  # its engine runs (join returned)


class _Described:
    """The rank actors' identity call (mixed into the workers, which know nothing of Ray)."""

    config: RankConfig
    engine: object

    def _identify(self, generation: int, cluster_id: str) -> None:
        self._generation, self._cluster_id = generation, cluster_id

    def describe(self) -> RankIdentity:
        joined = self.engine is not None
        return RankIdentity(self.config, self._generation, self._cluster_id, os.getpid(), joined)


class PrefillMember(_Described, PrefillWorker):
    def __init__(self, config: RankConfig, generation: int, cluster_id: str) -> None:
        PrefillWorker.__init__(self, config)
        self._identify(generation, cluster_id)


class DecodeMember(_Described, DecodeWorker):
    def __init__(self, config: RankConfig, generation: int, cluster_id: str) -> None:
        DecodeWorker.__init__(self, config)
        self._identify(generation, cluster_id)


WORKERS = {"prefill": PrefillMember, "decode": DecodeMember}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class Pool:
    def __init__(
        self,
        name: str,
        config: ClusterConfig,
        cluster_id: str,
        entry: registry.PoolRecord | None = None,
    ) -> None:
        """config: resolved (ClusterConfig.resolve_gpus); cluster_id: names its rendezvous.
        entry: the recorded pool to attach to (its actors are looked up, not started; a missing
        one is None in .actors); None: a new pool (placement group and actors started)."""
        assert config.ray.gpus_per_rank is not None, "resolve gpus_per_rank first"
        self.name, self.config, self.cluster_id = name, config, cluster_id
        self.prefix = registry.actor_prefix(config.ray.cluster_name, name)
        pool = getattr(config, name)
        self.num_ranks = pool.num_ranks
        # Index of each rank in the cluster-wide KV transport group: prefill ranks, then decode.
        self.kv_offset = 0 if name == "prefill" else config.prefill.num_ranks
        self.placement = load_placement(pool.placement_file, name) if pool.placement_file else None
        pg = registry.placement_group_of(entry) if entry is not None else None
        if entry is not None and pg is not None:
            self.generation, self.placement_group = entry.generation, pg
            self.actors = [registry.find_actor(n) for n in entry.actors]
            self.actors += [None] * (self.num_ranks - len(self.actors))
            self.created = False
            return
        self.created = True  # new actors: start() joins them
        self.generation = -1 if entry is None else entry.generation
        bundle = {"CPU": config.ray.cpus_per_rank, **pool.resources}
        if config.ray.gpus_per_rank:
            bundle["GPU"] = config.ray.gpus_per_rank
        self.placement_group = placement_group(
            [bundle] * self.num_ranks, strategy="PACK", name=self.prefix, lifetime="detached"
        )
        self.actors = []
        self.replace_actors()

    def rank_config(self, r: int) -> RankConfig:
        c = self.config
        return RankConfig(
            self.name,
            r,
            self.num_ranks,
            c.engine_config(self.name),
            c.ray.torch_threads,
            collective_timeout_s=c.ray.collective_timeout_s,
            kv_p2p=c.routing.kv_p2p,
            kv_rank=self.kv_offset + r,
            kv_world=c.prefill.num_ranks + c.decode.num_ranks,
            kv_lease_s=c.routing.kv_lease_s,
            rank_metrics_port=c.ports.rank_metrics_port,
            placement=self.placement,
        )

    def actor_name(self, r: int) -> str:
        suffix = f"-g{self.generation}" if self.generation else ""
        return f"{self.prefix}-{r}{suffix}"

    def _create_actors(self) -> list:
        c = self.config.ray
        # NOTE: concurrency groups are a class option (Ray refuses them in .options())
        actor_cls = ray.remote(concurrency_groups={CONTROL: CONTROL_CONCURRENCY})(
            WORKERS[self.name]
        )
        env = {"OMP_NUM_THREADS": str(c.torch_threads), **c.env}
        return [
            actor_cls.options(
                num_cpus=c.cpus_per_rank,
                num_gpus=c.gpus_per_rank,
                resources=getattr(self.config, self.name).resources,
                name=self.actor_name(r),
                namespace=registry.NAMESPACE,
                lifetime="detached",  # a router that dies leaves the ranks serving
                max_concurrency=1000,
                runtime_env={"env_vars": env},
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    self.placement_group, placement_group_bundle_index=r
                ),
            ).remote(self.rank_config(r), self.generation, self.cluster_id)
            for r in range(self.num_ranks)
        ]

    def record(self) -> registry.PoolRecord:
        """This pool as the registry keeps it (written once it has formed)."""
        names = [self.actor_name(r) for r in range(self.num_ranks)]
        return registry.PoolRecord(self.generation, self.placement_group.id.hex(), names)

    def handles(self) -> list[PrefillHandle] | list[DecodeHandle]:
        calls = self.config.calls
        timeout = calls.rank_call_timeout_s
        if self.name == "prefill":
            return [PrefillHandle(a, self.name, r, timeout) for r, a in enumerate(self.actors)]
        return [
            DecodeHandle(a, self.name, r, timeout, self.kv_offset + r, calls.kv_start_timeout_s)
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
        """Wait for the placement (at most start_timeout_s: a bundle Ray cannot place, e.g. its
        node is gone, would wait forever), form the process group, load the experts; -> per-rank
        readiness (every rank calls init at once: the group forms when all have joined)."""
        wait = self.config.ray.start_timeout_s
        try:
            await asyncio.wait_for(self.placement_group.ready(), wait)
        except TimeoutError:
            raise TimeoutError(
                f"the {self.name} pool's {self.num_ranks} bundles were not placed in {wait:.0f} s: "
                "the Ray cluster lacks the resources (`ray status` shows what is pending)"
            ) from None
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
        """Replace every rank and join the new ones at a new rendezvous. The caller bounds it
        (Cluster.reform: start_timeout_s)."""
        self.replace_actors()
        await self.start(kv_rdzv)

    def replace_actors(self) -> None:
        """Kill the pool's actors (and any stray of another generation: a router that died
        mid-re-form leaves some), start the next generation's in the same bundles (not joined
        yet: start() does that), and record them."""
        strays = registry.pool_actors(self.config.ray.cluster_name, self.name)
        self.kill_actors()
        for actor in strays.values():
            ray.kill(actor, no_restart=True)
        seen = [registry.generation_of(n) for n in strays]
        self.generation = max([self.generation, *seen]) + 1
        self.actors = self._create_actors()
        cluster_name = self.config.ray.cluster_name
        registry.update_pool(cluster_name, self.cluster_id, self.name, self.record())

    def kill_actors(self) -> None:
        for actor in self.actors:
            if actor is not None:
                ray.kill(actor, no_restart=True)

    def stop_actors(self) -> None:
        """An orderly removal: every rank stops (its KV tiers write what is queued), then is
        killed (registry.stop_and_kill). A re-form kills without it: its ranks died or hung."""
        registry.stop_and_kill([a for a in self.actors if a is not None], self.name)

    def shutdown(self) -> None:
        """Remove the pool for good: its actors (stopped first) and its placement group."""
        self.stop_actors()
        remove_placement_group(self.placement_group)


def identity_mismatch(pool: Pool, r: int, identity: RankIdentity) -> list[str]:
    """How a running rank differs from what `pool`'s config would start (empty: it matches);
    the placement, timeouts and ports may differ (a rebalance moves experts)."""
    want, got = pool.rank_config(r), identity.config
    diffs = [
        f"{field}: running {getattr(got, field)!r}, config {getattr(want, field)!r}"
        for field in ("pool", "rank", "num_ranks", "torch_threads", "kv_p2p", "kv_world")
        if getattr(got, field) != getattr(want, field)
    ]
    diffs += [
        f"{field}: running {getattr(got.engine, field)!r}, config {getattr(want.engine, field)!r}"
        for field in want.engine.__dataclass_fields__
        if getattr(got.engine, field) != getattr(want.engine, field)
    ]
    if identity.generation != pool.generation:
        diffs.append(f"generation: running {identity.generation}, recorded {pool.generation}")
    if identity.cluster_id != pool.cluster_id:
        diffs.append(f"cluster id: running {identity.cluster_id}, recorded {pool.cluster_id}")
    return diffs


def load_placement(path: str, pool: str) -> dict:
    """The pool's placement from a placement file (`epcluster rebalance --save` writes one with
    an entry per pool; a file with a single placement serves any pool)."""
    data = json.loads(Path(path).read_text())
    entry = data.get(pool, data) if isinstance(data, dict) else data
    Placement.from_dict(entry)  # fails here, at start, with what is wrong
    return entry


def _node_address(_self: PrefillMember | DecodeMember) -> str:
    """Runs inside a rank's actor: the address its node joined Ray with (where its /metrics
    and a rendezvous store listen). NOTE: not ray.util.get_node_ip_address(), which in a worker
    may answer the machine's outside address for a Ray that runs on loopback."""
    node_id = ray.get_runtime_context().get_node_id()
    return next(n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id)


def _node_address_and_port(self) -> tuple[str, int]:
    """Runs inside rank 0's actor: where the pool's torch.distributed store listens."""
    return _node_address(self), _free_port()
