"""Protobuf <-> engine dataclasses for the operator's calls: model info, cluster status, the
experts' load and rebalancing (router/api/convert.py converts the Generate path). Nothing here
does I/O."""

from engine.messages import (
    ClusterStatus,
    ModelInfo,
    PoolLoad,
    PoolStatus,
    RankStatus,
    RebalanceStatus,
)
from router.proto import epcluster_pb2 as pb

# ---- model info and cluster status ----


def model_info_to_proto(info: ModelInfo) -> pb.ModelInfo:
    msg = pb.ModelInfo(
        model=info.model,
        model_type=info.model_type,
        vocab_size=info.vocab_size,
        max_model_len=info.max_model_len,
        num_layers=info.num_layers,
        num_routed_experts=info.num_routed_experts,
        experts_per_token=info.experts_per_token,
        kv_bytes_per_token=info.kv_bytes_per_token,
        kernels=info.kernels,
    )
    if info.eos_token_id is not None:
        msg.eos_token_id = info.eos_token_id
    return msg


def model_info_from_proto(msg: pb.ModelInfo) -> ModelInfo:
    return ModelInfo(
        model=msg.model,
        model_type=msg.model_type,
        vocab_size=msg.vocab_size,
        max_model_len=msg.max_model_len,
        num_layers=msg.num_layers,
        num_routed_experts=msg.num_routed_experts,
        experts_per_token=msg.experts_per_token,
        eos_token_id=msg.eos_token_id if msg.HasField("eos_token_id") else None,
        kv_bytes_per_token=msg.kv_bytes_per_token,
        kernels=msg.kernels,
    )


def cluster_status_to_proto(status: ClusterStatus) -> pb.ClusterStatus:
    """The expert placement summary keeps, per pool, the first MoE layer any rank reports."""
    msg = pb.ClusterStatus(
        queue_depth=status.num_queued,
        queued_prompt_tokens=status.num_queued_tokens,
        in_flight=status.num_in_flight,
    )
    for pool in status.pools:
        pool_msg = msg.pools.add(name=pool.name)
        for r in pool.ranks:
            pool_msg.ranks.add(
                rank=r.rank,
                ready=r.ready,
                num_running=r.num_running,
                num_waiting=r.num_waiting,
                kv_used_blocks=r.kv_used_blocks,
                kv_total_blocks=r.kv_total_blocks,
                kv_cached_blocks=r.kv_cached_blocks,
                kv_usage=r.kv_usage,
                num_reserved=r.num_reserved,
                block_size=r.block_size,
                max_model_len=r.max_model_len,
                num_steps=r.num_steps,
                stalled_s=r.stalled_s,
                num_pending=r.num_pending,
                metrics_endpoint=r.metrics_endpoint,
                rebalance=rebalance_to_proto(r.rebalance) if r.rebalance else None,
                spec_verifies=r.spec_verifies,
                spec_draft_tokens=r.spec_draft_tokens,
                spec_accepted_tokens=r.spec_accepted_tokens,
            )
        layers = [layer for r in pool.ranks for layer in r.expert_ids]
        if not layers:
            continue
        placement = msg.placement.add(pool=pool.name, layer=min(layers))
        for r in pool.ranks:
            ids = r.expert_ids.get(placement.layer, [])
            placement.ranks.add(rank=r.rank, num_slots=len(ids), expert_ids=ids)
    return msg


def cluster_status_from_proto(msg: pb.ClusterStatus) -> ClusterStatus:
    """Inverse of cluster_status_to_proto; each rank's expert_ids holds the summary's layer."""
    experts = {
        (p.pool, r.rank): {p.layer: list(r.expert_ids)} for p in msg.placement for r in p.ranks
    }
    pools = [
        PoolStatus(
            pool.name,
            [
                RankStatus(
                    pool=pool.name,
                    rank=r.rank,
                    ready=r.ready,
                    num_running=r.num_running,
                    num_waiting=r.num_waiting,
                    kv_used_blocks=r.kv_used_blocks,
                    kv_total_blocks=r.kv_total_blocks,
                    kv_cached_blocks=r.kv_cached_blocks,
                    num_reserved=r.num_reserved,
                    block_size=r.block_size,
                    expert_ids=experts.get((pool.name, r.rank), {}),
                    max_model_len=r.max_model_len,
                    num_steps=r.num_steps,
                    stalled_s=r.stalled_s,
                    num_pending=r.num_pending,
                    metrics_endpoint=r.metrics_endpoint,
                    rebalance=(
                        rebalance_from_proto(r.rebalance) if r.HasField("rebalance") else None
                    ),
                    spec_verifies=r.spec_verifies,
                    spec_draft_tokens=r.spec_draft_tokens,
                    spec_accepted_tokens=r.spec_accepted_tokens,
                )
                for r in pool.ranks
            ],
        )
        for pool in msg.pools
    ]
    return ClusterStatus(
        pools=pools,
        num_in_flight=msg.in_flight,
        num_queued=msg.queue_depth,
        num_queued_tokens=msg.queued_prompt_tokens,
    )


# ---- expert load ----


def expert_load_to_proto(pools: list[PoolLoad]) -> pb.ExpertLoad:
    msg = pb.ExpertLoad()
    for pool in pools:
        pool_msg = msg.pools.add(
            pool=pool.pool, num_ranks=pool.num_ranks, num_experts=pool.num_experts
        )
        for layer, (tokens, experts) in sorted(pool.layers.items()):
            pool_msg.layers.add(layer=layer, slot_tokens=tokens, slot_experts=experts)
    return msg


def expert_load_from_proto(msg: pb.ExpertLoad) -> list[PoolLoad]:
    return [
        PoolLoad(
            p.pool,
            p.num_ranks,
            p.num_experts,
            {ll.layer: (list(ll.slot_tokens), list(ll.slot_experts)) for ll in p.layers},
        )
        for p in msg.pools
    ]


# ---- expert rebalancing ----

_REBALANCE_FIELDS = (
    "number",
    "outcome",
    "moving",
    "balancedness_before",
    "balancedness_after",
    "slots_moved",
    "layers_moved",
    "duration_s",
    "longest_pause_s",
    "from_checkpoint",
)


def rebalance_to_proto(status: RebalanceStatus) -> pb.RebalanceStatus:
    return pb.RebalanceStatus(**{f: getattr(status, f) for f in _REBALANCE_FIELDS})


def rebalance_from_proto(msg: pb.RebalanceStatus) -> RebalanceStatus:
    return RebalanceStatus(**{f: getattr(msg, f) for f in _REBALANCE_FIELDS})


def rebalance_response_to_proto(results: list[tuple[str, RebalanceStatus]]) -> pb.RebalanceResponse:
    msg = pb.RebalanceResponse()
    for pool, status in results:
        msg.pools.add(pool=pool, status=rebalance_to_proto(status))
    return msg


def rebalance_response_from_proto(msg: pb.RebalanceResponse) -> list[tuple[str, RebalanceStatus]]:
    return [(p.pool, rebalance_from_proto(p.status)) for p in msg.pools]
