// The Python module of the compiled CPU kernels: the one PYBIND11_MODULE, binding the entry
// points of gemm.cpp, quantized.cpp, attention.cpp and ops.cpp (declared in kernels.h) and
// decode_layer.cpp's DecodeLayer. kernels/cpu/build.py builds it with them.
#include <torch/extension.h>

#include "kernels.h"
#include "simd.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // Every kernel runs without the GIL (as torch's own ops do): a rank's other threads (Ray's
  // serialisation of streamed outputs, the asyncio loop answering reserve and status calls)
  // run on another core meanwhile instead of waiting for the engine thread's step to yield.
  const auto nogil = pybind11::call_guard<pybind11::gil_scoped_release>();
  m.def("mla_decode", &mla_decode, nogil,
        "absorbed MLA decode: W_UK, attention over the paged cache, W_UV, in one call (fp32)");
  m.def("rms_norm", &rms_norm, nogil, "RMSNorm of [T, D] rows (fp32)");
  m.def("rotary", &rotary, nogil, "rotary embedding of [T, (H,) Dr] (fp32)");
  m.def("grouped_topk", &grouped_topk, nogil, "the MoE gate: scores and group-limited top-k (fp32)");
  m.def("local_dispatch", &local_dispatch, nogil, "rows sorted by local expert slot (fp32)");
  m.def("write_rows", &write_rows, nogil, "the paged cache write: cache rows slots[i] = rows[i] (fp32)");
  m.def("argmax_rows", &argmax_rows, nogil, "each row's argmax, lowest index on ties (fp32)");
  m.def("combine", &combine, nogil, "weighted sum of each token's expert rows (fp32)");
  m.def("linear", &linear, nogil, "x @ w.T (fp32)");
  m.def("pack_panels", &pack_panels, nogil, "w [N, K] laid out for linear_panels and mlp_panels");
  m.def("linear_panels", &linear_panels, nogil, "x @ w.T, w packed by pack_panels (fp32)");
  m.def("mlp_panels", &mlp_panels, nogil, "SiLU-gated MLP over weights packed by pack_panels (fp32)");
  m.def("linear_int8", &linear_int8, nogil,
        "x @ (q * scale).T: int8 weight rows with a scale each, fp32 x (the drafts' head)");
  m.def("linear_int8_vnni", &linear_int8_vnni, nogil,
        "linear_int8 with x quantized per row, on AVX512-VNNI (int8_vnni)");
  m.def("grouped_mlp", &grouped_mlp, nogil, "SiLU-gated expert MLPs over slot-sorted rows (fp32)");
  m.def("paged_mla_attention", &paged_mla_attention, nogil,
        "absorbed MLA attention over a paged latent cache, one row of heads per query (fp32)");
  m.attr("lanes") = epc::kLanes;
  m.attr("int8_vnni") = int8_vnni_available();  // this build and CPU: linear_int8_vnni serves
  bind_decode(m);
}
