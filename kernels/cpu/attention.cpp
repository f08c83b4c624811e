// Absorbed MLA attention over the paged latent cache on CPU (fp32): each query row reads its
// sequence's cache blocks in place through its block table (no gather into padded tensors),
// for decode (one query per sequence) and chunked prefill over a cached prefix (each query of
// the chunk sees the keys up to its own position) alike.
//
// One task per (query, group of up to 6 heads): scores of the group's heads against every key
// (dot tiles: each key row read once for the group), an exact softmax, then the latent output
// as probabilities x key rows with the group's accumulators in registers.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "simd.h"

namespace {

using epc::kLanes;
using epc::kTileW;
using epc::kTileX;
using epc::vec;

constexpr int kChunk = kLanes == 16 ? 4 : 2;  // output vectors per head held in registers

// out[h, d0 .. d0 + CH * kLanes) = sum_j p[h, j] * row_j[d0 ..] for HG heads; the last vector
// keeps `tail` lanes when tail > 0 (then CH must be 1).
template <int HG, int CH>
void weighted_rows(const float* p, int64_t ldp, const std::vector<const float*>& rows,
                   int64_t d0, int tail, const float* inv, float* out, int64_t ldo) {
  vec acc[HG][CH];
  for (int h = 0; h < HG; ++h)
    for (int c = 0; c < CH; ++c) acc[h][c] = epc::vzero();
  const int64_t n = static_cast<int64_t>(rows.size());
  for (int64_t j = 0; j < n; ++j) {
    vec kv[CH];
    for (int c = 0; c < CH; ++c)
      kv[c] = tail ? epc::vload_n(rows[j] + d0, tail) : epc::vload(rows[j] + d0 + c * kLanes);
    for (int h = 0; h < HG; ++h) {
      const vec ph = epc::vset(p[h * ldp + j]);
      for (int c = 0; c < CH; ++c) acc[h][c] = epc::vfma(ph, kv[c], acc[h][c]);
    }
  }
  for (int h = 0; h < HG; ++h)
    for (int c = 0; c < CH; ++c) {
      const vec v = epc::vmul(acc[h][c], epc::vset(inv[h]));
      if (tail)
        epc::vstore_n(out + h * ldo + d0, v, tail);
      else
        epc::vstore(out + h * ldo + d0 + c * kLanes, v);
    }
}

template <int HG>
void latent_output(const float* p, int64_t ldp, const std::vector<const float*>& rows,
                   int64_t rank, const float* inv, float* out, int64_t ldo) {
  int64_t d = 0;
  for (; d + kChunk * kLanes <= rank; d += kChunk * kLanes)
    weighted_rows<HG, kChunk>(p, ldp, rows, d, 0, inv, out, ldo);
  for (; d + kLanes <= rank; d += kLanes) weighted_rows<HG, 1>(p, ldp, rows, d, 0, inv, out, ldo);
  if (d < rank)
    weighted_rows<HG, 1>(p, ldp, rows, d, static_cast<int>(rank - d), inv, out, ldo);
}

// One (query, head group): q rows [hg, C] (stride C), the query's key rows -> out rows [hg, Dc].
void attend(const float* q, int hg, const std::vector<const float*>& rows, int64_t width,
            int64_t rank, float scale, std::vector<float>& scores, float* out, int64_t ldo,
            const float* const* ahead, int64_t n_ahead) {
  const int64_t n = static_cast<int64_t>(rows.size());
  scores.resize(static_cast<size_t>(hg) * n);
  float* s = scores.data();
  // NOTE: the rows of the task after this one, prefetched while this one computes: the cache
  // comes from memory (a step reads every layer's), and without this the reads and the
  // multiplies take turns.
  const int64_t tiles = (n + kTileW - 1) / kTileW;
  const int64_t per_tile = (n_ahead + tiles - 1) / tiles;
  int64_t next = 0;
  for (int64_t j = 0; j < n; j += kTileW) {  // scores [hg, n]
    const int nw = static_cast<int>(std::min<int64_t>(kTileW, n - j));
    for (int64_t e = std::min(n_ahead, next + per_tile); next < e; ++next)
      for (int64_t b = 0; b < width * 4; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(ahead[next]) + b, _MM_HINT_T0);
    epc::dot_rows(rows.data() + j, nw, q, width, hg, width, s + j, n);
  }
  float inv[kTileX];
  for (int h = 0; h < hg; ++h) {  // exact softmax over the row: exp(scale * (s - max))
    float* sh = s + h * n;
    vec m = epc::vset(-INFINITY);
    int64_t j = 0;
    for (; j + kLanes <= n; j += kLanes) m = epc::vmax(m, epc::vload(sh + j));
    float top = epc::vhmax(m);
    for (; j < n; ++j) top = std::max(top, sh[j]);
    const vec sc = epc::vset(scale), shift = epc::vset(-scale * top);
    vec sum = epc::vzero();
    for (j = 0; j + kLanes <= n; j += kLanes) {
      const vec e = epc::vexp(epc::vfma(epc::vload(sh + j), sc, shift));
      epc::vstore(sh + j, e);
      sum = epc::vadd(sum, e);
    }
    float rest = 0.0f;
    if (j < n) {  // the last lanes: only the first n - j are keys
      const int k = static_cast<int>(n - j);
      const vec e = epc::vexp(epc::vfma(epc::vload_n(sh + j, k), sc, shift));
      epc::vstore_n(sh + j, e, k);
      for (int l = 0; l < k; ++l) rest += sh[j + l];
    }
    inv[h] = 1.0f / (epc::vsum(sum) + rest);
  }
  switch (hg) {
    case 1: latent_output<1>(s, n, rows, rank, inv, out, ldo); break;
    case 2: latent_output<2>(s, n, rows, rank, inv, out, ldo); break;
    case 3: latent_output<3>(s, n, rows, rank, inv, out, ldo); break;
    case 4: latent_output<4>(s, n, rows, rank, inv, out, ldo); break;
    case 5: latent_output<5>(s, n, rows, rank, inv, out, ldo); break;
    case 6: latent_output<6>(s, n, rows, rank, inv, out, ldo); break;
    default: break;
  }
}

// y[r, :] = x[r, :K] @ w for R rows, w [K, ldw] row-major, columns [0, V * kLanes) (the last
// vector only `tail` lanes when PARTIAL): each x value broadcast against a row of w, R x V
// accumulators, no horizontal sums (short dot products spent most of their time in those).
template <int R, int V, bool PARTIAL>
inline void kn_tile(const float* x, int64_t ldx, const float* w, int64_t ldw, int64_t K, float* y,
                    int64_t ldy, int tail) {
  vec acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = epc::vzero();
  for (int64_t k = 0; k < K; ++k) {
    vec wv[V];
    for (int v = 0; v < V; ++v)
      wv[v] = PARTIAL && v == V - 1 ? epc::vload_n(w + k * ldw + v * kLanes, tail)
                                    : epc::vload(w + k * ldw + v * kLanes);
    for (int r = 0; r < R; ++r) {
      const vec xb = epc::vset(x[r * ldx + k]);
      for (int v = 0; v < V; ++v) acc[r][v] = epc::vfma(xb, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) {
      if (PARTIAL && v == V - 1)
        epc::vstore_n(y + r * ldy + v * kLanes, acc[r][v], tail);
      else
        epc::vstore(y + r * ldy + v * kLanes, acc[r][v]);
    }
}

template <int V, bool PARTIAL>
void kn_rows(const float* x, int64_t ldx, int64_t T, const float* w, int64_t ldw, int64_t K,
             float* y, int64_t ldy, int tail) {
  constexpr int R = 24 / V;  // 24 accumulators
  int64_t t = 0;
  for (; t + R <= T; t += R) kn_tile<R, V, PARTIAL>(x + t * ldx, ldx, w, ldw, K, y + t * ldy, ldy, tail);
  for (; t < T; ++t) kn_tile<1, V, PARTIAL>(x + t * ldx, ldx, w, ldw, K, y + t * ldy, ldy, tail);
}

template <bool PARTIAL>
void kn_any(int vecs, const float* x, int64_t ldx, int64_t T, const float* w, int64_t ldw,
            int64_t K, float* y, int64_t ldy, int tail) {
  switch (vecs) {
#define EPC_KN(v) \
  case v: kn_rows<v, PARTIAL>(x, ldx, T, w, ldw, K, y, ldy, tail); break;
    EPC_KN(1) EPC_KN(2) EPC_KN(3) EPC_KN(4) EPC_KN(5) EPC_KN(6) EPC_KN(7) EPC_KN(8)
    EPC_KN(9) EPC_KN(10) EPC_KN(11) EPC_KN(12) EPC_KN(13) EPC_KN(14) EPC_KN(15) EPC_KN(16)
#undef EPC_KN
    default: break;
  }
}

// Column vectors per task of per_head_gemm: 4 (tiles of 24 / 4 = 6 rows reuse each weight
// vector) once there are rows to share them; for fewer than 4 rows, up to kWideVecs (a whole
// 256-column head on AVX-512), so that a task streams whole contiguous rows of w: in strips of 4
// vectors a row's 256 bytes sit a row stride apart, and for a single row (batch-1 decode) the
// strips read W_UK at ~60% of the rate whole rows do.
constexpr int kWideVecs = kLanes == 16 ? 16 : 8;

// For each head h: y[t, h, :n] = x[t, h, :k] @ w[h], w [NH, k, n] contiguous; x and y rows at
// h * xh + t * xt and h * yh + t * yt. Threads split (head, block of column vectors).
void per_head_gemm(const float* w, int64_t heads, int64_t k, int64_t n, const float* x,
                   int64_t xh, int64_t xt, int64_t T, float* y, int64_t yh, int64_t yt) {
  const int64_t kBlock = (T < 4 ? kWideVecs : 4) * kLanes;
  const int64_t blocks = (n + kBlock - 1) / kBlock;
  at::parallel_for(0, heads * blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t h = item / blocks, n0 = (item % blocks) * kBlock;
      const int64_t width = std::min<int64_t>(kBlock, n - n0);
      const int vecs = static_cast<int>((width + kLanes - 1) / kLanes);
      const int tail = static_cast<int>(width - (vecs - 1) * kLanes);
      const float* wh = w + h * k * n + n0;
      if (tail < kLanes)
        kn_any<true>(vecs, x + h * xh, xt, T, wh, n, k, y + h * yh + n0, yt, tail);
      else
        kn_any<false>(vecs, x + h * xh, xt, T, wh, n, k, y + h * yh + n0, yt, tail);
    }
  });
}

}  // namespace

