// The vector layer of the CPU kernels (kernels/cpu/gemm.cpp, kernels/cpu/attention.cpp,
// kernels/cpu/quantized.cpp): one fp32 vector type for the width the build targets (AVX-512: 16
// lanes, else AVX2 + FMA: 8), int8 loaded as fp32, the dot-product tile both fp32 kernels are
// made of, and an exp accurate to a few ulp.
//
// Every dot product here sums in one fixed order that depends only on its length (lane-wise
// partial sums, then the lanes), never on how many rows share a call: a row's result does not
// depend on the batch around it.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cstdint>

namespace epc {

#if defined(__AVX512F__)
using vec = __m512;
constexpr int kLanes = 16;
constexpr int kTileW = 4;  // weight rows per dot tile: 4 x 6 accumulators of the 32 registers
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vset(float x) { return _mm512_set1_ps(x); }
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline vec vload_n(const float* p, int n) {  // the first n lanes, zeros after
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
inline vec vload_i8(const int8_t* p) {  // kLanes int8 as fp32 (exact)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes));
}
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline void vstore_n(float* p, vec v, int n) {
  _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v);
}
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm512_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm512_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm512_div_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm512_max_ps(a, b); }
inline vec vmin(vec a, vec b) { return _mm512_min_ps(a, b); }
inline float vsum(vec v) { return _mm512_reduce_add_ps(v); }
inline float vhmax(vec v) { return _mm512_reduce_max_ps(v); }
inline vec vround(vec v) { return _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT); }
inline bool vany_nan(vec v) { return _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0; }
inline vec vpow2i(vec n) {  // 2^n for integral n in [-126, 127]
  __m512i e = _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127));
  return _mm512_castsi512_ps(_mm512_slli_epi32(e, 23));
}
#else
using vec = __m256;
constexpr int kLanes = 8;
constexpr int kTileW = 2;  // 2 x 6 accumulators of the 16 registers
inline __m256i lane_mask(int n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(n), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vset(float x) { return _mm256_set1_ps(x); }
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline vec vload_n(const float* p, int n) { return _mm256_maskload_ps(p, lane_mask(n)); }
inline vec vload_i8(const int8_t* p) {
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
}
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline void vstore_n(float* p, vec v, int n) { _mm256_maskstore_ps(p, lane_mask(n), v); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vadd(vec a, vec b) { return _mm256_add_ps(a, b); }
inline vec vsub(vec a, vec b) { return _mm256_sub_ps(a, b); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
inline vec vdiv(vec a, vec b) { return _mm256_div_ps(a, b); }
inline vec vmax(vec a, vec b) { return _mm256_max_ps(a, b); }
inline vec vmin(vec a, vec b) { return _mm256_min_ps(a, b); }
inline float vsum(vec v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float vhmax(vec v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}
inline vec vround(vec v) { return _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
inline bool vany_nan(vec v) { return _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0; }
inline vec vpow2i(vec n) {
  __m256i e = _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127));
  return _mm256_castsi256_ps(_mm256_slli_epi32(e, 23));
}
#endif

constexpr int kTileX = 6;  // rows of x per dot tile

// exp(x) within a few ulp for -87 <= x <= 88 (clamped outside: exp(-inf) gives about 1e-38).
// Cody-Waite reduction x = n ln2 + r, |r| <= ln2 / 2, then a degree-6 polynomial of r.
inline vec vexp(vec x) {
  x = vmax(vmin(x, vset(88.0f)), vset(-87.0f));
  const vec n = vround(vmul(x, vset(1.44269504088896341f)));
  vec r = vfma(n, vset(-0.693359375f), x);
  r = vfma(n, vset(2.12194440e-4f), r);
  vec p = vset(1.9875691500e-4f);
  p = vfma(p, r, vset(1.3981999507e-3f));
  p = vfma(p, r, vset(8.3334519073e-3f));
  p = vfma(p, r, vset(4.1665795894e-2f));
  p = vfma(p, r, vset(1.6666665459e-1f));
  p = vfma(p, r, vset(5.0000001201e-1f));
  p = vfma(vmul(p, r), r, vadd(r, vset(1.0f)));
  return vmul(p, vpow2i(n));
}

// out[i * ldo + j] = sum_k w[j][k] * x[i * ldx + k] for i < MX, j < NW: NW weight rows (given
// by pointer, anywhere) against MX rows of x, length K, each weight row read once.
// pf > 0: while reading w[j][k], prefetch w[j][k + pf] (the weights a later tile reads), on
// every pf_every-th vector of k starting at the pf_phase-th: a tile that makes several passes
// over the same weights (one per kTileX rows of x) spreads the next weights' prefetches over all
// of them, so memory is busy the whole time instead of during the first pass only.
// NOTE: without it a tile of several x rows computes long enough per cache line that the
// hardware prefetcher falls behind: streaming weights from memory dropped from ~31 to ~15 GB/s
// on one core at 6 rows.
// PACKED: x is this tile's rows as pack_rows lays them out ([K / kLanes][MX][kLanes]), one
// sequential stream where row-major rows are MX streams (gemm.cpp packs them);
// the same values summed in the same order.
template <int NW, int MX, bool PACKED = false>
inline void dot_tile(const float* const* w, const float* x, int64_t ldx, int64_t K, float* out,
                     int64_t ldo, int64_t pf, int pf_phase = 0, int pf_every = 1) {
  int countdown = pf_phase + 1;
  vec acc[NW][MX];
#pragma GCC unroll 8
  for (int j = 0; j < NW; ++j)
#pragma GCC unroll 8
    for (int i = 0; i < MX; ++i) acc[j][i] = vzero();
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    vec wv[NW];
#pragma GCC unroll 8
    for (int j = 0; j < NW; ++j) wv[j] = vload(w[j] + k);
    if (pf > 0 && --countdown == 0) {
      // one streamed row: non-temporal (it is not read again; 3-8% faster there)
#pragma GCC unroll 8
      for (int j = 0; j < NW; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(w[j] + k + pf), NW == 1 ? _MM_HINT_NTA : _MM_HINT_T0);
      countdown = pf_every;
    }
#pragma GCC unroll 8
    for (int i = 0; i < MX; ++i) {
      const vec xv = PACKED ? vload(x + k * MX + i * kLanes) : vload(x + i * ldx + k);
#pragma GCC unroll 8
      for (int j = 0; j < NW; ++j) acc[j][i] = vfma(wv[j], xv, acc[j][i]);
    }
  }
  if (k < K) {
    const int n = static_cast<int>(K - k);
    vec wv[NW];
#pragma GCC unroll 8
    for (int j = 0; j < NW; ++j) wv[j] = vload_n(w[j] + k, n);
#pragma GCC unroll 8
    for (int i = 0; i < MX; ++i) {
      const vec xv = PACKED ? vload(x + k * MX + i * kLanes) : vload_n(x + i * ldx + k, n);
#pragma GCC unroll 8
      for (int j = 0; j < NW; ++j) acc[j][i] = vfma(wv[j], xv, acc[j][i]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < NW; ++j)
#pragma GCC unroll 8
    for (int i = 0; i < MX; ++i) out[i * ldo + j] = vsum(acc[j][i]);
}

// K rounded up to whole vectors.
inline int64_t padded(int64_t K) { return (K + kLanes - 1) / kLanes * kLanes; }

// rows x rows of x (row-major, ldx) laid out for dot_rows<true>: the tile of rows r0 .. r0 + mx
// (r0 a multiple of kTileX, mx <= kTileX) at xp + r0 * padded(K), as [padded(K) / kLanes][mx]
// [kLanes], zeros after K (the unpacked tile loads zeros there too).
inline void pack_rows(const float* x, int64_t ldx, int64_t rows, int64_t K, float* xp) {
  const int64_t Kp = padded(K);
  for (int64_t r0 = 0; r0 < rows; r0 += kTileX) {
    const int64_t mx = std::min<int64_t>(kTileX, rows - r0);
    float* dst = xp + r0 * Kp;
    for (int64_t k = 0; k < Kp; k += kLanes) {
      const int n = static_cast<int>(std::min<int64_t>(kLanes, K - k));
      for (int64_t i = 0; i < mx; ++i) {
        const float* src = x + (r0 + i) * ldx + k;
        vstore(dst + k * mx + i * kLanes, n == kLanes ? vload(src) : vload_n(src, n));
      }
    }
  }
}

// dot_tile for nw <= kTileW weight rows and any number of x rows (in tiles of kTileX; PACKED:
// as pack_rows laid them out, ldx unused): out[i * ldo + j] for i < rows, j < nw. The passes
// over the x tiles share the prefetching of the weights pf ahead.
template <int NW, bool PACKED>
inline void dot_rows_fixed(const float* const* w, const float* x, int64_t ldx, int64_t rows,
                           int64_t K, float* out, int64_t ldo, int64_t pf) {
  const int64_t tile_stride = PACKED ? padded(K) : ldx;
  const int passes = static_cast<int>((rows + kTileX - 1) / kTileX);
  int pass = 0;
  int64_t i = 0;
  for (; i + kTileX <= rows; i += kTileX, ++pass)
    dot_tile<NW, kTileX, PACKED>(w, x + i * tile_stride, ldx, K, out + i * ldo, ldo, pf, pass,
                                 passes);
  const float* xt = x + i * tile_stride;
  float* ot = out + i * ldo;
  switch (rows - i) {
    case 1: dot_tile<NW, 1, PACKED>(w, xt, ldx, K, ot, ldo, pf, pass, passes); break;
    case 2: dot_tile<NW, 2, PACKED>(w, xt, ldx, K, ot, ldo, pf, pass, passes); break;
    case 3: dot_tile<NW, 3, PACKED>(w, xt, ldx, K, ot, ldo, pf, pass, passes); break;
    case 4: dot_tile<NW, 4, PACKED>(w, xt, ldx, K, ot, ldo, pf, pass, passes); break;
    case 5: dot_tile<NW, 5, PACKED>(w, xt, ldx, K, ot, ldo, pf, pass, passes); break;
    default: break;
  }
}

template <bool PACKED = false>
inline void dot_rows(const float* const* w, int nw, const float* x, int64_t ldx, int64_t rows,
                     int64_t K, float* out, int64_t ldo, int64_t pf = 0) {
  switch (nw) {
    case 1: dot_rows_fixed<1, PACKED>(w, x, ldx, rows, K, out, ldo, pf); break;
    case 2: dot_rows_fixed<2, PACKED>(w, x, ldx, rows, K, out, ldo, pf); break;
#if defined(__AVX512F__)
    case 3: dot_rows_fixed<3, PACKED>(w, x, ldx, rows, K, out, ldo, pf); break;
    case 4: dot_rows_fixed<4, PACKED>(w, x, ldx, rows, K, out, ldo, pf); break;
#endif
    default: break;
  }
}

}  // namespace epc
