"""What the Triton kernels need of a KV cache format: :class:`KernelFormat`, derived from the format, one constexpr.

:class:`kv8.quant.formats.FP8Format` is the one definition of each FP8 format (bit layout, bias, max finite value,
NaN and zero codes), :class:`kv8.quant.formats.IntFormat` that of the integer codes (int8: symmetric, max 127). The
kernel package sits below :mod:`kv8.quant` in the package layers (pyproject.toml's import-linter contract), so it
does not import the formats: a wrapper (:func:`~kv8.kernels.triton.store.store_kv`,
:func:`~kv8.kernels.triton.attention.unified_attention`) receives the format object (:class:`FP8Layout` or
:class:`IntLayout`: the fields it reads) and derives a :class:`KernelFormat` with :func:`kernel_format`, which the
kernels take as one constexpr (``FMT``; ``None`` for a 16/32-bit cache). No kernel names a format or restates its
constants; every field below is computed from the format's own.

Two families share the tuple, told apart by ``int_codes``: FP8 codes (``uint8`` bytes: sign | exponent |
mantissa) and integer codes -- 8-bit (``int8`` elements, one code each: ``kv_cache_dtype="int8_per_token_head"``)
or 4-bit (``packed``: ``uint8`` bytes of two two's complement nibbles, channel ``2j`` in the low nibble of byte
``j``, ``2j + 1`` in the high: ``int4_per_token_head``, :func:`kv8.quant.formats.pack_int4`); a row of ``D``
values is ``D / 2`` bytes (:func:`code_width`). An integer format's FP8-only fields are neutral (0, False, 1.0,
None); its ``nan_code`` and ``negative_nan_code`` are 0, the code a NaN encodes to. ``int4_per_group32``
(:class:`GroupLayout`: :class:`kv8.quant.int4_group.Int4GroupFormat`) is the int4 family with ``group_size`` 32: a
float16 scale per 32 values, of either sign, follows the row's codes (``D / 2 + 2 D / 32`` bytes); its codes span
the nibble's whole -8 .. 7 (the store's scale search uses -8), its ``max_finite`` (7) is the first candidate's
divisor. ``fp4_e2m1`` (:class:`FloatGroupLayout`: :class:`kv8.quant.fp4.FP4GroupFormat`) is a family of its own,
4-bit float codes (``packed`` without ``int_codes``): two E2M1 codes per byte (sign | 2 exponent bits | 1 mantissa
bit, bias 1: magnitudes 0, 0.5 .. 6; no NaN, no infinity), channel ``2j`` in the low nibble as int4's, then one
E4M3 scale code per group of 16 values (``D / 2 + ceil(D / 16)`` bytes; the last group shorter when ``D % 16 !=
0``). Its FP8 fields describe the codes as they describe an FP8 format's (bits and bias derived from the format's
``grid``, ``max_finite`` 6; a NaN encodes to +0, -0.0 is code 8), and ``scale_format`` is the ``KernelFormat`` of
its scales' FP8 layout, derived from their torch dtype (``float8_e4m3fn``), which the store's encode and the
attention's bit decode of the scale bytes take as their ``FMT``.

=====================  ===============================================  =============================================
field                  from the format                                  read by
=====================  ===============================================  =============================================
``int_codes``          the family: an integer format (``bits`` 8 or 4)  encode and decode (which of the two); the
                                                                        wrappers (``int8`` cache, dynamic scales)
``mantissa_bits``      M (fp4: the 4-bit codes' M, 1)                   encode (rounding), bit decode (the shift)
``exponent_bias``      its bias                                         encode (rebias, subnormal range)
``max_finite``         its largest finite value (int: the largest       the store's dynamic scales; int encode
                       code)                                            (the clamp); the group store's first
                                                                        candidate divisor
``max_finite_bits``    float32 bits of ``max_finite``                   FP8 encode (saturation bound on ``|y|``'s
                                                                        bits)
``nan_code``           the code a NaN encodes to                        encode
``negative_nan_code``  the code a NaN with its sign bit encodes to      encode
``has_negative_zero``  0x80 is -0.0 (else it is NaN and -0 encodes 0)   encode
``half_top_byte``      5 exponent bits, bias 15, inf: a half's top      bit decode: a shift, inf/NaN are half's own
                       byte
``nan_mask``,          NaN codes are those with ``code & nan_mask ==    bit decode (when not ``half_top_byte``)
``nan_match``          nan_match``
``half_factor``        ``2^(15 - bias)``                                bit decode (half's bias -> the format's)
``native``             Triton's FP8 type of the same layout (from the   native decode (``fp8e4nv``, ``fp8e5``,
                       format's torch dtype), or None                   ``fp8e4b8``)
``packed``             two 4-bit codes per byte (an integer format of   the store (pack), the attention's loads and
                       ``bits`` = 4)                                    decode (unpack); the wrappers (row width,
                                                                        cache dtype)
``group_size``         values per float16 scale in the row (0: none)    the store (group amax, scale bytes), the
                                                                        attention (scales per group); the wrappers
``group_scale_min``,   the group scales' clamp: float16's smallest       the store (the clamp of a group scale's
``group_scale_max``    subnormal and largest value (fp4: E4M3's)        magnitude; int4_per_group32 keeps the sign)
``head_dim_multiple``  what ``head_dim`` must be a multiple of (the     the wrappers (checks)
                       format's own: 2 packed, 32 int4_per_group32)
``scale_format``       the group scales' FP8 format as a                the store (the scale's encode), the attention
                       ``KernelFormat`` (fp4_e2m1: E4M3; None: float16  (its decode; one byte per group); the
                       scales, two bytes)                               wrappers (row width)
=====================  ===============================================  =============================================

Why a NamedTuple: Triton keys its compiled kernels on the constexprs' values (a NamedTuple of plain values is
hashable and compares by value), serializes them to JSON for its compile hooks, and reads a field (``FMT.nan_code``)
as a constant both compiled and in the interpreter (Triton 3.6 and 3.9).

K and V may be stored in different formats (``kv_cache_dtype="int8/int4_g32"``, "k8v4"): the wrappers take K's
format as ``fp8`` and V's as ``v_fp8`` (default :data:`SAME_AS_K`: V's is K's), derive one ``KernelFormat`` per side
with :func:`side_formats`, and the kernels take two constexprs (K's and V's); a tile of K is decoded by K's, a tile
of V by V's. A single-format call passes the same constexpr twice: the same kernel as one format alone.

To add a format family: give it its fields here (and a value of a field that tells the families apart, as
``int_codes`` does for the integer codes, ``packed`` without ``int_codes`` for the 4-bit float codes), derive them
in :func:`kernel_format`, and branch on them in the encode (:func:`kv8.kernels.triton.quant.encode_codes`; fp4:
the store's group branch) and the decode (:func:`kv8.kernels.triton.dequant.decode_fp8`); the wrappers (the cache
dtype: :func:`code_dtype`; which scales) and the launch planning pass the constexpr through unchanged. A field
that is itself a ``KernelFormat`` (``scale_format``) reaches a helper as a constexpr through an annotated
assignment (``SCALE_FMT: tl.constexpr = FMT.scale_format``; compiled, an attribute passed on as an argument is not
one).
"""

