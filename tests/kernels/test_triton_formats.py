"""What the Triton kernels take of an FP8 or integer format (:func:`kv8.kernels.triton.formats.kernel_format`) is
derived from kv8's one definition of it (:mod:`kv8.quant.formats`), and describes it: a model of the kernels' bit
decode built from those fields alone gives every code's value, and no kernel module restates a format's constants.

The kernels themselves are checked against the formats code by code in the interpreter (and compiled on a GPU):
the store's encode in tests/kernels/test_triton_store.py, the decode in tests/kernels/test_triton_attention.py,
both over every format of :data:`kv8.quant.formats.FP8_FORMATS` and int8.
"""

from __future__ import annotations

import json
import math
import re
import struct
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import kv8.kernels.triton as kernels_pkg
import kv8.kernels.triton.formats as formats_mod
from kv8.kernels.triton.formats import KernelFormat, code_dtype, code_width, kernel_format, scale_bytes
from kv8.quant.formats import E4M3, FP8_FORMATS, INT4, INT8, FP8Format, resolve_kv_cache_dtype
from kv8.quant.fp4 import FP4_E2M1
from kv8.quant.int4_group import INT4_G32

fmt_param = pytest.mark.parametrize("fmt", list(FP8_FORMATS.values()), ids=lambda f: f.name)


def _half(bits: int) -> float:
    return float(struct.unpack("<e", struct.pack("<H", bits & 0xFFFF))[0])


def _bit_decode_model(k: KernelFormat, code: int) -> float:
    """:func:`kv8.kernels.triton.dequant.decode_fp8_bits` in plain Python, from the kernel's fields only."""
    if k.half_top_byte:
        return _half(code << 8)
    if code & k.nan_mask == k.nan_match:
        return math.nan
    return _half(((code & 0x80) << 8) | ((code & 0x7F) << (10 - k.mantissa_bits))) * k.half_factor


