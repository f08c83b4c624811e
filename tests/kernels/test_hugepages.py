"""kernels/hugepages.py: the regions a tensor touches, collapsing in place, the off switch, and
which of a model's tensors are the weights a step reads."""

import torch
from torch import nn

from kernels import hugepages
from kernels.linear import panel_copy
from moe.loader import load_model


def test_regions_by_hand():
    assert hugepages.regions([(0, 8)], 8) == [(0, 8)]
    assert hugepages.regions([(5, 4)], 8) == [(0, 16)]  # bytes 5..8 touch regions 0 and 1
    assert hugepages.regions([(3, 5)], 8) == [(0, 8)]  # 3..7: region 0 only
    assert hugepages.regions([(0, 1), (24, 1)], 8) == [(0, 8), (24, 8)]  # a gap: two runs
    assert hugepages.regions([(9, 2), (10, 20)], 8) == [(8, 24)]  # overlapping spans, one run
    assert hugepages.regions([(3, 0)], 8) == []


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping holding address, from /proc/self/smaps."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= address < hi
        elif inside and head == "AnonHugePages:":
            return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_collapse_keeps_the_values_and_counts_what_smaps_says():
    t = torch.randn(4 << 20)  # 16 MiB, written: on small pages until collapsed
    before = t.clone()
    moved = hugepages.collapse([t])
    assert torch.equal(t, before)
    if not (hugepages.enabled() and hugepages.supported()):  # THP off, or Linux < 6.1
        assert moved == 0  # a no-op that says so
        return
    size = hugepages.huge_page_size()
    # what it reports smaps shows, within the two edge regions it may share with neighbours
    # (the mapping may hold other huge pages too: the heap, for one)
    middle = t.data_ptr() + t.nbytes // 2
    assert _anon_huge_kib(middle) * 1024 >= moved - 2 * size
    # the 2 MiB regions wholly inside the tensor (7 of its 8 or 9): MADV_COLLAPSE is best
    # effort (on a loaded machine CI's runs saw ENOMEM, EAGAIN and EINVAL, the kernel's answer
    # for a region it could not collapse this time), so only when it says it did them all must
    # smaps show them all; the values never change
    inner = -(-t.data_ptr() // size) * size
    inner_len = (t.data_ptr() + t.nbytes) // size * size - inner
    assert inner_len >= 7 * size
    err = hugepages._madvise(inner, inner_len)
    assert torch.equal(t, before)
    if err == 0:
        assert _anon_huge_kib(middle) * 1024 >= inner_len


def test_off_switch(monkeypatch):
    monkeypatch.setenv("EPCLUSTER_HUGE_PAGES", "0")
    assert not hugepages.enabled()
    t = torch.randn(4 << 20)
    assert hugepages.collapse([t]) == 0
    hugepages.advise([t])  # does nothing, raises nothing
    monkeypatch.setenv("EPCLUSTER_HUGE_PAGES", "1")
    assert hugepages.enabled() == (
        hugepages._THP.joinpath("enabled").exists()
        and "[never]" not in hugepages._THP.joinpath("enabled").read_text()
    )


def test_cuda_and_meta_tensors_are_left_alone():
    assert hugepages.collapse([torch.empty(4 << 20, device="meta")]) == 0


def test_read_weights_are_the_panel_copies_not_the_embedding():
    model = load_model("tiny-random")
    weights = {id(t) for t in model.read_weights(min_bytes=0)}
    embed = model.model.embed_tokens.weight
    assert id(embed) not in weights
    packed = 0
    for module in model.modules():
        for p in module.parameters(recurse=False):
            copy = panel_copy(p)
            if copy is not None:  # read through its copy in panels
                packed += 1
                assert id(copy) in weights and id(p) not in weights
            elif not isinstance(module, nn.Embedding):
                assert id(p) in weights
    assert packed > 0  # the CPU kernels packed the dense projections at prepare
    attn = model.model.layers[0].self_attn
    assert id(attn.w_uk) in weights and id(attn.w_uv_t) in weights  # derived: absorbed MLA
    big = model.read_weights(min_bytes=1 << 30)
    assert big == []
