// Weight-only int8 y = x @ W.T on CPU, for the MTP drafts' head (engine/speculative.py): W [N, K]
// held as int8 rows q [N, Kq] (Kq = K rounded up to 64) and one fp32 scale per row, quantized
// once by kernels/quantized.py (symmetric: scale[n] = max|W[n]| / 127), and
// y[m, n] = scale[n] * sum_k q[n, k] * x[m, k], x in fp32. kernels/cpu/build.py builds this file
// with the others.
//
// Why: at batch 1 a draft's head reads the whole fp32 lm_head (`small`: 32,000 x 768, 98 MB),
// about as many bytes as the MTP block and the main model's own head together; int8 reads a
// quarter of them. A draft only decides how many tokens a step keeps, never which (the verify
// does), so an approximate head costs acceptance at most, never a token.
// Why weight-only (int8 widened to fp32 in registers, fp32 FMAs) and not x quantized per row
// for AVX512-VNNI (vpdpbusd): at a few rows the read of W bounds it either way, and the sums
// are then exact up to fp32 rounding of the dequantized weights (tests/kernels compares with
// torch over q * scale), with no second error from x.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>

#include "kernels.h"
#include "simd.h"

namespace {

using epc::kLanes;
using epc::vec;

constexpr int64_t kRowAlign = 64;  // Kq: K rounded up to this (a row is whole cache lines)
constexpr int kTileN = kLanes == 16 ? 4 : 2;  // weight rows per tile (as epc::kTileW)
constexpr int kTileM = 6;  // rows of x per tile: kTileN x kTileM accumulators in registers
constexpr int64_t kPrefetchRows = 16;  // a tile prefetches the weight rows this far ahead

// out[i * ldo + j] = scale[j] * sum_k w[j * ldw + k] * x[i * ldx + k] for i < MX, j < NW.
// Each weight vector is widened once and used for all MX rows of x; its cache line 16 rows
// ahead is prefetched (the thread's rows are one sequential stream: the next tiles').
// NOTE: every output sums lane-wise over k, then the lanes, then scales: the same order
// whatever MX, so a row's result does not depend on the rows beside it.
template <int NW, int MX>
inline void i8_tile(const int8_t* w, int64_t ldw, const float* scale, const float* x,
                    int64_t ldx, int64_t K, float* out, int64_t ldo) {
  vec acc[NW][MX];
#pragma GCC unroll 8
  for (int j = 0; j < NW; ++j)
#pragma GCC unroll 8
    for (int i = 0; i < MX; ++i) acc[j][i] = epc::vzero();
  const int64_t pf = kPrefetchRows * ldw;
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    vec wv[NW];
#pragma GCC unroll 8
    for (int j = 0; j < NW; ++j) wv[j] = epc::vload_i8(w + j * ldw + k);
    if ((k & (kRowAlign - 1)) == 0) {
#pragma GCC unroll 8
      for (int j = 0; j < NW; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w + j * ldw + k + pf), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MX; ++i) {
      const vec xv = epc::vload(x + i * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < NW; ++j) acc[j][i] = epc::vfma(wv[j], xv, acc[j][i]);
    }
  }
  if (k < K) {  // x's tail loads zeros past K; q's row is read whole (Kq >= k + kLanes)
    const int n = static_cast<int>(K - k);
    vec wv[NW];
#pragma GCC unroll 8
    for (int j = 0; j < NW; ++j) wv[j] = epc::vload_i8(w + j * ldw + k);
#pragma GCC unroll 8
    for (int i = 0; i < MX; ++i) {
      const vec xv = epc::vload_n(x + i * ldx + k, n);
#pragma GCC unroll 8
      for (int j = 0; j < NW; ++j) acc[j][i] = epc::vfma(wv[j], xv, acc[j][i]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NW; ++j)
#pragma GCC unroll 8
    for (int i = 0; i < MX; ++i) out[i * ldo + j] = epc::vsum(acc[j][i]) * scale[j];
}

// NW weight rows against all M rows of x, kTileM at a time.
template <int NW>
void i8_rows(const int8_t* w, int64_t ldw, const float* scale, const float* x, int64_t M,
             int64_t K, float* y, int64_t ldy) {
  int64_t i = 0;
  for (; i + kTileM <= M; i += kTileM)
    i8_tile<NW, kTileM>(w, ldw, scale, x + i * K, K, K, y + i * ldy, ldy);
  const float* xt = x + i * K;
  float* yt = y + i * ldy;
  switch (M - i) {
    case 1: i8_tile<NW, 1>(w, ldw, scale, xt, K, K, yt, ldy); break;
    case 2: i8_tile<NW, 2>(w, ldw, scale, xt, K, K, yt, ldy); break;
    case 3: i8_tile<NW, 3>(w, ldw, scale, xt, K, K, yt, ldy); break;
    case 4: i8_tile<NW, 4>(w, ldw, scale, xt, K, K, yt, ldy); break;
    case 5: i8_tile<NW, 5>(w, ldw, scale, xt, K, K, yt, ldy); break;
    default: break;
  }
}

}  // namespace

// x [M, K] fp32, q [N, Kq] int8 (Kq = K rounded up to 64; what is past K is never used), scale
// [N] fp32 -> [M, N] = x @ (q[:, :K] * scale[:, None]).T. Threads split the weight rows in
// contiguous ranges (each reads one stream).
torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& q,
                          const torch::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.device().is_cpu() &&
                  x.is_contiguous(),
              "x: a contiguous fp32 [M, K] CPU matrix, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.device().is_cpu() &&
                  q.is_contiguous(),
              "q: a contiguous int8 [N, Kq] CPU matrix, got ", q.sizes(), " ", q.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), Kq = q.size(1);
  TORCH_CHECK(Kq == (K + kRowAlign - 1) / kRowAlign * kRowAlign, "q ", q.sizes(),
              ": its rows must be K = ", K, " rounded up to ", kRowAlign);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.scalar_type() == torch::kFloat &&
                  scale.is_contiguous(),
              "scale: contiguous fp32 [", N, "], got ", scale.sizes(), " ", scale.scalar_type());
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t tiles = (N + kTileN - 1) / kTileN;
  // NOTE: about 64 KiB of weights per task at least: below that a thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (Kq * kTileN));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t n0 = t * kTileN;
      const int8_t* w = qp + n0 * Kq;
      if (n0 + kTileN <= N) {
        i8_rows<kTileN>(w, Kq, sp + n0, xp, M, K, yp + n0, N);
      } else {
        for (int64_t n = n0; n < N; ++n)  // the last rows: one at a time
          i8_rows<1>(qp + n * Kq, Kq, sp + n, xp, M, K, yp + n, N);
      }
    }
  });
  return y;
}
