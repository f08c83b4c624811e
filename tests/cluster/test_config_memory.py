"""The memory plan before launch (cluster/config_memory.py): with ray.gpu_memory_bytes set, a
config whose pool cannot fit a GPU is refused while the config loads (before Ray starts), naming
the pool and the numbers; one that fits loads; without the GPU's memory nothing is checked."""

import json
from pathlib import Path

import pytest

from cluster.config import ClusterConfig
from cluster.config_checks import ConfigError
from cluster.plan.memory import GIB
from cluster.plan.models import PUBLISHED

GPU_80GB = 80_000_000_000


@pytest.fixture(scope="module")
def v3_dir(tmp_path_factory) -> Path:
    """DeepSeek-V3's config.json (no weights: the plan reads the config alone), FP8 as published."""
    path = tmp_path_factory.mktemp("DeepSeek-V3")
    fp8 = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}
    (path / "config.json").write_text(
        json.dumps({**PUBLISHED["deepseek-v3"], "quantization_config": fp8})
    )
    return path


def v3_config(model: Path, ranks: int, fp8_experts: str, gpu_bytes: int | None) -> ClusterConfig:
    return ClusterConfig.from_dict(
        {
            "model": str(model),
            "dtype": "bfloat16",
            "engine": {"kv_cache_bytes": 12 * GIB, "fp8_experts": fp8_experts},
            "prefill": {
                "num_ranks": ranks,
                "engine": {"kv_cache_bytes": 8 * GIB, "max_num_batched_tokens": 16384},
            },
            "decode": {"num_ranks": ranks},
            "ray": {"gpus_per_rank": 1, "gpu_memory_bytes": gpu_bytes},
        }
    )


def test_a_pool_that_cannot_fit_is_refused_with_its_numbers(v3_dir):
    with pytest.raises(ConfigError) as refused:
        v3_config(v3_dir, 16, "keep", GPU_80GB)
    message = str(refused.value)
    assert message.startswith(
        "prefill: a rank does not fit its GPU (ray.gpu_memory_bytes 74.5 GiB)"
    )
    for numbers in (
        "weights 69.9 GiB (replicated 31.9 + experts 38.1)",
        "activations 5.4 GiB",
        "KV 8.0 GiB",
        "of 74.5 GiB",
    ):
        assert numbers in message, (numbers, message)
    # EP32 with the experts dequantized to bf16 (38.1 GiB of them) does not fit either
    with pytest.raises(ConfigError, match=r"prefill: .*bf16 EP32 .*experts 38\.1"):
        v3_config(v3_dir, 32, "dequantize", GPU_80GB)


def test_a_pool_that_fits_is_accepted(v3_dir):
    config = v3_config(v3_dir, 32, "keep", GPU_80GB)
    assert config.ray.gpu_memory_bytes == GPU_80GB
    # auto keeps FP8 on GPUs: the same plan
    assert v3_config(v3_dir, 32, "auto", GPU_80GB).decode.num_ranks == 32


def test_no_check_without_the_gpus_memory(v3_dir):
    assert v3_config(v3_dir, 16, "keep", None).prefill.num_ranks == 16


def test_a_bad_gpu_memory_is_named():
    with pytest.raises(ConfigError, match="ray.gpu_memory_bytes must be null or > 0"):
        ClusterConfig.from_dict({"ray": {"gpu_memory_bytes": 0}})
