"""int8 projections (kernels/quantized.py, kernels/cpu/quantized.cpp): the quantization of
hand-made rows of W and of x (scales, a zero row, ties to even, the padding), its error bound on
random rows; the weight-only kernel against the exact product of the quantized weights (float64
over q and scale) within the fp32 summation bound, and the VNNI kernel equal to its torch
reference (integer sums are exact): random shapes with N and K off the vector width and the
tiles, a row's result independent of the rows beside it, wrong inputs refused; and the file
built for AVX2 (8 lanes, the other code path) alone."""

import hashlib
from types import ModuleType

import pytest
import torch
from torch.utils import cpp_extension

from kernels.cpu.prebuilt import FLAGS, HERE, LDFLAGS
from kernels.quantized import (
    ROW_ALIGN,
    Int8Weight,
    int8_linear,
    int8_linear_ref,
    int8_linear_vnni_ref,
    quantize_rows,
    quantize_x,
)

U = 2.0**-24  # fp32's unit roundoff


def test_hand_made_rows() -> None:
    """Scales max|row| / 127 (a negative max too), ties to even, a zero row, zeros past K."""
    w = torch.tensor(
        [
            [15.875, -0.0625, 0.1875, 0.3125, -15.875],  # scale 0.125: -0.5, 1.5, 2.5 are ties
            [0.0, 0.0, 0.0, 0.0, 0.0],
            [-31.75, 15.875, 0.625, 31.75, -15.875],  # max |-31.75|: scale 0.25, +-63.5 ties
            [1e-30, 0.0, -1e-30, 2e-31, 0.0],  # tiny but not zero
        ]
    )
    got = quantize_rows(w)
    assert got.q.shape == (4, ROW_ALIGN) and got.q.dtype == torch.int8
    assert got.in_features == 5 and torch.all(got.q[:, 5:] == 0)
    assert got.scale[0].item() == 0.125 and got.scale[1].item() == 0.0
    assert got.scale[2].item() == 0.25
    assert got.scale[3].item() == pytest.approx(1e-30 / 127, rel=1e-6)
    assert got.q[0, :5].tolist() == [127, 0, 2, 2, -127]
    assert got.q[1].abs().sum().item() == 0
    assert got.q[2, :5].tolist() == [-127, 64, 2, 127, -64]
    assert got.q[3, :5].tolist() == [127, 0, -127, 25, 0]
    assert got.sums.tolist() == [4, 0, 2, 25] and got.sums.dtype == torch.int32
    assert got.nbytes == 4 * ROW_ALIGN + 4 * 4 + 4 * 4
    assert got.dequantize()[0].tolist() == [15.875, 0.0, 0.25, 0.25, -15.875]


def test_random_rows_are_within_half_a_step() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(300, 131, generator=gen) * torch.rand(300, 1, generator=gen) * 10
    got = quantize_rows(w)
    assert got.q.shape == (300, 192)
    assert torch.all(got.q[:, :131].abs().amax(dim=1) == 127)  # every row reaches its max
    err = (got.dequantize() - w).abs()
    assert torch.all(err <= got.scale[:, None] * (0.5 + 1e-5))


def test_hand_made_rows_of_x() -> None:
    """x per row as the VNNI kernel quantizes it: scale max|row| / 127, ties to even."""
    x = torch.tensor([[127.0, 0.5, 1.5, -2.5, -0.5], [0.0] * 5, [-12.7, 0.05, 6.35, 0.0, 1.0]])
    xq, xs = quantize_x(x)
    assert xq[0].tolist() == [127, 0, 2, -2, 0] and xq[1].tolist() == [0] * 5
    assert xq[2, 0].item() == -127 and xq[2, 3].item() == 0 and xq[2, 4].item() == 10
    assert xs.tolist() == pytest.approx([1.0, 0.0, 0.1])


def face_checked(got: torch.Tensor, x: torch.Tensor, w: Int8Weight, kernels) -> None:
    """int8_linear's result: the VNNI kernel's numbers where it serves, else weight-only's."""
    if kernels.int8_vnni:
        assert torch.equal(got, int8_linear_vnni_ref(x, w))
    else:
        within_rounding(got, x, w)


