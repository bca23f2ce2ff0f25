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

  then the format's NaN codes are patched in (E4M3FN: ``S.1111.111``; E4M3FNUZ: ``0x80``, which would otherwise
  read as -0.0); E5M2's infinities and NaNs are half's own.
* the **native path** (:func:`decode_fp8_native`) uses the GPU's conversion: to float16, E4M3FN and E5M2 codes
  go through ``cvt.rn.f16x2.e4m3x2`` / ``e5m2x2`` in inline PTX (two codes per instruction; NVIDIA sm_89+);
  otherwise it bitcasts to Triton's FP8 type and converts: E4M3FN is ``tl.float8e4nv``, E5M2 ``tl.float8e5``
  (NVIDIA sm_89+), E4M3FNUZ ``tl.float8e4b8`` (AMD gfx94x). It gives the
  same value as the bit path for every code on hardware that has it; Triton's *interpreter* does not (it decodes
  an e4nv bitcast of 0x7F as 480 instead of NaN), which is why the wrapper never picks it there
  (:func:`native_fp8_supported`).

The formats' ids and the check that a format is one the kernels know are :mod:`kv8.kernels.triton.quant`'s
(:func:`~kv8.kernels.triton.quant.fp8_format_id`, :class:`~kv8.kernels.triton.quant.FP8Layout`: kv8.kernels sits
below kv8.quant in the package layers); the ``FMT`` constexpr here is that id (``0`` E4M3FN, ``1`` E4M3FNUZ, ``2``
E5M2), ``3`` (:data:`~kv8.kernels.triton.quant.INT8_ID`) for ``int8`` codes, which :func:`decode_fp8` converts
(through float32: exact, ``|code| <= 127``; the interpreter's own int8 -> bfloat16 cast is wrong), or
:data:`FP8_NONE` for a 16/32-bit cache, whose values it only converts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kv8.kernels.triton.quant import E4M3FN_ID, E4M3FNUZ_ID, E5M2_ID, bf16_bits_to_f32

__all__ = ["FP8_NONE", "decode_fp8", "decode_fp8_bits", "decode_fp8_native", "native_fp8_supported"]

FP8_NONE = -1  # the FMT of a 16/32-bit cache: no format (quant.py's format ids are 0, 1, 2)


def native_fp8_supported(device: torch.device, code: int, interpreted: bool) -> bool:
    """Whether kernels compiled for ``device`` may use the native conversion for format ``code``: never in the
    interpreter or off a GPU; E4M3FN and E5M2 on NVIDIA compute capability >= 8.9 (Ada, Hopper and later, where
    Triton lowers ``float8e4nv``); E4M3FNUZ on AMD gfx94x (MI300), the one target with ``float8e4b8``. Anything
    else takes the exact bit path (same values, a few more integer ops)."""
    if interpreted or device.type != "cuda" or code not in (E4M3FN_ID, E4M3FNUZ_ID, E5M2_ID):
        return False
    if torch.version.hip is not None:
        arch = str(getattr(torch.cuda.get_device_properties(device), "gcnArchName", ""))
        return code == E4M3FNUZ_ID and arch.startswith("gfx94")
    return code in (E4M3FN_ID, E5M2_ID) and torch.cuda.get_device_capability(device) >= (8, 9)


@triton.jit
def decode_fp8_bits(code, FMT: tl.constexpr, OUT: tl.constexpr):
    """uint8 codes (any shape) -> values of format ``FMT`` in dtype ``OUT`` (float32, float16 or bfloat16: every
    FP8 value is exact in each), exact for all 256 codes (module docstring). The arithmetic is in float16."""
    c = code.to(tl.uint16)
    if FMT == 2:  # E5M2: the top byte of an IEEE half, same bias; inf and NaN come with it
        half = (c << 8).to(tl.float16, bitcast=True)
    else:  # E4M3FN / E4M3FNUZ: exponent and mantissa into the half's low exponent bits, then a power-of-two factor
        half = (((c & 0x80) << 8) | ((c & 0x7F) << 7)).to(tl.float16, bitcast=True)
        if FMT == 0:  # E4M3FN: S.1111.111 is NaN
            half = tl.where((c & 0x7F) == 0x7F, float("nan"), half * 256.0)       # 2^(15 - 7)
        else:  # E4M3FNUZ: 0x80 is NaN
            half = tl.where(c == 0x80, float("nan"), half * 128.0)                # 2^(15 - 8)
    return half.to(OUT)


@triton.jit
def decode_fp8_native(code, FMT: tl.constexpr, OUT: tl.constexpr):
    """uint8 codes -> values in dtype ``OUT`` via the GPU's FP8 conversions (only where :func:`native_fp8_supported`
    says so). E4M3FN and E5M2 to float16 are ``cvt.rn.f16x2.e4m3x2`` / ``cvt.rn.f16x2.e5m2x2``, two codes per
    instruction, four codes (one register) per call of the inline assembly; it is marked impure so that Triton
    keeps it where it stands -- on codes loaded in their own layout, 16 consecutive per thread -- instead of moving
    it into a tensor-core operand layout, where it would load the codes from shared memory one byte at a time.
    The other formats and dtypes use Triton's FP8 types."""
    if OUT == tl.float16 and FMT != 1:
        cvt: tl.constexpr = "cvt.rn.f16x2.e4m3x2" if FMT == 0 else "cvt.rn.f16x2.e5m2x2"
        value = tl.inline_asm_elementwise(
            asm="{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; " + cvt + " $0, lo; " + cvt + " $1, hi; }",
            constraints="=r,=r,r", args=[code], dtype=tl.float16, is_pure=False, pack=4)
    elif FMT == 0:  # E4M3FN
        value = code.to(tl.float8e4nv, bitcast=True).to(OUT)
    elif FMT == 2:  # E5M2
        value = code.to(tl.float8e5, bitcast=True).to(OUT)
    else:
        tl.static_assert(FMT == 1, "FMT must be a format id of kv8.kernels.triton.quant")
        value = code.to(tl.float8e4b8, bitcast=True).to(OUT)
    return value


@triton.jit
def decode_fp8(raw, FMT: tl.constexpr, NATIVE: tl.constexpr, OUT: tl.constexpr):
    """Loaded cache elements -> dtype ``OUT``: FP8 codes of format id ``FMT`` decoded by the native or the bit path
    (exact), int8 codes converted (exact), a 16/32-bit cache's values converted (exact when ``OUT`` holds the cache
    dtype: the caller's duty)."""
    if FMT == 3:  # INT8_ID: int8 codes
        value = raw.to(tl.float32).to(OUT)
    elif FMT == -1:  # FP8_NONE
        if raw.dtype == tl.bfloat16 and OUT == tl.float32:
            value = bf16_bits_to_f32(raw)        # exact in the interpreter too (its cast flushes subnormals)
        else:
            value = raw.to(OUT)
    elif NATIVE:
        value = decode_fp8_native(raw, FMT, OUT)
    else:
        value = decode_fp8_bits(raw, FMT, OUT)
    return value
