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
* the **native path** (:func:`decode_fp8_native`) bitcasts to Triton's FP8 type and converts: E4M3FN is
  ``tl.float8e4nv``, E5M2 ``tl.float8e5`` (NVIDIA sm_89+), E4M3FNUZ ``tl.float8e4b8`` (AMD gfx94x). It gives the
  same value as the bit path for every code on hardware that has it; Triton's *interpreter* does not (it decodes
  an e4nv bitcast of 0x7F as 480 instead of NaN), which is why the wrapper never picks it there
  (:func:`native_fp8_supported`).

:class:`FP8Layout` is the part of :class:`kv8.quant.formats.FP8Format` the kernels read (kv8.kernels sits below
kv8.quant in the package layers, so it names the shape of a format instead of importing the class);
:func:`fp8_format_code` maps a format to the constexpr code the kernels branch on, after checking that its bit
layout is the one this module decodes.
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl

__all__ = ["FP8_NONE", "FP8_E4M3FN", "FP8_E4M3FNUZ", "FP8_E5M2", "FP8Layout", "decode_fp8", "decode_fp8_bits",
           "decode_fp8_native", "fp8_format_code", "native_fp8_supported"]

# The constexpr format codes kernels branch on (0: not FP8, a 16/32-bit cache).
FP8_NONE = 0
FP8_E4M3FN = 1
FP8_E4M3FNUZ = 2
FP8_E5M2 = 3

# name -> (code, exponent_bits, mantissa_bits, exponent_bias, has_inf): the layouts the bit path decodes.
_LAYOUTS: dict[str, tuple[int, int, int, int, bool]] = {
    "fp8_e4m3": (FP8_E4M3FN, 4, 3, 7, False),
    "fp8_e4m3fnuz": (FP8_E4M3FNUZ, 4, 3, 8, False),
    "fp8_e5m2": (FP8_E5M2, 5, 2, 15, True),
}


class FP8Layout(Protocol):
    """What a kernel needs to know of an FP8 format (satisfied by :class:`kv8.quant.formats.FP8Format`)."""

    @property
    def name(self) -> str: ...

    @property
    def exponent_bits(self) -> int: ...

    @property
    def mantissa_bits(self) -> int: ...

    @property
    def exponent_bias(self) -> int: ...

    @property
    def has_inf(self) -> bool: ...


def fp8_format_code(fmt: FP8Layout | None) -> int:
    """The constexpr code of ``fmt`` (:data:`FP8_NONE` for None). ``ValueError`` for a format this module does
    not decode: an unknown name, or a known name whose fields disagree with the layout decoded under it."""
    if fmt is None:
        return FP8_NONE
    name = getattr(fmt, "name", None)
    if name not in _LAYOUTS:
        raise ValueError(f"fp8={fmt!r}: format name {name!r} is not one the Triton kernels decode; allowed: "
                         f"{', '.join(_LAYOUTS)} (or None for a 16/32-bit cache)")
    code, e, m, bias, has_inf = _LAYOUTS[name]
    got = (getattr(fmt, "exponent_bits", None), getattr(fmt, "mantissa_bits", None),
           getattr(fmt, "exponent_bias", None), getattr(fmt, "has_inf", None))
    if got != (e, m, bias, has_inf):
        raise ValueError(f"fp8 format {name!r} has (exponent_bits, mantissa_bits, exponent_bias, has_inf)={got}, "
                         f"but {name} is decoded as {(e, m, bias, has_inf)}")
    return code


def native_fp8_supported(device: torch.device, code: int, interpreted: bool) -> bool:
    """Whether kernels compiled for ``device`` may use the native conversion for format ``code``: never in the
    interpreter or off a GPU; E4M3FN and E5M2 on NVIDIA compute capability >= 8.9 (Ada, Hopper and later, where
    Triton lowers ``float8e4nv``); E4M3FNUZ on AMD gfx94x (MI300), the one target with ``float8e4b8``. Anything
    else takes the exact bit path (same values, a few more integer ops)."""
    if interpreted or device.type != "cuda" or code == FP8_NONE:
        return False
    if torch.version.hip is not None:
        arch = str(getattr(torch.cuda.get_device_properties(device), "gcnArchName", ""))
        return code == FP8_E4M3FNUZ and arch.startswith("gfx94")
    return code in (FP8_E4M3FN, FP8_E5M2) and torch.cuda.get_device_capability(device) >= (8, 9)


@triton.jit
def decode_fp8_bits(code, FMT: tl.constexpr, OUT: tl.constexpr):
    """uint8 codes (any shape) -> values of format ``FMT`` in dtype ``OUT`` (float32, float16 or bfloat16: every
    FP8 value is exact in each), exact for all 256 codes (module docstring). The arithmetic is in float16."""
    c = code.to(tl.uint16)
    if FMT == 3:  # E5M2: the top byte of an IEEE half, same bias; inf and NaN come with it
        half = (c << 8).to(tl.float16, bitcast=True)
    else:  # E4M3FN / E4M3FNUZ: exponent and mantissa into the half's low exponent bits, then a power-of-two factor
        half = (((c & 0x80) << 8) | ((c & 0x7F) << 7)).to(tl.float16, bitcast=True)
        if FMT == 1:
            half = tl.where((c & 0x7F) == 0x7F, float("nan"), half * 256.0)       # 2^(15 - 7)
        else:
            half = tl.where(c == 0x80, float("nan"), half * 128.0)                # 2^(15 - 8)
    return half.to(OUT)


@triton.jit
def decode_fp8_native(code, FMT: tl.constexpr, OUT: tl.constexpr):
    """uint8 codes -> values in dtype ``OUT`` via Triton's FP8 types (only where :func:`native_fp8_supported`
    says so)."""
    if FMT == 1:
        value = code.to(tl.float8e4nv, bitcast=True).to(OUT)
    elif FMT == 3:
        value = code.to(tl.float8e5, bitcast=True).to(OUT)
    else:
        value = code.to(tl.float8e4b8, bitcast=True).to(OUT)
    return value


@triton.jit
def decode_fp8(raw, FMT: tl.constexpr, NATIVE: tl.constexpr, OUT: tl.constexpr):
    """Loaded cache elements -> dtype ``OUT``: FP8 codes decoded (``FMT`` != 0) by the native or the bit path
    (exact), a 16/32-bit cache's values converted (exact when ``OUT`` holds the cache dtype: the caller's duty)."""
    if FMT == 0:
        value = raw.to(OUT)
    elif NATIVE:
        value = decode_fp8_native(raw, FMT, OUT)
    else:
        value = decode_fp8_bits(raw, FMT, OUT)
    return value
