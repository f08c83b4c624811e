"""Prefill on one engine, decode on another, the prompt KV moved between them: the same tokens
as one engine doing both; failed or late transfers leak no block."""

import time

import pytest
import torch

from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.kv_transfer import FAIL_IMPORT_ENV, KVTransferError
from engine.request import PREFILLED


def prompts_and_params():
    gen = torch.Generator().manual_seed(9)
    prompts = [torch.randint(2, 512, (n,), generator=gen).tolist() for n in (5, 17, 40, 64, 9)]
    params = [
        SamplingParams(
            max_tokens=10,
            temperature=0.0 if i % 2 else 0.8,
            seed=100 + i,
            ignore_eos=True,
            logprobs=1 if i == 3 else None,
        )
        for i in range(5)
    ]
    return prompts, params


def run_until_done(engine: LLMEngine, outs: dict):
    while engine.has_unfinished():
        for d in engine.step():
            outs.setdefault(d.request_id, []).append(d)


def test_prefill_then_decode_equals_one_engine():
    prompts, params = prompts_and_params()
    expected = LLM("tiny", block_size=4).generate(prompts, params)
    cfg = EngineConfig(model="tiny", block_size=4)
    prefill, decode = LLMEngine(cfg), LLMEngine(cfg)
    payloads = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        req = prefill.add_request(str(i), p, sp, prefill_only=True)
        payloads[str(i)] = req
    firsts = {}
    while prefill.has_unfinished():
        for d in prefill.step():
            firsts[d.request_id] = d
    assert all(d.finish_reason == PREFILLED and len(d.token_ids) == 1 for d in firsts.values())
    prefill.assert_no_leaks()  # exported and freed (the prefix cache may keep blocks)
    outs: dict = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        rid = str(i)
        assert decode.reserve(rid, p, deadline=time.monotonic() + 30)
        req = payloads[rid]
        assert prefill.exported[rid].num_tokens == len(p)
        decode.start_prefilled(rid, p, sp, req.seed, firsts[rid], prefill.exported[rid])
        outs[rid] = [firsts[rid]]
    run_until_done(decode, outs)
    for i, exp in enumerate(expected):
        deltas = outs[str(i)]
        assert sum((d.token_ids for d in deltas), []) == exp.token_ids
        assert "".join(d.text for d in deltas) == exp.text
        assert deltas[-1].finish_reason == "length"
    got_lp = sum((d.logprobs or [] for d in outs["3"]), [])
    assert [lp.token_id for lp in got_lp] == expected[3].token_ids
    decode.assert_no_leaks()


def test_failed_import_and_expired_reservation_free_blocks(monkeypatch):
    cfg = EngineConfig(model="tiny", block_size=4)
    prefill, decode = LLMEngine(cfg), LLMEngine(cfg)
    prompt, sp = list(range(2, 30)), SamplingParams(max_tokens=4)
    req = prefill.add_request("a", prompt, sp, prefill_only=True)
    first = [d for d in prefill.step()][0]
    assert decode.reserve("a", prompt, deadline=time.monotonic() + 30)
    assert decode.block_manager.num_used_blocks == 7
    monkeypatch.setenv(FAIL_IMPORT_ENV, "1")
    with pytest.raises(KVTransferError):
        decode.start_prefilled("a", prompt, sp, req.seed, first, prefill.exported["a"])
    decode.assert_no_leaks()
    monkeypatch.delenv(FAIL_IMPORT_ENV)
    # a reservation whose KV never comes is released at its deadline
    assert decode.reserve("b", prompt, deadline=time.monotonic() - 1)
    assert decode.expire_reservations(time.monotonic()) == ["b"]
    with pytest.raises(KVTransferError, match="no reservation"):
        decode.start_prefilled("b", prompt, sp, req.seed, first, prefill.exported["a"])
    decode.assert_no_leaks()
    # abort releases a reservation too
    assert decode.reserve("c", prompt, deadline=time.monotonic() + 30)
    decode.abort_request("c")
    decode.assert_no_leaks()


def test_object_store_transport_passes_payloads_and_refuses_anything_else():
    from engine.kv_transfer import KVPayload, ObjectStoreTransport

    transport = ObjectStoreTransport()
    payload = KVPayload("r", torch.zeros(3, 5, 40), 0)
    assert transport.receive(transport.send(payload)) is payload
    assert payload.nbytes == 3 * 5 * 40 * 4
    with pytest.raises(KVTransferError, match="expected a KV payload"):
        transport.receive(None)
