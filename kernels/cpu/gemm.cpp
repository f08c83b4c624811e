// CPU kernels (fp32) for the decode step's multiplies: y = x @ w.T, and the routed experts'
// MLPs over expert-sorted rows in one call per layer. kernels/cpu/build.py builds this file, with
// kernels/cpu/attention.cpp, for the widest vectors the CPU has (AVX-512 or AVX2).
//
// Why not MKL: for a few rows MKL packs each weight matrix on every call and reads it at 5-16
// GB/s, and on this class of CPU (AMD, AVX-512) it multiplies with 256-bit vectors, half the
// machine's fp32 peak. Here each weight row is read once: in place, by a dot-product tile of up
// to 4 weight rows x 6 rows of x in registers (kernels/cpu/simd.h: the routed experts, any
// weight), or from a copy laid out in panels once (pack_panels: the layers' dense projections,
// outer-product tiles of 8 rows x 48 outputs); threads split weight rows.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <memory>
#include <vector>

#include "kernels.h"
#include "simd.h"

namespace {

using epc::kLanes;
using epc::kTileW;

constexpr int64_t kPrefetchRows = 8;  // how far ahead of its reads a tile prefetches weights
constexpr int64_t kStreamRows = 8;  // up to this many rows of x, tiles of one weight row

// For each group g with rows[g] > 0: y[starts[g] + i, :] = x[starts[g] + i, :] @ w[g].T, with
// w [G, n_out, K] contiguous and x, y row-major (ldx, ldy). Threads share the tasks of kTileW
// weight rows of every group (the same bytes each), so the expert weights a step needs are read
// once, split evenly. A group of up to kStreamRows rows of x is memory-bound: its task reads
// the weight rows one at a time, one sequential stream, which this class of CPU (AMD Zen 5, 2
// cores) reads ~25% faster than four interleaved rows (routed experts at 5 rows each: 33 -> 41
// GB/s; lm_head at 1 and 8 rows: 2.28 -> 1.77 and 3.08 -> 2.54 ms). More rows are
// compute-bound, and a tile of kTileW weight rows shares each load of x among them (at 32 rows
// one row at a time takes 2.5x as long); their x rows are packed first (epc::pack_rows: a tile
// then reads x as one stream, not kTileX), and each tile spreads the prefetches of the weights
// it reads next over all its passes over x (lm_head at 32 rows 6.7 -> 5.3 ms, a layer's routed
// experts at batch 32 3.3 -> 2.7 ms in A/B).
// NOTE: both sum each output in the same order (vector lanes over k, then the lanes), so a row's
// result does not depend on how many rows share the call (the test for it asserts equality):
// the cluster, which batches requests differently from the engine, gives the same tokens. A
// different order for some row counts (weights broadcast against x transposed) would break that.
void grouped_linear(const float* x, int64_t ldx, int64_t K, const std::vector<int64_t>& starts,
                    const std::vector<int64_t>& rows, const float* w, int64_t n_out, float* y,
                    int64_t ldy) {
  std::vector<int64_t> groups;
  for (int64_t g = 0; g < static_cast<int64_t>(rows.size()); ++g)
    if (rows[g] > 0) groups.push_back(g);
  // The x rows of the compute-bound groups, packed so that each tile reads them as one stream.
  const int64_t Kp = epc::padded(K);
  std::vector<int64_t> packed_at(rows.size(), -1);
  std::vector<int64_t> packed_groups;
  int64_t packed_size = 0;
  for (int64_t g : groups)
    if (rows[g] > kStreamRows) {
      packed_at[g] = packed_size;
      packed_size += rows[g] * Kp;
      packed_groups.push_back(g);
    }
  std::unique_ptr<float[]> packed(packed_size > 0 ? new float[packed_size] : nullptr);
  at::parallel_for(0, static_cast<int64_t>(packed_groups.size()), 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const int64_t g = packed_groups[i];
      epc::pack_rows(x + starts[g] * ldx, ldx, rows[g], K, packed.get() + packed_at[g]);
    }
  });
  const int64_t tiles = (n_out + kTileW - 1) / kTileW;
  const int64_t total = static_cast<int64_t>(groups.size()) * tiles;
  // NOTE: about 64 KiB of weights per task at least: below that a thread costs more than it saves.
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / (K * kTileW));
  at::parallel_for(0, total, grain, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = groups[item / tiles];
      const int64_t n0 = (item % tiles) * kTileW;
      const int nw = static_cast<int>(std::min<int64_t>(kTileW, n_out - n0));
      const float* wr[kTileW];
      for (int j = 0; j < nw; ++j) wr[j] = w + (g * n_out + n0 + j) * K;
      const float* xg = x + starts[g] * ldx;
      float* yg = y + starts[g] * ldy + n0;
      if (rows[g] <= kStreamRows) {
        for (int j = 0; j < nw; ++j)
          epc::dot_rows(wr + j, 1, xg, ldx, rows[g], K, yg + j, ldy, kPrefetchRows * K);
      } else {
        epc::dot_rows<true>(wr, nw, packed.get() + packed_at[g], 0, rows[g], K, yg, ldy,
                            kPrefetchRows * K);
      }
    }
  });
}

