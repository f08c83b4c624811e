// y = x @ w.T for a few rows of x on CPU (fp32, AVX2 + FMA, OpenMP over w's rows).
//
// MKL reads w at about 15 GB/s for a matrix-vector product on this class of machine (and packs w
// for small matrix products), while plain streaming reaches 40+ GB/s: here each row of w is read
// once, in place, and multiplied with up to 6 rows of x at a time (kept in cache). Every output
// is one dot product with a fixed summation order, so a row's result does not depend on how
// many other rows share the call. See kernels/linear.py for when it is used.
#include <torch/extension.h>
#include <immintrin.h>

#include <algorithm>

namespace {

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  __m128 sh = _mm_movehdup_ps(lo);
  __m128 s = _mm_add_ps(lo, sh);
  sh = _mm_movehl_ps(sh, s);
  s = _mm_add_ss(s, sh);
  return _mm_cvtss_f32(s);
}

constexpr int kRows = 6;  // rows of x per pass: 6 accumulators + 1 weight register

}  // namespace

// Dot products of rows n0 (and n0 + 1 when two) of W with rows m0 .. m0 + rows - 1 of X.
template <int Ns>
inline void block(const float* X, const float* W, float* Y, int64_t K, int64_t N, int64_t n0,
                  int64_t m0, int64_t rows) {
  __m256 acc[Ns][kRows];
  for (int j = 0; j < Ns; ++j)
    for (int i = 0; i < kRows; ++i) acc[j][i] = _mm256_setzero_ps();
  for (int64_t k = 0; k < K; k += 8) {
    __m256 wv[Ns];
    for (int j = 0; j < Ns; ++j) wv[j] = _mm256_loadu_ps(W + (n0 + j) * K + k);
    for (int i = 0; i < rows; ++i) {
      const __m256 xv = _mm256_loadu_ps(X + (m0 + i) * K + k);
      for (int j = 0; j < Ns; ++j) acc[j][i] = _mm256_fmadd_ps(wv[j], xv, acc[j][i]);
    }
  }
  for (int j = 0; j < Ns; ++j)
    for (int i = 0; i < rows; ++i) Y[(m0 + i) * N + n0 + j] = hsum(acc[j][i]);
}

// x [M, K], w [N, K], both contiguous fp32 on CPU, K % 8 == 0 -> [M, N].
torch::Tensor few_rows_linear(const torch::Tensor& x, const torch::Tensor& w) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1), "shapes");
  TORCH_CHECK(x.scalar_type() == torch::kFloat && w.scalar_type() == torch::kFloat, "fp32 only");
  TORCH_CHECK(x.is_contiguous() && w.is_contiguous() && x.size(1) % 8 == 0, "layout");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  const float* X = x.data_ptr<float>();
  const float* W = w.data_ptr<float>();
  float* Y = y.data_ptr<float>();
  // NOTE: two rows of W per block: each x load then feeds two FMAs (12 accumulators + 2 W
  // registers + 1 x register fit the 16 ymm registers).
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N / 2; ++n)
    for (int64_t m0 = 0; m0 < M; m0 += kRows)
      block<2>(X, W, Y, K, N, 2 * n, m0, std::min<int64_t>(kRows, M - m0));
  if (N % 2)
    for (int64_t m0 = 0; m0 < M; m0 += kRows)
      block<1>(X, W, Y, K, N, N - 1, m0, std::min<int64_t>(kRows, M - m0));
  return y;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("few_rows_linear", &few_rows_linear, "y = x @ w.T for a few rows (fp32, AVX2)");
}