from __future__ import annotations

import enum
import math
import struct
from typing import NamedTuple, Protocol, TypeAlias, cast

import torch

__all__ = ["COMPILED_PACKED_MAX_HEAD_DIM", "SAME_AS_K", "AnyLayout", "FP8Layout", "FloatGroupLayout", "GroupLayout",
           "IntLayout", "KernelFormat", "SameAsK", "check_compiled_packed_head_dim", "code_dtype", "code_width",
           "kernel_format", "scale_bytes", "side_formats"]

_SIGN = 0x80
_HALF_MAX = 65504.0
_HALF_MIN_SUBNORMAL = 2.0 ** -24
# Triton's FP8 types by the torch dtype of the same layout (kv8.quant.formats checks that a format's torch dtype
# decodes every code as the format does)
_TRITON_FP8 = {torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5", torch.float8_e4m3fnuz: "fp8e4b8",
               torch.float8_e5m2fnuz: "fp8e5b16"}


class FP8Layout(Protocol):
    """What the kernels read of an FP8 format (:class:`kv8.quant.formats.FP8Format` has all of it)."""

    @property
    def name(self) -> str: ...
    @property
    def exponent_bits(self) -> int: ...
    @property
    def mantissa_bits(self) -> int: ...
    @property
    def exponent_bias(self) -> int: ...
    @property
    def max_finite(self) -> float: ...
    @property
    def min_subnormal(self) -> float: ...
    @property
    def torch_dtype(self) -> torch.dtype: ...
    @property
    def has_negative_zero(self) -> bool: ...
    @property
    def has_inf(self) -> bool: ...
    @property
    def nan_codes(self) -> tuple[int, ...]: ...
    @property
    def nan_code(self) -> int: ...
    @property
    def negative_nan_code(self) -> int: ...


