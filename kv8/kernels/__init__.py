"""kv8's native kernels, one subpackage per platform.

* :mod:`kv8.kernels.cpu`: two C++ libraries (attention; dense linear layers and elementwise ops), built on first
  use with the machine's compiler and loaded with ctypes; their sources in ``cpu/csrc/``.
* :mod:`kv8.kernels.triton`: the GPU path's Triton kernels (quantize-on-store, unified paged attention), also run
  on CPU tensors by Triton's interpreter in the tests.

This package sits below every other kv8 layer but the options and validators: the kernels take plain tensors,
ints and small protocols, never kv8's configs.
"""
