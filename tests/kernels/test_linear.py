"""kernels/linear.py against F.linear: every path (the AVX2 kernel, W @ x.T, F.linear) on odd
shapes, row counts on both sides of each switch, and layouts the kernel must refuse."""

import pytest
import torch
import torch.nn.functional as F

from kernels.linear import KERNEL_ROWS, SMALL_ROWS, Linear, cpu_kernel, linear


@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 12, 13, 32, 33, 100])
@pytest.mark.parametrize(("out_features", "in_features"), [(7, 8), (33, 96), (1152, 384)])
def test_equals_f_linear(rows, out_features, in_features):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    x = torch.randn(rows, in_features, generator=gen)
    w = torch.randn(out_features, in_features, generator=gen)
    got = linear(x, w)
    assert got.shape == (rows, out_features) and got.is_contiguous()
    torch.testing.assert_close(got, F.linear(x, w), rtol=1e-5, atol=1e-4)  # sums of ~20


def test_the_kernel_builds_here_and_is_row_independent():
    """On an AVX2 machine the kernel is there; a row's result does not depend on the others."""
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("no AVX2 on this CPU: the torch paths serve")
    kernel = cpu_kernel()
    assert kernel is not None
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(11, 64, generator=gen), torch.randn(40, 64, generator=gen)
    together = kernel.few_rows_linear(x, w)
    alone = torch.cat([kernel.few_rows_linear(x[i : i + 1], w) for i in range(11)])
    assert torch.equal(together, alone)
    torch.testing.assert_close(together, x @ w.T, rtol=1e-5, atol=1e-5)


def test_layouts_the_kernel_cannot_take_fall_back():
    gen = torch.Generator().manual_seed(1)
    odd = torch.randn(1, 30, generator=gen), torch.randn(9, 30, generator=gen)  # K % 8 != 0
    torch.testing.assert_close(linear(*odd), F.linear(*odd))
    x, w = torch.randn(1, 64, generator=gen), torch.randn(64, 9, generator=gen).T  # strided W
    torch.testing.assert_close(linear(x, w), F.linear(x, w))
    x64, w64 = x.double(), torch.randn(5, 64, dtype=torch.float64, generator=gen)
    torch.testing.assert_close(linear(x64, w64), F.linear(x64, w64))
    assert 1 in KERNEL_ROWS and max(KERNEL_ROWS) <= SMALL_ROWS


def test_the_module_keeps_nn_linear_state():
    layer = Linear(16, 8, bias=False)
    assert list(layer.state_dict()) == ["weight"]
    x = torch.randn(3, 16)
    torch.testing.assert_close(layer(x), F.linear(x, layer.weight))
