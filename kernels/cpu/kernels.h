// The compiled CPU kernels' entry points (fp32; quantized.cpp's weights are int8), defined in
// gemm.cpp, quantized.cpp, attention.cpp and ops.cpp; decode_layer.cpp calls them in a decode
// layer's order, and bindings.cpp binds them for Python.
#pragma once

#include <torch/extension.h>

#include <vector>

torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w);
torch::Tensor grouped_mlp(const torch::Tensor& x, const std::vector<int64_t>& counts,
                          const torch::Tensor& w13, const torch::Tensor& w2);
torch::Tensor pack_panels(const torch::Tensor& w);
torch::Tensor linear_panels(const torch::Tensor& x, const torch::Tensor& p, int64_t n_out);
torch::Tensor mlp_panels(const torch::Tensor& x, const torch::Tensor& p13, const torch::Tensor& p2,
                         int64_t I);
torch::Tensor linear_int8(const torch::Tensor& x, const torch::Tensor& q,
                          const torch::Tensor& scale);
torch::Tensor linear_int8_vnni(const torch::Tensor& x, const torch::Tensor& q,
                               const torch::Tensor& scale, const torch::Tensor& sums);
bool int8_vnni_available();
torch::Tensor paged_mla_attention(const torch::Tensor& q, const torch::Tensor& cache,
                                  const torch::Tensor& tables, const torch::Tensor& lens,
                                  double scale, int64_t rank);
torch::Tensor mla_decode(const torch::Tensor& q_nope, const torch::Tensor& q_pe,
                         const torch::Tensor& cache, const torch::Tensor& tables,
                         const torch::Tensor& lens, const torch::Tensor& w_uk,
                         const torch::Tensor& w_uv_t, double scale);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps);
torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                     bool interleaved);
std::vector<torch::Tensor> grouped_topk(const torch::Tensor& logits, int64_t top_k, int64_t scoring,
                                        int64_t method, int64_t n_group, int64_t topk_group,
                                        bool norm, double scaling,
                                        const c10::optional<torch::Tensor>& bias);
torch::Tensor combine(const torch::Tensor& rows, const torch::Tensor& send_order,
                      const torch::Tensor& weights);
torch::Tensor argmax_rows(const torch::Tensor& x);
void write_rows(torch::Tensor& cache, const torch::Tensor& slots, const torch::Tensor& rows);
std::vector<torch::Tensor> local_dispatch(const torch::Tensor& x, const torch::Tensor& topk_idx,
                                          const torch::Tensor& log2slot, int64_t num_slots);

// kernels/cpu/decode_layer.cpp: the DecodeLayer class
void bind_decode(pybind11::module& m);