def exact(x: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    """x @ (q * scale).T in float64: the product the kernel rounds."""
    q = w.q[:, : w.in_features].double()
    return (x.double() @ q.T) * w.scale.double()


def within_rounding(got: torch.Tensor, x: torch.Tensor, w: Int8Weight) -> None:
    """|got - exact| <= (K + 2) u sum_k |x q| scale: fp32 sums of K terms in any order, the
    product by the scale and the conversion of each int8 (exact) bound it."""
    k = w.in_features
    q = w.q[:, :k].double()
    bound = (k + 2) * U * (x.double().abs() @ q.abs().T) * w.scale.double() + 1e-30
    err = (got.double() - exact(x, w)).abs()
    assert torch.all(err <= bound), (err / bound).max().item()


# rows: tiles of 6 and the rests; N: tiles of 4 (AVX2: 2) and a rest; K: vector tails (16, 8)
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 32])
@pytest.mark.parametrize(("n_out", "k"), [(1, 8), (7, 17), (33, 96), (301, 100), (1000, 768)])
def test_linear_int8_is_the_product_of_the_quantized_weights(kernels, rows, n_out, k) -> None:
    gen = torch.Generator().manual_seed(rows * 1000 + n_out + k)
    x, w = torch.randn(rows, k, generator=gen), quantize_rows(torch.randn(n_out, k, generator=gen))
    got = kernels.linear_int8(x, w.q, w.scale)
    assert got.shape == (rows, n_out) and got.dtype == torch.float32
    within_rounding(got, x, w)
    within_rounding(int8_linear_ref(x, w), x, w)  # the reference agrees
    face_checked(int8_linear(x, w), x, w, kernels)


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 13, 32])
@pytest.mark.parametrize(("n_out", "k"), [(1, 8), (7, 17), (33, 96), (301, 100), (1000, 768)])
def test_linear_int8_vnni_is_its_reference(kernels, rows, n_out, k) -> None:
    """x quantized per row, integer sums (exact), then fp32 scales: the same numbers as torch's
    (|sums| < 2^24 here, so their conversion to fp32 is exact too)."""
    gen = torch.Generator().manual_seed(rows * 1000 + n_out + k + 1)
    x, w = torch.randn(rows, k, generator=gen), quantize_rows(torch.randn(n_out, k, generator=gen))
    x[0, 0] = 0.0
    if not kernels.int8_vnni:  # this CPU or build: the kernel refuses, the face takes linear_int8
        with pytest.raises(RuntimeError, match="no AVX512-VNNI"):
            kernels.linear_int8_vnni(x, w.q, w.scale, w.sums)
        return
    got = kernels.linear_int8_vnni(x, w.q, w.scale, w.sums)
    assert got.shape == (rows, n_out)
    assert torch.equal(got, int8_linear_vnni_ref(x, w))
    # x's rounding adds at most half a step of each row: |err| <= xs / 2 * sum_k |q| * scale
    _, xs = quantize_x(x)
    bound = xs[:, None] / 2 * w.q.abs().sum(1).float()[None, :] * w.scale[None, :] * 1.001
    assert torch.all((got.double() - exact(x, w)).abs() <= bound.double() + 1e-6)


@pytest.mark.parametrize("vnni", [False, True], ids=["weight-only", "vnni"])
def test_rows_are_independent_of_the_batch(kernels, vnni: bool) -> None:
    gen = torch.Generator().manual_seed(1)
    x, w = torch.randn(13, 70, generator=gen), quantize_rows(torch.randn(41, 70, generator=gen))
    if vnni and not kernels.int8_vnni:  # refused on this CPU or build (the face never calls it)
        with pytest.raises(RuntimeError, match="no AVX512-VNNI"):
            kernels.linear_int8_vnni(x, w.q, w.scale, w.sums)
        return

    def run(rows: torch.Tensor) -> torch.Tensor:
        if vnni:
            return kernels.linear_int8_vnni(rows, w.q, w.scale, w.sums)
        return kernels.linear_int8(rows, w.q, w.scale)

    assert torch.equal(run(x), torch.cat([run(x[i : i + 1]) for i in range(13)]))


