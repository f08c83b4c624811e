// The decode step's small ops on CPU (fp32), each one call where torch needs 5-15: RMSNorm,
// rotary embedding, the MoE gate's scoring and group-limited top-k, the weighted combine of
// the expert outputs, and the greedy argmax over the vocabulary (torch's took 0.5 ms for 32 x
// 32000). At decode sizes each torch op costs a few microseconds of dispatch; a step
// of the `small` preset ran about 2,000 of them (bench/step_profile.py).
// kernels/cpu/build.py builds this file with kernels/cpu/gemm.cpp and kernels/cpu/attention.cpp.
#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <utility>
#include <vector>

#include "simd.h"

namespace {

using epc::kLanes;
using epc::vec;

void check_fp32(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat && t.device().is_cpu(), name, ": fp32 on CPU");
}

// sum of squares of x[0..n), in lane-wise partial sums then the lanes (a fixed order)
float sum_squares(const float* x, int64_t n) {
  vec acc = epc::vzero();
  int64_t k = 0;
  for (; k + kLanes <= n; k += kLanes) {
    const vec v = epc::vload(x + k);
    acc = epc::vfma(v, v, acc);
  }
  if (k < n) {
    const vec v = epc::vload_n(x + k, static_cast<int>(n - k));
    acc = epc::vfma(v, v, acc);
  }
  return epc::vsum(acc);
}

// The indices of the k largest of v[0..n) (ties: the lower index first), in descending order.
void top_indices(const float* v, int n, int k, int* out) {
  int idx[256];
  std::iota(idx, idx + n, 0);
  std::partial_sort(idx, idx + k, idx + n, [v](int a, int b) {
    return v[a] > v[b] || (v[a] == v[b] && a < b);
  });
  std::copy(idx, idx + k, out);
}

}  // namespace

// x [T, D] (rows may be strided), w [D] -> [T, D]: x * rsqrt(mean(x^2) + eps) * w.
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  check_fp32(x, "x");
  check_fp32(w, "w");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.is_contiguous() && w.size(0) == x.size(1),
              "x [T, D] with unit stride and w [D], got ", x.sizes(), " and ", w.sizes());
  const int64_t T = x.size(0), D = x.size(1), ldx = x.stride(0);
  auto y = torch::empty({T, D}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const float* r = xp + t * ldx;
      const float inv = 1.0f / std::sqrt(sum_squares(r, D) / static_cast<float>(D) +
                                         static_cast<float>(eps));
      const vec s = epc::vset(inv);
      int64_t k = 0;
      for (; k + kLanes <= D; k += kLanes)
        epc::vstore(yp + t * D + k, epc::vmul(epc::vload(wp + k), epc::vmul(epc::vload(r + k), s)));
      for (; k < D; ++k) yp[t * D + k] = wp[k] * (r[k] * inv);
    }
  });
  return y;
}

// x [T, H, Dr] or [T, Dr] (last dim unit stride, any other strides), cos, sin [T, Dr/2] ->
// contiguous, same shape: pairs (x0, x1), (x2, x3) ... when interleaved, else (x_i, x_{i+Dr/2});
// out = [a cos - b sin for each pair, then b cos + a sin] (kernels/rotary.py's layout).
torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                     bool interleaved) {
  check_fp32(x, "x");
  check_fp32(cos, "cos");
  check_fp32(sin, "sin");
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1, "x [T, (H,) Dr] with unit "
              "stride, got ", x.sizes());
  const int64_t T = x.size(0), H = x.dim() == 3 ? x.size(1) : 1, Dr = x.size(-1), half = Dr / 2;
  TORCH_CHECK(Dr % 2 == 0 && cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == T &&
                  cos.size(1) == half && cos.is_contiguous() && sin.is_contiguous(),
              "cos, sin must be [T, Dr/2] contiguous, got ", cos.sizes());
  const int64_t st = x.stride(0), sh = x.dim() == 3 ? x.stride(1) : 0;
  auto y = torch::empty(x.sizes(), x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      const float* r = xp + t * st + h * sh;
      float* o = yp + (t * H + h) * Dr;
      for (int64_t i = 0; i < half; ++i) {
        const float a = interleaved ? r[2 * i] : r[i], b = interleaved ? r[2 * i + 1] : r[i + half];
        const float c = cp[t * half + i], s = sp[t * half + i];
        o[i] = a * c - b * s;
        o[i + half] = b * c + a * s;
      }
    }
  return y;
}

