"""kv8's Triton kernels, the GPU path's attention: quantize-on-store into the paged KV cache and one attention
kernel family for a whole mixed batch. They run compiled on a CUDA GPU, and in Triton's interpreter
(``TRITON_INTERPRET=1``) on CPU tensors, where the tests check them against the reference attention and
:class:`kv8.cache.codec.KVCodec`. Triton is needed only on that path (the ``test`` extra installs it; the CPU
path never imports this package).
"""