class IntLayout(Protocol):
    """What the kernels read of an integer code format (:class:`kv8.quant.formats.IntFormat` has all of it)."""

    @property
    def name(self) -> str: ...
    @property
    def bits(self) -> int: ...
    @property
    def max_finite(self) -> float: ...


class GroupLayout(Protocol):
    """What the kernels read of a format with scales per group of values inside each row
    (:class:`kv8.quant.int4_group.Int4GroupFormat` has all of it)."""

    @property
    def name(self) -> str: ...
    @property
    def group_size(self) -> int: ...
    @property
    def max_finite(self) -> float: ...
    @property
    def scale_name(self) -> str: ...
    @property
    def head_dim_multiple(self) -> int: ...


class FloatGroupLayout(GroupLayout, Protocol):
    """What the kernels read of a group format of 4-bit float codes with FP8 group scales
    (:class:`kv8.quant.fp4.FP4GroupFormat` has all of it): the codes' magnitudes and the scales' torch dtype."""

    @property
    def grid(self) -> tuple[float, ...]: ...
    @property
    def scale_dtype(self) -> torch.dtype: ...


AnyLayout: TypeAlias = FP8Layout | IntLayout | GroupLayout | FloatGroupLayout   # a wrapper's fp8 / v_fp8


class SameAsK(enum.Enum):
    """The type of :data:`SAME_AS_K`, the default of a wrapper's ``v_fp8``."""

    SAME_AS_K = "the K format"


SAME_AS_K = SameAsK.SAME_AS_K   # ``v_fp8`` default: V's code format is K's (``fp8``), a single-format cache


class KernelFormat(NamedTuple):
    """The constants the encode and the decode of one FP8 or integer format are specialized on (module
    docstring)."""

    name: str
    int_codes: bool
    mantissa_bits: int
    exponent_bias: int
    max_finite: float
    max_finite_bits: int
    nan_code: int
    negative_nan_code: int
    has_negative_zero: bool
    half_top_byte: bool
    nan_mask: int
    nan_match: int
    half_factor: float
    native: str | None
    packed: bool
    group_size: int = 0            # > 0: a scale per group_size values after the row's codes
    group_scale_min: float = 0.0   # the clamp of a group scale's magnitude: float16's (E4M3's) smallest subnormal ..
    group_scale_max: float = 0.0   # .. and its largest finite value
    head_dim_multiple: int = 1     # head_dim must be a multiple of this (the format's own rule)
    scale_format: KernelFormat | None = None   # the group scales' FP8 format (fp4_e2m1); None: float16 scales


_FIELDS = ("name", "exponent_bits", "mantissa_bits", "exponent_bias", "max_finite", "min_subnormal", "torch_dtype",
           "has_negative_zero", "has_inf", "nan_codes", "nan_code", "negative_nan_code")


def code_dtype(fmt: KernelFormat) -> torch.dtype:
    """The dtype of a cache of ``fmt``'s codes: ``int8`` for one integer code per element, ``uint8`` (raw bytes) for
    FP8 and for two 4-bit codes per byte."""
    return torch.int8 if fmt.int_codes and not fmt.packed else torch.uint8


def scale_bytes(fmt: KernelFormat) -> int:
    """Bytes of one group scale in a row of a group format: 2 (float16, little-endian) or 1 (an FP8 code:
    ``scale_format``)."""
    return 1 if fmt.scale_format is not None else 2


def code_width(fmt: KernelFormat | None, head_dim: int) -> int:
    """Elements of one stored row of ``head_dim`` values: ``head_dim / 2`` bytes for packed 4-bit codes (and, after
    them, :func:`scale_bytes` per group of ``group_size`` values, the last group maybe shorter: their scales), else
    ``head_dim`` (one code or value each)."""
    if fmt is None or not fmt.packed:
        return head_dim
    return head_dim // 2 + (scale_bytes(fmt) * -(-head_dim // fmt.group_size) if fmt.group_size else 0)


