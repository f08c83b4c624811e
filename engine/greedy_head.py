"""The exact head's argmax for greedy rows, without reading the whole fp32 head (issue 29):
screened by its int8 copy (kernels/quantized.py), then the exact logits of the few candidates.

Legend (kernels/__init__.py): R rows, D hidden, V vocab, C candidates (of all rows together).

Per row x (the normed hidden state the head multiplies):
1. z = x @ (q * s).T, the int8 logits (the weight-only kernel `linear_int8`: fp32 x, so x adds no
   rounding of its own; VNNI would quantize x too, and its bound has K * max|x| where this one
   has ||x||_1, several times looser on real hidden states).
2. A rigorous bound E[n] >= |z[n] - y[n]|, y the exact logits as the engine computes them (the
   panel kernel of `kernels.linear.linear`, packed=True), `bound_factors` below.
3. The true argmax t has y[t] >= y[m] >= z[m] - E[m] for every m, and z[t] >= y[t] - E[t], so
   z[t] + E[t] >= lower = max_m (z[m] - E[m]): the candidates are the n with z[n] + E[n] >=
   lower. Every token tied at the exact maximum is one of them (the same argument). As
   lower >= max z - max E, an fp32 pass z >= max z - 2 max E finds every candidate first, and
   the bound's float64 arithmetic runs over those few tokens only.
4. The exact logits of the candidates only: their fp32 rows gathered and laid out in panels, then
   the same compiled kernel (`linear_panels`). NOTE: that kernel computes each output as one chain
   of fused multiply-adds over k in order from zero, whatever the panel, its column or the
   number of rows (kernels/cpu/gemm.cpp panel_tile), so these logits are bitwise the full head's:
   no near-tie fallback is needed (tests/engine/test_greedy_head.py asserts the equality), and
   the argmax over the candidates in vocabulary order, lowest index on ties, is
   `engine.sampler.argmax` of the full logits (which is torch.argmax's, NaN apart: none here).
A row falls back to the full head (None) where a bound could fail (a non-finite x, logits that
could overflow) or its prefilter leaves too many tokens to pay (max_candidates); a call of more
than MAX_ROWS rows does too.
"""

import logging
import math

import torch

from kernels import hugepages
from kernels.backend import use_cpu_kernel
from kernels.cpu.build import cpu_kernels
from kernels.quantized import QMAX, Int8Weight, quantize_rows

log = logging.getLogger(__name__)

U = 2.0**-24  # fp32's unit roundoff
# NOTE: a generous relative slack on the float64 arithmetic of the screen itself (its sums and
# products round at 2**-53), and an absolute one for fp32 underflow (each rounding in the
# subnormal range errs by up to 2**-150 absolutely; a row takes under 2**20 of them)
SLACK_REL = 2.0**-20
SLACK_ABS = 2.0**-100
# NOTE: past this many rows a step's head is compute-bound, and the weight-only int8 kernel
# (which widens every weight to fp32) is slower than the full head's panels (bench.linear
# --int8-head, small's head: 8 rows 0.93 ms against 2.17, 32 rows 3.95 against 3.37): the
# full head serves such steps.
MAX_ROWS = 16
# NOTE: "auto" screens a head of at least this many weights: the screen's Python costs ~40 us a
# row (the bound, the candidates), which a head pays back by reading a quarter of its bytes only
# from about a million fp32 weights (4 MB: ~0.1 ms at this machine's 40 GB/s); tiny's 512 x 64
# head reads in ~5 us, small's 32,000 x 768 in ~1.2 ms (docs/mtp.md)
AUTO_MIN_WEIGHTS = 2**20
FP32_SAFE = 1.0e38  # below float32's max (3.4e38) with room: no logit or partial sum overflows


def gamma(n: int) -> float:
    """n u / (1 - n u): the relative error bound of n fp32 roundings (Higham, Lemma 3.1)."""
    return n * U / (1 - n * U)


