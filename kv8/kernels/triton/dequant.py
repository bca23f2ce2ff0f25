"""FP8 KV codes -> values inside a Triton kernel: an exact bit decode and the GPU's native conversion.

The KV cache stores FP8 values as raw ``uint8`` codes (:mod:`kv8.quant.formats` owns the three layouts). A kernel
loads the codes and decodes them in registers with :func:`decode_fp8`, straight into the dtype its ``tl.dot`` takes
(float32, float16 or bfloat16: every FP8 value is exact in all three), choosing the path with constexprs that the
host wrapper sets:

* the **bit path** (:func:`decode_fp8_bits`) builds the value from the code's bits and is exact for all 256 codes
  of every format, NaN and infinities included. It works in Triton's interpreter and on any GPU. The trick: an
  FP8 code's sign, exponent and mantissa fields, moved into the matching fields of an IEEE half, give a half
  whose value is the FP8 value times a power of two (subnormals included, since a half's exponent range covers
  all three formats' subnormals), the power-of-two factor is exact in half, and so is the conversion to the
  output dtype::

      E5M2      S EEEEE MM  (bias 15) -> half bits  S EEEEE MM00000000        same bias: no factor
      E4M3(FN)  S EEEE MMM  (bias 7)  -> half bits  S 0EEEE MMM0000000        half bias 15: value * 2^8
      E4M3FNUZ  S EEEE MMM  (bias 8)  -> half bits  S 0EEEE MMM0000000        half bias 15: value * 2^7

  (in general: the exponent and mantissa shifted by ``10 - M``, the factor ``2^(15 - bias)``), then the format's
  NaN codes are patched in (E4M3FN: ``S.1111.111``; E4M3FNUZ: ``0x80``, which would otherwise read as -0.0);
  E5M2's infinities and NaNs are half's own.
* the **native path** (:func:`decode_fp8_native`) uses the GPU's conversion: to float16, E4M3FN and E5M2 codes
  go through ``cvt.rn.f16x2.e4m3x2`` / ``e5m2x2`` in inline PTX (two codes per instruction; NVIDIA sm_89+);
  otherwise it bitcasts to Triton's FP8 type and converts: E4M3FN is ``tl.float8e4nv``, E5M2 ``tl.float8e5``
  (NVIDIA sm_89+), E4M3FNUZ ``tl.float8e4b8`` (AMD gfx94x). It gives the
  same value as the bit path for every code on hardware that has it; Triton's *interpreter* does not (it decodes
  an e4nv bitcast of 0x7F as 480 instead of NaN), which is why the wrapper never picks it there
  (:func:`native_fp8_supported`).

The format is the ``FMT`` constexpr, a :class:`~kv8.kernels.triton.formats.KernelFormat` derived from the
:class:`kv8.quant.formats.FP8Format` (which layout, which NaN codes, which factor, which native type: all from the
format's fields), or ``None`` for a 16/32-bit cache, whose values :func:`decode_fp8` only converts. Whether the
native path may be used is the platform's to say (:func:`native_fp8_supported`). An integer format's
``KernelFormat`` (``FMT.int_codes``: an ``int8_per_token_head`` cache) has ``int8`` codes, which
:func:`decode_fp8` converts through float32 (exact, ``|code| <= 127``; the interpreter's own int8 -> bfloat16 cast
is wrong); an ``int4_per_token_head`` cache (``FMT.packed``) has bytes of two 4-bit codes, which it unpacks in
registers first (:func:`unpack_nibbles`: a row of ``B`` bytes becomes ``2 B`` codes); an ``int4_per_group32``
cache's rows also carry a float16 scale per group of values (:func:`group_scales` reads them,
:func:`apply_group_scales` multiplies each code by its group's). An ``fp4_e2m1`` cache (``FMT.packed`` without
``FMT.int_codes``) has bytes of two E2M1 codes, which :func:`unpack_e2m1` decodes by the bit path's trick on 4
bits (the sign from bit 3, exponent and mantissa into a half's, times ``2^(15 - bias)``), and an E4M3 scale code
per group of 16 after them, which :func:`decode_fp8_bits` decodes with the format's ``scale_format`` (all exact).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kv8.kernels.triton import interpreter
from kv8.kernels.triton.formats import KernelFormat
from kv8.kernels.triton.quant import bf16_bits_to_f32
from kv8.platform import Platform

__all__ = ["apply_group_scales", "decode_fp8", "decode_fp8_bits", "decode_fp8_native", "group_scales",
           "native_fp8_supported", "unpack_e2m1", "unpack_nibbles"]


def native_fp8_supported(platform: Platform, fmt: KernelFormat | None) -> bool:
    """Whether kernels for ``platform`` may decode ``fmt`` with the GPU's conversion: where the platform converts
    the format in hardware (:attr:`kv8.platform.Platform.native_fp8`: E4M3 and E5M2 on NVIDIA compute capability
    >= 8.9, E4M3FNUZ on AMD gfx94x) and Triton has a type of its layout (``fmt.native``); never in Triton's
    interpreter (its FP8 types decode some codes wrongly) or for a 16/32-bit cache (``fmt`` None). Elsewhere the
    exact bit path (same values, a few more integer ops). Reads no device: the platform has read it once."""
    if interpreter.INTERPRETED or fmt is None or fmt.native is None:
        return False
    return fmt.name in platform.native_fp8


@triton.jit
def decode_fp8_bits(code, FMT: tl.constexpr, OUT: tl.constexpr):
    """uint8 codes (any shape) -> values of format ``FMT`` (a :class:`~kv8.kernels.triton.formats.KernelFormat`)
    in dtype ``OUT`` (float32, float16 or bfloat16: every FP8 value is exact in each), exact for all 256 codes
    (module docstring). The arithmetic is in float16."""
    c = code.to(tl.uint16)
    if FMT.half_top_byte:  # E5M2: the top byte of an IEEE half, same bias; inf and NaN come with it
        half = (c << 8).to(tl.float16, bitcast=True)
    else:  # E4M3FN / E4M3FNUZ: exponent and mantissa into the half's low exponent bits, then a power-of-two factor
        SHIFT: tl.constexpr = 10 - FMT.mantissa_bits
        half = (((c & 0x80) << 8) | ((c & 0x7F) << SHIFT)).to(tl.float16, bitcast=True)
        if FMT.nan_mask == 0xFF:  # one NaN code (E4M3FNUZ: 0x80, which would read as -0.0)
            is_nan = c == FMT.nan_match
        else:  # a NaN code of either sign (E4M3FN: S.1111.111)
            is_nan = (c & FMT.nan_mask) == FMT.nan_match
        half = tl.where(is_nan, float("nan"), half * FMT.half_factor)        # 2^(15 - bias)
    return half.to(OUT)


@triton.jit
def decode_fp8_native(code, FMT: tl.constexpr, OUT: tl.constexpr):
    """uint8 codes -> values in dtype ``OUT`` via the GPU's FP8 conversions (only where :func:`native_fp8_supported`
    says so), by ``FMT.native``, Triton's FP8 type of the format's layout. E4M3FN (``fp8e4nv``) and E5M2 (``fp8e5``)
    to float16 are ``cvt.rn.f16x2.e4m3x2`` / ``cvt.rn.f16x2.e5m2x2``, two codes per instruction, four codes (one
    register) per call of the inline assembly; it is marked impure so that Triton keeps it where it stands -- on
    codes loaded in their own layout, 16 consecutive per thread -- instead of moving it into a tensor-core operand
    layout, where it would load the codes from shared memory one byte at a time. The other types and dtypes use
    Triton's conversions of its FP8 types."""
    if OUT == tl.float16 and (FMT.native == "fp8e4nv" or FMT.native == "fp8e5"):
        cvt: tl.constexpr = "cvt.rn.f16x2.e4m3x2" if FMT.native == "fp8e4nv" else "cvt.rn.f16x2.e5m2x2"
        value = tl.inline_asm_elementwise(
            asm="{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; " + cvt + " $0, lo; " + cvt + " $1, hi; }",
            constraints="=r,=r,r", args=[code], dtype=tl.float16, is_pure=False, pack=4)
    elif FMT.native == "fp8e4nv":  # E4M3FN
        value = code.to(tl.float8e4nv, bitcast=True).to(OUT)
    elif FMT.native == "fp8e5":  # E5M2
        value = code.to(tl.float8e5, bitcast=True).to(OUT)
    else:
        tl.static_assert(FMT.native == "fp8e4b8", "FMT.native must be fp8e4nv, fp8e5 or fp8e4b8")
        value = code.to(tl.float8e4b8, bitcast=True).to(OUT)
    return value