#: The largest head_dim at which the *compiled* attention kernels read 4-bit codes (two per byte: int4_per_token_head,
#: int4_per_group32, fp4_e2m1). Above it they gave wrong outputs on an NVIDIA H200 (Triton 3.6.0, torch 2.11,
#: 2026-11-30; ``benchmarks/gpu_check.py``'s tests: head_dim 256 with bf16 queries, each of the three formats, and
#: fp4_e2m1 at 200; up to 128 all right) while Triton's interpreter gives the reference's; the cause is not
#: established. Compiled launches refuse those shapes (:func:`check_compiled_packed_head_dim`) until a GPU run shows
#: them right.
COMPILED_PACKED_MAX_HEAD_DIM = 128


def check_compiled_packed_head_dim(sides: tuple[KernelFormat | None, KernelFormat | None], head_dim: int) -> None:
    """``ValueError`` naming the side, its format and ``head_dim`` when a side of 4-bit codes (``packed``) has a
    head_dim above :data:`COMPILED_PACKED_MAX_HEAD_DIM`: for compiled kernels only (the interpreter reads every
    head_dim right; the caller decides which runs)."""
    if head_dim <= COMPILED_PACKED_MAX_HEAD_DIM:
        return
    for which, fmt in zip("KV", sides):
        if fmt is not None and fmt.packed:
            raise ValueError(f"{which}'s {fmt.name} codes at head_dim={head_dim}: the compiled Triton attention reads "
                             f"4-bit codes up to head_dim {COMPILED_PACKED_MAX_HEAD_DIM} only (above it, wrong "
                             "outputs were measured on an H200 with Triton 3.6); use int8_per_token_head or an FP8 "
                             "format for this model on a GPU, or run on the CPU")


def side_formats(fp8: AnyLayout | None, v_fp8: AnyLayout | None | SameAsK
                 ) -> tuple[KernelFormat | None, KernelFormat | None]:
    """K's and V's :class:`KernelFormat` (None: a 16/32-bit side) of a wrapper's ``fp8`` and ``v_fp8``
    (:data:`SAME_AS_K` or ``fp8`` itself: V's is K's, derived once). ``ValueError`` from :func:`kernel_format`, with
    ``v_fp8: `` in front for V's."""
    k_fmt = None if fp8 is None else kernel_format(fp8)
    if v_fp8 is SAME_AS_K or v_fp8 is fp8:
        return k_fmt, k_fmt
    try:
        v_fmt = None if v_fp8 is None else kernel_format(v_fp8)
    except ValueError as exc:
        raise ValueError(f"v_fp8: {exc}") from None
    return k_fmt, v_fmt


def _group_format(fmt: GroupLayout) -> KernelFormat:
    size, max_finite, scale = fmt.group_size, fmt.max_finite, fmt.scale_name
    if scale != "float16" or size < 2 or size & (size - 1):
        raise ValueError(f"group format {fmt.name!r}: {scale} scales per group of {size}, max_finite={max_finite}; "
                         "the Triton kernels read int4 codes (max 2^3 - 1) with a float16 scale per power-of-two "
                         "group (int4_per_group32), or 4-bit float codes with FP8 scales (a format with a grid and "
                         "a scale_dtype: fp4_e2m1)")
    f16 = torch.finfo(torch.float16)
    return _int_format(_IntCodes(fmt.name, 4, max_finite))._replace(
        group_size=size, group_scale_min=float(f16.smallest_normal * f16.eps), group_scale_max=float(f16.max),
        head_dim_multiple=fmt.head_dim_multiple)