// q [T, NH, C] (q_nope absorbed into the latent by W_UK, then q_pe); cache [NB, BS, C];
// tables [T, M] int64, the block table of each query's sequence; lens [T] int64, the keys each
// query sees (1 .. M * BS) -> [T, NH, rank]: softmax(scale * q . key) weighted sum of the keys'
// first `rank` numbers. Cache rows past a query's length and table entries past its blocks are
// never read.
torch::Tensor paged_mla_attention(const torch::Tensor& q, const torch::Tensor& cache,
                                  const torch::Tensor& tables, const torch::Tensor& lens,
                                  double scale, int64_t rank) {
  TORCH_CHECK(q.dim() == 3 && cache.dim() == 3 && q.size(2) == cache.size(2), "q ", q.sizes(),
              " and cache ", cache.sizes(), " must be [T, NH, C] and [NB, BS, C]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && cache.scalar_type() == torch::kFloat,
              "q and cache: fp32");
  TORCH_CHECK(q.is_contiguous() && cache.is_contiguous(), "q and cache must be contiguous");
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == q.size(0) &&
                  tables.scalar_type() == torch::kLong, "tables: [T, M] int64, got ",
              tables.sizes());
  TORCH_CHECK(lens.dim() == 1 && lens.size(0) == q.size(0) && lens.scalar_type() == torch::kLong &&
                  lens.is_contiguous(), "lens: [T] int64, got ", lens.sizes());
  const int64_t T = q.size(0), NH = q.size(1), C = q.size(2);
  const int64_t NB = cache.size(0), BS = cache.size(1), M = tables.size(1);
  TORCH_CHECK(0 < rank && rank <= C, "rank ", rank, " must be in (0, ", C, "]");
  auto out = torch::empty({T, NH, rank}, q.options());
  const float* qp = q.data_ptr<float>();
  const float* cp = cache.data_ptr<float>();
  const int64_t* tp = tables.data_ptr<int64_t>();
  const int64_t* lp = lens.data_ptr<int64_t>();
  const int64_t ts0 = tables.stride(0), ts1 = tables.stride(1);
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(1 <= lp[t] && lp[t] <= M * BS, "lens[", t, "] = ", lp[t], ": not in 1..", M * BS);
    for (int64_t b = 0; b < (lp[t] + BS - 1) / BS; ++b) {
      const int64_t block = tp[t * ts0 + b * ts1];
      TORCH_CHECK(0 <= block && block < NB, "tables[", t, ", ", b, "] = ", block,
                  ": not a block of the cache (", NB, ")");
    }
  }
  const int64_t groups = (NH + kTileX - 1) / kTileX;
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T * groups, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const float*> rows, ahead;
    auto rows_of = [&](int64_t t, std::vector<const float*>& r) {
      r.resize(lp[t]);
      for (int64_t j = 0; j < lp[t]; ++j)
        r[j] = cp + (tp[t * ts0 + (j / BS) * ts1] * BS + j % BS) * C;
    };
    int64_t last = -1;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / groups, g = item % groups, h0 = g * kTileX;
      const int hg = static_cast<int>(std::min<int64_t>(kTileX, NH - h0));
      if (t != last) {
        if (t == last + 1 && !ahead.empty()) rows.swap(ahead); else rows_of(t, rows);
        last = t;
        ahead.clear();
        if ((t + 1) * groups < end) rows_of(t + 1, ahead);
      }
      // this query's groups share the prefetch of the next query's rows
      const int64_t na = static_cast<int64_t>(ahead.size());
      const int64_t a0 = na * g / groups, a1 = na * (g + 1) / groups;
      attend(qp + (t * NH + h0) * C, hg, rows, C, rank, static_cast<float>(scale), scores,
             op + (t * NH + h0) * rank, rank, ahead.data() + a0, a1 - a0);
    }
  });
  return out;
}

