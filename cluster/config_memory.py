"""The memory plan before launch: each pool's rank must fit its GPU (ray.gpu_memory_bytes), or
the config is refused with the numbers before Ray starts. The bytes come from
cluster/plan/memory.py (rank_memory), the same arithmetic `epcluster plan` uses."""

import json
from dataclasses import replace
from pathlib import Path

from cluster.config_checks import ConfigError
from cluster.config_sections import PoolConfig
from cluster.plan.memory import GIB, MemoryPlan, MemoryPlanError, rank_memory
from cluster.plan.models import load_model
from engine.config import EngineConfig
from moe.placement import Placement


def checkpoint_fp8(model: str) -> bool:
    """Whether a checkpoint's weights are FP8 block-quantized, by its config.json's
    quantization_config (DeepSeek-V3's publishes {"quant_method": "fp8", ...}); presets: no."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return False
    quantization = json.loads(path.read_text()).get("quantization_config") or {}
    return quantization.get("quant_method") == "fp8"


def pool_slots(pool: str, path: str | None) -> int | None:
    """The pool's physical expert slots from its placement file (None: one per expert)."""
    if path is None:
        return None
    data = json.loads(Path(path).read_text())
    entry = data.get(pool, data) if isinstance(data, dict) else data
    return Placement.from_dict(entry).num_slots


def pool_memory(
    model: str, engine: EngineConfig, pool: str, section: PoolConfig, gpu_bytes: float
) -> MemoryPlan:
    """One rank of `pool` (its config `section`, its ranks' `engine` config) on a GPU of
    gpu_bytes: weights, KV cache, activations, headroom. Raises ConfigError naming the pool and
    the numbers when it does not fit."""
    # NOTE: a GPU's memory is given, so the ranks run on GPUs: fp8_experts "auto" keeps FP8
    engine = replace(engine, device="cuda")
    fp8 = engine.keep_fp8_experts and checkpoint_fp8(model)
    num_ranks = section.num_ranks
    try:
        return rank_memory(
            load_model(model),
            gpu_bytes,
            num_ranks,
            engine.dtype,
            fp8,
            engine.kv_cache_bytes,
            engine.max_num_batched_tokens,
            pool_slots(pool, section.placement_file),
        )
    except MemoryPlanError as e:
        raise ConfigError(
            f"{pool}: a rank does not fit its GPU (ray.gpu_memory_bytes "
            f"{gpu_bytes / GIB:.1f} GiB): {e}. Lower {pool}.engine.kv_cache_bytes or "
            f"max_num_batched_tokens, raise {pool}.num_ranks, or serve an FP8 checkpoint's "
            "experts in FP8 (engine.fp8_experts)"
        ) from e
