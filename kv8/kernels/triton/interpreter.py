"""Triton's interpreter, decided once: whether this process's kernels are interpreted, and the helpers whose
interpreted form must differ from (or work around) the compiled one.

With ``TRITON_INTERPRET=1`` when a kernel is decorated, ``triton.jit`` returns an interpreted function that runs on
CPU tensors with numpy (how the tests run without a GPU). :data:`INTERPRETED` is decided here, once, by decorating
a probe the same way; every kernel module of this package imports this module before it decorates its kernels, so
they agree with it. Kernels read it as the global constexpr :data:`INTERPRETER`, so no launch passes it and the
compiled kernels (``INTERPRETER`` false) are what they would be without it.

The interpreter's workarounds, all here except one:

* :func:`cast_rn`: float32 -> a dot or output dtype, rounded to nearest even; the interpreter's bfloat16 cast
  truncates, so there the bits are rounded (:func:`kv8.kernels.triton.quant.f32_to_bf16_bits`).
* :func:`dot`: the interpreter cannot multiply bfloat16, so there 16-bit operands (exact in float32) are multiplied
  as float32; :func:`widen`, float32 from any operand exactly (the interpreter's bfloat16 cast flushes subnormals).
* :func:`max_combine`, :func:`add_combine`: reductions are ``tl.reduce`` with these combiners rather than
  ``tl.max`` / ``tl.sum`` (and fills are ``tl.full`` rather than ``tl.zeros``), Triton's own ``@jit`` helpers,
  which the interpreter can run only if ``triton`` itself was imported with ``TRITON_INTERPRET=1``; with builtins
  only, the kernels interpret whichever module imported Triton first. (Same code compiled.)
* the native FP8 conversions are never used in the interpreter (its FP8 types decode some codes wrongly):
  :func:`kv8.kernels.triton.dequant.native_fp8_supported` reads :data:`INTERPRETED`.
* the one outside: the attention kernel's key loop is ``for j in range(lo, hi)`` compiled (the form Triton's
  software pipeliner overlaps with the loads) and a ``while`` loop in the interpreter, which cannot take loaded
  scalars as ``range`` bounds (numpy >= 2.4 refuses ``int()`` of its 1-element arrays); a loop cannot be a helper,
  so :func:`kv8.kernels.triton.attention._paged_attention_kernel` branches on :data:`INTERPRETER` there.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from kv8.kernels.triton.quant import bf16_bits_to_f32, f32_to_bf16_bits

__all__ = ["INTERPRETED", "INTERPRETER", "add_combine", "cast_rn", "dot", "max_combine", "widen"]


@triton.jit
def _probe():
    pass


INTERPRETED: bool = not isinstance(_probe, JITFunction)   # kernels decorated now are interpreted: CPU tensors work
INTERPRETER = tl.constexpr(INTERPRETED)                   # the same, as the kernels read it


@triton.jit
def max_combine(a, b):
    return tl.maximum(a, b)


@triton.jit
def add_combine(a, b):
    return a + b


@triton.jit
def cast_rn(x, DTYPE: tl.constexpr):
    """float32 ``x`` -> ``DTYPE``, rounded to nearest even as compiled code does (in the interpreter too)."""
    if INTERPRETER and DTYPE == tl.bfloat16:
        res = f32_to_bf16_bits(x).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        res = x.to(DTYPE)
    return res


@triton.jit
def widen(x):
    """A dot operand -> float32, exactly (in the interpreter too, whose bfloat16 cast flushes subnormals)."""
    if x.dtype == tl.bfloat16:
        res = bf16_bits_to_f32(x)
    else:
        res = x.to(tl.float32)
    return res


@triton.jit
def dot(a, b):
    """``a @ b`` with float32 accumulation; ``a`` and ``b`` share one dtype (float32: IEEE precision, no TF32). In
    the interpreter 16-bit operands (exact in float32) are multiplied as float32."""
    if a.dtype == tl.float32:
        res = tl.dot(a, b, input_precision="ieee")
    elif INTERPRETER:
        res = tl.dot(widen(a), widen(b), input_precision="ieee")
    else:
        res = tl.dot(a, b)
    return res