def _minifloat_grid(mantissa_bits: int, bias: int) -> tuple[float, ...]:
    """The magnitudes of the 8 codes of a 3-bit float (``3 - mantissa_bits`` exponent bits, ``bias``), subnormals
    where the exponent is 0, no infinity or NaN: what the kernels' bit decode of a 4-bit code gives."""
    step = 1 << mantissa_bits
    return tuple(float(m % step) * 2.0 ** (1 - bias - mantissa_bits) if m < step
                 else (1 + (m % step) / step) * 2.0 ** (m // step - bias) for m in range(8))


class _TorchFP8(NamedTuple):
    """The :class:`FP8Layout` of a torch FP8 dtype, read from the dtype itself (:func:`_torch_fp8`)."""

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
    negative_nan_code: int


def _torch_fp8(name: str, dtype: torch.dtype) -> _TorchFP8:
    """The layout of torch's FP8 dtype ``dtype`` as its own conversions define it, read from every code's value: the
    smallest subnormal (code 1), the mantissa bits (codes ``0 .. 2^(M + 1) - 1`` are the subnormals and the first
    binade, equally spaced; the spacing doubles after them), the bias (the smallest subnormal is
    ``2^(1 - bias - M)``), the largest finite value, NaN codes, infinities, -0.0 (code 0x80), and the codes a NaN of
    either sign converts to. ``ValueError`` unless ``dtype`` is a one-byte float."""
    if not (dtype.is_floating_point and dtype.itemsize == 1):
        raise ValueError(f"{dtype} is not a one-byte float dtype")
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).to(torch.float64)
    tiny = float(values[1])
    steps = values[1:128] - values[:127]
    first_wide = int((steps != tiny).nonzero()[0])             # 2^(M + 1): the first code past the first binade
    mantissa = first_wide.bit_length() - 2
    finite = values[values.isfinite()]
    nan = torch.tensor([math.nan, -math.nan], dtype=torch.float32).to(dtype).view(torch.uint8).tolist()
    return _TorchFP8(
        name=name, exponent_bits=7 - mantissa, mantissa_bits=mantissa,
        exponent_bias=1 - mantissa - round(math.log2(tiny)), max_finite=float(finite.max()), min_subnormal=tiny,
        torch_dtype=dtype, has_negative_zero=bool(values[0x80] == 0 and values[0x80].signbit()),
        has_inf=bool(values.isinf().any()), nan_codes=tuple(int(c) for c in values.isnan().nonzero().flatten()),
        nan_code=nan[0], negative_nan_code=nan[1])


def _float_group_format(fmt: FloatGroupLayout) -> KernelFormat:
    """fp4_e2m1's family: 4-bit float codes (a grid the bit decode builds: a sign and 3 bits, exponent and mantissa,
    bias in 0 .. 15) with FP8 group scales (a torch FP8 dtype whose layout :func:`_fp8_format` accepts)."""
    grid, size = tuple(fmt.grid), fmt.group_size
    fields = [(m, b) for m in range(3) for b in range(16) if _minifloat_grid(m, b) == grid]
    if not fields or fmt.max_finite != grid[-1] or size < 2 or size & (size - 1):
        raise ValueError(f"group format {fmt.name!r}: code magnitudes {grid}, max_finite={fmt.max_finite}, groups "
                         f"of {size}; the Triton kernels read 4-bit float codes (a sign, exponent and mantissa bits "
                         "of 3 with a bias of 0 .. 15, max_finite the largest) in power-of-two groups")
    try:
        scales = _torch_fp8(fmt.scale_name, fmt.scale_dtype)
        scale_format = _fp8_format(scales)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"group format {fmt.name!r}: its {fmt.scale_name} scales (scale_dtype={fmt.scale_dtype}) "
                         f"are not an FP8 layout the Triton kernels read: {exc}") from None
    mantissa, bias = fields[0]
    max_finite = grid[-1]
    return KernelFormat(
        name=fmt.name, int_codes=False, mantissa_bits=mantissa, exponent_bias=bias, max_finite=max_finite,
        max_finite_bits=int(struct.unpack("<I", struct.pack("<f", max_finite))[0]), nan_code=0, negative_nan_code=0,
        has_negative_zero=True, half_top_byte=False, nan_mask=0, nan_match=0, half_factor=2.0 ** (15 - bias),
        native=None, packed=True, group_size=size, group_scale_min=scales.min_subnormal,
        group_scale_max=scales.max_finite, head_dim_multiple=fmt.head_dim_multiple, scale_format=scale_format)


class _IntCodes(NamedTuple):
    """An integer layout (:class:`IntLayout`) of a group format's codes."""

    name: str
    bits: int
    max_finite: float


def _int_format(fmt: IntLayout) -> KernelFormat:
    bits, max_finite = fmt.bits, fmt.max_finite
    if bits not in (4, 8) or max_finite != float((1 << (bits - 1)) - 1):
        raise ValueError(f"integer format {fmt.name!r}: bits={bits}, max_finite={max_finite}; the Triton kernels "
                         "read and write symmetric codes of 8 bits (one per signed byte, max 2^7 - 1) or 4 bits "
                         "(two per byte, max 2^3 - 1)")
    return KernelFormat(
        name=fmt.name, int_codes=True, mantissa_bits=0, exponent_bias=0, max_finite=float(max_finite),
        max_finite_bits=int(struct.unpack("<I", struct.pack("<f", max_finite))[0]), nan_code=0, negative_nan_code=0,
        has_negative_zero=False, half_top_byte=False, nan_mask=0, nan_match=0, half_factor=1.0, native=None,
        packed=bits == 4, head_dim_multiple=2 if bits == 4 else 1)