@triton.jit
def unpack_nibbles(raw, AXIS: tl.constexpr):
    """``uint8`` bytes of two two's complement 4-bit codes, channels along ``AXIS`` (``[R, B]`` with ``AXIS`` 1,
    ``[B, R]`` with 0) -> ``int32`` codes in -8..7 (``[R, 2 B]``, ``[2 B, R]``), channel ``2j`` from the low nibble
    of byte ``j``, ``2j + 1`` from the high (:func:`kv8.quant.formats.unpack_int4`): the two nibbles sign-extended
    (``(n ^ 8) - 8``) in registers and interleaved by a join (and, along axis 0, a permute) and a reshape."""
    b = raw.to(tl.int32)
    lo = ((b & 0xF) ^ 8) - 8
    hi = (((b >> 4) & 0xF) ^ 8) - 8
    if AXIS == 1:
        res = tl.reshape(tl.join(lo, hi), [raw.shape[0], raw.shape[1] * 2])
    else:
        res = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), [raw.shape[0] * 2, raw.shape[1]])
    return res


@triton.jit
def unpack_e2m1(raw, FMT: tl.constexpr, AXIS: tl.constexpr):
    """``uint8`` bytes of two 4-bit float codes of the packed float format ``FMT`` (``fp4_e2m1``: sign in bit 3,
    exponent and ``FMT.mantissa_bits`` below it, bias ``FMT.exponent_bias``), channels along ``AXIS`` as
    :func:`unpack_nibbles` has them (``[R, B]`` with 1 -> ``[R, 2 B]``, ``[B, R]`` with 0 -> ``[2 B, R]``; channel
    ``2j`` from the low nibble of byte ``j``) -> float32 values, exact for all 16 codes (-0.0 included): each code's
    sign moved to a half's bit 15, its exponent and mantissa shifted by ``10 - M`` into the half's, the half (a
    subnormal for the small codes) widened and times ``2^(15 - bias)`` (``FMT.half_factor``), as
    :func:`decode_fp8_bits` builds an FP8 code."""
    b = raw.to(tl.int32)
    lo = b & 0xF
    hi = (b >> 4) & 0xF
    if AXIS == 1:
        n = tl.reshape(tl.join(lo, hi), [raw.shape[0], raw.shape[1] * 2])
    else:
        n = tl.reshape(tl.permute(tl.join(lo, hi), (0, 2, 1)), [raw.shape[0] * 2, raw.shape[1]])
    SHIFT: tl.constexpr = 10 - FMT.mantissa_bits
    half = (((n & 0x8) << 12) | ((n & 0x7) << SHIFT)).to(tl.uint16).to(tl.float16, bitcast=True)
    return half.to(tl.float32) * FMT.half_factor