// logits [T, E] -> (weights [T, K] fp32, ids [T, K] int64): kernels/gate.py grouped_topk_ref.
// scoring 0 softmax / 1 sigmoid; method 0 greedy / 1 group_limited_greedy / 2 noaux_tc.
std::vector<torch::Tensor> grouped_topk(const torch::Tensor& logits, int64_t top_k, int64_t scoring,
                                        int64_t method, int64_t n_group, int64_t topk_group,
                                        bool norm, double scaling,
                                        const c10::optional<torch::Tensor>& bias) {
  check_fp32(logits, "logits");
  TORCH_CHECK(logits.dim() == 2 && logits.is_contiguous(), "logits [T, E] contiguous");
  const int64_t T = logits.size(0), E = logits.size(1);
  TORCH_CHECK(E <= 256 && 0 < top_k && top_k <= E && n_group >= 1 && E % n_group == 0 &&
                  topk_group >= 1 && topk_group <= n_group,
              "E=", E, " (at most 256), K=", top_k, ", groups ", n_group, "/", topk_group);
  TORCH_CHECK(method != 2 || (bias.has_value() && bias->numel() == E), "noaux_tc needs a bias");
  const float* bp = nullptr;
  torch::Tensor b;
  if (bias.has_value()) {
    b = bias->to(torch::kFloat).contiguous();
    bp = b.data_ptr<float>();
  }
  auto weights = torch::empty({T, top_k}, logits.options());
  auto ids = torch::empty({T, top_k}, logits.options().dtype(torch::kLong));
  const float* lp = logits.data_ptr<float>();
  float* wp = weights.data_ptr<float>();
  int64_t* ip = ids.data_ptr<int64_t>();
  const int per = static_cast<int>(E / n_group);
  for (int64_t t = 0; t < T; ++t) {
    const float* l = lp + t * E;
    float scores[256], choice[256], group_scores[256];
    int chosen[256], groups[256];
    if (scoring == 0) {
      const float top = *std::max_element(l, l + E);
      float sum = 0.0f;
      for (int64_t e = 0; e < E; ++e) sum += (scores[e] = std::exp(l[e] - top));
      for (int64_t e = 0; e < E; ++e) scores[e] /= sum;
    } else {
      for (int64_t e = 0; e < E; ++e) scores[e] = 1.0f / (1.0f + std::exp(-l[e]));
    }
    for (int64_t e = 0; e < E; ++e) choice[e] = method == 2 ? scores[e] + bp[e] : scores[e];
    if (method != 0 && n_group > 1) {
      for (int g = 0; g < n_group; ++g) {
        const float* c = choice + g * per;
        if (method == 2) {  // the sum of the group's top 2
          int two[2];
          top_indices(c, per, std::min(2, per), two);
          group_scores[g] = c[two[0]] + (per > 1 ? c[two[1]] : 0.0f);
        } else {
          group_scores[g] = *std::max_element(c, c + per);
        }
      }
      top_indices(group_scores, static_cast<int>(n_group), static_cast<int>(topk_group), groups);
      bool keep[256] = {};
      for (int i = 0; i < topk_group; ++i) keep[groups[i]] = true;
      for (int64_t e = 0; e < E; ++e)
        if (!keep[e / per]) choice[e] = -INFINITY;
    }
    top_indices(choice, static_cast<int>(E), static_cast<int>(top_k), chosen);
    float sum = 0.0f;
    for (int k = 0; k < top_k; ++k) sum += scores[chosen[k]];
    const float denom = sum + 1e-20f;
    for (int k = 0; k < top_k; ++k) {
      const float w = norm ? scores[chosen[k]] / denom : scores[chosen[k]];
      wp[t * top_k + k] = w * static_cast<float>(scaling);
      ip[t * top_k + k] = chosen[k];
    }
  }
  return {weights, ids};
}

// rows [T * K, D] expert outputs in send order (rows[i] is the pair send_order[i] = t * K + k),
// weights [T, K] -> [T, D]: sum over k, in k order, of weights[t, k] * that pair's row.
torch::Tensor combine(const torch::Tensor& rows, const torch::Tensor& send_order,
                      const torch::Tensor& weights) {
  check_fp32(rows, "rows");
  check_fp32(weights, "weights");
  TORCH_CHECK(rows.dim() == 2 && rows.is_contiguous() && weights.dim() == 2 &&
                  weights.is_contiguous() && send_order.scalar_type() == torch::kLong &&
                  send_order.is_contiguous() && send_order.numel() == rows.size(0) &&
                  rows.size(0) == weights.numel(),
              "rows [T*K, D], send_order [T*K] int64, weights [T, K]; got ", rows.sizes(), ", ",
              send_order.sizes(), ", ", weights.sizes());
  const int64_t T = weights.size(0), K = weights.size(1), D = rows.size(1), N = T * K;
  const int64_t* so = send_order.data_ptr<int64_t>();
  std::vector<int64_t> where(N, -1);  // pair -> its row
  for (int64_t i = 0; i < N; ++i) {
    TORCH_CHECK(0 <= so[i] && so[i] < N && where[so[i]] < 0, "send_order is not a permutation");
    where[so[i]] = i;
  }
  auto out = torch::empty({T, D}, rows.options());
  const float* rp = rows.data_ptr<float>();
  const float* wp = weights.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 8192 / std::max<int64_t>(D * K, 1)), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      float* o = op + t * D;
      for (int64_t k = 0; k < K; ++k) {
        const float* r = rp + where[t * K + k] * D;
        const float w = wp[t * K + k];
        if (k == 0)
          for (int64_t d = 0; d < D; ++d) o[d] = r[d] * w;
        else
          for (int64_t d = 0; d < D; ++d) o[d] += r[d] * w;
      }
    }
  });
  return out;
}