void check_matrix(const torch::Tensor& t, int64_t dim, const char* name) {
  TORCH_CHECK(t.dim() == dim, name, " must have ", dim, " dims, got ", t.sizes());
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.device().is_cpu(), name, ": fp32 on CPU");
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous");
}

// ---- weights packed in panels (the dense projections) --------------------------------------
// pack_panels lays W [N, K] out as [T, K, kPanel] (T = ceil(N / kPanel), zeros past row N):
// kPanel output columns side by side for every k, so a task (one panel) reads one sequential
// stream, and a tile is an outer product: per k, kPanelVecs vectors of weights times the
// broadcast x[i, k] of each of its rows. Against the dot tiles it reads ~2.3x fewer bytes from
// cache per multiply-add and sums no lanes at the end: 400 GFLOP/s at 32 rows in cache (the dot
// tiles 270-290); lm_head at 32 rows 5.8 -> 4.5 ms, o_proj 149 -> 107 us in A/B.
// NOTE: each output is one chain of fused multiply-adds over k in order, whatever the number of
// rows (a tile of 1 row and one of 8 do the same), so rows stay independent of the batch.
constexpr int kPanelVecs = 3;
constexpr int64_t kPanel = kPanelVecs * kLanes;
constexpr int kPanelRows = kLanes == 16 ? 8 : 4;  // rows of x per tile: 8 x 3 (AVX2: 4 x 3) acc.