@triton.jit
def group_scales(raw):
    """``uint8 [R, 2 G]``: the little-endian bytes of ``G`` float16 group scales per row -> ``float32 [R, G]``
    (exact, by the bits: a negative scale keeps its sign, a subnormal its value)."""
    b = raw.to(tl.int32)
    lo, hi = tl.split(tl.reshape(b, [raw.shape[0], raw.shape[1] // 2, 2]))
    return (lo | (hi << 8)).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def apply_group_scales(values, scales, AXIS: tl.constexpr, GS: tl.constexpr):
    """float32 ``values`` with their channels along ``AXIS`` (``[R, D]`` with 1, ``[D, R]`` with 0) times the scale
    of each channel's group of ``GS`` (``scales [R, D / GS]``, :func:`group_scales`), exact in float32 for int4 codes
    (-8 .. 7) and float16 scales of either sign, and for E2M1 values and E4M3 scales (2 and 4 significant bits): a
    plain product, no assumption on either's sign or range."""
    if AXIS == 1:
        res = tl.reshape(tl.reshape(values, [values.shape[0], values.shape[1] // GS, GS]) * scales[:, :, None],
                         [values.shape[0], values.shape[1]])
    else:
        res = tl.reshape(tl.reshape(values, [values.shape[0] // GS, GS, values.shape[1]])
                         * tl.trans(scales)[:, None, :], [values.shape[0], values.shape[1]])
    return res


@triton.jit
def decode_fp8(raw, FMT: tl.constexpr, NATIVE: tl.constexpr, OUT: tl.constexpr, AXIS: tl.constexpr = 1):
    """Loaded cache elements -> dtype ``OUT``: FP8 codes of format ``FMT`` (a
    :class:`~kv8.kernels.triton.formats.KernelFormat`) decoded by the native or the bit path (exact), int8 codes of
    an integer format (``FMT.int_codes``) converted (exact), int4 bytes (``FMT.packed``: ``[R, B]`` -> ``[R, 2 B]``
    values, :func:`unpack_nibbles`) unpacked and converted (exact), bytes of two 4-bit float codes (``FMT.packed``
    without ``FMT.int_codes``: ``fp4_e2m1``, :func:`unpack_e2m1`) decoded (exact; their group scales are the
    caller's), or, with ``FMT`` None, a 16/32-bit cache's values converted (exact when ``OUT`` holds the cache dtype:
    the caller's duty)."""
    if FMT is None:
        if raw.dtype == tl.bfloat16 and OUT == tl.float32:
            value = bf16_bits_to_f32(raw)        # exact in the interpreter too (its cast flushes subnormals)
        else:
            value = raw.to(OUT)
    elif FMT.int_codes:  # int8 codes: exact through float32 (not the interpreter's int8 -> bfloat16 cast)
        if FMT.packed:   # int4: [R, B] bytes -> [R, 2 B] codes
            value = unpack_nibbles(raw, AXIS).to(tl.float32).to(OUT)
        else:
            value = raw.to(tl.float32).to(OUT)
    elif FMT.packed:     # 4-bit float codes (fp4_e2m1): [R, B] bytes -> [R, 2 B] values
        value = unpack_e2m1(raw, FMT, AXIS).to(OUT)
    elif NATIVE:
        value = decode_fp8_native(raw, FMT, OUT)
    else:
        value = decode_fp8_bits(raw, FMT, OUT)
    return value
