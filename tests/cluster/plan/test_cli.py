"""`epcluster plan`: the JSON keys, the table, workloads from files, a refusal."""

import json
import re

import pytest

from cluster.cli import main
from cluster.plan.workload import load_workload

KEYS = {
    "prefill_tokens_per_s_per_node", "decode_tokens_per_s_per_node", "ttft_s", "tpot_s",
    "prefill_nodes", "decode_nodes", "cost_per_day_usd", "cost_per_million_input_tokens_usd",
    "cost_per_million_output_tokens_usd", "roofline", "memory_gib",
}  # fmt: skip


def test_json_keys(capsys):
    args = ["plan", "--model", "small", "--gpu", "H100", "--workload", "chat-small"]
    assert main([*args, "--rate", "200", "--samples", "2000", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert KEYS <= set(out)
    assert out["prefill_nodes"] >= 1 and out["decode_nodes"] >= 1
    # 200 req/s x 128 output tokens spread over the decode nodes
    assert out["decode_tokens_per_s_per_node"] == pytest.approx(200 * 128 / out["decode_nodes"])
    assert out["cost_per_day_usd"] == pytest.approx(
        (out["prefill_nodes"] + out["decode_nodes"]) * 8 * 2.69 * 24
    )
    assert out["tpot_s"] <= 0.05


def test_table_with_given_nodes(capsys):
    args = ["plan", "--model", "deepseek-v3", "--gpu", "H800", "--workload", "deepseek-v3-day"]
    assert main([*args, "--prefill-nodes", "4", "--decode-nodes", "18", "--samples", "3000"]) == 0
    out = capsys.readouterr().out
    assert "roofline" in out and "memory per GPU" in out and "per million" in out
    assert re.search(r"^prefill +32 +4 +\d+", out, re.M)  # EP, nodes per unit, units
    assert re.search(r"^decode +144 +18 +\d+", out, re.M)


def test_refuses_what_cannot_fit(capsys):
    args = ["plan", "--model", "deepseek-v3", "--gpu", "H100", "--workload", "deepseek-v3-day"]
    assert main([*args, "--dtype", "bf16", "--decode-nodes", "1", "--prefill-nodes", "1"]) == 2
    err = capsys.readouterr().err  # the memory plan's numbers: 288 slots / 8 ranks, 58 layers
    assert "deepseek-v3 bf16 EP8 (+32 redundant) does not fit a 74.5 GiB GPU" in err
    assert f"+ experts {36 * 58 * 3 * 7168 * 2048 * 2 / 2**30:.1f})" in err
    # no node counts: the search says that nothing of its grid fits
    assert main([*args, "--dtype", "bf16", "--slo-tpot", "0.001"]) == 2
    assert "no decode configuration" in capsys.readouterr().err


def test_workload_files(tmp_path):
    stats = tmp_path / "w.json"
    stats.write_text(json.dumps({"rate": 3, "prompt_mean": 500, "output_mean": 50}))
    w = load_workload(str(stats))
    assert (w.rate, w.prompt_mean, w.prefix_hit) == (3, 500, 0.0)
    assert {r.prompt for r in w.sample(10)} == {500}
    trace = tmp_path / "t.jsonl"
    rows = [{"arrival_s": t, "prompt_tokens": 100 * (t + 1), "output_tokens": 10,
             "cached_tokens": 50} for t in range(5)]  # fmt: skip
    trace.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    w = load_workload(str(trace))
    assert w.rate == pytest.approx(1.0) and w.prompt_mean == 300
    assert w.prefix_hit == pytest.approx(250 / 1500)
    assert all(r.prompt in (100, 200, 300, 400, 500) for r in w.sample(20))
    stats.write_text(json.dumps({"rate": 3, "prompt": 5}))
    with pytest.raises(ValueError, match="unknown fields"):
        load_workload(str(stats))