// y[i, :n_valid] for i < MX from panel p (K x kPanel) and x rows (ldx). pf: the next panel,
// prefetched to L2 on every pf_every-th k from the pf_phase-th (the passes of a panel over its
// tiles of rows share it, as in epc::dot_tile).
template <int MX>
inline void panel_tile(const float* p, const float* x, int64_t ldx, int64_t K, float* y,
                       int64_t ldy, int n_valid, const float* pf, int pf_phase, int pf_every) {
  epc::vec acc[MX][kPanelVecs];
#pragma GCC unroll 8
  for (int i = 0; i < MX; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kPanelVecs; ++j) acc[i][j] = epc::vzero();
  int countdown = pf_phase + 1;
  for (int64_t k = 0; k < K; ++k) {
    const float* pk = p + k * kPanel;
    epc::vec wv[kPanelVecs];
#pragma GCC unroll 4
    for (int j = 0; j < kPanelVecs; ++j) wv[j] = epc::vload(pk + j * kLanes);
    if (pf != nullptr && --countdown == 0) {
#pragma GCC unroll 4
      for (int j = 0; j < kPanelVecs; ++j)
        _mm_prefetch(reinterpret_cast<const char*>(pf + k * kPanel + j * kLanes), _MM_HINT_T1);
      countdown = pf_every;
    }
#pragma GCC unroll 8
    for (int i = 0; i < MX; ++i) {
      const epc::vec xb = epc::vset(x[i * ldx + k]);
#pragma GCC unroll 4
      for (int j = 0; j < kPanelVecs; ++j) acc[i][j] = epc::vfma(xb, wv[j], acc[i][j]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < MX; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < kPanelVecs; ++j) {
      const int n = n_valid - j * kLanes;
      if (n >= kLanes)
        epc::vstore(y + i * ldy + j * kLanes, acc[i][j]);
      else if (n > 0)
        epc::vstore_n(y + i * ldy + j * kLanes, acc[i][j], n);
    }
}

// One panel against all rows of x, kPanelRows at a time.
void panel_rows(const float* p, const float* x, int64_t ldx, int64_t rows, int64_t K, float* y,
                int64_t ldy, int n_valid, const float* pf) {
  const int passes = static_cast<int>((rows + kPanelRows - 1) / kPanelRows);
  int pass = 0;
  int64_t i = 0;
  for (; i + kPanelRows <= rows; i += kPanelRows, ++pass)
    panel_tile<kPanelRows>(p, x + i * ldx, ldx, K, y + i * ldy, ldy, n_valid, pf, pass, passes);
  const float* xt = x + i * ldx;
  float* yt = y + i * ldy;
  switch (rows - i) {
    case 1: panel_tile<1>(p, xt, ldx, K, yt, ldy, n_valid, pf, pass, passes); break;
    case 2: panel_tile<2>(p, xt, ldx, K, yt, ldy, n_valid, pf, pass, passes); break;
    case 3: panel_tile<3>(p, xt, ldx, K, yt, ldy, n_valid, pf, pass, passes); break;
#if defined(__AVX512F__)
    case 4: panel_tile<4>(p, xt, ldx, K, yt, ldy, n_valid, pf, pass, passes); break;
    case 5: panel_tile<5>(p, xt, ldx, K, yt, ldy, n_valid, pf, pass, passes); break;
    case 6: panel_tile<6>(p, xt, ldx, K, yt, ldy, n_valid, pf, pass, passes); break;
    case 7: panel_tile<7>(p, xt, ldx, K, yt, ldy, n_valid, pf, pass, passes); break;
#endif
    default: break;
  }
}

// y [M, n_out] (ldy) = x [M, K] (ldx) @ W.T, W as pack_panels laid it out; threads split panels.
void panel_linear(const float* x, int64_t ldx, int64_t M, int64_t K, const float* p,
                  int64_t n_out, float* y, int64_t ldy) {
  const int64_t T = (n_out + kPanel - 1) / kPanel;
  const int64_t grain = std::max<int64_t>(1, (1 << 14) / (K * kPanel));  // >= 64 KiB a task
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* pt = p + t * K * kPanel;
      panel_rows(pt, x, ldx, M, K, y + t * kPanel, ldy,
                 static_cast<int>(std::min<int64_t>(kPanel, n_out - t * kPanel)),
                 t + 1 < end ? pt + K * kPanel : nullptr);
    }
  });
}

// h [N, I] = silu(gu[:, :I]) * gu[:, I:] for gu [N, 2I].
void silu_mul_rows(const float* gu, int64_t N, int64_t I, float* h) {
  at::parallel_for(0, N, std::max<int64_t>(1, 4096 / I), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* g = gu + r * 2 * I;
      const float* u = g + I;
      float* o = h + r * I;
      for (int64_t k = 0; k < I; k += kLanes) {
        const int n = static_cast<int>(std::min<int64_t>(kLanes, I - k));
        const epc::vec gv = epc::vload_n(g + k, n);
        const epc::vec sig = epc::vdiv(epc::vset(1.0f), epc::vadd(epc::vset(1.0f),
                                       epc::vexp(epc::vsub(epc::vzero(), gv))));
        epc::vstore_n(o + k, epc::vmul(epc::vmul(gv, sig), epc::vload_n(u + k, n)), n);
      }
    }
  });
}

void check_panels(const torch::Tensor& p, int64_t n_out, int64_t K, const char* name) {
  check_matrix(p, 3, name);
  TORCH_CHECK(p.size(0) == (n_out + kPanel - 1) / kPanel && p.size(1) == K &&
                  p.size(2) == kPanel,
              name, " ", p.sizes(), " is not pack_panels of a [", n_out, ", ", K, "] weight");
}

}  // namespace

// x [M, K], w [N, K] -> [M, N] = x @ w.T.
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w) {
  check_matrix(x, 2, "x");
  check_matrix(w, 2, "w");
  TORCH_CHECK(x.size(1) == w.size(1), "x ", x.sizes(), " and w ", w.sizes(), " differ in K");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto y = torch::empty({M, N}, x.options());
  grouped_linear(x.data_ptr<float>(), K, K, {0}, {M}, w.data_ptr<float>(), N,
                 y.data_ptr<float>(), N);
  return y;
}

