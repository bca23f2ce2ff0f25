"""FP8 and integer encode helpers for Triton kernels: float32 -> ``uint8`` FP8 codes with integer and bit operations
only, and -> ``int8`` / packed int4 codes (:func:`encode_int8`, :func:`pack_nibbles`, end of this docstring).

Contract (the one :meth:`kv8.quant.formats.FP8Format.encode` defines; these helpers are tested bit-exact against
it): for a float32 value ``y`` (already divided by its scale)::

    code = saturate(round_to_nearest_even(y))     in the format's bit layout S | E | M

* finite ``|y| > max_finite`` and ``±inf`` saturate to ``±max_finite`` (never inf, never NaN);
* values below the format's normal range become subnormals (``m * 2^(1 - bias - M)``), rounded to nearest even;
  a subnormal that rounds up to ``2^M`` units is the smallest normal code, as it should be;
* NaN becomes the format's NaN code, ``nan_code | 0x80`` for a NaN with its sign bit set where that is a NaN
  code (e4m3fn 0x7F/0xFF, e5m2 0x7E/0xFE), else the one NaN (fnuz 0x80);
* ``±0`` and anything that rounds to zero keeps its sign (0x80) where the format has a negative zero; fnuz has none
  (0x80 is its NaN), so there it is 0x00.

Why bits and not ``tl.float8*`` casts: Triton's fp8 types cover only some formats (no fnuz on NVIDIA), saturate
differently per backend, and the interpreter maps some of them wrongly (``tl.float8e4nv`` 0x7F decodes to 480, not
NaN). Integer shifts, adds and compares give the same codes in the interpreter and compiled on any GPU; the only
float operation here is :func:`scaled_rn`'s IEEE division (``div.rn.f32``: correctly rounded, subnormals kept,
unlike Triton's ``/``, which is ``div.full.f32``, an approximation).

The constants each helper is specialized on come from the format itself: :func:`encode_fp8`, :func:`encode_int8`
and :func:`encode_codes` (which of the two, by ``FMT.int_codes``) take a
:class:`~kv8.kernels.triton.formats.KernelFormat` (derived from a :class:`kv8.quant.formats.FP8Format` or
:class:`~kv8.quant.formats.IntFormat` by :func:`~kv8.kernels.triton.formats.kernel_format`) as their constexpr.

int8 codes (``kv_cache_dtype="int8_per_token_head"``; :class:`kv8.quant.formats.IntFormat` is the contract) are
``clamp(round_half_even(y), -127, 127)``, NaN -> 0, ``±inf`` -> ``±127``: :func:`encode_int8`; int4 codes
(``int4_per_token_head``) the same with 7 for 127 (the clamp is the format's ``max_finite``), two per byte
(:func:`pack_nibbles`; ``fp4_e2m1``'s 4-bit float codes, :func:`encode_e2m1`, are packed the same way). Its
rounding is the float32 add-and-subtract of ``1.5 * 2^23`` (for ``|y| <= 127`` the sum lies in ``[2^23, 2^24)``,
where the float32 spacing is 1, so the IEEE add rounds ``y`` to an integer, nearest even, and the subtraction is
exact): two IEEE operations, the same in the interpreter (numpy float32) and compiled (``add.f32``/``sub.f32``;
nothing to contract into an FMA), on any GPU -- unlike libdevice's ``rint``, which the interpreter and each backend
map differently.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["bf16_bits_to_f32", "encode_codes", "encode_e2m1", "encode_fp8", "encode_int8", "f32_to_bf16_bits",
           "pack_nibbles", "scaled_rn"]


# ----------------------------------------------------------------------------------------------------------------
# float32 <-> 16-bit patterns, exact everywhere
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def bf16_bits_to_f32(x):
    """bf16 tensor -> float32, exact for every pattern (subnormals, NaN payloads): the bits shifted up by 16.

    Not ``x.to(tl.float32)``: the interpreter flushes bf16 subnormals to zero there.
    """
    b = x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF
    return (b << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(y):
    """float32 -> bf16 (round to nearest even, overflow to ±inf, subnormals kept), as int32 in [0, 0xFFFF].

    NaN keeps its sign and upper payload with the quiet bit set (``bits >> 16 | 0x40``); torch's own NaN payloads
    differ by device and code path, so only NaN-ness is part of the contract. Not ``y.to(tl.bfloat16)``: the
    interpreter truncates there.
    """
    bits = y.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    # Two's complement add on the signed pattern = add on the magnitude: a finite magnitude plus < 2^16 never
    # carries into the sign bit (at most 0x7F7FFFFF + 0x8000 -> 0x7F807FFF: +-inf).
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) & 0xFFFF
    quiet_nan = ((bits >> 16) & 0xFFFF) | 0x40
    return tl.where(mag > 0x7F800000, quiet_nan, rounded)


@triton.jit
def scaled_rn(x, s):
    """``x / s`` in float32, correctly rounded (IEEE ``div.rn``, subnormals kept), for finite ``s > 0``.

    A NaN ``x`` comes back bit for bit (so its sign survives: a GPU division returns the canonical, positive NaN,
    while the reference on the CPU keeps the sign); every other result has the sign of ``x``, as division by
    ``s > 0`` gives it.
    """
    is_nan = (x.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000
    return tl.where(is_nan, x, tl.math.div_rn(x, s))


# ----------------------------------------------------------------------------------------------------------------
# float32 -> fp8 codes
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def _encode_bits(y, MAN: tl.constexpr, BIAS: tl.constexpr, MAX_BITS: tl.constexpr, NAN_POS: tl.constexpr,
                 NAN_NEG: tl.constexpr, NEG_ZERO: tl.constexpr):
    """float32 ``y`` -> int32 codes in [0, 255] for the layout ``S | (7 - MAN) exponent bits | MAN``.

    ``MAX_BITS`` is the float32 pattern of the format's max finite value, ``BIAS`` its exponent bias.
    """
    SHIFT: tl.constexpr = 23 - MAN                       # float32 mantissa bits dropped in the normal range
    REBIAS: tl.constexpr = (127 - BIAS) << MAN           # float32 exponent bias -> the format's, in code units
    MIN_NORMAL_BITS: tl.constexpr = (128 - BIAS) << 23   # float32 pattern of 2^(1 - BIAS), the smallest normal
    SUB_SHIFT0: tl.constexpr = 151 - BIAS - MAN          # m >> (SUB_SHIFT0 - e): |y| in subnormal units

    bits = y.to(tl.int32, bitcast=True)
    negative = bits < 0
    mag = bits & 0x7FFFFFFF
    is_nan = mag > 0x7F800000
    mag = tl.minimum(mag, MAX_BITS)                      # saturate (inf included); max_finite is exact

    # normal range: round the 23-bit mantissa to MAN bits, nearest even; a carry moves into the exponent
    normal = ((mag + ((1 << (SHIFT - 1)) - 1) + ((mag >> SHIFT) & 1)) >> SHIFT) - REBIAS

    # below it: |y| = m * 2^(e - 150) with the implicit bit, in units of 2^(1 - BIAS - MAN) = m >> (SUB_SHIFT0 - e);
    # shifts clamped to [1, 30] (a shift >= 25 already leaves 0 with a remainder below half: rounds to 0)
    e = mag >> 23
    m = (mag & 0x7FFFFF) | 0x800000
    sh = tl.minimum(tl.maximum(SUB_SHIFT0 - e, 1), 30)
    q = m >> sh
    rem = m & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    q = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(tl.int32)

    code = tl.where(mag >= MIN_NORMAL_BITS, normal, q)
    if NEG_ZERO:
        code = tl.where(negative, code | 0x80, code)
    else:
        code = tl.where(negative & (code != 0), code | 0x80, code)   # no -0: it would be the NaN code
    return tl.where(is_nan, tl.where(negative, NAN_NEG, NAN_POS), code)


@triton.jit
def encode_fp8(y, FMT: tl.constexpr):
    """float32 -> uint8 codes of the FP8 format ``FMT`` (a :class:`~kv8.kernels.triton.formats.KernelFormat`)."""
    return _encode_bits(y, FMT.mantissa_bits, FMT.exponent_bias, FMT.max_finite_bits, FMT.nan_code,
                        FMT.negative_nan_code, FMT.has_negative_zero).to(tl.uint8)


# ----------------------------------------------------------------------------------------------------------------
# float32 -> int8 codes
# ----------------------------------------------------------------------------------------------------------------

@triton.jit
def encode_int8(y, FMT: tl.constexpr):
    """float32 ``y`` (already divided by its scale) -> ``int8`` codes ``clamp(round_half_even(y), -max, max)``
    with ``max = FMT.max_finite`` (the integer format's largest code, 127 for int8); NaN -> 0, ``±inf`` -> ``±max``
    (:meth:`kv8.quant.formats.IntFormat.encode`). The rounding adds and subtracts ``1.5 * 2^23`` (module
    docstring)."""
    is_nan = (y.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000
    y = tl.minimum(tl.maximum(tl.where(is_nan, 0.0, y), -FMT.max_finite), FMT.max_finite)
    r = (y + 12582912.0) - 12582912.0                    # 1.5 * 2^23: rounds to an integer, nearest even
    return r.to(tl.int32).to(tl.int8)


@triton.jit
def pack_nibbles(codes):
    """Integer codes ``[R, C]`` (``C`` even; values in -8..7) -> ``uint8 [R, C / 2]``, two's complement nibbles:
    channel ``2j`` in the low nibble of byte ``j``, ``2j + 1`` in the high (:func:`kv8.quant.formats.pack_int4`).
    The pairs are split in registers (a reshape to ``[R, C / 2, 2]``), so a thread packs the channels it holds."""
    c = codes.to(tl.int32) & 0xF
    lo, hi = tl.split(tl.reshape(c, [c.shape[0], c.shape[1] // 2, 2]))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def encode_e2m1(y, FMT: tl.constexpr):
    """float32 ``y`` (already divided by its group's scale) -> ``int32`` 4-bit float codes 0..15 of the packed float
    format ``FMT`` (``fp4_e2m1``'s E2M1: sign in bit 3, then ``3 - FMT.mantissa_bits`` exponent bits and
    ``FMT.mantissa_bits``, bias ``FMT.exponent_bias``): the FP8 encode's rounding (:func:`_encode_bits`: nearest
    even -- a tie goes to the even code --, subnormals, saturating at ``±FMT.max_finite``, infinities included), NaN
    -> ``FMT.nan_code`` (+0, whatever its sign), the sign kept for ``-0.0`` and values that round to zero
    (``FMT.has_negative_zero``: code 8); the sign moved from bit 7 to bit 3
    (:meth:`kv8.quant.fp4.FP4GroupFormat.encode_e2m1`). The magnitude never exceeds 7: the saturation bound is the
    largest code's value."""
    code = _encode_bits(y, FMT.mantissa_bits, FMT.exponent_bias, FMT.max_finite_bits, FMT.nan_code,
                        FMT.negative_nan_code, FMT.has_negative_zero)
    return (code & 0x7) | ((code >> 4) & 0x8)


@triton.jit
def encode_codes(y, FMT: tl.constexpr):
    """float32 ``y`` (already divided by its scale) -> the codes of ``FMT`` (a
    :class:`~kv8.kernels.triton.formats.KernelFormat`): ``int8`` codes for an integer format (``FMT.int_codes``,
    :func:`encode_int8`), else ``uint8`` FP8 codes (:func:`encode_fp8`)."""
    if FMT.int_codes:
        code = encode_int8(y, FMT)
    else:
        code = encode_fp8(y, FMT)
    return code
