"""The KV cache's code formats (FP8, int8, int4; the group-scaled FP4 E2M1 in :mod:`kv8.quant.fp4` and int4 in
:mod:`kv8.quant.int4_group`) and the resolved KV-cache dtype.

This module owns three concepts that every other part of kv8 relies on:

* :class:`FP8Format` -- one 8-bit floating-point format (OCP ``E4M3FN``, AMD ``E4M3FNUZ``, OCP ``E5M2``) with an
  exact codec between float tensors and raw ``uint8`` codes.
* :class:`IntFormat` -- symmetric integer codes (``int8``: -127..127, ``int8`` storage), the codes of
  ``kv_cache_dtype="int8_per_token_head"`` (a scale per token and KV head).
* :class:`KVCacheDtype` -- what the user asked for with ``kv_cache_dtype``, resolved to a storage dtype.

``fp4_e2m1`` (:class:`kv8.quant.fp4.FP4GroupFormat`: an E4M3 scale per group of 16 values) and ``int4_per_group32``
(:class:`kv8.quant.int4_group.Int4GroupFormat`: a float16 scale per group of 32 values) store their scales inside each
row (:data:`GroupFormat`): their rows are encoded whole by those classes, not through :func:`quantize`.

:data:`CodeFormat` is either code format: both have ``name``, ``max_finite``, ``storage_dtype``, ``encode`` and
``decode`` and ``clip_limit``, which is all :func:`quantize`, :func:`dequantize` and the KV codec use.

The KV cache stores FP8 values as raw ``uint8`` codes, never as torch float8 tensors, so every format (including the
emulated fnuz one) is handled identically and later kernels can decode the bits directly.

Encoding convention (the one vLLM's cache kernels use): ``code = saturate(round_to_nearest_even(x))`` computed in
float32, where saturation clamps to ``±max_finite`` (so ``±inf`` and any out-of-range finite value become the largest
finite code of the same sign, never NaN or inf). NaN encodes to :attr:`FP8Format.nan_code`, with the sign bit kept where
the format has a negative NaN. Inputs wider than float32 (float64) are first rounded to float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from kv8.quant.fp4 import FP4_E2M1, FP4GroupFormat
from kv8.quant.int4_group import INT4_G32, Int4GroupFormat
from kv8.validators import is_number

__all__ = [
    "KV_PAIR_ALIASES",
    "check_kv_cache_dtype",
    "kv_cache_dtype_name",
    "resolve_kv_cache_dtypes",
    "split_kv_cache_dtype",
    "FP8Format",
    "E4M3",
    "E4M3FNUZ",
    "E5M2",
    "FP8_FORMATS",
    "fp8_format",
    "IntFormat",
    "INT8",
    "INT4",
    "pack_int4",
    "unpack_int4",
    "CodeFormat",
    "GroupFormat",
    "quantize",
    "dequantize",
    "KVCacheDtype",
    "KV_CACHE_DTYPE_CHOICES",
    "KV_CACHE_DTYPE_NAMES",
    "resolve_kv_cache_dtype",
]

_SIGN_BIT = 0x80
_DECODE_DTYPES: tuple[torch.dtype, ...] = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _code_value(code: int, exponent_bits: int, mantissa_bits: int, exponent_bias: int,
                has_inf: bool, nan_codes: tuple[int, ...]) -> float:
    """Value of one 8-bit code under the given layout (pure Python, exact)."""
    if code in nan_codes:
        return math.nan
    sign = -1.0 if code & _SIGN_BIT else 1.0
    exponent = (code >> mantissa_bits) & ((1 << exponent_bits) - 1)
    mantissa = code & ((1 << mantissa_bits) - 1)
    if has_inf and exponent == (1 << exponent_bits) - 1:
        if mantissa != 0:
            raise ValueError(f"code 0x{code:02x} has an all-ones exponent and a non-zero mantissa but is not in "
                             f"nan_codes={nan_codes}")
        return sign * math.inf
    if exponent == 0:  # zero or subnormal
        return sign * math.ldexp(mantissa, 1 - exponent_bias - mantissa_bits)
    return sign * math.ldexp((1 << mantissa_bits) + mantissa, exponent - exponent_bias - mantissa_bits)


@dataclass(frozen=True)
class FP8Format:
    """One 8-bit floating-point format and its exact codec.

    Bit layout of a code: ``S | E (exponent_bits) | M (mantissa_bits)``, sign in bit 7. With ``e`` the exponent field
    and ``m`` the mantissa field: ``e == 0`` is zero/subnormal, value ``(-1)^S * m / 2^M * 2^(1 - bias)``; otherwise
    ``(-1)^S * (1 + m / 2^M) * 2^(e - bias)``. Special codes:

    * ``fp8_e4m3`` (OCP E4M3FN, bias 7): no infinities; NaN is ``S.1111.111`` (0x7F, 0xFF); 0x80 is -0.0;
      max 448, min subnormal 2^-9.
    * ``fp8_e4m3fnuz`` (AMD, bias 8): no infinities, no negative zero; 0x80 is the only NaN; max 240, min
      subnormal 2^-10.
    * ``fp8_e5m2`` (OCP/IEEE-like, bias 15): ``S.11111.00`` is ±inf (0x7C, 0xFC), ``S.11111.{01,10,11}`` are NaN;
      0x80 is -0.0; max 57344, min subnormal 2^-16.

    Invariants (checked at construction): the fields agree with each other -- ``max_finite`` and ``min_subnormal``
    are exactly the largest finite and smallest positive values of the layout, ``nan_code`` is a NaN code, and the
    reference ``torch_dtype`` decodes every non-NaN code to the same value as this layout.

    Attributes:
        nan_code: the code NaN encodes to (positive NaN); a negative NaN encodes to ``nan_code | 0x80`` when that is
            also a NaN code (e4m3fn: 0x7F/0xFF, e5m2: 0x7E/0xFE, the quiet NaN ml_dtypes produces), else to
            ``nan_code`` (fnuz: 0x80).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    exponent_bias: int
    max_finite: float
    min_subnormal: float
    torch_dtype: torch.dtype
    has_negative_zero: bool
    has_inf: bool
    nan_codes: tuple[int, ...]
    nan_code: int

    def __post_init__(self) -> None:
        for field in ("exponent_bits", "mantissa_bits", "exponent_bias", "nan_code"):
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"FP8Format.{field}={value!r} must be an int")
        if self.exponent_bits < 1 or self.mantissa_bits < 1 or self.exponent_bits + self.mantissa_bits != 7:
            raise ValueError(f"FP8Format exponent_bits={self.exponent_bits}, mantissa_bits={self.mantissa_bits}: "
                             "both must be >= 1 and sum to 7 (plus one sign bit)")
        if not self.nan_codes or any(not 0 <= c <= 255 for c in self.nan_codes):
            raise ValueError(f"FP8Format.nan_codes={self.nan_codes!r} must be a non-empty tuple of codes in [0, 255]")
        if self.nan_code not in self.nan_codes or self.nan_code & _SIGN_BIT and self.nan_code != _SIGN_BIT:
            raise ValueError(f"FP8Format.nan_code=0x{self.nan_code:02x} must be a positive NaN code (or 0x80 when "
                             f"that is the only NaN), one of nan_codes={self.nan_codes}")
        if self.has_negative_zero == (_SIGN_BIT in self.nan_codes):
            raise ValueError(f"FP8Format.has_negative_zero={self.has_negative_zero} contradicts nan_codes="
                             f"{self.nan_codes}: code 0x80 is either -0.0 or NaN")
        values = [_code_value(c, self.exponent_bits, self.mantissa_bits, self.exponent_bias, self.has_inf,
                              self.nan_codes) for c in range(256)]
        finite = [v for v in values if math.isfinite(v)]
        if max(finite) != self.max_finite:
            raise ValueError(f"FP8Format.max_finite={self.max_finite} but the layout's largest finite value is "
                             f"{max(finite)}")
        smallest = min(v for v in finite if v > 0)
        if smallest != self.min_subnormal:
            raise ValueError(f"FP8Format.min_subnormal={self.min_subnormal} but the layout's smallest positive value "
                             f"is {smallest}")
        if not isinstance(self.torch_dtype, torch.dtype) or self.torch_dtype.itemsize != 1 \
                or not self.torch_dtype.is_floating_point:
            raise ValueError(f"FP8Format.torch_dtype={self.torch_dtype!r} must be a torch float8 dtype")
        reference = torch.arange(256, dtype=torch.uint8).view(self.torch_dtype).to(torch.float32).tolist()
        for code, (mine, ref) in enumerate(zip(values, reference)):
            if math.isnan(mine) != math.isnan(ref) or (not math.isnan(mine) and mine != ref):
                raise ValueError(f"FP8Format {self.name!r}: code 0x{code:02x} decodes to {mine} but torch_dtype="
                                 f"{self.torch_dtype} decodes it to {ref}")

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype of a tensor of codes: ``uint8`` (raw bits)."""
        return torch.uint8

    @property
    def clip_limit(self) -> float:
        """Magnitudes (after scaling) beyond this count as clipped: ``max_finite``."""
        return self.max_finite

    @property
    def negative_nan_code(self) -> int:
        """The code a NaN with its sign bit set encodes to."""
        signed = self.nan_code | _SIGN_BIT
        return signed if signed in self.nan_codes else self.nan_code

    def values(self) -> list[float]:
        """The value of every code 0..255, in code order (NaN for NaN codes, ±0.0 with its sign)."""
        return _decode_table(self, torch.float32, torch.device("cpu")).tolist()

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Encode ``x`` (any float dtype, already divided by the scale) to ``uint8`` codes of the same shape.

        ``code = saturate(round_to_nearest_even(float32(x)))``: finite values outside ``±max_finite`` and ``±inf``
        saturate to ``±max_finite``; NaN becomes :attr:`nan_code` (:attr:`negative_nan_code` for a negative NaN);
        -0.0 becomes 0x80 where the format has a negative zero, else 0x00.
        """
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            raise ValueError(f"FP8Format.encode: x must be a floating-point tensor, got "
                             f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
        xf = x.to(torch.float32)
        # torch's float8 cast is round-to-nearest-even on finite in-range float32 (verified exhaustively against
        # ml_dtypes over all 2^32 inputs for the three formats); clamping first gives the saturation convention.
        codes = xf.clamp(-self.max_finite, self.max_finite).to(self.torch_dtype).view(torch.uint8)
        nan = torch.isnan(xf)
        if bool(nan.any()):
            positive = torch.tensor(self.nan_code, dtype=torch.uint8, device=codes.device)
            negative = torch.tensor(self.negative_nan_code, dtype=torch.uint8, device=codes.device)
            codes = torch.where(nan, torch.where(torch.signbit(xf), negative, positive), codes)
        return codes

    def decode(self, codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decode ``uint8`` codes to values in ``dtype`` (same shape, same device).

        Exact for every supported ``dtype`` (float16, bfloat16, float32, float64): all three formats' values are
        representable in each of them.
        """
        if not isinstance(codes, torch.Tensor) or codes.dtype != torch.uint8:
            raise ValueError(f"FP8Format.decode: codes must be a torch.uint8 tensor, got "
                             f"{codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__}")
        if dtype not in _DECODE_DTYPES:
            raise ValueError(f"FP8Format.decode: dtype={dtype} is not supported; choose one of {_DECODE_DTYPES}")
        return torch.take(_decode_table(self, dtype, codes.device), codes.long())


@lru_cache(maxsize=64)
def _decode_table(fmt: FP8Format, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """256-entry lookup table: ``table[code]`` is the value of ``code`` in ``dtype`` on ``device``."""
    values = [_code_value(c, fmt.exponent_bits, fmt.mantissa_bits, fmt.exponent_bias, fmt.has_inf, fmt.nan_codes)
              for c in range(256)]
    table = torch.tensor(values, dtype=torch.float64).to(dtype)
    if not torch.equal(torch.nan_to_num(table.double()), torch.nan_to_num(torch.tensor(values, dtype=torch.float64))):
        raise ValueError(f"{fmt.name} values are not exactly representable in dtype={dtype}")
    return table.to(device)


E4M3 = FP8Format(
    name="fp8_e4m3", exponent_bits=4, mantissa_bits=3, exponent_bias=7, max_finite=448.0,
    min_subnormal=2.0 ** -9, torch_dtype=torch.float8_e4m3fn, has_negative_zero=True, has_inf=False,
    nan_codes=(0x7F, 0xFF), nan_code=0x7F,
)
E4M3FNUZ = FP8Format(
    name="fp8_e4m3fnuz", exponent_bits=4, mantissa_bits=3, exponent_bias=8, max_finite=240.0,
    min_subnormal=2.0 ** -10, torch_dtype=torch.float8_e4m3fnuz, has_negative_zero=False, has_inf=False,
    nan_codes=(0x80,), nan_code=0x80,
)
E5M2 = FP8Format(
    name="fp8_e5m2", exponent_bits=5, mantissa_bits=2, exponent_bias=15, max_finite=57344.0,
    min_subnormal=2.0 ** -16, torch_dtype=torch.float8_e5m2, has_negative_zero=True, has_inf=True,
    nan_codes=(0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF), nan_code=0x7E,
)

FP8_FORMATS: dict[str, FP8Format] = {f.name: f for f in (E4M3, E4M3FNUZ, E5M2)}


def fp8_format(name: str) -> FP8Format:
    """The FP8 format with canonical ``name`` ("fp8_e4m3", "fp8_e4m3fnuz" or "fp8_e5m2")."""
    if name not in FP8_FORMATS:
        raise ValueError(f"fp8 format name={name!r} is not known; choose one of: {', '.join(FP8_FORMATS)}")
    return FP8_FORMATS[name]


@dataclass(frozen=True)
class IntFormat:
    """Symmetric signed integer codes of ``bits`` bits: ``code = clamp(round_half_even(float32(x)), -max, max)``
    with ``max = 2^(bits - 1) - 1`` (127 for int8, 7 for int4: the most negative code is never written, so the
    range is symmetric and ``-code`` always exists). NaN encodes to 0 (an integer code has no NaN); ``±inf``
    saturate to ``±max``. Decoding is exact in every float dtype (``|code| <= 127``).

    :meth:`encode` returns one ``int8`` per value for both widths; a cache of 4-bit codes packs two per byte
    (:func:`pack_int4`: the even channel in the low nibble, two's complement).

    Invariant: ``bits`` is 8 or 4.
    """

    name: str
    bits: int

    def __post_init__(self) -> None:
        if self.bits not in (4, 8):
            raise ValueError(f"IntFormat.bits={self.bits!r}: integer codes are 8 or 4 bits")

    @property
    def max_finite(self) -> float:
        """The largest code, as a float (127.0 for int8, 7.0 for int4): what a scale maps the largest magnitude
        to."""
        return float((1 << (self.bits - 1)) - 1)

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype of a tensor of codes as :meth:`encode` returns them: ``int8`` (one value per element)."""
        return torch.int8

    @property
    def clip_limit(self) -> float:
        """Magnitudes (after scaling) beyond this count as clipped: ``max + 0.5``, past which rounding would have
        given a larger code than the clamp allows (``amax / scale`` itself may land an ulp above ``max``)."""
        return self.max_finite + 0.5

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (any float dtype, already divided by the scale) -> ``int8`` codes of the same shape:
        ``clamp(round_half_even(float32(x)), -max, max)``, NaN -> 0."""
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            raise ValueError(f"IntFormat.encode: x must be a floating-point tensor, got "
                             f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
        m = self.max_finite
        xf = torch.nan_to_num(x.to(torch.float32), nan=0.0, posinf=m, neginf=-m)
        return torch.round(xf.clamp(-m, m)).to(torch.int8)

    def decode(self, codes: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``int8`` codes -> their values in ``dtype`` (exact for float16, bfloat16, float32, float64)."""
        if not isinstance(codes, torch.Tensor) or codes.dtype != torch.int8:
            raise ValueError(f"IntFormat.decode: codes must be a torch.int8 tensor, got "
                             f"{codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__}")
        if dtype not in _DECODE_DTYPES:
            raise ValueError(f"IntFormat.decode: dtype={dtype} is not supported; choose one of {_DECODE_DTYPES}")
        return codes.to(dtype)


INT8 = IntFormat(name="int8", bits=8)
INT4 = IntFormat(name="int4", bits=4)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes as ``int8`` values in -8..7, ``[..., D]`` (D even) -> ``uint8 [..., D / 2]``: channel ``2j`` in
    the low nibble of byte ``j``, channel ``2j + 1`` in its high nibble, each as a two's complement nibble."""
    if codes.dtype != torch.int8 or codes.shape[-1] % 2:
        raise ValueError(f"pack_int4: codes must be int8 with an even last dim, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    nib = codes.to(torch.uint8) & 0xF
    return nib[..., 0::2] | (nib[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: ``uint8 [..., D / 2]`` -> ``int8 [..., D]`` in -8..7."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_int4: packed codes must be uint8, got {packed.dtype}")
    nibbles = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).to(torch.int16)
    return ((nibbles ^ 8) - 8).to(torch.int8)

#: a KV code format: FP8 or integer codes
CodeFormat = FP8Format | IntFormat
#: a format whose rows carry their own scales, one per group of values (``fp4_e2m1``, ``int4_per_group32``): both
#: have ``name``, ``group_size``, ``scale_name``, ``max_finite``, ``clip_limit``, ``storage_dtype``,
#: ``head_dim_multiple``, ``check_head_dim``, ``row_bytes``, ``encode``, ``decode`` and ``clipped``
GroupFormat = FP4GroupFormat | Int4GroupFormat


def _checked_scale(scale: torch.Tensor | float, shape: torch.Size, where: str) -> torch.Tensor | float:
    """Validate a scale (finite, > 0, broadcastable to ``shape`` without growing it); tensors become float32."""
    if isinstance(scale, torch.Tensor):
        if not scale.dtype.is_floating_point:
            raise ValueError(f"{where}: scale must be a floating-point tensor or a float, got dtype {scale.dtype}")
        try:
            broadcast = torch.broadcast_shapes(shape, scale.shape)
        except RuntimeError as exc:
            raise ValueError(f"{where}: scale of shape {tuple(scale.shape)} does not broadcast to "
                             f"{tuple(shape)}") from exc
        if broadcast != shape:
            raise ValueError(f"{where}: scale of shape {tuple(scale.shape)} would broadcast the input of shape "
                             f"{tuple(shape)} to {tuple(broadcast)}")
        scale32 = scale.to(torch.float32)
        if not bool(torch.all(torch.isfinite(scale32) & (scale32 > 0))):
            raise ValueError(f"{where}: scale must be finite and > 0 everywhere, got {scale}")
        return scale32
    if not is_number(scale):
        raise ValueError(f"{where}: scale={scale!r} must be a float or a floating-point tensor")
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"{where}: scale={scale!r} must be finite and > 0")
    return float(scale)


def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: CodeFormat) -> torch.Tensor:
    """``fmt.encode(float32(x) / scale)``: codes (``fmt.storage_dtype``) with the shape of ``x``.

    ``scale`` is a positive finite float or a float tensor broadcastable to ``x`` (per-tensor, per-head, ...).
    """
    if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
        raise ValueError(f"quantize: x must be a floating-point tensor, got "
                         f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
    return fmt.encode(x.to(torch.float32) / _checked_scale(scale, x.shape, "quantize"))


def dequantize(codes: torch.Tensor, scale: torch.Tensor | float, fmt: CodeFormat,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``fmt.decode(codes) * scale``, multiplied in float32 and then cast to ``dtype``."""
    if not isinstance(codes, torch.Tensor):
        raise ValueError(f"dequantize: codes must be a {fmt.storage_dtype} tensor, got {type(codes).__name__}")
    if dtype not in _DECODE_DTYPES:
        raise ValueError(f"dequantize: dtype={dtype} is not supported; choose one of {_DECODE_DTYPES}")
    values = fmt.decode(codes, torch.float32) * _checked_scale(scale, codes.shape, "dequantize")
    return values.to(dtype)


# ----------------------------------------------------------------------------------------------------------------
# kv_cache_dtype resolution
# ----------------------------------------------------------------------------------------------------------------

KV_CACHE_DTYPE_CHOICES: tuple[str, ...] = (
    "auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "int8_per_token_head",
    "int4_per_token_head", "int4_per_group32", "fp4_e2m1",
)
# Other accepted spellings (vLLM's and torch's names); every entry point accepts them.
_ALIASES: dict[str, str] = {
    "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
    "fp8": "fp8_e4m3", "fp8_e4m3fn": "fp8_e4m3", "int8": "int8_per_token_head", "int4": "int4_per_token_head",
    "int4_g32": "int4_per_group32", "nvfp4": "fp4_e2m1", "fp4": "fp4_e2m1",
}
# choices plus the other aliases ("fp8" is both a choice and an alias: listed once)
_OTHER_ALIASES: tuple[str, ...] = tuple(a for a in _ALIASES if a not in KV_CACHE_DTYPE_CHOICES)
KV_CACHE_DTYPE_NAMES: tuple[str, ...] = KV_CACHE_DTYPE_CHOICES + _OTHER_ALIASES
_FLOAT_CACHES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32,
}
#: integer caches: name -> their codes (every token and KV head carries its own scale)
_INT_CACHES: dict[str, IntFormat] = {"int8_per_token_head": INT8, "int4_per_token_head": INT4}
#: group-scaled caches: name -> their format (codes and a scale per group of values, in one row)
_GROUP_CACHES: dict[str, GroupFormat] = {"int4_per_group32": INT4_G32, "fp4_e2m1": FP4_E2M1}
_COMPUTE_DTYPES: dict[torch.dtype, str] = {dtype: name for name, dtype in _FLOAT_CACHES.items()}


@dataclass(frozen=True)
class KVCacheDtype:
    """What the user asked for with ``kv_cache_dtype``, resolved.

    Invariants: ``name`` is canonical ("bfloat16" | "float16" | "float32" | "fp8_e4m3" | "fp8_e4m3fnuz" | "fp8_e5m2"
    | "int8_per_token_head" | "int4_per_token_head" | "int4_per_group32" | "fp4_e2m1"); FP8 caches store raw codes
    (``storage_dtype == torch.uint8`` and ``fp8`` is the matching format); the int8 cache stores ``torch.int8``
    codes (``int_codes`` is :data:`INT8`), the int4 cache two codes per ``torch.uint8`` (:func:`pack_int4`;
    ``int_codes`` is :data:`INT4`), both with a scale per token and KV head, always; the group-scaled caches
    (``group``, :attr:`group_scales`) store ``uint8`` rows of two codes per byte followed by their group scales: FP4
    (:data:`kv8.quant.fp4.FP4_E2M1`: E2M1 codes, an E4M3 scale per 16 values) and int4 per group of 32
    (:data:`kv8.quant.int4_group.INT4_G32`: a float16 scale per 32 values); 16/32-bit caches store their float dtype
    and have no code format.
    """

    name: str
    storage_dtype: torch.dtype
    fp8: FP8Format | None
    int_codes: IntFormat | None = None
    group: GroupFormat | None = None

    def __post_init__(self) -> None:
        expected: tuple[torch.dtype, FP8Format | None, IntFormat | None, GroupFormat | None]
        if self.name in _FLOAT_CACHES:
            expected = (_FLOAT_CACHES[self.name], None, None, None)
        elif self.name in FP8_FORMATS:
            expected = (torch.uint8, FP8_FORMATS[self.name], None, None)
        elif self.name in _INT_CACHES:
            codes = _INT_CACHES[self.name]
            expected = (torch.int8 if codes.bits == 8 else torch.uint8, None, codes, None)
        elif self.name in _GROUP_CACHES:
            expected = (torch.uint8, None, None, _GROUP_CACHES[self.name])
        else:
            raise ValueError(f"KVCacheDtype.name={self.name!r} is not canonical; choose one of: "
                             f"{', '.join([*_FLOAT_CACHES, *FP8_FORMATS, *_INT_CACHES, *_GROUP_CACHES])}")
        if (self.storage_dtype, self.fp8, self.int_codes, self.group) != expected:
            names = [f.name if f is not None else None for f in expected[1:]]
            raise ValueError(f"KVCacheDtype {self.name!r}: storage_dtype={self.storage_dtype}, fp8="
                             f"{self.fp8.name if self.fp8 else None}, int_codes="
                             f"{self.int_codes.name if self.int_codes else None}, group="
                             f"{self.group.name if self.group else None} must be {expected[0]}, "
                             f"{names[0]}, {names[1]}, {names[2]}")

    @property
    def is_fp8(self) -> bool:
        """True when the cache stores FP8 codes."""
        return self.fp8 is not None

    @property
    def codes(self) -> CodeFormat | GroupFormat | None:
        """The code format of a quantized cache (FP8, int8, int4, or a group-scaled one); None for a 16/32-bit
        cache."""
        return self.fp8 if self.fp8 is not None else self.int_codes if self.int_codes is not None else self.group

    @property
    def is_quantized(self) -> bool:
        """True when the cache stores codes with scales (FP8, int8, int4 or FP4), not plain floats."""
        return self.codes is not None

    @property
    def group_scales(self) -> bool:
        """True when each stored row carries its own scales, per group of values (``fp4_e2m1``,
        ``int4_per_group32``): no static scales and no per-token scale tensor beside the codes."""
        return self.group is not None

    @property
    def per_token_scales(self) -> bool:
        """True when the format always keeps a scale per token and KV head (int8); FP8 has them only with
        ``kv_cache_scale_mode="dynamic"``."""
        return self.int_codes is not None

    @property
    def token_scalable(self) -> bool:
        """True when a scale per token and KV head can scale the format's codes (FP8 and the integer codes): what
        dynamic scales apply to, and what every such side of a K/V pair keeps. The group-scaled formats carry their
        scales in each row and 16/32-bit values have none."""
        return self.is_quantized and not self.group_scales

    @property
    def bytes_per_element(self) -> int:
        """Bytes of one element of the cache tensor (1 for FP8, int8 and int4 -- two int4 values share one --, 2 for
        16-bit, 4 for float32). What one value costs: :attr:`bits_per_value`."""
        return self.storage_dtype.itemsize

    @property
    def bits_per_value(self) -> int:
        """Bits one cached K or V value occupies, its scale not counted (4, 8, 16 or 32)."""
        if self.group is not None:
            return 4
        return self.int_codes.bits if self.int_codes is not None else 8 * self.storage_dtype.itemsize

    def stored_width(self, head_dim: int) -> int:
        """Elements of the cache tensor one head's row of ``head_dim`` values takes (``head_dim / 2`` for int4;
        ``head_dim / 2 + ceil(head_dim / 16)`` bytes for FP4, ``head_dim / 2 + 2 head_dim / 32`` for
        int4_per_group32: codes, then the group scales)."""
        if self.group is not None:
            return self.group.row_bytes(head_dim)
        return head_dim * self.bits_per_value // (8 * self.storage_dtype.itemsize)


#: K/V pair spellings that name no single format: ``"k8v4"`` (vLLM's name for 8-bit keys and 4-bit values) is int8
#: keys beside int4_per_group32 values (the 4-bit format with the smaller error per byte, docs/accuracy.md)
KV_PAIR_ALIASES: dict[str, tuple[str, str]] = {"k8v4": ("int8_per_token_head", "int4_per_group32")}
KV_PAIR_SEPARATOR = "/"


def split_kv_cache_dtype(name: str) -> tuple[str, str] | None:
    """The (K, V) names of a pair ``kv_cache_dtype`` -- ``"KFORMAT/VFORMAT"`` (each any accepted single name, e.g.
    ``"int8/int4_g32"``) or an alias of :data:`KV_PAIR_ALIASES` --, or None for a single name (checked by
    :func:`resolve_kv_cache_dtype`). A pair whose two names resolve to one format is that format. ``ValueError``
    for a malformed pair (``"a/b/c"``, an empty side, ``"auto"`` on a side: a pair names both formats)."""
    if isinstance(name, str) and name in KV_PAIR_ALIASES:
        return KV_PAIR_ALIASES[name]
    if not isinstance(name, str) or KV_PAIR_SEPARATOR not in name:
        return None
    sides = name.split(KV_PAIR_SEPARATOR)
    if len(sides) != 2 or not all(sides) or "auto" in sides:
        raise ValueError(f"kv_cache_dtype={name!r}: a K/V pair is written KFORMAT/VFORMAT with two formats other "
                         f"than auto (e.g. int8/int4_g32, or {', '.join(KV_PAIR_ALIASES)}); choose each from: "
                         f"{', '.join(c for c in KV_CACHE_DTYPE_CHOICES if c != 'auto')}")
    return sides[0], sides[1]


def resolve_kv_cache_dtypes(name: str, compute_dtype: torch.dtype) -> tuple[KVCacheDtype, KVCacheDtype]:
    """The (K, V) formats a ``kv_cache_dtype`` names: both the same for a single name
    (:func:`resolve_kv_cache_dtype`), each side's for a pair (:func:`split_kv_cache_dtype`)."""
    pair = split_kv_cache_dtype(name)
    if pair is None:
        one = resolve_kv_cache_dtype(name, compute_dtype)
        return one, one
    sides = []
    for which, side in zip(("K", "V"), pair):
        try:
            sides.append(resolve_kv_cache_dtype(side, compute_dtype))
        except ValueError as e:
            raise ValueError(f"kv_cache_dtype={name!r}, its {which} format: {e}") from None
    return sides[0], sides[1]


def kv_cache_dtype_name(k_dtype: KVCacheDtype, v_dtype: KVCacheDtype) -> str:
    """The canonical name of a cache storing keys as ``k_dtype`` and values as ``v_dtype``: the format's name when
    they are one, else ``"K/V"`` of their canonical names."""
    return k_dtype.name if k_dtype == v_dtype else f"{k_dtype.name}{KV_PAIR_SEPARATOR}{v_dtype.name}"


def check_kv_cache_dtype(name: str) -> str:
    """``name`` when it is an accepted ``kv_cache_dtype`` (a single name or a K/V pair), else ``ValueError`` saying
    what is allowed: the option's one check of its spelling (what it resolves to depends on the compute dtype)."""
    resolve_kv_cache_dtypes(name, torch.float32)
    return name


def resolve_kv_cache_dtype(name: str, compute_dtype: torch.dtype) -> KVCacheDtype:
    """Resolve a ``kv_cache_dtype`` setting against the model's compute dtype.

    ``"auto"`` is the compute dtype (bfloat16, float16 or float32); ``"fp8"`` is ``fp8_e4m3``; ``"int8"`` and
    ``"int4"`` are ``int8_per_token_head`` and ``int4_per_token_head`` (vLLM's names), ``"int4_g32"`` is
    ``int4_per_group32``, ``"nvfp4"`` and ``"fp4"`` are ``fp4_e2m1``; the aliases bf16, fp16, half, fp32, float and
    fp8_e4m3fn are accepted too. Names are matched exactly (case-sensitive).
    """
    if compute_dtype not in _COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype={compute_dtype} is not supported; choose one of: "
                         f"{', '.join(str(d) for d in _COMPUTE_DTYPES)}")
    if not isinstance(name, str) or (name not in KV_CACHE_DTYPE_CHOICES and name not in _ALIASES):
        raise ValueError(f"kv_cache_dtype={name!r} is not supported; choose one of: "
                         f"{', '.join(KV_CACHE_DTYPE_CHOICES)} (aliases: {', '.join(_OTHER_ALIASES)}), or a K/V "
                         f"pair KFORMAT/VFORMAT such as int8/int4_g32 ({', '.join(KV_PAIR_ALIASES)})")
    canonical = _COMPUTE_DTYPES[compute_dtype] if name == "auto" else _ALIASES.get(name, name)
    if canonical in _FLOAT_CACHES:
        return KVCacheDtype(name=canonical, storage_dtype=_FLOAT_CACHES[canonical], fp8=None)
    if canonical in _INT_CACHES:
        codes = _INT_CACHES[canonical]
        return KVCacheDtype(name=canonical, storage_dtype=torch.int8 if codes.bits == 8 else torch.uint8, fp8=None,
                            int_codes=codes)
    if canonical in _GROUP_CACHES:
        return KVCacheDtype(name=canonical, storage_dtype=torch.uint8, fp8=None, group=_GROUP_CACHES[canonical])
    return KVCacheDtype(name=canonical, storage_dtype=torch.uint8, fp8=FP8_FORMATS[canonical])
