"""Build one rank of an expert-parallel pool: its slice of the experts, dispatch/combine over the
pool's process group, and an engine that steps in lockstep with the other ranks."""

import torch.distributed as dist

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from moe.config import ModelConfig
from moe.loader import load_model, resolve_model_path
from moe.placement import Placement


def default_placement(config: EngineConfig, num_ranks: int) -> Placement:
    """Contiguous experts per rank, no replicas."""
    mc = ModelConfig.from_file(resolve_model_path(config.model))
    return Placement.contiguous(tuple(mc.moe_layers), mc.n_routed_experts, num_ranks)


def build_ep_engine(
    config: EngineConfig,
    group: dist.ProcessGroup | None,
    rank: int,
    num_ranks: int,
    placement: Placement | None = None,
) -> LLMEngine:
    """The engine of `rank` in a pool of `num_ranks` (group: its torch.distributed group; the
    default group when None). With one rank, a plain engine."""
    if num_ranks == 1:
        return LLMEngine(config)
    placement = placement or default_placement(config, num_ranks)
    if placement.num_ranks != num_ranks:
        raise ValueError(f"placement is for {placement.num_ranks} ranks, the pool has {num_ranks}")
    model = load_model(
        resolve_model_path(config.model),
        dtype=config.torch_dtype,
        device=config.device,
        experts=placement.rank_experts(rank),
        keep_fp8_experts=config.keep_fp8_experts,
    )
    model.install_expert_parallel(group, placement, rank)
    # Expert weights of a live re-placement travel on a group of their own, beside the
    # all-to-alls (every rank of the pool creates it here, in the same order).
    moves_group = dist.new_group(dist.get_process_group_ranks(group or dist.group.WORLD))
    return LLMEngine(config, model, group, num_ranks, placement, moves_group)
