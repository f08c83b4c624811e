"""The branches of the Triton kernels' dots, and how the tests run each one in the interpreter.

A kernel over bf16/fp16 tiles has two branches (its FP32_DOT constexpr, chosen by each wrapper's
`fp32_dot` argument): the tensor-core dot of the 16-bit tiles, or tiles cast to fp32 and an IEEE
dot; fp32 data takes the second only. Triton's interpreter keeps bf16 tiles as their raw uint16
bits, and its tl.dot multiplies those integers, so the bf16 tensor-core branch cannot run there as
written: `DotRecorder` replaces the interpreter's dot of bf16 tiles by an exact one. Each tile is
widened to fp32 (exact: a bf16 number is the top half of an fp32 one) and multiplied with fp32
sums, which is what a tensor core computes up to the order of its sums. Everything else in the
branch runs as written: the loads and their masks, the index arithmetic, the casts to bf16. fp16
tiles need nothing (the interpreter holds them as numpy float16).
"""

from collections import Counter

import numpy as np
import pytest
import torch

# (input dtype, fp32_dot, the one kind of dot that branch runs: operand dtypes and precision)
BRANCHES = [
    pytest.param(torch.float32, True, "fp32 x fp32 ieee", id="fp32-ieee"),
    pytest.param(torch.bfloat16, True, "fp32 x fp32 ieee", id="bf16-ieee"),
    pytest.param(torch.bfloat16, False, "bf16 x bf16 tf32", id="bf16-mma"),
    pytest.param(torch.float16, False, "fp16 x fp16 tf32", id="fp16-mma"),
]


class DotRecorder:
    """Counts the interpreter's tl.dot calls by kind ("bf16 x bf16 tf32": operand dtypes, then
    the input precision, which a 16-bit dot ignores) while it makes bf16 dots exact (see the
    module's docstring). On a GPU the kernels are compiled: nothing is patched or counted."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        from kernels import backend

        self.counts: Counter[str] = Counter()
        self.interpreted = backend.interpreting()
        if self.interpreted:
            from triton.runtime import interpreter

            original = interpreter.InterpreterBuilder.create_dot
            monkeypatch.setattr(
                interpreter.InterpreterBuilder, "create_dot", self._exact_dot(original)
            )

    def _exact_dot(self, original):
        from triton.runtime.interpreter import TensorHandle

        def create_dot(builder, a, b, acc, input_precision, max_num_imprecise_acc):
            precision = getattr(input_precision, "name", str(input_precision)).lower()
            self.counts[f"{a.dtype.name} x {b.dtype.name} {precision}"] += 1
            if a.dtype.name != "bf16" and b.dtype.name != "bf16":
                return original(builder, a, b, acc, input_precision, max_num_imprecise_acc)
            assert a.dtype.name == b.dtype.name == "bf16", (a.dtype, b.dtype)
            widen = lambda bits: (bits.astype(np.uint32) << 16).view(np.float32)
            product = np.matmul(widen(a.data), widen(b.data), dtype=np.float32)
            return TensorHandle(product + acc.data, acc.dtype.scalar)

        return create_dot

    def assert_only(self, kind: str) -> None:
        """Every dot since the recorder was made was of `kind`, and there was one at least: the
        kernel took the branch the test asked for."""
        if self.interpreted:
            assert set(self.counts) == {kind}, dict(self.counts)
