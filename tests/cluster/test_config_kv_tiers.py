"""engine.kv_tiers from the cluster YAML: a mapping in the engine section or a pool's engine
overrides becomes the rank engines' KVTiersConfig; a bad one is refused naming its dotted path."""

import pytest

from cluster.config import ClusterConfig
from cluster.config_checks import ConfigError
from engine.config import KVTiersConfig


def test_kv_tiers_on_the_prefill_pool_reach_its_engines_only(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(
        "prefill:\n"
        "  engine:\n"
        "    kv_tiers: {host_bytes: 1048576, disk_path: /var/kv, disk_bytes: 4194304}\n"
    )
    config = ClusterConfig.load(path)
    tiers = config.engine_config("prefill").kv_tiers
    assert tiers == KVTiersConfig(host_bytes=1048576, disk_path="/var/kv", disk_bytes=4194304)
    assert config.engine_config("decode").kv_tiers is None
    assert config.engine.kv_tiers is None


def test_kv_tiers_in_the_shared_engine_section_and_a_pool_turning_them_off():
    config = ClusterConfig.from_dict(
        {"engine": {"kv_tiers": {"host_bytes": 4096}}, "decode": {"engine": {"kv_tiers": None}}}
    )
    assert config.engine.kv_tiers == KVTiersConfig(host_bytes=4096)
    assert config.engine_config("prefill").kv_tiers == KVTiersConfig(host_bytes=4096)
    assert config.engine_config("decode").kv_tiers is None


def test_a_flag_sets_one_tier_field():
    config = ClusterConfig.load(None, {"prefill.engine.kv_tiers.host_bytes": 8192})
    assert config.engine_config("prefill").kv_tiers == KVTiersConfig(host_bytes=8192)


BAD = {
    "unknown tier field": (
        {"engine": {"kv_tiers": {"host_mb": 1}}},
        "unknown config field engine.kv_tiers.host_mb",
    ),
    "tier field type": (
        {"prefill": {"engine": {"kv_tiers": {"host_bytes": "1G"}}}},
        "prefill.engine.kv_tiers.host_bytes must be an integer (got str '1G')",
    ),
    "disk path without budget": (
        {"prefill": {"engine": {"kv_tiers": {"host_bytes": 1, "disk_path": "/tmp/x"}}}},
        "prefill.engine.kv_tiers disk_path and disk_bytes go together",
    ),
    "no budget": ({"engine": {"kv_tiers": {}}}, "engine.kv_tiers needs a host or a disk budget"),
    "not a mapping": ({"engine": {"kv_tiers": 5}}, "engine.kv_tiers must be KVTiersConfig"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_kv_tiers_names_its_path(case):
    raw, expected = BAD[case]
    with pytest.raises(ConfigError) as err:
        ClusterConfig.from_dict(raw)
    assert expected in str(err.value)
