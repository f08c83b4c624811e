"""The compiled CPU kernels (fp32 C++, built by `pip install`: setup.py, prebuilt.py; build.py's
cpu_kernels() serves them, built on first use only where the install built none that fits).

- gemm.cpp: y = x @ W.T (in place or over panels packed once), the routed experts' MLPs in one
  call per layer.
- quantized.cpp: y = x @ W.T with W as int8 rows and a scale each (the MTP drafts' head).
- attention.cpp: absorbed MLA attention over the paged latent cache.
- ops.cpp: the step's small ops (RMSNorm, rotary, the gate, dispatch sort, combine, argmax).
- decode_layer.cpp: DecodeLayer, a whole decoder layer of a decode step in one call (a second
  implementation of moe/model.py's DecoderLayer, bit for bit; engine/cpu_decode.py drives it).
- simd.h: the vector type and dot tiles; kernels.h: the entry points the others share.
- bindings.cpp: the one Python module binding them all.

The Python faces (kernels/*.py) call them through build.cpu_kernels(), which is None where they
cannot build (no compiler, no AVX2, EPCLUSTER_CPU_KERNEL=0): the torch references serve then.
"""
