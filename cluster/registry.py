"""Where a cluster's pools are found again: the rank actors and placement groups are detached
and named by the cluster's name (ClusterConfig.cluster_name) in the Ray namespace NAMESPACE, and a
record in the GCS's key-value store (ray.experimental.internal_kv) names each pool's current
generation, its actors and its placement group. A router that starts on a Ray cluster where the
record exists attaches to those ranks instead of starting new ones (cluster/launcher.py);
`epcluster stop` removes them for good (remove_pools).

Why a record and not only the names: a pool that was re-formed has actors named ...-g<N>, and
a router that died in the middle of a re-form leaves half a generation behind. The record is
written whenever a generation's actors are created (before they join: a rank that never joined
tells so through its describe() call), so it always names the pool's placement group; the
strays of another generation are found by their names (pool_actors) and killed before the next
forming.
"""

import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import ray
from ray.actor import ActorHandle
from ray.experimental import internal_kv
from ray.util.placement_group import PlacementGroup, remove_placement_group

log = logging.getLogger(__name__)

NAMESPACE = "epcluster"  # every named actor of every epcluster cluster on a Ray cluster
POOLS = ("prefill", "decode")
STOP_TIMEOUT_S = 10.0  # a rank's orderly stop: its KV tiers' queued writes (Rank.stop)
STOP_GRACE_S = 5.0  # over that, for the stop call itself


@dataclass(frozen=True, slots=True)
class PoolRecord:
    """One pool as the record holds it."""

    generation: int
    placement_group: str  # its id, hex
    actors: list[str]  # rank i's actor name at [i]


@dataclass(frozen=True, slots=True)
class ClusterRecord:
    cluster_id: str  # names the pools' rendezvous (files and stores), unique per forming
    pools: dict[str, PoolRecord]

    def to_json(self) -> bytes:
        pools = {name: vars_of(p) for name, p in self.pools.items()}
        return json.dumps({"cluster_id": self.cluster_id, "pools": pools}).encode()

    @classmethod
    def from_json(cls, data: bytes) -> "ClusterRecord":
        raw = json.loads(data)
        return cls(raw["cluster_id"], {k: PoolRecord(**v) for k, v in raw["pools"].items()})


def vars_of(p: PoolRecord) -> dict[str, Any]:
    return {"generation": p.generation, "placement_group": p.placement_group, "actors": p.actors}


def actor_prefix(cluster_name: str, pool: str) -> str:
    return f"epcluster-{cluster_name}-{pool}"


def _key(cluster_name: str) -> str:
    return f"pools/{cluster_name}"


def read(cluster_name: str) -> ClusterRecord | None:
    """The record of `cluster_name`'s pools on the connected Ray cluster, None if none."""
    data = internal_kv._internal_kv_get(_key(cluster_name), namespace=NAMESPACE)
    return None if data is None else ClusterRecord.from_json(data)


def write(cluster_name: str, record: ClusterRecord) -> None:
    internal_kv._internal_kv_put(_key(cluster_name), record.to_json(), namespace=NAMESPACE)


def update_pool(cluster_name: str, cluster_id: str, pool: str, entry: PoolRecord) -> None:
    """Record one pool's new generation (after it formed), keeping the other pool's entry."""
    record = read(cluster_name) or ClusterRecord(cluster_id, {})
    write(cluster_name, ClusterRecord(cluster_id, {**record.pools, pool: entry}))


def find_actor(name: str) -> Any | None:
    """The live named actor, or None (never created, killed, or its process died)."""
    try:
        return ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return None


def pool_actors(cluster_name: str, pool: str) -> dict[str, Any]:
    """Every live actor of the pool, whatever its generation: name -> handle."""
    pattern = re.compile(re.escape(actor_prefix(cluster_name, pool)) + r"-\d+(-g\d+)?")
    found = {}
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == NAMESPACE and pattern.fullmatch(entry["name"]):
            handle = find_actor(entry["name"])
            if handle is not None:
                found[entry["name"]] = handle
    return found


def generation_of(name: str) -> int:
    """The generation an actor name carries (rank actors of generation 0 have no suffix)."""
    match = re.search(r"-g(\d+)$", name)
    return int(match.group(1)) if match else 0


def placement_group_of(entry: PoolRecord) -> PlacementGroup | None:
    """The pool's placement group, None when it was removed."""
    from ray._raylet import PlacementGroupID

    pg = PlacementGroup(PlacementGroupID.from_hex(entry.placement_group))
    state = ray.util.placement_group_table(pg).get("state")
    return None if state in (None, "REMOVED") else pg


def stop_and_kill(actors: list[ActorHandle], pool: str, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """An orderly removal of rank actors: each one's stop (Rank.stop: its engine ends, its KV
    tiers write what is queued, so a restart finds those blocks on disk), at most timeout_s for
    all of them, then the kill. NOTE: ray.kill alone skips Rank.stop."""
    refs = [actor.stop.remote(timeout_s) for actor in actors]
    if refs:
        try:
            _, late = ray.wait(refs, num_returns=len(refs), timeout=timeout_s + STOP_GRACE_S)
        except Exception as e:  # a rank already gone: the kill is all there is to do
            log.warning("%s pool: stopping its ranks failed: %r", pool, e)
        else:
            if late:
                log.warning("%s pool: %d ranks did not stop in time", pool, len(late))
    for actor in actors:
        ray.kill(actor, no_restart=True)


def remove_pools(cluster_name: str) -> list[str]:
    """Kill every rank actor of the cluster, remove its placement groups and its record (for
    good: `epcluster stop`); -> what was removed, for the operator."""
    removed = []
    record = read(cluster_name)
    for pool in POOLS:
        actors = sorted(pool_actors(cluster_name, pool).items())
        stop_and_kill([actor for _, actor in actors], pool)
        removed += [f"actor {name}" for name, _ in actors]
        entry = record.pools.get(pool) if record else None
        pg = placement_group_of(entry) if entry else None
        if pg is not None:
            remove_placement_group(pg)
            removed.append(f"placement group {actor_prefix(cluster_name, pool)}")
    if record is not None:
        internal_kv._internal_kv_del(_key(cluster_name), namespace=NAMESPACE)
        removed.append(f"record {_key(cluster_name)}")
    return removed