// x [B, V] -> [B] int64: the index of each row's largest value, the lowest on ties; a NaN
// counts as the largest (the first NaN wins), as torch.argmax.
torch::Tensor argmax_rows(const torch::Tensor& x) {
  check_fp32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) > 0, "x [B, V>0] contiguous");
  const int64_t B = x.size(0), V = x.size(1);
  auto out = torch::empty({B}, x.options().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, B, 1, [&](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) {
      const float* r = xp + row * V;
      vec m = epc::vset(-INFINITY);
      bool nan = false;
      int64_t k = 0;
      for (; k + kLanes <= V; k += kLanes) {
        const vec v = epc::vload(r + k);
        nan |= epc::vany_nan(v);
        m = epc::vmax(m, v);
      }
      float top = epc::vhmax(m);
      for (; k < V; ++k) {
        nan |= std::isnan(r[k]);
        top = std::max(top, r[k]);
      }
      int64_t i = 0;
      if (nan) {
        while (!std::isnan(r[i])) ++i;
      } else {
        while (r[i] != top) ++i;
      }
      op[row] = i;
    }
  });
  return out;
}

// The dispatch of a rank that holds every routed expert: x [T, D], topk_idx [T, K] logical
// experts, log2slot [E] (-1: not held) -> (send_order [T*K]: the (token, k) pairs stably
// sorted by slot, rows [T*K, D] = x[send_order // K], counts [S] int64). A counting sort, one
// op where torch took ten. A pair routed to an expert not held: send_order is empty (the
// caller raises, naming the experts).
std::vector<torch::Tensor> local_dispatch(const torch::Tensor& x, const torch::Tensor& topk_idx,
                                          const torch::Tensor& log2slot, int64_t num_slots) {
  check_fp32(x, "x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && topk_idx.dim() == 2 &&
                  topk_idx.is_contiguous() && topk_idx.scalar_type() == torch::kLong &&
                  topk_idx.size(0) == x.size(0) && log2slot.is_contiguous() &&
                  log2slot.scalar_type() == torch::kLong,
              "x [T, D], topk_idx [T, K] int64, log2slot [E] int64");
  const int64_t T = x.size(0), D = x.size(1), K = topk_idx.size(1), N = T * K,
                E = log2slot.size(0);
  const int64_t* idx = topk_idx.data_ptr<int64_t>();
  const int64_t* l2s = log2slot.data_ptr<int64_t>();
  auto counts = torch::zeros({num_slots}, topk_idx.options());
  int64_t* cp = counts.data_ptr<int64_t>();
  std::vector<int64_t> slot(N);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t e = idx[i];
    const int64_t s = (0 <= e && e < E) ? l2s[e] : -1;
    if (s < 0 || s >= num_slots) return {torch::empty({0}, topk_idx.options()), x, counts};
    slot[i] = s;
    ++cp[s];
  }
  std::vector<int64_t> next(num_slots, 0);
  for (int64_t s = 1; s < num_slots; ++s) next[s] = next[s - 1] + cp[s - 1];
  auto order = torch::empty({N}, topk_idx.options());
  int64_t* op = order.data_ptr<int64_t>();
  for (int64_t i = 0; i < N; ++i) op[next[slot[i]]++] = i;
  auto rows = torch::empty({N, D}, x.options());
  const float* xp = x.data_ptr<float>();
  float* rp = rows.data_ptr<float>();
  at::parallel_for(0, N, std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1)), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) std::copy(xp + op[i] / K * D, xp + (op[i] / K + 1) * D, rp + i * D);
  });
  return {order, rows, counts};
}

// cache [NB, BS, C] viewed as rows: cache row slots[i] = rows[i] for each of the step's tokens
// (the paged cache write; one op where index_put took 25 us a layer).
void write_rows(torch::Tensor& cache, const torch::Tensor& slots, const torch::Tensor& rows) {
  check_fp32(cache, "cache");
  check_fp32(rows, "rows");
  TORCH_CHECK(cache.is_contiguous() && rows.dim() == 2 && rows.stride(1) == 1 &&
                  rows.size(1) == cache.size(-1) && slots.scalar_type() == torch::kLong &&
                  slots.is_contiguous() && slots.numel() == rows.size(0),
              "cache [.., C] contiguous, rows [T, C], slots [T] int64; got ", cache.sizes(), ", ",
              rows.sizes(), ", ", slots.sizes());
  const int64_t C = cache.size(-1), total = cache.numel() / C, T = rows.size(0);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t i = 0; i < T; ++i)
    TORCH_CHECK(0 <= sp[i] && sp[i] < total, "slot ", sp[i], " is not a row of the cache (", total, ")");
  float* cp = cache.data_ptr<float>();
  const float* rp = rows.data_ptr<float>();
  const int64_t ldr = rows.stride(0);
  for (int64_t i = 0; i < T; ++i) std::copy(rp + i * ldr, rp + i * ldr + C, cp + sp[i] * C);
}