@fmt_param
def test_kernel_fields_are_the_formats(fmt: FP8Format) -> None:
    k = kernel_format(fmt)
    assert (k.name, k.mantissa_bits, k.exponent_bias, k.max_finite) == \
        (fmt.name, fmt.mantissa_bits, fmt.exponent_bias, fmt.max_finite)
    assert (k.nan_code, k.negative_nan_code, k.has_negative_zero) == \
        (fmt.nan_code, fmt.negative_nan_code, fmt.has_negative_zero)
    assert struct.unpack("<f", struct.pack("<I", k.max_finite_bits))[0] == fmt.max_finite
    assert k.half_factor == 2.0 ** (15 - fmt.exponent_bias)
    # Triton's type of the same layout, where it has one: what the native decode bitcasts to
    want_native = {torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5", torch.float8_e4m3fnuz: "fp8e4b8"}
    assert k.native == want_native[fmt.torch_dtype]
    assert kernel_format(fmt) == k and hash(kernel_format(fmt)) == hash(k)   # one compiled kernel per format
    assert not k.int_codes and code_dtype(k) == torch.uint8


def test_int8_is_a_family_of_its_own() -> None:
    """int8 codes: the integer family (``int_codes``), its largest code the format's, one code per int8 element,
    no FP8 type to decode natively; a NaN encodes to code 0."""
    k = kernel_format(INT8)
    assert k.int_codes and k.name == INT8.name and k.max_finite == INT8.max_finite
    assert struct.unpack("<f", struct.pack("<I", k.max_finite_bits))[0] == INT8.max_finite
    assert code_dtype(k) == INT8.storage_dtype == torch.int8
    assert k.native is None and (k.nan_code, k.negative_nan_code) == (0, 0)
    assert kernel_format(INT8) == k and k not in {kernel_format(f) for f in FP8_FORMATS.values()}
    assert not k.packed and code_width(k, 64) == 64


def test_int4_is_the_integer_family_packed_two_per_byte() -> None:
    """int4 codes: the integer family with the format's largest code (7), ``packed`` (two codes per ``uint8``, the
    cache dtype of :data:`INT4`'s cache rows, ``D / 2`` of them); no FP8 field is set."""
    k = kernel_format(INT4)
    assert k.int_codes and k.packed and k.name == INT4.name and k.max_finite == INT4.max_finite == 7.0
    assert struct.unpack("<f", struct.pack("<I", k.max_finite_bits))[0] == INT4.max_finite
    assert code_dtype(k) == resolve_kv_cache_dtype("int4", torch.bfloat16).storage_dtype == torch.uint8
    assert code_width(k, 96) == 48 and code_width(None, 96) == 96
    assert k.native is None and (k.nan_code, k.negative_nan_code) == (0, 0)
    assert k != kernel_format(INT8) and not any(kernel_format(f).packed for f in FP8_FORMATS.values())
    assert k.group_size == 0


def test_int4_per_group32_is_int4_with_float16_group_scales() -> None:
    """int4_per_group32: int4 codes (packed, max 7) with ``group_size`` 32 and its float16 scales' clamp, float16's
    smallest subnormal and largest value (what Int4GroupFormat.encode_scale clamps to); a row is D / 2 + 2 D / 32
    bytes, its row_bytes; head_dim a multiple of 32, the format's own rule."""
    k = kernel_format(INT4_G32)
    assert k.int_codes and k.packed and k.max_finite == INT4_G32.max_finite and k.group_size == INT4_G32.group_size
    assert (k.group_scale_min, k.group_scale_max) == (2.0 ** -24, 65504.0)
    assert all(code_width(k, d) == INT4_G32.row_bytes(d) for d in (32, 64, 96, 256))
    assert code_dtype(k) == INT4_G32.storage_dtype == torch.uint8
    assert k.scale_format is None and scale_bytes(k) == 2 and k.head_dim_multiple == INT4_G32.head_dim_multiple == 32


def _e2m1_decode_model(k: KernelFormat, code: int) -> float:
    """:func:`kv8.kernels.triton.dequant.unpack_e2m1` of one 4-bit code in plain Python, from the kernel's fields:
    the sign from bit 3 and the 3 low bits moved into a half's, times ``half_factor``."""
    return _half(((code & 0x8) << 12) | ((code & 0x7) << (10 - k.mantissa_bits))) * k.half_factor


def test_fp4_e2m1_is_a_family_of_4_bit_float_codes_with_fp8_scales() -> None:
    """fp4_e2m1: packed 4-bit float codes (``packed`` without ``int_codes``) whose fields, derived from the format's
    grid, give every code's value by the kernels' bit decode (-0.0 included) and bound the encode at 6 (NaN -> +0,
    -0.0 kept); an E4M3 scale code per 16 values, ``scale_format`` derived from the format's torch dtype: the same
    kernel fields as kv8's E4M3 FP8 format, clamped to its smallest subnormal and largest value (what
    FP4GroupFormat.encode_scale clamps to); rows of D / 2 + ceil(D / 16) bytes for any even D, its row_bytes."""
    k = kernel_format(FP4_E2M1)
    assert k.packed and not k.int_codes and k.name == FP4_E2M1.name and k.native is None
    assert (k.mantissa_bits, k.exponent_bias, k.max_finite) == (1, 1, FP4_E2M1.max_finite)
    assert struct.unpack("<f", struct.pack("<I", k.max_finite_bits))[0] == FP4_E2M1.max_finite
    assert (k.nan_code, k.negative_nan_code, k.has_negative_zero) == (0, 0, True)
    codes = torch.arange(16, dtype=torch.uint8)
    for code, want in zip(codes.tolist(), FP4_E2M1.decode_e2m1(codes).tolist()):
        got = _e2m1_decode_model(k, code)
        assert got == want and math.copysign(1, got) == math.copysign(1, want), code
    assert k.group_size == FP4_E2M1.group_size == 16 and k.head_dim_multiple == FP4_E2M1.head_dim_multiple == 2
    assert k.scale_format == kernel_format(E4M3)._replace(name="E4M3") and scale_bytes(k) == 1
    assert (k.group_scale_min, k.group_scale_max) == (2.0 ** -9, 448.0)
    scale_codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    for code, want in enumerate(FP4_E2M1.decode_scale(scale_codes).tolist()):
        got = _bit_decode_model(k.scale_format, code)
        assert (math.isnan(got) and math.isnan(want)) or got == want, hex(code)
    assert all(code_width(k, d) == FP4_E2M1.row_bytes(d) for d in (2, 8, 16, 40, 64, 96, 128, 200, 256))
    assert code_dtype(k) == FP4_E2M1.storage_dtype == torch.uint8
    assert kernel_format(FP4_E2M1) == k and hash(kernel_format(FP4_E2M1)) == hash(k)
    assert json.loads(json.dumps(k))[-1][0] == "E4M3"    # the nested format serializes (Triton's compile hooks)


@fmt_param
def test_bit_decode_model_from_the_kernel_fields_gives_every_value(fmt: FP8Format) -> None:
    """The fields the decode is specialized on describe the format: all 256 codes, NaN, infinities and -0.0."""
    k = kernel_format(fmt)
    for code, want in enumerate(fmt.values()):
        got = _bit_decode_model(k, code)
        if math.isnan(want):
            assert math.isnan(got), hex(code)
        else:
            assert got == want and math.copysign(1, got) == math.copysign(1, want), hex(code)


E5M2FNUZ = FP8Format(name="fp8_e5m2fnuz", exponent_bits=5, mantissa_bits=2, exponent_bias=16, max_finite=57344.0,
                     min_subnormal=2.0 ** -17, torch_dtype=torch.float8_e5m2fnuz, has_negative_zero=False,
                     has_inf=False, nan_codes=(0x80,), nan_code=0x80)


def _like(fmt: FP8Format, **change: object) -> SimpleNamespace:
    fields = ("name", "exponent_bits", "mantissa_bits", "exponent_bias", "max_finite", "min_subnormal",
              "torch_dtype", "has_negative_zero", "has_inf", "nan_codes", "nan_code", "negative_nan_code")
    return SimpleNamespace(**{**{f: getattr(fmt, f) for f in fields}, **change})


@fmt_param
def test_a_torch_fp8_dtype_read_code_by_code_is_the_format(fmt: FP8Format) -> None:
    """What the kernels derive of a group format's FP8 scales from their torch dtype alone (:func:`_torch_fp8`) is
    kv8's format of that dtype: the same kernel fields, but for the code a NaN encodes to where kv8 chooses its own
    (E5M2: 0x7E, torch 0x7F; the scales are never NaN)."""
    derived = formats_mod._torch_fp8(fmt.name, fmt.torch_dtype)
    want = kernel_format(fmt)
    assert kernel_format(derived)._replace(nan_code=want.nan_code, negative_nan_code=want.negative_nan_code) == want
    assert (derived.nan_code, derived.negative_nan_code) == (
        (0x7F, 0xFF) if fmt.name == "fp8_e5m2" else (fmt.nan_code, fmt.negative_nan_code))
    with pytest.raises(ValueError, match="torch.float16 is not a one-byte float dtype"):
        formats_mod._torch_fp8("f16", torch.float16)


def _fp4_like(**change: object) -> SimpleNamespace:
    fields = ("name", "group_size", "max_finite", "scale_name", "head_dim_multiple", "grid", "scale_dtype")
    return SimpleNamespace(**{**{f: getattr(FP4_E2M1, f) for f in fields}, **change})


@pytest.mark.parametrize("layout,message", [
    (E5M2FNUZ, r"'fp8_e5m2fnuz': 5 exponent bits with exponent_bias=16, has_inf=False"),
    (SimpleNamespace(name="fp8_e3m4"), r"fp8=.* is not an FP8 format: it has no exponent_bits"),
    (_like(FP8_FORMATS["fp8_e4m3"], has_inf=True), r"has_inf=True with exponent_bits=4"),
    (_like(FP8_FORMATS["fp8_e4m3"], nan_codes=(0x7F, 0x7E)), r"nan_codes=\[126, 127\]: want one code"),
    (_like(FP8_FORMATS["fp8_e4m3"], exponent_bits=6, mantissa_bits=1), r"exponent_bits=6 > 5"),
    (SimpleNamespace(name="int4", bits=4, max_finite=8.0), r"integer format 'int4': bits=4, max_finite=8.0; .* or "
                                                           r"4 bits \(two per byte, max 2\^3 - 1\)"),
    (SimpleNamespace(name="int8", bits=8, max_finite=100.0), r"integer format 'int8': bits=8, max_finite=100.0"),
    (_fp4_like(grid=tuple(float(i) for i in range(8)), max_finite=7.0),
     r"group format 'e2m1': code magnitudes \(0.0, 1.0, .*, 7.0\), max_finite=7.0, groups of 16; the Triton kernels "
     r"read 4-bit float codes"),
    (_fp4_like(group_size=24), r"groups of 24; the Triton kernels read 4-bit float codes .* in power-of-two groups"),
    (_fp4_like(scale_dtype=torch.float8_e5m2fnuz), r"group format 'e2m1': its E4M3 scales \(scale_dtype=torch."
                                                   r"float8_e5m2fnuz\) are not an FP8 layout .*5 exponent bits"),
    (_fp4_like(scale_name="float16", scale_dtype=torch.float16), r"its float16 scales .* are not an FP8 layout"),
    (SimpleNamespace(name="g16", group_size=16, max_finite=7.0, scale_name="bfloat16", head_dim_multiple=16),
     r"group format 'g16': bfloat16 scales per group of 16, max_finite=7.0; the Triton kernels read int4 codes"),
], ids=["e5m2fnuz", "not a format", "inf", "nan codes", "wide exponent", "int4 max", "int8 max", "fp4 grid",
        "fp4 group", "fp4 scale layout", "fp4 scale not fp8", "int4 group scale"])
def test_layouts_the_kernels_cannot_decode_are_refused(layout: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        kernel_format(layout)  # type: ignore[arg-type]


def test_no_kernel_module_restates_a_format() -> None:
    """The formats' names, max finite values and their float32 bit patterns appear in no kernel module: the
    kernels take them from :func:`kernel_format` (which names only torch's and Triton's dtypes). For int8 the name
    is a bare ``int8`` (``tl.int8``/``torch.int8`` are dtypes) and its max a float literal ``127.`` (the integer 127
    is also float32's exponent bias, which the FP8 encode uses)."""
    sources = {p.name: p.read_text() for p in Path(kernels_pkg.__file__).parent.glob("*.py")}
    assert {"quant.py", "dequant.py", "store.py", "attention.py", "formats.py"} <= set(sources)
    for fmt in FP8_FORMATS.values():
        bits = struct.unpack("<I", struct.pack("<f", fmt.max_finite))[0]
        patterns = [rf"\b{fmt.name}\b", rf"(?i)\b0x{bits:08x}\b", rf"(?<![\d.]){fmt.max_finite:g}(?![\d])"]
        for name, text in sources.items():
            code = re.sub(r'"""(.|\n)*?"""|#[^\n]*', "", text)     # docstrings and comments may name them
            for pattern in patterns:
                assert not re.search(pattern, code), (name, pattern)
    for name, text in sources.items():    # fp4_e2m1: its name, its scales' clamp below (2^-9; 448 is E4M3's above)
        code = re.sub(r'"""(.|\n)*?"""|#[^\n]*', "", text)
        for pattern in (rf"\b{FP4_E2M1.name}\b", r"0\.001953125", r"2\.0 \*\* -9"):
            assert not re.search(pattern, code), (name, pattern)
    int_bits = struct.unpack("<I", struct.pack("<f", INT8.max_finite))[0]
    for name, text in sources.items():
        code = re.sub(r'"""(.|\n)*?"""|#[^\n]*', "", text)
        for pattern in (rf"(?<![\w.]){INT8.name}\b", rf"(?i)\b0x{int_bits:08x}\b", r"(?<![\d.])127\."):
            assert not re.search(pattern, code), (name, pattern)
