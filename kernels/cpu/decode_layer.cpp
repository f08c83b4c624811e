// One decoder layer of a decode step in one call from Python: the same kernels, in the same
// order and on the same tensors as the layer's Python code (moe/model.py DecoderLayer.stages
// with every query on the absorbed path, this rank holding every routed expert), so the numbers
// are bit for bit those of the Python path.
//
// Why: at batch 1 a `small` step made ~134 kernel calls with ~2 ms of Python and torch glue
// between them (views, splits, dispatch handles, generator stages), ~15% of the step, spread
// thin over the layer code (no line over ~1% under py-spy). engine/cpu_decode.py builds one
// DecodeLayer per layer after loading and calls forward() per layer: ~10 calls a step.
#include <torch/extension.h>

#include <vector>

#include "kernels.h"

namespace {

struct DecodeLayer {
  // attention (moe/attention.py MLAttention)
  torch::Tensor input_norm;  // [D] input_layernorm
  torch::Tensor w_in;        // panels of [q_width + C, D]: q_a_proj (or q_proj), kv_a_proj
  int64_t w_in_rows = 0;
  torch::Tensor q_norm;  // [q_lora_rank] q_a_layernorm; undefined without q LoRA
  torch::Tensor q_b;     // panels of q_b_proj [NH * (Dn + Dr), q_lora_rank]
  int64_t q_b_rows = 0;
  torch::Tensor kv_norm;  // [Dc] kv_a_layernorm
  torch::Tensor w_uk;     // [NH, Dn, Dc]
  torch::Tensor w_uv_t;   // [NH, Dc, Dv]
  torch::Tensor o_proj;   // panels of [D, NH * Dv]
  int64_t heads = 0, nope = 0, rope = 0, rank = 0;
  bool interleave = true;
  double scale = 1.0, eps = 1e-6;
  torch::Tensor post_norm;  // [D] post_attention_layernorm
  // feed-forward: a dense MLP (mlp_*), or the MoE: gate, routed experts, shared experts (mlp_*)
  torch::Tensor mlp_w13, mlp_w2;  // panels; undefined: no dense MLP / shared expert
  int64_t mlp_inter = 0;
  bool moe = false;
  torch::Tensor gate;       // [E, D]
  c10::optional<torch::Tensor> gate_bias;  // [E] e_score_correction_bias
  int64_t top_k = 0, scoring = 0, method = 0, n_group = 1, topk_group = 1;
  bool norm_topk = true;
  double routed_scale = 1.0;
  torch::Tensor w13, w2;   // [S, 2I, D], [S, D, I]
  torch::Tensor log2slot;  // [E] int64, every expert held
  int64_t slots = 0;

  // The attention half: x [T, D] -> (x + attention [T, D], its post-attention norm [T, D]).
  // cos, sin [T, Dr/2]; the cache [NB, BS, C] takes the step's latents at slot_mapping [T];
  // tables [T, M], lens [T]: each query's block table and keys.
  std::vector<torch::Tensor> attention(const torch::Tensor& x, const torch::Tensor& cos,
                                       const torch::Tensor& sin, torch::Tensor& cache,
                                       const torch::Tensor& slot_mapping,
                                       const torch::Tensor& tables,
                                       const torch::Tensor& lens) const {
    TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x [T, D] contiguous, got ", x.sizes());
    const int64_t T = x.size(0), C = rank + rope;
    // input norm, the fused input projection, q LoRA, rotary, the latent
    const torch::Tensor qkv = ::linear_panels(::rms_norm(x, input_norm, eps), w_in, w_in_rows);
    const int64_t q_width = w_in_rows - C;
    torch::Tensor q = qkv.narrow(1, 0, q_width);
    const torch::Tensor kv_a = qkv.narrow(1, q_width, C);
    if (q_norm.defined()) q = ::linear_panels(::rms_norm(q, q_norm, eps), q_b, q_b_rows);
    q = q.view({T, heads, nope + rope});
    const torch::Tensor q_nope = q.narrow(2, 0, nope);
    const torch::Tensor q_pe = ::rotary(q.narrow(2, nope, rope), cos, sin, interleave);
    const torch::Tensor k_pe = ::rotary(kv_a.narrow(1, rank, rope), cos, sin, interleave);
    const torch::Tensor latent =
        torch::cat({::rms_norm(kv_a.narrow(1, 0, rank), kv_norm, eps), k_pe}, 1);  // [T, C]
    ::write_rows(cache, slot_mapping, latent);
    const torch::Tensor attn = ::mla_decode(q_nope, q_pe, cache, tables, lens, w_uk, w_uv_t, scale);
    const torch::Tensor h1 =
        x + ::linear_panels(attn.view({T, heads * attn.size(2)}), o_proj, x.size(1));
    return {h1, ::rms_norm(h1, post_norm, eps)};
  }

