"""Routing statistics -> the EPLB imbalance the cost model pays."""

import json

import pytest
import torch

from cluster.cli import main
from cluster.plan.hardware import CATALOG
from cluster.plan.models import load_model
from cluster.plan.planner import ModelCosts
from cluster.plan.routing import eplb_imbalance, load_expert_tokens


def test_imbalance_by_hand():
    """Loads 4, 1, 1, 1 on 2 ranks of 2 slots: heaviest first onto the lightest rank with room
    gives 4 + 1 and 1 + 1: max / mean = 5 / 3.5. Two redundant slots go to the hot expert
    (3 replicas of 4/3), 3 slots a rank: 4/3 + 4/3 + 1 and 4/3 + 1 + 1, 11/3 / 3.5."""
    w = torch.tensor([[4.0, 1, 1, 1]])
    assert eplb_imbalance(w, 2, 0, 1, 2) == pytest.approx(5 / 3.5)
    assert eplb_imbalance(w, 2, 2, 1, 2) == pytest.approx((11 / 3) / 3.5)
    assert eplb_imbalance(torch.ones(3, 8), 4, 0, 1, 8) == pytest.approx(1.0)
    assert eplb_imbalance(w, 1, 0, 1, 8) == 1.0


def test_load_file(tmp_path):
    path = tmp_path / "load.json"
    path.write_text(json.dumps({"tokens_per_expert": [1, 2, 3, 4]}))
    assert load_expert_tokens(path, 4).shape == (1, 4)
    path.write_text(json.dumps([[1, 2, 3]]))
    with pytest.raises(ValueError, match=r"\[layers\]\[4\]"):
        load_expert_tokens(path, 4)


def test_skewed_routing_slows_the_step(tmp_path, capsys):
    """`small` (32 experts) on EP8 of H100s: an even load costs imbalance 1 (below the assumed
    1.05), a skewed one (half the tokens on 2 experts) more, and the step with it."""
    model, hw = load_model("small"), CATALOG["H100"]
    even = ModelCosts(model, hw, expert_tokens=torch.ones(7, 32))
    hot = torch.ones(7, 32)
    hot[:, :2] = 15.0
    skewed = ModelCosts(model, hw, expert_tokens=hot)
    assert even.unit(8).imbalance == 1.0
    redundant = even.unit(8).redundant_experts
    assert skewed.unit(8).imbalance == pytest.approx(eplb_imbalance(hot, 8, redundant, 4, 8))
    assert skewed.unit(8).imbalance > 1.05
    assert skewed.prefill_s(8, 4096, 32, 0.0) > even.prefill_s(8, 4096, 32, 0.0)
    path = tmp_path / "load.json"
    path.write_text(json.dumps({"tokens_per_expert": hot.tolist()}))
    args = ["plan", "--model", "small", "--gpu", "H100", "--workload", "chat-small"]
    assert main([*args, "--expert-load", str(path), "--samples", "1000", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["decode_nodes"] >= 1
