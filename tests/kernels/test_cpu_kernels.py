"""The compiled CPU kernels (kernels/cpu/gemm.cpp, kernels/cpu/attention.cpp) against the torch
references: x @ W.T, the grouped expert MLP over slot-sorted rows, and absorbed MLA attention over
a paged cache read in place (decode and chunked prefill over a cached prefix). Odd sizes, vector
tails, empty slots, table holes, batch 1; a row's result never depends on the rows around it;
wrong shapes are refused with a message. Built here by kernels/cpu/build.py (make test has a
compiler)."""

import os
import time

import pytest
import torch

from kernels.cpu.build import clear_stale_lock
from kernels.linear import linear, panels
from kernels.mla_attention import paged_latent_attention, paged_latent_attention_ref
from kernels.moe_mlp import dense_mlp, grouped_expert_mlp, grouped_expert_mlp_ref
from tests.kernels.test_mla_attention import paged_case


def reference(monkeypatch, fn, *args):
    """fn(*args) on the torch path (EPCLUSTER_KERNELS=reference), the switch restored after."""
    with monkeypatch.context() as m:
        m.setenv("EPCLUSTER_KERNELS", "reference")
        return fn(*args)


# 8 | 9 rows: one-row | four-row tiles
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 8, 9, 13, 32, 100])
@pytest.mark.parametrize(("n_out", "k"), [(1, 8), (7, 17), (33, 96), (300, 384)])
def test_linear_equals_matmul(kernels, rows, n_out, k):
    gen = torch.Generator().manual_seed(rows * 100 + n_out)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n_out, k, generator=gen)
    got = kernels.linear(x, w)
    assert got.shape == (rows, n_out)
    torch.testing.assert_close(got, (x.double() @ w.double().T).float(), rtol=1e-5, atol=1e-4)


def test_linear_rows_are_independent_of_the_batch(kernels):
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(13, 70, generator=gen), torch.randn(41, 70, generator=gen)
    together = kernels.linear(x, w)
    alone = torch.cat([kernels.linear(x[i : i + 1], w) for i in range(13)])
    assert torch.equal(together, alone)


def test_linear_refuses_what_it_cannot_take(kernels):
    with pytest.raises(RuntimeError, match="differ in K"):
        kernels.linear(torch.randn(2, 8), torch.randn(3, 9))
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.linear(torch.randn(2, 8), torch.randn(8, 3).T)
    with pytest.raises(RuntimeError, match="fp32"):
        kernels.linear(torch.randn(2, 8).double(), torch.randn(3, 8).double())


@pytest.mark.parametrize("rows", [1, 3, 7, 8, 9, 17, 32, 100])  # tiles of 8 rows and their rests
@pytest.mark.parametrize(("n_out", "k"), [(1, 8), (47, 17), (49, 96), (300, 384)])  # panels of 48
def test_linear_panels_equals_matmul(kernels, rows, n_out, k):
    gen = torch.Generator().manual_seed(rows * 100 + n_out)
    x, w = torch.randn(rows, k, generator=gen), torch.randn(n_out, k, generator=gen)
    got = kernels.linear_panels(x, kernels.pack_panels(w), n_out)
    assert got.shape == (rows, n_out)
    torch.testing.assert_close(got, (x.double() @ w.double().T).float(), rtol=1e-5, atol=1e-4)


def test_linear_panels_rows_are_independent_of_the_batch(kernels):
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(21, 70, generator=gen), torch.randn(100, 70, generator=gen)
    p = kernels.pack_panels(w)
    together = kernels.linear_panels(x, p, 100)
    alone = torch.cat([kernels.linear_panels(x[i : i + 1], p, 100) for i in range(21)])
    assert torch.equal(together, alone)


