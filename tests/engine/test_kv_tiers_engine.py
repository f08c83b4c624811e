"""The KV tiers wired into the engine (tiny-random, CPU): a prefix evicted from a small paged
cache comes back from host memory or disk with the same greedy tokens as a plain prefill and
counts as cached tokens; a second engine on the same directory starts warm; a corrupt block file
is a miss; preemption, chunked prefill and aborts leave no block behind."""

import os

import pytest
import torch

from engine import LLM, SamplingParams
from engine.block_manager import block_hashes
from engine.config import EngineConfig, EngineConfigError, KVTiersConfig

BS = 4
BLOCK_BYTES = 3 * BS * 40 * 4  # tiny-random: 3 layers x BS x C 40 x float32
NUM_BLOCKS = 40  # small, so that a few other prompts evict a prefix
GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 512, (length,), generator=gen).tolist() for _ in range(n)]


def tiered(host_bytes: int = 0, disk: str | None = None, **options: object) -> LLM:
    tiers = KVTiersConfig(host_bytes, disk, 10**8 if disk else 0)
    llm = LLM(
        "tiny-random",
        block_size=BS,
        kv_cache_bytes=NUM_BLOCKS * BLOCK_BYTES,
        kv_tiers=tiers,
        **options,
    )
    assert llm.engine.block_manager.num_blocks == NUM_BLOCKS
    return llm


def run(llm: LLM, batch: list[list[int]], params: SamplingParams = GREEDY) -> list:
    outs = llm.generate(batch, params)
    if llm.engine.tiers is not None:
        llm.engine.tiers.flush()  # the write-back is asynchronous; the next lookup sees it
    return outs


def in_paged(llm: LLM, prompt: list[int]) -> bool:
    return block_hashes(prompt, BS)[0] in llm.engine.block_manager.hash_to_block


def evict(llm: LLM, prefix: list[int]) -> None:
    for filler in prompts(3, 120, seed=99):
        run(llm, [filler])
    assert not in_paged(llm, prefix), "the fillers should have evicted the prefix"


@pytest.fixture(scope="module")
def plain() -> LLM:
    return LLM("tiny-random", block_size=BS)


PREFIX = prompts(1, 64, seed=1)[0]
SUFFIXES = prompts(2, 7, seed=2)


def test_evicted_prefix_comes_back_from_host(plain):
    llm = tiered(host_bytes=10**6)
    run(llm, [PREFIX + SUFFIXES[0]])
    evict(llm, PREFIX)
    hits = llm.engine.kv_tier_stats()["host"].hits
    out = run(llm, [PREFIX + SUFFIXES[1]])[0]
    assert out.token_ids == run(plain, [PREFIX + SUFFIXES[1]])[0].token_ids
    assert out.num_cached_tokens == len(PREFIX)  # 16 whole blocks, all from host
    stats = llm.engine.kv_tier_stats()
    assert stats["host"].hits - hits == len(PREFIX) // BS
    assert stats["link"].tokens_loaded == len(PREFIX)
    llm.engine.assert_no_leaks()


def test_disk_serves_evicted_prefix_and_a_second_engine(plain, tmp_path):
    llm = tiered(disk=str(tmp_path), max_num_batched_tokens=16)  # no host: chunked prefill
    run(llm, [PREFIX + SUFFIXES[0]])
    evict(llm, PREFIX)
    out = run(llm, [PREFIX + SUFFIXES[1]])[0]
    want = run(plain, [PREFIX + SUFFIXES[1]])[0].token_ids
    assert out.token_ids == want and out.num_cached_tokens == len(PREFIX)
    assert llm.engine.kv_tier_stats()["disk"].hits == len(PREFIX) // BS
    llm.engine.assert_no_leaks()
    llm.engine.close()
    # Restart-warm / shared: a fresh engine on the same directory prefills only the rest.
    # The first engine also wrote the blocks its second request filled: all of them but the
    # one holding the last prompt token (always recomputed) come back.
    second = tiered(host_bytes=10**6, disk=str(tmp_path))
    prompt = PREFIX + SUFFIXES[1]
    out = run(second, [prompt])[0]
    reusable = (len(prompt) - 1) // BS
    assert out.token_ids == want and out.num_cached_tokens == reusable * BS
    assert second.engine.kv_tier_stats()["disk"].hits == reusable
    second.engine.assert_no_leaks()


def test_a_corrupt_block_file_is_a_miss_and_the_output_is_right(plain, tmp_path):
    first = tiered(disk=str(tmp_path))
    run(first, [PREFIX + SUFFIXES[0]])
    first.engine.close()
    files = [os.path.join(r, n) for r, _, names in os.walk(tmp_path) for n in names]
    assert len(files) >= len(PREFIX) // BS
    for path in files:  # flip the last payload byte: the checksum no longer matches
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
    second = tiered(disk=str(tmp_path))
    out = run(second, [PREFIX + SUFFIXES[1]])[0]
    assert out.token_ids == run(plain, [PREFIX + SUFFIXES[1]])[0].token_ids
    assert out.num_cached_tokens == 0
    stats = second.engine.kv_tier_stats()
    assert stats["disk"].hits == 0 and stats["disk"].misses >= 1
    assert stats["link"].blocks_loaded == 0
    second.engine.assert_no_leaks()


def test_preemption_reloads_from_the_tiers_with_the_same_tokens(plain):
    llm = tiered(host_bytes=10**6, max_num_batched_tokens=32)
    batch = prompts(6, 40, seed=3)
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    outs = run(llm, batch, params)
    assert llm.engine.num_preemptions > 0
    assert llm.engine.kv_tier_stats()["link"].blocks_loaded > 0
    want = run(plain, batch, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    llm.engine.assert_no_leaks()


def test_aborts_after_tier_loads_leak_nothing():
    llm = tiered(host_bytes=10**6, max_num_batched_tokens=16)
    run(llm, [PREFIX + SUFFIXES[0]])
    evict(llm, PREFIX)
    engine = llm.engine
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    for i, suffix in enumerate(prompts(4, 9, seed=4)):
        engine.add_request(str(i), PREFIX + suffix, params)
    engine.step()  # admits (and loads from host) what fits; the rest waits
    engine.step()
    assert engine.kv_tier_stats()["link"].blocks_loaded >= len(PREFIX) // BS
    for i in range(4):
        engine.abort_request(str(i))
    engine.assert_no_leaks()
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks


def test_off_by_default_and_checked():
    assert EngineConfig().kv_tiers is None
    assert LLM("tiny-random", block_size=BS).engine.tiers is None
    with pytest.raises(EngineConfigError, match="kv_tiers"):
        EngineConfig(kv_tiers=KVTiersConfig(disk_path="/tmp/x"))  # a path without a budget
    with pytest.raises(EngineConfigError, match="kv_tiers"):
        EngineConfig(kv_tiers=KVTiersConfig())  # no tier at all
    with pytest.raises(EngineConfigError, match="kv_tiers"):
        EngineConfig(kv_tiers=KVTiersConfig(host_bytes=1), enable_prefix_caching=False)
