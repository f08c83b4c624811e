// int8 y = x @ W.T on CPU, for the MTP drafts' head (engine/speculative.py): W [N, K] held as
// int8 rows q [N, Kq] (Kq = K rounded up to 64, zeros past K) and one fp32 scale per row,
// quantized once by kernels/quantized.py (symmetric: scale[n] = max|W[n]| / 127). Two kernels:
// linear_int8, weight-only: y[m, n] = scale[n] * sum_k q[n, k] * x[m, k] with x in fp32 (int8
// widened to fp32 in registers, fp32 FMAs; any AVX2 CPU); and linear_int8_vnni, x quantized per
// row too, integer sums on AVX512-VNNI (below). kernels/cpu/build.py builds this file with the
// others.
//
// Why: at batch 1 a draft's head reads the whole fp32 lm_head (`small`: 32,000 x 768, 98 MB),
// about as many bytes as the MTP block and the main model's own head together; int8 reads a
// quarter of them. A draft only decides how many tokens a step keeps, never which (the verify
// does), so an approximate head costs acceptance at most, never a token.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

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


// ---- AVX512-VNNI: x quantized per row too (the AVX-512 build, where the CPU has it) --------
// vpdpbusd multiplies 64 unsigned bytes by 64 signed ones and adds each 4 products into a
// 32-bit lane: 64 multiply-adds an instruction where the fp32 FMAs above do 16 (and widen the
// weights first), so from ~8 rows up, where those are compute-bound, it is ~4x the rate. x is
// quantized per row (symmetric: xs = max|x[m]| / 127, round half to even) and offset to
// unsigned (xq + 128), which the weights' row sums take back out: y[m, n] = xs[m] * scale[n] *
// (sum_k (xq + 128) q - 128 sum_k q). The integer sums are exact, so x's rounding is the only
// error added to the weights' (kernels/quantized.py int8_linear_vnni_ref is the same numbers).
#if defined(__AVX512F__)
#define EPC_VNNI __attribute__((target("avx512f,avx512vnni")))

bool cpu_has_vnni() { return __builtin_cpu_supports("avx512vnni"); }

// x [M, K] -> xu [M, Kq] (xq + 128; 128, i.e. xq = 0, past K) and xs [M].
void quantize_x(const float* x, int64_t M, int64_t K, int64_t Kq, uint8_t* xu, float* xs) {
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * K;
    float amax = 0.0f;
    for (int64_t k = 0; k < K; ++k) amax = std::max(amax, std::fabs(row[k]));
    const float inv = amax > 0.0f ? 127.0f / amax : 0.0f;
    xs[m] = amax / 127.0f;
    uint8_t* out = xu + m * Kq;
    for (int64_t k = 0; k < K; ++k) {  // nearbyint: the default rounding, half to even
      const float v = std::min(127.0f, std::max(-127.0f, std::nearbyint(row[k] * inv)));
      out[k] = static_cast<uint8_t>(static_cast<int>(v) + 128);
    }
    std::fill(out + K, out + Kq, static_cast<uint8_t>(128));
  }
}

// As i8_tile, on the quantized x rows (ldx = Kq): whole 64-byte chunks, no tail.
template <int NW, int MX>
EPC_VNNI inline void vnni_tile(const int8_t* w, int64_t ldw, const float* scale,
                               const int32_t* sums, const uint8_t* xu, const float* xs,
                               int64_t Kq, float* out, int64_t ldo) {
  __m512i acc[NW][MX];
#pragma GCC unroll 8
  for (int j = 0; j < NW; ++j)
#pragma GCC unroll 8
    for (int i = 0; i < MX; ++i) acc[j][i] = _mm512_setzero_si512();
  const int64_t pf = kPrefetchRows * ldw;
  for (int64_t k = 0; k < Kq; k += kRowAlign) {
    __m512i wv[NW];
#pragma GCC unroll 8
    for (int j = 0; j < NW; ++j) {
      wv[j] = _mm512_loadu_si512(w + j * ldw + k);
      _mm_prefetch(reinterpret_cast<const char*>(w + j * ldw + k + pf), _MM_HINT_T0);
    }
#pragma GCC unroll 8
    for (int i = 0; i < MX; ++i) {
      const __m512i xv = _mm512_loadu_si512(xu + i * Kq + k);
#pragma GCC unroll 8
      for (int j = 0; j < NW; ++j) acc[j][i] = _mm512_dpbusd_epi32(acc[j][i], xv, wv[j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NW; ++j)
#pragma GCC unroll 8
    for (int i = 0; i < MX; ++i) {
      const int32_t s = _mm512_reduce_add_epi32(acc[j][i]) - 128 * sums[j];
      out[i * ldo + j] = static_cast<float>(s) * (xs[i] * scale[j]);
    }
}

template <int NW>
EPC_VNNI void vnni_rows(const int8_t* w, int64_t ldw, const float* scale, const int32_t* sums,
                        const uint8_t* xu, const float* xs, int64_t M, int64_t Kq, float* y,
                        int64_t ldy) {
  int64_t i = 0;
  for (; i + kTileM <= M; i += kTileM)
    vnni_tile<NW, kTileM>(w, ldw, scale, sums, xu + i * Kq, xs + i, Kq, y + i * ldy, ldy);
  const uint8_t* xt = xu + i * Kq;
  float* yt = y + i * ldy;
  switch (M - i) {
    case 1: vnni_tile<NW, 1>(w, ldw, scale, sums, xt, xs + i, Kq, yt, ldy); break;
    case 2: vnni_tile<NW, 2>(w, ldw, scale, sums, xt, xs + i, Kq, yt, ldy); break;
    case 3: vnni_tile<NW, 3>(w, ldw, scale, sums, xt, xs + i, Kq, yt, ldy); break;
    case 4: vnni_tile<NW, 4>(w, ldw, scale, sums, xt, xs + i, Kq, yt, ldy); break;
    case 5: vnni_tile<NW, 5>(w, ldw, scale, sums, xt, xs + i, Kq, yt, ldy); break;
    default: break;
  }
}
#else
bool cpu_has_vnni() { return false; }
#endif

void check_int8_args(const torch::Tensor& x, const torch::Tensor& q, const torch::Tensor& scale) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat && x.device().is_cpu() &&
                  x.is_contiguous(),
              "x: a contiguous fp32 [M, K] CPU matrix, got ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(q.dim() == 2 && q.scalar_type() == torch::kChar && q.device().is_cpu() &&
                  q.is_contiguous(),
              "q: a contiguous int8 [N, Kq] CPU matrix, got ", q.sizes(), " ", q.scalar_type());
  const int64_t K = x.size(1), N = q.size(0), Kq = q.size(1);
  TORCH_CHECK(Kq == (K + kRowAlign - 1) / kRowAlign * kRowAlign, "q ", q.sizes(),
              ": its rows must be K = ", K, " rounded up to ", kRowAlign);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N && scale.scalar_type() == torch::kFloat &&
                  scale.is_contiguous(),
              "scale: contiguous fp32 [", N, "], got ", scale.sizes(), " ", scale.scalar_type());
}