def kernel_format(fmt: FP8Layout | IntLayout | GroupLayout | FloatGroupLayout) -> KernelFormat:
    """The kernels' constants for ``fmt``; ``ValueError`` naming the field when ``fmt`` lacks one or has a layout the
    kernels cannot handle. An integer format (``bits``, no ``exponent_bits``) must be 8 bits with max ``2^7 - 1``
    (one code per int8 element) or 4 bits with max ``2^3 - 1`` (two codes per byte). An FP8 format must have a
    layout the bit decode can build from a half: not more than 5 exponent bits, 5 bits that are IEEE's (bias 15, inf
    and NaN in the all-ones exponent), infinities only with 5, NaN codes that are one code or one code of each sign,
    values inside a half's range. A group format (``group_size``) has power-of-two groups: int4 codes with float16
    scales (``scale_name``), or, with a ``grid`` and a ``scale_dtype``, 4-bit float codes whose magnitudes the bit
    decode builds with FP8 scales of such a layout."""
    if hasattr(fmt, "group_size"):
        if hasattr(fmt, "grid") and hasattr(fmt, "scale_dtype"):
            return _float_group_format(cast(FloatGroupLayout, fmt))
        return _group_format(cast(GroupLayout, fmt))
    if hasattr(fmt, "bits") and not hasattr(fmt, "exponent_bits"):
        return _int_format(fmt)
    return _fp8_format(cast(FP8Layout, fmt))


def _fp8_format(fmt: FP8Layout) -> KernelFormat:
    missing = [f for f in _FIELDS if not hasattr(fmt, f)]
    if missing:
        raise ValueError(f"fp8={fmt!r} is not an FP8 format: it has no {', '.join(missing)} "
                         "(pass a kv8.quant.formats.FP8Format, or an IntFormat)")
    e, m, bias = fmt.exponent_bits, fmt.mantissa_bits, fmt.exponent_bias
    nans = set(fmt.nan_codes)

    def bad(what: str) -> ValueError:
        return ValueError(f"fp8 format {fmt.name!r}: {what}; the Triton kernels' bit decode cannot build it from a "
                          "half")

    if e + m != 7 or m < 1:
        raise bad(f"exponent_bits={e}, mantissa_bits={m} is not a sign | exponent | mantissa byte")
    if e > 5:
        raise bad(f"exponent_bits={e} > 5 (a half's)")
    half_top_byte = e == 5
    nan_mask = nan_match = 0
    if half_top_byte:
        ieee = {s | 0x7C | low for s in (0, _SIGN) for low in (1, 2, 3)}
        if bias != 15 or not fmt.has_inf or nans != ieee:
            raise bad(f"5 exponent bits with exponent_bias={bias}, has_inf={fmt.has_inf}, nan_codes="
                      f"{sorted(nans)}: only IEEE's (bias 15, inf and NaN where a half has them) are a half's top "
                      "byte")
    else:
        if fmt.has_inf:
            raise bad(f"has_inf=True with exponent_bits={e} (a half has no infinities there)")
        low = {c & ~_SIGN for c in nans}
        if len(nans) == 1:
            nan_mask, nan_match = 0xFF, next(iter(nans))
        elif len(low) == 1 and nans == {next(iter(low)), next(iter(low)) | _SIGN}:
            nan_mask, nan_match = 0x7F, next(iter(low))
        else:
            raise bad(f"nan_codes={sorted(nans)}: want one code, or one code with either sign")
    if not (fmt.max_finite <= _HALF_MAX and fmt.min_subnormal >= _HALF_MIN_SUBNORMAL):
        raise bad(f"values {fmt.min_subnormal} .. {fmt.max_finite} lie outside a half's range")
    return KernelFormat(
        name=fmt.name, int_codes=False, mantissa_bits=m, exponent_bias=bias, max_finite=float(fmt.max_finite),
        max_finite_bits=int(struct.unpack("<I", struct.pack("<f", fmt.max_finite))[0]),
        nan_code=fmt.nan_code, negative_nan_code=fmt.negative_nan_code, has_negative_zero=bool(fmt.has_negative_zero),
        half_top_byte=half_top_byte, nan_mask=nan_mask, nan_match=nan_match, half_factor=2.0 ** (15 - bias),
        native=_TRITON_FP8.get(fmt.torch_dtype), packed=False)
