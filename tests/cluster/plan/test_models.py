"""Models as data: published configs and checkpoints count what the module tree holds."""

import pytest
import torch

from cluster.plan.models import load_model, model_names
from moe.model import DeepseekForCausalLM
from moe.presets import TRAINED


def _meta_params(model) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in DeepseekForCausalLM(model.config).parameters())


@pytest.mark.parametrize("name", ["deepseek-v2-lite", "tiny-random"])
def test_counts_match_the_module_tree(name):
    m = load_model(name)
    assert m.total_params == _meta_params(m)


def test_published_models():
    v3, lite = load_model("deepseek-v3"), load_model("deepseek-v2-lite")
    assert round(v3.total_params / 1e9) == 671 and v3.mtp_layers == 1
    assert round(v3.active_params / 1e9, 1) == 36.6  # 37B with the embedding row
    assert round(lite.total_params / 1e9, 1) == 15.7 and lite.config.q_lora_rank is None
    assert v3.kv_bytes_per_token(2) == 576 * 61 * 2


def test_a_checkpoint_directory_and_errors():
    by_path = load_model(str(TRAINED["tiny"]))
    assert by_path.config == load_model("tiny").config
    assert {"small", "tiny", "deepseek-v3"} <= set(model_names())
    with pytest.raises(ValueError, match="no such path"):
        load_model("no-such-model")