// x [N, D] rows grouped by slot (counts[s] rows for slot s, in slot order), w13 [S, 2I, D]
// (gate rows, then up rows), w2 [S, D, I] -> [N, D]: per slot, (silu(x w_gate.T) * x w_up.T)
// w2.T. Empty slots read nothing.
torch::Tensor grouped_mlp(const torch::Tensor& x, const std::vector<int64_t>& counts,
                          const torch::Tensor& w13, const torch::Tensor& w2) {
  check_matrix(x, 2, "x");
  check_matrix(w13, 3, "w13");
  check_matrix(w2, 3, "w2");
  const int64_t N = x.size(0), D = x.size(1), S = w13.size(0), I = w2.size(2);
  TORCH_CHECK(static_cast<int64_t>(counts.size()) == S, "counts: ", counts.size(), " for ", S,
              " slots");
  TORCH_CHECK(w13.size(1) == 2 * I && w13.size(2) == D, "w13 ", w13.sizes(), " for D=", D,
              ", I=", I);
  TORCH_CHECK(w2.size(0) == S && w2.size(1) == D, "w2 ", w2.sizes(), " for D=", D);
  std::vector<int64_t> starts(S);
  int64_t total = 0;
  for (int64_t s = 0; s < S; ++s) {
    TORCH_CHECK(counts[s] >= 0, "counts must be >= 0");
    starts[s] = total;
    total += counts[s];
  }
  TORCH_CHECK(total == N, "counts sum to ", total, ", x has ", N, " rows");
  auto out = torch::empty({N, D}, x.options());
  if (N == 0) return out;
  auto gate_up = torch::empty({N, 2 * I}, x.options());
  auto h = torch::empty({N, I}, x.options());
  float* gu = gate_up.data_ptr<float>();
  float* hp = h.data_ptr<float>();
  grouped_linear(x.data_ptr<float>(), D, D, starts, counts, w13.data_ptr<float>(), 2 * I, gu,
                 2 * I);
  silu_mul_rows(gu, N, I, hp);
  grouped_linear(hp, I, I, starts, counts, w2.data_ptr<float>(), D, out.data_ptr<float>(), D);
  return out;
}

// w [N, K] -> [ceil(N / kPanel), K, kPanel], the layout of linear_panels and mlp_panels.
torch::Tensor pack_panels(const torch::Tensor& w) {
  check_matrix(w, 2, "w");
  const int64_t N = w.size(0), K = w.size(1), T = (N + kPanel - 1) / kPanel;
  auto padded = torch::zeros({T * kPanel, K}, w.options());
  padded.narrow(0, 0, N).copy_(w);
  return padded.view({T, kPanel, K}).transpose(1, 2).contiguous();
}

// x [M, K], p = pack_panels(w [n_out, K]) -> [M, n_out] = x @ w.T.
torch::Tensor linear_panels(const torch::Tensor& x, const torch::Tensor& p, int64_t n_out) {
  check_matrix(x, 2, "x");
  check_panels(p, n_out, x.size(1), "p");
  const int64_t M = x.size(0), K = x.size(1);
  auto y = torch::empty({M, n_out}, x.options());
  if (M > 0)
    panel_linear(x.data_ptr<float>(), K, M, K, p.data_ptr<float>(), n_out, y.data_ptr<float>(),
                 n_out);
  return y;
}

// x [N, D], p13 = pack_panels(w13 [2I, D]) (gate rows, then up rows), p2 = pack_panels(w2 [D, I])
// -> [N, D] = (silu(x w_gate.T) * x w_up.T) w2.T: a dense MLP (or shared expert) in one call.
torch::Tensor mlp_panels(const torch::Tensor& x, const torch::Tensor& p13, const torch::Tensor& p2,
                         int64_t I) {
  check_matrix(x, 2, "x");
  const int64_t N = x.size(0), D = x.size(1);
  check_panels(p13, 2 * I, D, "p13");
  check_panels(p2, D, I, "p2");
  auto out = torch::empty({N, D}, x.options());
  if (N == 0) return out;
  auto gate_up = torch::empty({N, 2 * I}, x.options());
  auto h = torch::empty({N, I}, x.options());
  panel_linear(x.data_ptr<float>(), D, N, D, p13.data_ptr<float>(), 2 * I,
               gate_up.data_ptr<float>(), 2 * I);
  silu_mul_rows(gate_up.data_ptr<float>(), N, I, h.data_ptr<float>());
  panel_linear(h.data_ptr<float>(), I, N, I, p2.data_ptr<float>(), D, out.data_ptr<float>(), D);
  return out;
}