def bound_factors(head: Int8Weight, amax: torch.Tensor) -> torch.Tensor:
    """head: the int8 copy of w [V, D], amax [V] = max_k |w[n, k]| -> e [V] float64 with
    |z[n] - y[n]| <= e[n] * ||x||_1 for any finite x (no overflow).

    With K = in_features, s = scale[n], A = amax[n] (<= 127 s / (1 - u), s being A / 127
    rounded), exact real sums written S():
    - quantization: |s q[k] - w[k]| <= s (1/2 + 127.01 u) (q = round(fl(w / s)), the division
      rounded once; the clamp to 127 never bites below 127.5), so
      |s S(q x) - S(w x)| <= s (1/2 + 2**-12) ||x||_1;
    - the int8 kernel: K / lanes fused multiply-adds a lane, a tree of the lanes, one product by
      s: at most K + 6 roundings a term, |z - s S(q x)| <= gamma(K + 6) s S(|q x|) <=
      gamma(K + 6) 127 s ||x||_1;
    - the exact head: one FMA chain of K roundings, |y - S(w x)| <= gamma(K) A ||x||_1.
    NOTE: a row whose A / 127 is near or below fp32's normal range (s rounded with fewer bits,
    or to 0) takes the plain |z| + |y| <= (127 s + A) (1 + gamma(K + 6)) ||x||_1 instead.
    """
    k = head.in_features
    per_scale = 0.5 + 2.0**-12 + QMAX * gamma(k + 6) + QMAX * gamma(k) / (1 - U)
    s, a = head.scale.double(), amax.double()
    tiny = (QMAX * s + a) * (1 + gamma(k + 6)) * (1 + 2.0**-10)
    return torch.where(a < 2.0**-100, tiny, s * per_scale) * (1 + SLACK_REL)


class GreedyHead:
    """The screen over one head: its fp32 weight [V, D] (the model's lm_head, whose panel copy
    the full head reads), its int8 copy, and counters the bench reads (num_rows rows screened,
    num_candidates their candidates summed, num_fallbacks rows sent back to the full head)."""

    def __init__(
        self,
        weight: torch.Tensor,
        head: Int8Weight,
        max_candidates: int = 256,
        max_rows: int = MAX_ROWS,
    ) -> None:
        assert weight.dim() == 2 and weight.dtype == torch.float32, (weight.shape, weight.dtype)
        assert head.q.shape[0] == weight.shape[0] and head.in_features == weight.shape[1]
        self.weight = weight.detach()  # the same storage (lm_head's, never a copy)
        self.head, self.max_candidates, self.max_rows = head, max_candidates, max_rows
        self.factors = bound_factors(head, self.weight.abs().amax(dim=1))  # [V] float64
        self.max_factor = float(self.factors.max()) if self.factors.numel() else 0.0
        self.factors = self.factors.tolist()  # read per candidate pair, as Python floats
        # |z| and |y| <= 127 max(s) ||x||_1 (1 + gamma(K + 6)) (1 + u): this per unit of ||x||_1
        self.max_abs = float(head.scale.max()) * QMAX * (1 + 2.0**-10) if self.factors else 0.0
        # every |logit| and partial sum is at most max|w| ||x||_1 (1 + gamma), the int8 kernel's
        # unscaled sums 127 ||x||_1 (1 + gamma): all finite below this
        self.max_l1 = FP32_SAFE / (QMAX * 2 * max(float(head.scale.max()), 1.0))
        self.num_rows = self.num_candidates = self.num_fallbacks = 0

    def serves(self, x: torch.Tensor) -> bool:
        """Whether the full head over x takes the compiled panel kernel (so the candidates'
        logits are bitwise its own): fp32 CPU rows, the CPU kernels on, the weight contiguous."""
        return use_cpu_kernel(x) and self.weight.is_contiguous()

    def argmax(self, x: torch.Tensor) -> list[int | None]:
        """x [R, D] fp32 -> per row the exact head's argmax (lowest index on ties), or None where
        the row must take the full head (see the module docstring)."""
        assert x.dim() == 2 and x.shape[1] == self.weight.shape[1], x.shape
        if not 0 < x.shape[0] <= self.max_rows or not self.serves(x):
            return [None] * x.shape[0]
        x = x.contiguous()
        n = x.shape[0]
        kernels = cpu_kernels()
        # NOTE: the per-row and per-pair arithmetic runs on Python floats (IEEE float64, as
        # torch's): a row has a few dozen pairs, and a torch op costs a few us each.
        # Step 1: the int8 logits, z's maximum, each row's L1 norm (an upper bound to 2**-50)
        z = kernels.linear_int8(x, self.head.q, self.head.scale)  # [R, V] fp32
        top = kernels.argmax_rows(z)  # [R]
        zmax = z.gather(1, top[:, None]).flatten().tolist()  # [R]
        l1 = (x.double().abs().sum(dim=1) * (1 + SLACK_REL)).tolist()  # [R]
        slack, thr = [0.0] * n, [math.nan] * n  # a row that cannot be bounded: no pairs
        for r in range(n):
            # x finite with ||x||_1 under max_l1: no logit or partial sum overflows
            if not (math.isfinite(l1[r]) and l1[r] < self.max_l1):
                continue
            # the slack covers the float64 roundings below: 2**-53 of |z| (<= 127 max(s)
            # ||x||_1 (1 + gamma), the |z|_max bound) + err at most
            slack[r] = l1[r] * (self.max_abs + self.max_factor) * SLACK_REL + SLACK_ABS
            emax = l1[r] * self.max_factor + slack[r]  # >= every token's bound
            # Step 2 (below): lower >= zmax - emax (z's own argmax), so a candidate has z >=
            # zmax - 2 emax; that threshold lowered past its rounding to fp32
            t = zmax[r] - 2 * emax
            thr[r] = t - abs(t) * SLACK_REL - SLACK_ABS
        # Step 2: an fp32 prefilter, one pass over z
        rows, cols = (z >= torch.tensor(thr, dtype=torch.float32)[:, None]).nonzero(as_tuple=True)
        # a row past max_candidates pairs falls back now: the loops below cost ~1 us a pair
        crowded = torch.bincount(rows, minlength=n) > self.max_candidates  # [R]
        if bool(crowded.any()):
            kept = ~crowded[rows]
            rows, cols = rows[kept], cols[kept]
        pairs = list(zip(rows.tolist(), cols.tolist(), z[rows, cols].tolist(), strict=True))
        # Step 3: the bound and the candidates, over those pairs only
        lower = [-math.inf] * n
        for r, c, v in pairs:
            lower[r] = max(lower[r], v - (l1[r] * self.factors[c] + slack[r]))
        cands: list[list[int]] = [[] for _ in range(n)]  # in vocabulary order (nonzero's)
        for r, c, v in pairs:
            if v + (l1[r] * self.factors[c] + slack[r]) >= lower[r]:
                cands[r].append(c)
        screened = [r for r in range(n) if 0 < len(cands[r]) <= self.max_candidates]
        self.num_rows += n
        self.num_candidates += sum(len(cands[r]) for r in screened)
        self.num_fallbacks += n - len(screened)
        out: list[int | None] = [None] * n
        if not screened:
            return out
        # Step 4: exact logits of the candidates of all screened rows, bitwise the full head's
        union = sorted({c for r in screened for c in cands[r]})  # [C]
        at = {c: j for j, c in enumerate(union)}
        packed = kernels.pack_panels(self.weight.index_select(0, torch.tensor(union)))
        exact = kernels.linear_panels(x[screened], packed, len(union)).tolist()  # [r, C]
        for row, r in zip(exact, screened, strict=True):
            best = cands[r][0]
            for c in cands[r][1:]:  # ascending: a tie keeps the lower index, as the full argmax
                if row[at[c]] > row[at[best]]:
                    best = c
            out[r] = best
        return out

    @property
    def mean_candidates(self) -> float:
        """Candidates per screened row so far (0 before any)."""
        screened = self.num_rows - self.num_fallbacks
        return self.num_candidates / screened if screened else 0.0