// The whole absorbed MLA decode attention in one call: q_nope [T, NH, Dn] (last dim unit stride,
// other strides free), q_pe [T, NH, Dr] roped, the cache and tables as paged_mla_attention,
// w_uk [NH, Dn, Dc], w_uv_t [NH, Dc, Dv] (W_UV transposed) -> [T, NH, Dv]. The same numbers as
// q_lat = q_nope W_UK; o = attention(q_lat ++ q_pe); o W_UV.T, without the ops between them.
// Phases by head (each head's W_UK / W_UV read once for all T queries), then by query.
torch::Tensor mla_decode(const torch::Tensor& q_nope, const torch::Tensor& q_pe,
                         const torch::Tensor& cache, const torch::Tensor& tables,
                         const torch::Tensor& lens, const torch::Tensor& w_uk,
                         const torch::Tensor& w_uv_t, double scale) {
  TORCH_CHECK(q_nope.dim() == 3 && q_nope.stride(2) == 1 && q_pe.dim() == 3 &&
                  q_pe.stride(2) == 1 && w_uk.dim() == 3 && w_uv_t.dim() == 3 &&
                  w_uk.is_contiguous() && w_uv_t.is_contiguous(),
              "q_nope, q_pe [T, NH, *] with unit last stride; w_uk, w_uv_t contiguous");
  for (const auto* t : {&q_nope, &q_pe, &w_uk, &w_uv_t})
    TORCH_CHECK(t->scalar_type() == torch::kFloat, "mla_decode: fp32 tensors");
  const int64_t T = q_nope.size(0), NH = q_nope.size(1), Dn = q_nope.size(2), Dr = q_pe.size(2);
  const int64_t Dc = w_uk.size(2), Dv = w_uv_t.size(2), C = Dc + Dr;
  TORCH_CHECK(q_pe.size(0) == T && q_pe.size(1) == NH && w_uk.size(0) == NH &&
                  w_uk.size(1) == Dn && w_uv_t.size(0) == NH && w_uv_t.size(1) == Dc &&
                  cache.dim() == 3 && cache.size(2) == C,
              "shapes: q_nope ", q_nope.sizes(), " q_pe ", q_pe.sizes(), " w_uk ", w_uk.sizes(),
              " w_uv_t ", w_uv_t.sizes(), " cache ", cache.sizes());
  auto q = torch::empty({T, NH, C}, q_nope.options());
  auto out = torch::empty({T, NH, Dv}, q_nope.options());
  if (T == 0) return out;
  const float* qn = q_nope.data_ptr<float>();
  const int64_t qs0 = q_nope.stride(0), qs1 = q_nope.stride(1);
  float* qp = q.data_ptr<float>();
  // q[t, h, :Dc] = q_nope[t, h] @ W_UK[h]
  per_head_gemm(w_uk.data_ptr<float>(), NH, Dn, Dc, qn, qs1, qs0, T, qp, C, NH * C);
  const auto pe = q_pe.accessor<float, 3>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < NH; ++h)
      for (int64_t r = 0; r < Dr; ++r) qp[(t * NH + h) * C + Dc + r] = pe[t][h][r];
  const torch::Tensor latent = paged_mla_attention(q, cache, tables, lens, scale, Dc);
  const float* lp = latent.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // out[t, h] = latent[t, h] @ W_UV[h].T
  per_head_gemm(w_uv_t.data_ptr<float>(), NH, Dc, Dv, lp, Dc, NH * Dc, T, op, Dv, NH * Dv);
  return out;
}
