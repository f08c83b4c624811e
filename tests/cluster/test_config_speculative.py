"""engine.speculative from the cluster YAML: a mapping in the engine section or the decode
pool's engine overrides becomes the rank engines' SpeculativeConfig; a bad one is refused
naming its dotted path."""

import pytest

from cluster.config import ClusterConfig
from cluster.config_checks import ConfigError
from engine.config import SpeculativeConfig


def test_speculative_on_the_decode_pool_reaches_its_engines_only(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("decode:\n  engine:\n    speculative: {method: mtp, num_draft_tokens: 2}\n")
    config = ClusterConfig.load(path)
    assert config.engine_config("decode").speculative == SpeculativeConfig("mtp", 2)
    assert config.engine_config("decode").num_draft_tokens == 2
    assert config.engine_config("prefill").speculative is None
    assert config.engine.speculative is None


def test_speculative_in_the_engine_section_with_the_default_k_and_a_flag():
    config = ClusterConfig.from_dict({"engine": {"speculative": {"method": "mtp"}}})
    assert config.engine_config("decode").speculative == SpeculativeConfig("mtp", 1)
    flag = ClusterConfig.load(None, {"decode.engine.speculative.num_draft_tokens": 3})
    assert flag.engine_config("decode").speculative == SpeculativeConfig("mtp", 3)
    gated = ClusterConfig.from_dict({"engine": {"speculative": {"max_batch_size": 8}}})
    assert gated.engine_config("decode").speculative == SpeculativeConfig("mtp", 1, 8)
    assert gated.engine_config("decode").speculative.draft_head == "auto"
    exact = ClusterConfig.from_dict({"engine": {"speculative": {"draft_head": "exact"}}})
    assert exact.engine_config("decode").speculative == SpeculativeConfig(draft_head="exact")


BAD = {
    "k too large": (
        {"decode": {"engine": {"speculative": {"num_draft_tokens": 4}}}},
        "decode.engine.speculative.num_draft_tokens must be 1, 2 or 3 (got 4)",
    ),
    "max batch size": (
        {"decode": {"engine": {"speculative": {"max_batch_size": 0}}}},
        "decode.engine.speculative.max_batch_size must be a whole number >= 1 or null (got 0)",
    ),
    "draft head": (
        {"decode": {"engine": {"speculative": {"draft_head": "int4"}}}},
        "decode.engine.speculative.draft_head must be auto, int8 or exact (got 'int4')",
    ),
    "method": (
        {"engine": {"speculative": {"method": "eagle"}}},
        "engine.speculative.method must be mtp (got 'eagle')",
    ),
    "unknown field": (
        {"engine": {"speculative": {"k": 2}}},
        "unknown config field engine.speculative.k",
    ),
    "k type": (
        {"engine": {"speculative": {"num_draft_tokens": "2"}}},
        "engine.speculative.num_draft_tokens must be an integer (got str '2')",
    ),
    "not a mapping": ({"engine": {"speculative": 2}}, "engine.speculative must be"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_speculative_names_its_path(case):
    raw, expected = BAD[case]
    with pytest.raises(ConfigError) as err:
        ClusterConfig.from_dict(raw)
    assert expected in str(err.value)
