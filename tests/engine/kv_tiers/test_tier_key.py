from dataclasses import replace

from engine.block_manager import block_hashes
from engine.kv_tiers.key import BlockKey, KeySpace, model_fingerprint
from moe.config import ModelConfig
from moe.presets import PRESETS

BH = b"\x01" * 16


def test_key_names_differ_by_model_dtype_block_size_and_layers() -> None:
    base = KeySpace(model=b"a" * 16, dtype="bfloat16", block_size=64, num_layers=61)
    variants = [
        base,
        replace(base, model=b"b" * 16),
        replace(base, dtype="float32"),
        replace(base, block_size=16),
        replace(base, num_layers=60),
    ]
    names = {v.key(BH).name for v in variants}
    assert len(names) == len(variants)
    assert base.key(BH).name != base.key(b"\x02" * 16).name
    assert base.key(BH).name == KeySpace(b"a" * 16, "bfloat16", 64, 61).key(BH).name
    assert all(len(n) == 32 and int(n, 16) >= 0 for n in names)


def test_model_fingerprint_follows_config_and_checkpoint() -> None:
    config = ModelConfig.from_dict(PRESETS["tiny-random"])
    fp = model_fingerprint(config, "tiny-random")
    assert len(fp) == 16 and fp == model_fingerprint(config, "tiny-random")
    assert fp != model_fingerprint(config, "/ckpt/other")
    assert fp != model_fingerprint(replace(config, rms_norm_eps=1e-5), "tiny-random")


def test_key_bytes_round_trip_and_reject_garbage() -> None:
    key = KeySpace(b"a" * 16, "float16", 16, 27).key(BH)
    assert BlockKey.from_bytes(key.to_bytes()) == key
    assert BlockKey.from_bytes(key.to_bytes()[:-1]) is None
    assert BlockKey.from_bytes(b"garbage") is None


def test_keys_are_the_prefix_caches_block_hashes() -> None:
    space = KeySpace(b"a" * 16, "float32", 4, 2)
    tokens = list(range(10))  # two full blocks and a partial one
    assert [k.block_hash for k in space.keys(tokens)] == block_hashes(tokens, 4)
