"""Prefill on one engine, decode on another, the prompt KV moved between them: the same tokens
as one engine doing both; failed or late transfers leak no block."""

import time

import pytest
import torch

import engine.handoff
from engine import LLM, EngineConfig, LLMEngine, SamplingParams
from engine.kv_transfer import KVTransferError, ObjectStoreTransport
from engine.messages import GenerateRequest, KVPayload


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
        for d in engine.step().outputs:
            outs.setdefault(d.request_id, []).append(d)


def test_prefill_then_decode_equals_one_engine():
    prompts, params = prompts_and_params()
    expected = LLM("tiny-random", block_size=4).generate(prompts, params)
    cfg = EngineConfig(model="tiny-random", block_size=4)
    prefill, decode = LLMEngine(cfg), LLMEngine(cfg)
    requests = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        requests[str(i)] = prefill.add_request(str(i), p, sp, prefill_only=True)
    handed_off = {}
    while prefill.has_unfinished():
        step = prefill.step()
        assert step.outputs == []  # a handed-off request's first token travels with its KV
        handed_off.update({h.first.request_id: h for h in step.prefilled})
    assert sorted(handed_off) == sorted(requests)
    for h in handed_off.values():
        assert h.first.finish_reason is None and len(h.first.token_ids) == 1
    prefill.assert_no_leaks()  # exported and freed (the prefix cache may keep blocks)
    outs: dict = {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        rid = str(i)
        assert decode.reserve(rid, p, deadline=time.monotonic() + 30)
        first, kv = handed_off[rid].first, handed_off[rid].kv
        assert kv.num_tokens == len(p)
        decode.start_prefilled(GenerateRequest(rid, p, sp, requests[rid].seed), first, kv)
        outs[rid] = [first]
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
    cfg = EngineConfig(model="tiny-random", block_size=4)
    prefill, decode = LLMEngine(cfg), LLMEngine(cfg)
    prompt, sp = list(range(2, 30)), SamplingParams(max_tokens=4)
    req = prefill.add_request("a", prompt, sp, prefill_only=True)
    (handed_off,) = prefill.step().prefilled
    first, kv = handed_off.first, handed_off.kv
    assert decode.reserve("a", prompt, deadline=time.monotonic() + 30)
    assert decode.block_manager.num_used_blocks == 7

    def broken_import(*args, **kwargs):
        raise KVTransferError("the copy failed")

    monkeypatch.setattr(engine.handoff, "import_kv", broken_import)
    request = GenerateRequest("a", prompt, sp, req.seed)
    with pytest.raises(KVTransferError, match="the copy failed"):
        decode.start_prefilled(request, first, kv)
    decode.assert_no_leaks()
    monkeypatch.undo()
    # KV of the wrong length is refused, and the reservation released
    assert decode.reserve("a", prompt, deadline=time.monotonic() + 30)
    short = KVPayload("a", kv.data[:, :-1], 0)
    with pytest.raises(KVTransferError, match="KV for 27 tokens, the prompt has 28"):
        decode.start_prefilled(request, first, short)
    decode.assert_no_leaks()
    # a reservation whose KV never comes is released at its deadline
    assert decode.reserve("b", prompt, deadline=time.monotonic() - 1)
    assert decode.reservations.expire(time.monotonic()) == ["b"]
    with pytest.raises(KVTransferError, match="no reservation"):
        decode.start_prefilled(GenerateRequest("b", prompt, sp, req.seed), first, kv)
    decode.assert_no_leaks()
    # abort releases a reservation too
    assert decode.reserve("c", prompt, deadline=time.monotonic() + 30)
    decode.abort_request("c")
    decode.assert_no_leaks()


def test_object_store_transport_passes_payloads_and_refuses_anything_else():
    transport = ObjectStoreTransport()
    payload = KVPayload("r", torch.zeros(3, 5, 40), 0)
    assert transport.receive(transport.send(payload)) is payload
    assert payload.nbytes == 3 * 5 * 40 * 4
    with pytest.raises(KVTransferError, match="expected a KV payload"):
        transport.receive(None)
