"""kernels/linear.py against F.linear, whichever path serves (the compiled kernel, W @ x.T,
F.linear): odd shapes, row counts on both sides of each switch, layouts the kernel cannot take,
and EPCLUSTER_KERNELS=reference."""

import pytest
import torch
import torch.nn.functional as F

from kernels.linear import SMALL_ROWS, Linear, linear


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 12, 13, 32, 33, 100])
@pytest.mark.parametrize(("out_features", "in_features"), [(7, 8), (33, 96), (1152, 384)])
def test_equals_f_linear(rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen)
    got = linear(x, w)
    assert got.shape == (rows, out_features) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)  # sums of ~20


def test_layouts_the_kernel_cannot_take_fall_back():
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(1, 64, generator=gen), torch.randn(64, 9, generator=gen).T  # strided W
    torch.testing.assert_close(linear(x, w), F.linear(x, w))
    x64, w64 = x.double(), torch.randn(5, 64, dtype=torch.float64, generator=gen)
    torch.testing.assert_close(linear(x64, w64), F.linear(x64, w64))
    x3 = torch.randn(2, 3, 64, generator=gen)  # leading dims
    w3 = torch.randn(10, 64, generator=gen)
    torch.testing.assert_close(linear(x3, w3), F.linear(x3, w3), rtol=1e-5, atol=1e-5)
    assert SMALL_ROWS >= 8


def test_reference_mode_is_f_linear(monkeypatch):
    monkeypatch.setenv("EPCLUSTER_KERNELS", "reference")
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(4, 48, generator=gen), torch.randn(20, 48, generator=gen)
    assert torch.equal(linear(x, w), F.linear(x, w))


def test_the_module_keeps_nn_linear_state():
    layer = Linear(16, 8, bias=False)
    assert list(layer.state_dict()) == ["weight"]
    x = torch.randn(3, 16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))


def test_no_rows():
    x, w = torch.randn(0, 16), torch.randn(5, 16)
    assert linear(x, w).shape == (0, 5)
    assert linear(torch.randn(2, 0, 16), w).shape == (2, 0, 5)
