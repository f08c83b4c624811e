"""The CPU entry comes from the probe's cache (no measuring when one is there)."""

import json

from cluster.plan.probe import get_hardware


def test_cpu_hardware_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EPCLUSTER_CACHE", str(tmp_path))
    measured = {"read_bw": 2.5e10, "fp32_flops": 1e11, "all_to_all_bw": 2e9, "threads": 2}
    (tmp_path / "probe.json").write_text(json.dumps(measured))
    hw = get_hardware("cpu")
    assert hw.read_bw == 2.5e10 and hw.peak("fp32") == 1e11  # measured: efficiency 1
    assert hw.intra_node_bw == hw.inter_node_bw == 2e9
    assert "probe.py" in hw.sources["all"]
