"""Leaf ops, the lowest floor. The folder:

- One Python face per op (gate, linear, mla_attention, moe_mlp, rmsnorm, rotary, fp8): a
  plain-torch reference beside it and, where written, a Triton kernel (a @jit function in the same
  module) and a compiled CPU kernel behind the same function; backend.py chooses between them.
- cpu/: the compiled CPU kernels (C++ sources, their one bindings file, and build.py).
- backend.py (which path serves a call) and hugepages.py (placing weights on huge pages) are
  not ops but what the faces share.

Shape legend, project-wide: a letter means the same thing in every docstring and `# [..]` tag of
kernels/, moe/ and engine/ (a module's own legend lists the letters it uses).

    T   tokens of a flat batch           B   sequences (requests) of a batch
    D   hidden size                      V   vocabulary
    I   intermediate size of an MLP      Dq  q_lora_rank
    NH  attention heads                  Dn, Dr, Dv  nope / rope / value dims of a head
    Dc  kv_lora_rank (the latent)        C   = Dc + Dr numbers cached per token per layer
    Q   query tokens of one sequence     J   context (key) positions of one sequence
    NB  blocks of the paged cache        BS  block size (tokens per block)
    M   blocks in a block table          L   layers (MoE layers where a placement is meant)
    E   logical routed experts           K   experts per token (top-k)
    G   expert groups                    X   most replicas of one expert
    S   physical expert slots of a pool  S_r = S / R slots on one rank
    R   ranks of a pool                  N   rows (token x k pairs) dispatched or received
    ND  nodes                            Fo, Fi  out / in features of a weight matrix
                                         Bo, Bi  128 x 128 scale blocks along Fo, Fi (FP8)
"""