def greedy_head(
    weight: torch.Tensor, choice: str, shared: tuple[torch.Tensor, Int8Weight] | None = None
) -> GreedyHead | None:
    """The screen EngineConfig.greedy_head asks for over lm_head's weight [V, D] ("auto":
    where the compiled CPU kernels serve it and it has AUTO_MIN_WEIGHTS or more), or None (the
    full head for every row). shared: (a weight, its int8 copy) already held, the drafts',
    reused when it is this weight (one copy, not two); else a copy is made now. Raises
    ValueError for "screened" where the kernels do not serve."""
    serves = use_cpu_kernel(weight) and weight.is_contiguous()
    if choice == "exact" or (
        choice == "auto" and not (serves and weight.numel() >= AUTO_MIN_WEIGHTS)
    ):
        return None
    if not serves:
        raise ValueError(
            "greedy_head screened: the compiled CPU kernels do not serve this model's head "
            f"({weight.dtype} on {weight.device}): set auto or exact"
        )
    if shared is not None and _same_tensor(shared[0], weight):
        return GreedyHead(weight, shared[1])
    head = quantize_rows(weight)
    hugepages.collapse([head.q])  # as the model's weights (moe/model.py)
    log.info("greedy rows: an int8 copy of lm_head to screen them, %.1f MB", head.nbytes / 1e6)
    return GreedyHead(weight, head)


def _same_tensor(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b are the same elements of one storage (a weight under two names)."""
    return (a.data_ptr(), a.shape, a.stride(), a.dtype) == (
        b.data_ptr(),
        b.shape,
        b.stride(),
        b.dtype,
    )
