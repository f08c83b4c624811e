"""A router's pools at start: the ones this cluster name already runs on the Ray cluster
(attached to: checked, not reloaded) or new ones.

Attaching checks every rank's identity (RankIdentity: its rank config, generation and cluster
id) against what this router's config would start, and refuses with the differences named:
serving another model, pool size or cache layout through a router that believes otherwise would
be wrong in ways no request could tell. A pool with a rank that is gone or never joined is
re-formed (new actors in its recorded placement group) before the router serves.
"""

import logging
import time
import uuid
from dataclasses import dataclass, field

import ray
from ray.exceptions import GetTimeoutError, RayActorError

from cluster import registry
from cluster.config import ClusterConfig
from cluster.config_checks import ConfigError
from cluster.pool import Pool, RankIdentity, identity_mismatch

log = logging.getLogger(__name__)


@dataclass(slots=True)
class OpenedPools:
    cluster_id: str
    pools: dict[str, Pool]
    attached: bool  # the pools ran before this router: nothing of them was started here
    to_form: list[str] = field(default_factory=list)  # pools whose new actors must join
    identities: dict[str, list[RankIdentity]] = field(default_factory=dict)


def open_pools(config: ClusterConfig) -> OpenedPools:
    """The config's pools on the connected Ray cluster: attached to when its record exists,
    otherwise started (actors created; Cluster starts them). Raises ConfigError when the running
    pools do not match the config."""
    record = registry.read(config.ray.cluster_name)
    if record is None:
        cluster_id = uuid.uuid4().hex[:12]
        pools = {name: Pool(name, config, cluster_id) for name in registry.POOLS}
        return OpenedPools(cluster_id, pools, False, list(registry.POOLS))
    started = time.monotonic()
    opened = OpenedPools(record.cluster_id, {}, True)
    for name in registry.POOLS:
        entry = record.pools.get(name)
        if entry is not None and len(entry.actors) != getattr(config, name).num_ranks:
            raise _refuse(config, name, [f"num_ranks: running {len(entry.actors)}, config "
                                         f"{getattr(config, name).num_ranks}"])  # fmt: skip
        pool = Pool(name, config, record.cluster_id, entry)
        opened.pools[name] = pool
        if pool.created:  # not recorded, or its placement group was removed
            opened.to_form.append(name)
            continue
        why = _check(config, pool, opened)
        if why is not None:
            log.warning("the running %s pool cannot serve (%s): re-forming it", name, why)
            pool.replace_actors()
            opened.to_form.append(name)
    log.info(
        "attached to the running pools of cluster %r (prefill generation %d, decode generation "
        "%d) in %.2f s%s",
        config.ray.cluster_name,
        opened.pools["prefill"].generation,
        opened.pools["decode"].generation,
        time.monotonic() - started,
        f"; re-forming {opened.to_form}" if opened.to_form else "",
    )
    return opened


def _check(config: ClusterConfig, pool: Pool, opened: OpenedPools) -> str | None:
    """None when every rank of the attached pool runs and matches; else why it must re-form.
    Raises ConfigError on a rank that runs another config."""
    missing = [r for r, a in enumerate(pool.actors) if a is None]
    if missing:
        return f"ranks {missing} are gone"
    refs = [a.describe.remote() for a in pool.actors]
    try:
        identities: list[RankIdentity] = ray.get(refs, timeout=config.calls.rank_call_timeout_s)
    except (RayActorError, GetTimeoutError) as e:
        return f"a rank does not answer: {type(e).__name__}"
    diffs = [
        f"rank {r}: {d}" for r, i in enumerate(identities) for d in identity_mismatch(pool, r, i)
    ]
    if diffs:
        raise _refuse(config, pool.name, diffs)
    opened.identities[pool.name] = identities
    unjoined = [r for r, i in enumerate(identities) if not i.joined]
    return f"ranks {unjoined} never joined" if unjoined else None


def _refuse(config: ClusterConfig, pool: str, diffs: list[str]) -> ConfigError:
    where = config.ray.ray_address or "the local Ray"
    return ConfigError(
        f"the {pool} pool of cluster {config.ray.cluster_name!r} already runs on {where} with "
        f"another config ({'; '.join(diffs[:6])}): start this router with the config the pools "
        f"run, or remove them first (`epcluster stop --address {where} --cluster-name "
        f"{config.ray.cluster_name}`), or use another ray.cluster_name"
    )
