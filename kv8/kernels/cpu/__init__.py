"""kv8's CPU kernels: two C++ libraries built on first use and loaded with ctypes.

* :mod:`kv8.kernels.cpu.build`: compiles a source once per source (and the headers it includes), compiler and CPU,
  and caches the shared library.
* :mod:`kv8.kernels.cpu.abi`: what both wrappers share: the library loaded, its argument structs checked against
  their ctypes mirror, its error codes raised with its own messages.
* :mod:`kv8.kernels.cpu.attention`: the attention library (``csrc/attention/``): fused paged attention over the
  KV cache and quantize-on-store.
* :mod:`kv8.kernels.cpu.dense`: the dense library (``csrc/dense/``): packed bf16 / FP8 linear layers, fused
  RMSNorm, SiLU * up and RoPE, and the sampler's row argmax.

``csrc/common/`` holds what both libraries include: ``kv8_abi.h`` (the dtype codes and ``KV_FORMATS``, the table
of KV cache formats; the error codes and messages; the argument-struct machinery), AMX tile set-up, the FP8 -> bf16
table decode and exp.
"""