// run(n0) for every tile of kTileN weight rows from n0 (the last may have fewer), threads
// splitting them in contiguous ranges: each reads one stream.
template <class Run>
void for_row_tiles(int64_t N, int64_t Kq, const Run& run) {
  const int64_t tiles = (N + kTileN - 1) / kTileN;
  // NOTE: about 64 KiB of weights per task at least: below that a thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (1 << 16) / (Kq * kTileN));
  at::parallel_for(0, tiles, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) run(t * kTileN);
  });
}

}  // namespace

// x [M, K] fp32, q [N, Kq] int8 (Kq = K rounded up to 64; what is past K is never used), scale
// [N] fp32 -> [M, N] = x @ (q[:, :K] * scale[:, None]).T.
torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& q,
                          const torch::Tensor& scale) {
  check_int8_args(x, q, scale);
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0), Kq = q.size(1);
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for_row_tiles(N, Kq, [&](int64_t n0) {
    if (n0 + kTileN <= N) {
      i8_rows<kTileN>(qp + n0 * Kq, Kq, sp + n0, xp, M, K, yp + n0, N);
      return;
    }
    for (int64_t n = n0; n < N; ++n)  // the last rows: one at a time
      i8_rows<1>(qp + n * Kq, Kq, sp + n, xp, M, K, yp + n, N);
  });
  return y;
}

bool int8_vnni_available() { return cpu_has_vnni(); }

// linear_int8 with x quantized per row and AVX512-VNNI (int8_vnni_available()): x [M, K] fp32,
// q [N, Kq] int8 whose entries past K are 0 (kernels/quantized.py writes them so), scale [N]
// fp32, sums [N] int32 = q's row sums -> [M, N] = xs * (xq @ q.T) * scale.
torch::Tensor linear_int8_vnni(const torch::Tensor& x, const torch::Tensor& q,
                               const torch::Tensor& scale, const torch::Tensor& sums) {
  TORCH_CHECK(int8_vnni_available(), "linear_int8_vnni: this CPU or build has no AVX512-VNNI");
  check_int8_args(x, q, scale);
  const int64_t M = x.size(0), N = q.size(0);
  TORCH_CHECK(sums.dim() == 1 && sums.size(0) == N && sums.scalar_type() == torch::kInt &&
                  sums.is_contiguous(),
              "sums: contiguous int32 [", N, "], got ", sums.sizes(), " ", sums.scalar_type());
  auto y = torch::empty({M, N}, x.options());
  if (M == 0 || N == 0) return y;
#if defined(__AVX512F__)
  const int64_t K = x.size(1), Kq = q.size(1);
  std::vector<uint8_t> xu(M * Kq);
  std::vector<float> xs(M);
  quantize_x(x.data_ptr<float>(), M, K, Kq, xu.data(), xs.data());
  const int8_t* qp = q.data_ptr<int8_t>();
  const float* sp = scale.data_ptr<float>();
  const int32_t* sums_p = sums.data_ptr<int32_t>();
  const uint8_t* xp = xu.data();
  float* yp = y.data_ptr<float>();
  for_row_tiles(N, Kq, [&](int64_t n0) {
    if (n0 + kTileN <= N) {
      vnni_rows<kTileN>(qp + n0 * Kq, Kq, sp + n0, sums_p + n0, xp, xs.data(), M, Kq, yp + n0, N);
      return;
    }
    for (int64_t n = n0; n < N; ++n)
      vnni_rows<1>(qp + n * Kq, Kq, sp + n, sums_p + n, xp, xs.data(), M, Kq, yp + n, N);
  });
#endif
  return y;
}