def test_packed_linear_follows_its_weight(kernels):
    """linear(packed=True) keeps the panels on the weight and packs again when the weight changes
    in place (a tensor that counts versions) or is given new storage."""
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(5, 40, generator=gen), torch.randn(30, 40, generator=gen)
    first = linear(x, w, packed=True)
    assert panels(w) is panels(w)  # kept
    torch.testing.assert_close(first, x @ w.T, rtol=1e-5, atol=1e-5)
    w.mul_(2)
    torch.testing.assert_close(linear(x, w, packed=True), 2 * first, rtol=1e-5, atol=1e-5)
    w.data = torch.randn(30, 40, generator=gen)
    torch.testing.assert_close(linear(x, w, packed=True), x @ w.T, rtol=1e-5, atol=1e-5)


def test_linear_panels_refuses_what_it_cannot_take(kernels):
    p = kernels.pack_panels(torch.randn(50, 8))
    with pytest.raises(RuntimeError, match="not pack_panels of a \\[50, 9\\] weight"):
        kernels.linear_panels(torch.randn(2, 9), p, 50)
    with pytest.raises(RuntimeError, match="not pack_panels of a \\[97, 8\\] weight"):
        kernels.linear_panels(torch.randn(2, 8), p, 97)


@pytest.mark.parametrize(("rows", "hidden", "inter"), [(1, 40, 24), (13, 64, 50), (32, 768, 384)])
def test_dense_mlp_equals_reference(kernels, rows, hidden, inter):
    gen = torch.Generator().manual_seed(rows + hidden)
    x = torch.randn(rows, hidden, generator=gen)
    w13 = torch.randn(2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(hidden, inter, generator=gen) / inter**0.5
    got = dense_mlp(x, w13, w2)
    torch.testing.assert_close(
        got, grouped_expert_mlp_ref(x, [rows], w13[None], w2[None]), rtol=1e-4, atol=1e-5
    )
    alone = torch.cat([dense_mlp(x[i : i + 1], w13, w2) for i in range(rows)])
    assert torch.equal(got, alone)


@pytest.mark.parametrize(
    "counts, hidden, inter",
    [
        ([3, 0, 17, 1], 40, 24),  # odd sizes, an empty slot, a slot over several tiles
        ([0, 1, 0], 32, 16),  # batch 1 between empty slots
        ([0, 0], 16, 16),  # no rows
        ([5, 2, 9, 4, 1, 0, 7, 3], 768, 384),  # the small preset's shapes
    ],
)
def test_grouped_mlp_equals_reference(kernels, counts, hidden, inter):
    gen = torch.Generator().manual_seed(len(counts) + hidden)
    x = torch.randn(sum(counts), hidden, generator=gen)
    w13 = torch.randn(len(counts), 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(len(counts), hidden, inter, generator=gen) / inter**0.5
    got = kernels.grouped_mlp(x, counts, w13, w2)
    torch.testing.assert_close(
        got, grouped_expert_mlp_ref(x, counts, w13, w2), rtol=1e-4, atol=1e-5
    )
    # the dispatching entry point takes it on fp32 CPU tensors
    assert torch.equal(grouped_expert_mlp(x, counts, w13, w2), got)


def test_grouped_mlp_refuses_bad_counts(kernels):
    x, w13, w2 = torch.randn(3, 16), torch.randn(2, 16, 16), torch.randn(2, 16, 8)
    with pytest.raises(RuntimeError, match="sum to 4"):
        kernels.grouped_mlp(x, [2, 2], w13, w2)
    with pytest.raises(RuntimeError, match="for 2 slots"):
        kernels.grouped_mlp(x, [3], w13, w2)


@pytest.mark.parametrize(
    "context_lens, num_heads, rank, rope, page",
    [
        ([5, 33, 1], 3, 24, 8, 4),  # lengths off the page, a 1-token context
        ([5, 33, 1], 20, 24, 8, 4),  # heads over several groups of 6
        ([50], 12, 256, 32, 16),  # batch 1, the small preset's widths
        ([7, 16, 129], 12, 256, 32, 16),
    ],
)
def test_paged_attention_equals_reference(kernels, context_lens, num_heads, rank, rope, page):
    """The cache is NaN wherever a sequence has no row: a read out of bounds would show."""
    q, cache, tables, lens = paged_case(
        context_lens, num_heads, rank, rope, page, torch.float32, "cpu", seed=len(context_lens)
    )
    scale = (rank + rope) ** -0.5
    got = kernels.paged_mla_attention(q, cache, tables, lens, scale, rank)
    ref = paged_latent_attention_ref(q, cache, tables, lens, scale, rank)
    assert got.shape == (len(context_lens), num_heads, rank) and not got.isnan().any()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    assert torch.equal(paged_latent_attention(q, cache, tables, lens, scale, rank), got)


def test_paged_attention_chunked_prefill_sees_its_own_prefix(kernels):
    """A chunk of queries of one sequence, each with the keys up to its position, equals decode
    steps one at a time (the same kernel serves both)."""
    q, cache, tables, lens = paged_case([40], 12, 64, 16, 8, torch.float32, "cpu", seed=3)
    chunk = torch.randn(6, 12, 80, generator=torch.Generator().manual_seed(4))
    chunk_lens = torch.arange(35, 41)  # a prefix of 34 cached, 6 new tokens
    got = kernels.paged_mla_attention(chunk, cache, tables.expand(6, -1).contiguous(),
                                      chunk_lens, 0.1, 64)  # fmt: skip
    for i in range(6):
        one = kernels.paged_mla_attention(chunk[i : i + 1], cache, tables, chunk_lens[i : i + 1],
                                          0.1, 64)  # fmt: skip
        assert torch.equal(got[i : i + 1], one)
        ref = paged_latent_attention_ref(chunk[i : i + 1], cache, tables, chunk_lens[i : i + 1],
                                         0.1, 64)  # fmt: skip
        torch.testing.assert_close(one, ref, rtol=1e-4, atol=1e-5)


def test_paged_attention_refuses_bad_tables(kernels):
    q, cache, tables, lens = paged_case([5, 9], 2, 16, 8, 4, torch.float32, "cpu", seed=5)
    bad = tables.clone()
    bad[1, 1] = cache.shape[0]  # past the cache
    with pytest.raises(RuntimeError, match="not a block of the cache"):
        kernels.paged_mla_attention(q, cache, bad, lens, 0.1, 16)
    with pytest.raises(RuntimeError, match="not in 1.."):
        kernels.paged_mla_attention(q, cache, tables, torch.tensor([5, 0]), 0.1, 16)


def test_a_stale_build_lock_is_removed_a_live_one_kept(tmp_path):
    lock = tmp_path / "lock"
    lock.touch()
    assert not clear_stale_lock(tmp_path, max_age_s=300) and lock.exists()
    old = time.time() - 301
    os.utime(lock, (old, old))
    assert clear_stale_lock(tmp_path, max_age_s=300) and not lock.exists()
    assert not clear_stale_lock(tmp_path)  # no lock at all


def test_rms_norm_equals_reference(kernels, monkeypatch):
    from kernels.rmsnorm import rms_norm

    gen = torch.Generator().manual_seed(6)
    for rows, width in [(1, 8), (5, 37), (32, 768)]:
        x, w = torch.randn(rows, width + 3, generator=gen), torch.randn(width, generator=gen)
        x = x[:, 3:]  # strided rows
        got = kernels.rms_norm(x, w, 1e-6)
        ref = reference(monkeypatch, rms_norm, x, w, 1e-6)
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
        assert torch.equal(rms_norm(x, w, 1e-6), got)  # the public op takes it


@pytest.mark.parametrize("interleaved", [True, False])
def test_rotary_equals_reference(kernels, interleaved, monkeypatch):
    from kernels.rotary import apply_rotary

    gen = torch.Generator().manual_seed(7)
    cos, sin = torch.randn(5, 16, generator=gen), torch.randn(5, 16, generator=gen)
    q = torch.randn(5, 3, 40, generator=gen)[..., 8:]  # [T, H, 32], strided
    k = torch.randn(5, 50, generator=gen)[:, 18:]  # [T, 32], strided
    for x in (q, k):
        got = kernels.rotary(x, cos, sin, interleaved)
        ref = reference(monkeypatch, apply_rotary, x, cos, sin, interleaved)
        assert got.shape == ref.shape
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "scoring, method, groups, topk_group, norm",
    [
        ("sigmoid", "noaux_tc", 4, 2, True),  # DeepSeek-V3
        ("softmax", "group_limited_greedy", 4, 2, False),  # DeepSeek-V2
        ("softmax", "greedy", 1, 1, False),  # V2-Lite
        ("sigmoid", "noaux_tc", 8, 4, True),
    ],
)
def test_gate_equals_reference(kernels, scoring, method, groups, topk_group, norm):
    from kernels.gate import grouped_topk_ref

    gen = torch.Generator().manual_seed(8)
    logits, bias = torch.randn(33, 32, generator=gen), torch.randn(32, generator=gen) * 0.1
    args = (logits, 6, scoring, method, groups, topk_group, norm, 2.5, bias)
    ref_w, ref_i = grouped_topk_ref(*args)
    w, i = kernels.grouped_topk(logits, 6, ("softmax", "sigmoid").index(scoring),
                                ("greedy", "group_limited_greedy", "noaux_tc").index(method),
                                groups, topk_group, norm, 2.5, bias)  # fmt: skip
    # the same experts per row, in whichever order, with the same weights
    i, order = i.sort(1)
    ref_i, ref_order = ref_i.sort(1)
    assert torch.equal(i, ref_i)
    torch.testing.assert_close(w.gather(1, order), ref_w.gather(1, ref_order), rtol=1e-5, atol=1e-6)


def test_combine_equals_reference(kernels):
    from moe.dispatch import CombineHandle, DispatchHandle

    gen = torch.Generator().manual_seed(9)
    tokens, top_k, hidden = 7, 3, 20
    weights = torch.rand(tokens, top_k, generator=gen)
    send_order = torch.randperm(tokens * top_k, generator=gen)
    rows = torch.randn(tokens * top_k, hidden, generator=gen)
    got = kernels.combine(rows, send_order, weights)
    by_pair = torch.empty_like(rows)
    by_pair[send_order] = rows
    ref = (by_pair.view(tokens, top_k, hidden) * weights[:, :, None]).sum(1)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    handle = DispatchHandle(weights, send_order, rows)
    assert torch.equal(CombineHandle(handle, rows).output(), got)
    with pytest.raises(RuntimeError, match="not a permutation"):
        kernels.combine(rows, torch.zeros(tokens * top_k, dtype=torch.long), weights)


@pytest.mark.parametrize("context_lens", [[1], [5, 33, 17], list(range(1, 31))])  # full tiles
@pytest.mark.parametrize("shape", [(5, 24, 8, 32, 20), (3, 40, 8, 300, 70)])  # rank: 2 blocks
def test_mla_decode_equals_the_three_steps(kernels, context_lens, shape, monkeypatch):
    """W_UK, the paged attention and W_UV in one call equal the reference's einsum, attention,
    einsum (q_nope a strided view, as the attention passes it); each query's output is the same
    numbers alone as in the batch (fewer than 4 queries take wider column blocks)."""
    from kernels.mla_attention import mla_decode

    heads, nope, rope, rank, dv = shape
    q_lat, cache, tables, lens = paged_case(context_lens, heads, rank, rope, 4, torch.float32,
                                            "cpu", seed=10)  # fmt: skip
    gen = torch.Generator().manual_seed(11)
    q = torch.randn(len(context_lens), heads, nope + rope, generator=gen)
    q_nope, q_pe = q.split([nope, rope], dim=-1)
    w_uk = torch.randn(heads, nope, rank, generator=gen) / nope**0.5
    w_uv = torch.randn(heads, dv, rank, generator=gen) / rank**0.5
    got = mla_decode(q_nope, q_pe, cache, tables, lens, w_uk, w_uv, 0.3,
                     w_uv.transpose(1, 2).contiguous())  # fmt: skip
    ref = reference(monkeypatch, mla_decode, q_nope, q_pe, cache, tables, lens, w_uk, w_uv, 0.3)
    assert got.shape == (len(context_lens), heads, dv) and not got.isnan().any()
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-5)
    w_uv_t = w_uv.transpose(1, 2).contiguous()
    for t in range(len(context_lens)):
        one = slice(t, t + 1)
        alone = mla_decode(q_nope[one], q_pe[one], cache, tables[one], lens[one], w_uk, w_uv, 0.3,
                           w_uv_t)  # fmt: skip
        assert torch.equal(alone[0], got[t]), t