  // The whole layer: x [T, D] -> (x after the layer [T, D], rows routed to each expert slot
  // [S] int64: undefined in a dense layer); the arguments as attention's. An MoE layer needs
  // its routed experts here (w13, w2, log2slot: every expert held).
  std::vector<torch::Tensor> forward(const torch::Tensor& x, const torch::Tensor& cos,
                                     const torch::Tensor& sin, torch::Tensor& cache,
                                     const torch::Tensor& slot_mapping,
                                     const torch::Tensor& tables, const torch::Tensor& lens) const {
    const auto a = attention(x, cos, sin, cache, slot_mapping, tables, lens);
    const torch::Tensor &h1 = a[0], &h = a[1];
    if (!moe) return {h1 + ::mlp_panels(h, mlp_w13, mlp_w2, mlp_inter), torch::Tensor()};
    TORCH_CHECK(w13.defined() && log2slot.defined(), "an MoE layer without its routed experts");
    // the gate, the dispatch to local slots, the shared expert, the routed experts, combine
    const torch::Tensor logits = ::linear(h, gate);
    const auto topk = ::grouped_topk(logits, top_k, scoring, method, n_group, topk_group,
                                     norm_topk, routed_scale, gate_bias);
    const auto sent = ::local_dispatch(h, topk[1], log2slot, slots);  // order, rows, counts
    TORCH_CHECK(sent[0].numel() == topk[1].numel(),
                "tokens were routed to an expert this rank does not hold");
    torch::Tensor shared;
    if (mlp_w13.defined()) shared = ::mlp_panels(h, mlp_w13, mlp_w2, mlp_inter);
    const int64_t* cp = sent[2].data_ptr<int64_t>();
    const std::vector<int64_t> counts(cp, cp + slots);
    const torch::Tensor y = ::grouped_mlp(sent[1], counts, w13, w2);
    torch::Tensor out = ::combine(y, sent[0], topk[0]);
    if (shared.defined()) out = out + shared;
    return {h1 + out, sent[2]};
  }
};

}  // namespace

void bind_decode(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<DecodeLayer>(m, "DecodeLayer",
                          "one decoder layer of a decode step (engine/cpu_decode.py fills it)")
      .def(py::init<>())
      .def_readwrite("input_norm", &DecodeLayer::input_norm)
      .def_readwrite("w_in", &DecodeLayer::w_in)
      .def_readwrite("w_in_rows", &DecodeLayer::w_in_rows)
      .def_readwrite("q_norm", &DecodeLayer::q_norm)
      .def_readwrite("q_b", &DecodeLayer::q_b)
      .def_readwrite("q_b_rows", &DecodeLayer::q_b_rows)
      .def_readwrite("kv_norm", &DecodeLayer::kv_norm)
      .def_readwrite("w_uk", &DecodeLayer::w_uk)
      .def_readwrite("w_uv_t", &DecodeLayer::w_uv_t)
      .def_readwrite("o_proj", &DecodeLayer::o_proj)
      .def_readwrite("heads", &DecodeLayer::heads)
      .def_readwrite("nope", &DecodeLayer::nope)
      .def_readwrite("rope", &DecodeLayer::rope)
      .def_readwrite("rank", &DecodeLayer::rank)
      .def_readwrite("interleave", &DecodeLayer::interleave)
      .def_readwrite("scale", &DecodeLayer::scale)
      .def_readwrite("eps", &DecodeLayer::eps)
      .def_readwrite("post_norm", &DecodeLayer::post_norm)
      .def_readwrite("mlp_w13", &DecodeLayer::mlp_w13)
      .def_readwrite("mlp_w2", &DecodeLayer::mlp_w2)
      .def_readwrite("mlp_inter", &DecodeLayer::mlp_inter)
      .def_readwrite("moe", &DecodeLayer::moe)
      .def_readwrite("gate", &DecodeLayer::gate)
      .def_readwrite("gate_bias", &DecodeLayer::gate_bias)
      .def_readwrite("top_k", &DecodeLayer::top_k)
      .def_readwrite("scoring", &DecodeLayer::scoring)
      .def_readwrite("method", &DecodeLayer::method)
      .def_readwrite("n_group", &DecodeLayer::n_group)
      .def_readwrite("topk_group", &DecodeLayer::topk_group)
      .def_readwrite("norm_topk", &DecodeLayer::norm_topk)
      .def_readwrite("routed_scale", &DecodeLayer::routed_scale)
      .def_readwrite("w13", &DecodeLayer::w13)
      .def_readwrite("w2", &DecodeLayer::w2)
      .def_readwrite("log2slot", &DecodeLayer::log2slot)
      .def_readwrite("slots", &DecodeLayer::slots)
      // without the GIL, as the module's kernels (bindings.cpp)
      .def("attention", &DecodeLayer::attention, py::call_guard<py::gil_scoped_release>(),
           "x [T, D] -> (x + attention, its post-attention norm)")
      .def("forward", &DecodeLayer::forward, py::call_guard<py::gil_scoped_release>(),
           "x [T, D] -> (x after the layer, slot counts)");
}