def test_zero_rows_and_empty_inputs(kernels) -> None:
    w = quantize_rows(torch.cat([torch.zeros(3, 20), torch.ones(2, 20)]))
    got = kernels.linear_int8(torch.randn(4, 20), w.q, w.scale)
    assert torch.equal(got[:, :3], torch.zeros(4, 3))
    assert kernels.linear_int8(torch.randn(0, 20), w.q, w.scale).shape == (0, 5)
    if kernels.int8_vnni:
        x = torch.cat([torch.zeros(1, 20), torch.randn(3, 20)])  # a zero row of x too
        got = kernels.linear_int8_vnni(x, w.q, w.scale, w.sums)
        assert torch.equal(got[:, :3], torch.zeros(4, 3)) and torch.equal(got[0], torch.zeros(5))
        assert kernels.linear_int8_vnni(x[:0], w.q, w.scale, w.sums).shape == (0, 5)


def test_the_face_keeps_leading_dims_and_falls_back(kernels, monkeypatch) -> None:
    gen = torch.Generator().manual_seed(2)
    x, w = torch.randn(2, 3, 40, generator=gen), quantize_rows(torch.randn(9, 40, generator=gen))
    got = int8_linear(x, w)
    assert got.shape == (2, 3, 9)
    face_checked(got.view(6, 9), x.view(6, 40), w, kernels)
    monkeypatch.setenv("EPCLUSTER_KERNELS", "reference")
    assert torch.equal(int8_linear(x, w), int8_linear_ref(x, w))


def test_refuses_what_it_cannot_take(kernels) -> None:
    w = quantize_rows(torch.randn(3, 70))
    with pytest.raises(RuntimeError, match="rounded up to 64"):
        kernels.linear_int8(torch.randn(2, 60), w.q, w.scale)  # q is for K = 70
    with pytest.raises(RuntimeError, match="int8"):
        kernels.linear_int8(torch.randn(2, 70), w.q.float(), w.scale)
    with pytest.raises(RuntimeError, match="fp32"):
        kernels.linear_int8(torch.randn(2, 70).double(), w.q, w.scale)
    with pytest.raises(RuntimeError, match="scale"):
        kernels.linear_int8(torch.randn(2, 70), w.q, w.scale[:2])
    with pytest.raises(RuntimeError, match="contiguous"):
        kernels.linear_int8(torch.randn(70, 2).T, w.q, w.scale)
    if kernels.int8_vnni:
        with pytest.raises(RuntimeError, match="sums: contiguous int32"):
            kernels.linear_int8_vnni(torch.randn(2, 70), w.q, w.scale, w.sums.long())
        with pytest.raises(RuntimeError, match="rounded up to 64"):
            kernels.linear_int8_vnni(torch.randn(2, 60), w.q, w.scale, w.sums)


AVX2_BINDING = """#include <torch/extension.h>
#include "kernels.h"
#include "simd.h"
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_int8", &linear_int8);
  m.attr("lanes") = epc::kLanes;
}
"""


@pytest.fixture(scope="module")
def avx2(tmp_path_factory: pytest.TempPathFactory, kernels: ModuleType) -> ModuleType:
    """quantized.cpp alone, built with the AVX2 build's flags (named by its sources' hash, so
    torch's extension cache builds it once: ~40 s); where the `kernels` fixture serves."""
    sources = [HERE / name for name in ("quantized.cpp", "simd.h", "kernels.h")]
    digest = hashlib.sha256(AVX2_BINDING.encode() + b"".join(p.read_bytes() for p in sources))
    name = f"epcluster_quantized_avx2_{digest.hexdigest()[:10]}"
    binding = tmp_path_factory.mktemp("avx2") / "binding.cpp"
    binding.write_text(AVX2_BINDING)
    return cpp_extension.load(
        name,
        [str(HERE / "quantized.cpp"), str(binding)],
        extra_cflags=FLAGS["AVX2"],
        extra_ldflags=LDFLAGS,
        extra_include_paths=[str(HERE)],
    )


@pytest.mark.slow
@pytest.mark.parametrize("rows", [1, 3, 7])
@pytest.mark.parametrize(("n_out", "k"), [(5, 8), (33, 17), (301, 100)])
def test_the_avx2_build(avx2, rows, n_out, k) -> None:
    assert avx2.lanes == 8
    gen = torch.Generator().manual_seed(rows * 1000 + n_out + k)
    x, w = torch.randn(rows, k, generator=gen), quantize_rows(torch.randn(n_out, k, generator=gen))
    got = avx2.linear_int8(x, w.q, w.scale)
    within_rounding(got, x, w)
    alone = torch.cat([avx2.linear_int8(x[i : i + 1], w.q, w.scale) for i in range(rows)])
    assert torch.equal(got, alone)