def test_argmax_equals_torch_with_ties_and_nan(kernels):
    gen = torch.Generator().manual_seed(12)
    x = torch.randn(6, 1000, generator=gen)
    x[1, 7] = x[1, 900] = 50.0  # a tie: the lower index
    x[2, -1] = 60.0  # in the last lanes
    x[3, 5] = x[3, 3] = float("nan")  # the first NaN, as torch
    x[4] = float("-inf")
    x[5, 20] = float("inf")
    assert (
        kernels.argmax_rows(x).tolist()
        == x.argmax(dim=-1).tolist()
        == [x[0].argmax().item(), 7, 999, 3, 0, 20]
    )
    odd = torch.randn(3, 37, generator=gen)  # a vocabulary off the vector width
    assert torch.equal(kernels.argmax_rows(odd), odd.argmax(dim=-1))


def test_local_dispatch_equals_the_torch_sort(kernels):
    """Hand-checkable: 3 tokens, top-2, experts held in slots (expert 2 twice: its first slot)."""
    x = torch.arange(6.0).view(3, 2)
    topk = torch.tensor([[2, 0], [1, 2], [0, 1]])
    log2slot = torch.tensor([1, 0, 2, -1])  # expert 3 not held
    order, rows, counts = kernels.local_dispatch(x, topk, log2slot, 4)
    # slots per pair: [2, 1, 0, 2, 1, 0] -> stable by slot: pairs 2, 5 | 1, 4 | 0, 3
    assert order.tolist() == [2, 5, 1, 4, 0, 3]
    assert torch.equal(rows, x[order // 2]) and counts.tolist() == [2, 2, 2, 0]
    missing, _, _ = kernels.local_dispatch(x, torch.tensor([[3, 0], [1, 2], [0, 1]]), log2slot, 4)
    assert missing.numel() == 0


def test_local_dispatcher_refuses_an_expert_it_does_not_hold(kernels):
    from moe.dispatch import LocalDispatcher

    dispatcher = LocalDispatcher([0, 1], num_experts=4)
    x, w = torch.randn(2, 8), torch.ones(2, 1)
    with pytest.raises(RuntimeError, match=r"experts \[3\]"):
        dispatcher.dispatch(x, torch.tensor([[1], [3]]), w)
    handle = dispatcher.dispatch(x, torch.tensor([[1], [0]]), w)
    assert handle.recv_counts == [1, 1] and dispatcher.load.peek().tolist() == [1, 1]
    assert torch.equal(handle.recv_x, x[[1, 0]])


def test_cache_write_equals_index_put(kernels, monkeypatch):
    from kernels.mla_attention import write_cache

    gen = torch.Generator().manual_seed(13)
    cache = torch.randn(5, 4, 24, generator=gen)
    latent = torch.randn(6, 30, generator=gen)[:, :24]  # strided rows
    slots = torch.tensor([19, 0, 7, 8, 3, 12])
    expected = cache.clone()
    expected.view(-1, 24)[slots] = latent
    write_cache(cache, slots, latent)
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="not a row of the cache"):
        kernels.write_rows(cache, torch.tensor([20]), latent[:1])
