"""Tests for kv8.quant.formats: FP8 codecs (ml_dtypes is the bit-pattern oracle) and kv_cache_dtype resolution."""

from __future__ import annotations

import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from kv8.quant.formats import (
    E4M3,
    E4M3FNUZ,
    E5M2,
    FP8_FORMATS,
    KV_CACHE_DTYPE_CHOICES,
    FP8Format,
    KVCacheDtype,
    dequantize,
    fp8_format,
    quantize,
    resolve_kv_cache_dtype,
)

ORACLES = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e4m3fnuz": ml_dtypes.float8_e4m3fnuz,
           "fp8_e5m2": ml_dtypes.float8_e5m2}
FORMATS = [E4M3, E4M3FNUZ, E5M2]
fmt_param = pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)


def oracle_encode(x: np.ndarray, fmt: FP8Format) -> np.ndarray:
    """ml_dtypes' RNE conversion of float32 ``x``, saturated first (ml_dtypes itself does not saturate)."""
    with np.errstate(invalid="ignore", over="ignore"):
        clipped = np.clip(x.astype(np.float32), -fmt.max_finite, fmt.max_finite)
        return clipped.astype(ORACLES[fmt.name]).view(np.uint8)


def assert_encode_matches_oracle(x: np.ndarray, fmt: FP8Format) -> None:
    x = np.ascontiguousarray(x, dtype=np.float32)
    got = fmt.encode(torch.from_numpy(x)).numpy()
    want = oracle_encode(x, fmt)
    bad = np.flatnonzero(got != want)
    assert bad.size == 0, (f"{fmt.name}: {bad.size} mismatches, e.g. x={x[bad[:5]].tolist()} "
                           f"(bits {[hex(b) for b in x[bad[:5]].view(np.uint32)]}) got "
                           f"{[hex(c) for c in got[bad[:5]]]} want {[hex(c) for c in want[bad[:5]]]}")


def finite_values(fmt: FP8Format) -> np.ndarray:
    """Sorted distinct finite values of the format (both zeros collapse to +0.0)."""
    codes = np.arange(256, dtype=np.uint8).view(ORACLES[fmt.name]).astype(np.float64)
    finite = codes[np.isfinite(codes)]
    return np.unique(np.where(finite == 0, 0.0, finite))


# ---------------------------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------------------------

@fmt_param
def test_decode_all_256_codes_match_ml_dtypes_bit_for_bit(fmt: FP8Format) -> None:
    codes = np.arange(256, dtype=np.uint8)
    want = codes.view(ORACLES[fmt.name]).astype(np.float32)
    got = fmt.decode(torch.from_numpy(codes)).numpy()
    assert got.dtype == np.float32
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    finite = ~np.isnan(want)
    # Comparing the bit patterns also checks the sign of zero (0x80 is -0.0, or NaN for fnuz).
    np.testing.assert_array_equal(got[finite].view(np.uint32), want[finite].view(np.uint32))
    assert tuple(np.flatnonzero(np.isnan(want))) == fmt.nan_codes
    assert math.isnan(fmt.values()[fmt.nan_code]) and math.isnan(fmt.values()[fmt.negative_nan_code])


@fmt_param
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_decode_to_other_dtypes_is_exact(fmt: FP8Format, dtype: torch.dtype) -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    ref = fmt.decode(codes)
    got = fmt.decode(codes, dtype)
    assert got.dtype == dtype
    assert torch.equal(torch.isnan(got), torch.isnan(ref))
    ok = ~torch.isnan(ref)
    assert torch.equal(got.float()[ok], ref[ok])
    assert torch.equal(torch.signbit(got.float()[ok]), torch.signbit(ref[ok]))


@fmt_param
def test_decode_keeps_shape_and_handles_strided_input(fmt: FP8Format) -> None:
    codes = torch.randint(0, 256, (4, 6, 5), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    flat = fmt.decode(codes.reshape(-1)).reshape(4, 6, 5)
    strided = codes.transpose(0, 2)
    out = fmt.decode(strided)
    assert out.shape == strided.shape
    assert torch.equal(torch.nan_to_num(out), torch.nan_to_num(flat.transpose(0, 2)))
    assert fmt.decode(torch.tensor(0x38, dtype=torch.uint8)).shape == ()
    assert fmt.decode(torch.empty(0, 3, dtype=torch.uint8)).shape == (0, 3)


@fmt_param
def test_format_constants_match_ml_dtypes(fmt: FP8Format) -> None:
    info = ml_dtypes.finfo(ORACLES[fmt.name])
    assert fmt.max_finite == float(info.max)
    assert fmt.min_subnormal == float(info.smallest_subnormal)
    assert fmt.mantissa_bits == info.nmant
    values = fmt.values()
    assert any(math.isinf(v) for v in values) == fmt.has_inf
    assert (math.copysign(1.0, values[0x80]) < 0) == fmt.has_negative_zero
    assert fp8_format(fmt.name) is fmt and FP8_FORMATS[fmt.name] is fmt


def test_documented_bit_layouts() -> None:
    """Hard-coded expectations, independent of the oracle."""
    assert (E4M3.exponent_bias, E4M3FNUZ.exponent_bias, E5M2.exponent_bias) == (7, 8, 15)
    assert (E4M3.max_finite, E4M3FNUZ.max_finite, E5M2.max_finite) == (448.0, 240.0, 57344.0)
    assert E4M3.values()[0x7E] == 448.0 and E4M3.values()[0x38] == 1.0 and E4M3.values()[0x01] == 2.0 ** -9
    assert E4M3FNUZ.values()[0x7F] == 240.0 and E4M3FNUZ.values()[0x40] == 1.0 and E4M3FNUZ.values()[0x00] == 0.0
    assert E5M2.values()[0x7C] == math.inf and E5M2.values()[0xFC] == -math.inf and E5M2.values()[0x3C] == 1.0
    assert (E4M3.nan_code, E4M3.negative_nan_code) == (0x7F, 0xFF)
    assert (E4M3FNUZ.nan_code, E4M3FNUZ.negative_nan_code) == (0x80, 0x80)
    assert (E5M2.nan_code, E5M2.negative_nan_code) == (0x7E, 0xFE)


# ---------------------------------------------------------------------------------------------------------------
# encode
# ---------------------------------------------------------------------------------------------------------------

def dense_inputs(fmt: FP8Format) -> np.ndarray:
    """Every FP8 value, every midpoint (tie) between adjacent values, their float32 neighbours, both signs, plus
    subnormal/underflow, saturation and special inputs."""
    values = finite_values(fmt)
    values = values[values >= 0]
    mids = (values[:-1] + values[1:]) / 2  # exact in float64 and in float32 (one more significant bit)
    top_ulp = values[-1] - values[-2]
    beyond = np.array([fmt.max_finite + top_ulp / 2, fmt.max_finite + top_ulp, 2 * fmt.max_finite, 1e30,
                       float(np.finfo(np.float32).max)])
    tiny = np.array([fmt.min_subnormal / 2, fmt.min_subnormal / 4, fmt.min_subnormal * 0.75, fmt.min_subnormal * 1.5,
                     float(np.finfo(np.float32).smallest_subnormal), float(np.finfo(np.float32).tiny), 1e-30])
    base = np.concatenate([values, mids, beyond, tiny]).astype(np.float32)
    assert np.array_equal(base[len(values):len(values) + len(mids)].astype(np.float64), mids)
    with np.errstate(over="ignore"):  # nextafter(float32 max, inf) is inf, which is wanted here
        up = np.nextafter(base, np.float32(np.inf))
        down = np.nextafter(base, np.float32(-np.inf))
    positive = np.concatenate([base, up, down])
    specials = np.array([np.inf, -np.inf, np.nan, 0.0, -0.0], dtype=np.float32)
    negative_nan = np.array([0xFFC00000, 0xFF800001, 0x7F800001], dtype=np.uint32).view(np.float32)
    return np.concatenate([positive, -positive, specials, negative_nan])


@fmt_param
def test_encode_dense_set_matches_ml_dtypes_rne(fmt: FP8Format) -> None:
    x = dense_inputs(fmt)
    assert x.size > 1500
    assert_encode_matches_oracle(x, fmt)


@fmt_param
def test_encode_ties_round_to_even(fmt: FP8Format) -> None:
    values = finite_values(fmt)
    values = values[values >= 0]
    mids = ((values[:-1] + values[1:]) / 2).astype(np.float32)
    codes = fmt.encode(torch.from_numpy(mids)).numpy()
    # Adjacent non-negative values have adjacent codes, so a tie picks whichever of the two has an even code.
    lower = fmt.encode(torch.from_numpy(values[:-1].astype(np.float32))).numpy()
    expected = np.where(lower % 2 == 0, lower, lower + 1)
    np.testing.assert_array_equal(codes, expected)


@fmt_param
def test_encode_saturates_and_maps_specials(fmt: FP8Format) -> None:
    top = int(np.flatnonzero(np.array(fmt.values()) == fmt.max_finite)[0])
    negative_nan = np.array([0xFFC00000], dtype=np.uint32).view(np.float32)[0]
    x = torch.tensor([math.inf, -math.inf, 1e30, -1e30, fmt.max_finite * 1.01, math.nan, negative_nan, 0.0, -0.0])
    assert torch.signbit(x[6]) and not torch.signbit(x[5])
    got = fmt.encode(x).tolist()
    negative_zero = 0x80 if fmt.has_negative_zero else 0x00
    assert got == [top, top | 0x80, top, top | 0x80, top, fmt.nan_code, fmt.negative_nan_code, 0x00, negative_zero]
    decoded = fmt.decode(fmt.encode(x))
    assert not torch.isinf(decoded).any()


@fmt_param
def test_encode_random_float32_full_exponent_range(fmt: FP8Format) -> None:
    rng = np.random.default_rng(1234)
    bits = rng.integers(0, 2 ** 32, size=2_000_000, dtype=np.uint64).astype(np.uint32)
    assert_encode_matches_oracle(bits.view(np.float32), fmt)
    # And densely over the exponents the format covers (where rounding actually matters).
    exponents = rng.uniform(math.log2(fmt.min_subnormal) - 2, math.log2(fmt.max_finite) + 1, size=1_000_000)
    signs = rng.choice(np.array([-1.0, 1.0]), size=exponents.size)
    assert_encode_matches_oracle((signs * np.exp2(exponents)).astype(np.float32), fmt)


@fmt_param
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_encode_every_16_bit_input(fmt: FP8Format, dtype: torch.dtype) -> None:
    x16 = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16).view(dtype)
    got = fmt.encode(x16).numpy()
    want = oracle_encode(x16.float().numpy(), fmt)
    np.testing.assert_array_equal(got, want)


@fmt_param
def test_encode_float64_rounds_to_float32_first(fmt: FP8Format) -> None:
    x = torch.from_numpy(np.random.default_rng(7).standard_normal(10_000) * 50)
    assert torch.equal(fmt.encode(x), fmt.encode(x.float()))


@fmt_param
def test_encode_shape_dtype_and_strides(fmt: FP8Format) -> None:
    x = torch.randn(3, 4, 5, generator=torch.Generator().manual_seed(0)) * 10
    codes = fmt.encode(x.transpose(0, 2))
    assert codes.dtype == torch.uint8 and codes.shape == (5, 4, 3)
    assert torch.equal(codes, fmt.encode(x).transpose(0, 2))
    assert fmt.encode(torch.tensor(1.0)).shape == ()
    assert fmt.encode(torch.empty(2, 0)).shape == (2, 0)
    assert fmt.encode(torch.tensor([math.nan, 1.0]).reshape(1, 2)).shape == (1, 2)


def test_codec_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="floating-point"):
        E4M3.encode(torch.arange(4))
    with pytest.raises(ValueError, match="floating-point"):
        E4M3.encode([1.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="uint8"):
        E4M3.decode(torch.arange(4, dtype=torch.int8))
    with pytest.raises(ValueError, match="dtype=torch.int32"):
        E4M3.decode(torch.arange(4, dtype=torch.uint8), torch.int32)
    with pytest.raises(ValueError, match="fp8_e4m3, fp8_e4m3fnuz, fp8_e5m2"):
        fp8_format("fp8_e3m4")


def test_fp8_format_validates_consistency() -> None:
    with pytest.raises(ValueError, match="max_finite"):
        dataclasses.replace(E4M3, max_finite=480.0)
    with pytest.raises(ValueError, match="min_subnormal"):
        dataclasses.replace(E4M3, min_subnormal=2.0 ** -10)
    with pytest.raises(ValueError, match="has_negative_zero"):
        dataclasses.replace(E4M3FNUZ, has_negative_zero=True)
    with pytest.raises(ValueError, match="nan_code"):
        dataclasses.replace(E5M2, nan_code=0x7C)
    with pytest.raises(ValueError, match="sum to 7"):
        dataclasses.replace(E4M3, exponent_bits=5)
    with pytest.raises(ValueError, match="torch_dtype"):  # layout of e4m3fn, reference codec of fnuz
        dataclasses.replace(E4M3, torch_dtype=torch.float8_e4m3fnuz)


# ---------------------------------------------------------------------------------------------------------------
# quantize / dequantize
# ---------------------------------------------------------------------------------------------------------------

def min_normal(fmt: FP8Format) -> float:
    return 2.0 ** (1 - fmt.exponent_bias)


@fmt_param
@pytest.mark.parametrize("scale", [1.0, 0.037, 3.7, 250.0])
def test_round_trip_error_bounds(fmt: FP8Format, scale: float) -> None:
    rng = np.random.default_rng(99)
    n = 200_000
    lo, hi = math.log2(fmt.min_subnormal) - 3, math.log2(fmt.max_finite) + 3
    y = (rng.choice(np.array([-1.0, 1.0]), n) * np.exp2(rng.uniform(lo, hi, n))).astype(np.float32)
    x = torch.from_numpy(y) * scale
    codes = quantize(x, scale, fmt)
    assert codes.dtype == torch.uint8 and codes.shape == x.shape
    assert torch.equal(codes, fmt.encode(x / scale))
    yq = (x / scale).double()  # what was actually encoded
    dec = fmt.decode(codes).double()
    deq = dequantize(codes, scale, fmt).double()
    xd = x.double()
    eps = 2.0 ** -22  # float32 rounding of the division and the multiplication
    rel = 2.0 ** -(fmt.mantissa_bits + 1)

    normal = (yq.abs() >= min_normal(fmt)) & (yq.abs() <= fmt.max_finite)
    assert normal.sum() > n // 4
    assert ((dec - yq).abs() <= rel * yq.abs())[normal].all()
    assert ((deq - xd).abs() <= (rel + eps) * xd.abs())[normal].all()

    sub = yq.abs() < min_normal(fmt)
    assert sub.sum() > n // 20
    assert ((dec - yq).abs() <= fmt.min_subnormal / 2)[sub].all()
    assert ((deq - xd).abs() <= fmt.min_subnormal / 2 * scale * (1 + eps) + eps * xd.abs())[sub].all()

    over = yq.abs() > fmt.max_finite
    assert over.sum() > n // 20
    assert torch.equal(dec[over], fmt.max_finite * torch.sign(yq[over]))
    torch.testing.assert_close(deq[over], fmt.max_finite * scale * torch.sign(xd[over]), rtol=eps, atol=0)


@fmt_param
def test_quantize_per_row_tensor_scale_and_output_dtypes(fmt: FP8Format) -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(8, 2, 16, generator=gen, dtype=torch.float32).to(torch.bfloat16) * 20
    scale = torch.rand(8, 2, 1, generator=gen) + 0.1
    codes = quantize(x, scale, fmt)
    assert torch.equal(codes, fmt.encode(x.float() / scale))
    deq32 = dequantize(codes, scale, fmt)
    assert torch.equal(deq32, fmt.decode(codes) * scale)
    assert torch.equal(dequantize(codes, scale, fmt, torch.bfloat16), deq32.to(torch.bfloat16))
    assert torch.equal(dequantize(codes, scale.double(), fmt), deq32)
    assert torch.equal(quantize(x, torch.tensor(2.0), fmt), quantize(x, 2.0, fmt))


@pytest.mark.parametrize("scale", [0.0, -1.0, math.nan, math.inf, True, "1.0", torch.tensor([1.0, 0.0]),
                                   torch.tensor([1.0, math.inf]), torch.tensor([1, 2])])
def test_quantize_rejects_bad_scale(scale: object) -> None:
    x = torch.ones(3, 2)
    with pytest.raises(ValueError, match="scale"):
        quantize(x, scale, E4M3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="scale"):
        dequantize(torch.zeros(3, 2, dtype=torch.uint8), scale, E4M3)  # type: ignore[arg-type]


def test_quantize_rejects_bad_shapes_and_inputs() -> None:
    with pytest.raises(ValueError, match="broadcast"):
        quantize(torch.ones(3, 2), torch.ones(3, 3), E4M3)
    with pytest.raises(ValueError, match="broadcast the input"):
        quantize(torch.ones(3, 1), torch.ones(3, 4), E4M3)
    with pytest.raises(ValueError, match="floating-point"):
        quantize(torch.ones(3, dtype=torch.int64), 1.0, E4M3)
    with pytest.raises(ValueError, match="uint8"):
        dequantize(torch.ones(3), 1.0, E4M3)
    with pytest.raises(ValueError, match="dtype"):
        dequantize(torch.ones(3, dtype=torch.uint8), 1.0, E4M3, torch.int8)


# ---------------------------------------------------------------------------------------------------------------
# kv_cache_dtype
# ---------------------------------------------------------------------------------------------------------------

EXPECTED = {
    "bfloat16": (torch.bfloat16, None, 2), "float16": (torch.float16, None, 2), "float32": (torch.float32, None, 4),
    "fp8_e4m3": (torch.uint8, E4M3, 1), "fp8_e4m3fnuz": (torch.uint8, E4M3FNUZ, 1), "fp8_e5m2": (torch.uint8, E5M2, 1),
}
COMPUTE_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


@pytest.mark.parametrize("compute", COMPUTE_DTYPES)
@pytest.mark.parametrize("name, canonical", [
    ("bfloat16", "bfloat16"), ("float16", "float16"), ("float32", "float32"), ("fp8", "fp8_e4m3"),
    ("fp8_e4m3", "fp8_e4m3"), ("fp8_e5m2", "fp8_e5m2"), ("fp8_e4m3fnuz", "fp8_e4m3fnuz"),
    ("bf16", "bfloat16"), ("fp16", "float16"), ("half", "float16"), ("fp32", "float32"), ("float", "float32"),
    ("fp8_e4m3fn", "fp8_e4m3"),
])
def test_resolve_names_and_aliases(name: str, canonical: str, compute: torch.dtype) -> None:
    resolved = resolve_kv_cache_dtype(name, compute)
    storage, fp8, nbytes = EXPECTED[canonical]
    assert resolved == KVCacheDtype(name=canonical, storage_dtype=storage, fp8=fp8)
    assert resolved.fp8 is fp8
    assert resolved.is_fp8 == (fp8 is not None)
    assert resolved.bytes_per_element == nbytes


@pytest.mark.parametrize("compute, canonical", [
    (torch.bfloat16, "bfloat16"), (torch.float16, "float16"), (torch.float32, "float32")])
def test_resolve_auto_follows_compute_dtype(compute: torch.dtype, canonical: str) -> None:
    resolved = resolve_kv_cache_dtype("auto", compute)
    assert resolved.name == canonical and resolved.storage_dtype == compute and not resolved.is_fp8
    assert resolved.bytes_per_element == compute.itemsize


def test_every_choice_resolves() -> None:
    assert KV_CACHE_DTYPE_CHOICES == ("auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2",
                                      "fp8_e4m3fnuz", "int8_per_token_head", "int4_per_token_head", "int4_per_group32",
                                      "fp4_e2m1")
    names = {resolve_kv_cache_dtype(c, torch.bfloat16).name for c in KV_CACHE_DTYPE_CHOICES}
    # (the integer caches: tests/quant/test_int_kv.py; group-scaled: tests/quant/test_fp4_kv.py,
    # tests/quant/test_int4_group_kv.py)
    assert names == set(EXPECTED) | {"int8_per_token_head", "int4_per_token_head", "int4_per_group32", "fp4_e2m1"}


@pytest.mark.parametrize("bad", ["xyz", "FP8", "fp8_e4m3 ", "INT8", "int2", "", "float64", None,
                                 torch.float8_e4m3fn])
def test_resolve_rejects_unknown_names_listing_the_choices(bad: object) -> None:
    with pytest.raises(ValueError) as info:
        resolve_kv_cache_dtype(bad, torch.bfloat16)  # type: ignore[arg-type]
    message = str(info.value)
    assert message.startswith(f"kv_cache_dtype={bad!r} is not supported; choose one of: auto, bfloat16, float16, "
                              "float32, fp8, fp8_e4m3, fp8_e5m2, fp8_e4m3fnuz, int8_per_token_head, "
                              "int4_per_token_head, int4_per_group32, fp4_e2m1")


@pytest.mark.parametrize("compute", [torch.float64, torch.int8, torch.float8_e4m3fn])
def test_resolve_rejects_unsupported_compute_dtype(compute: torch.dtype) -> None:
    with pytest.raises(ValueError, match="compute_dtype="):
        resolve_kv_cache_dtype("auto", compute)


def test_kv_cache_dtype_validates_consistency() -> None:
    with pytest.raises(ValueError, match="not canonical"):
        KVCacheDtype(name="fp8", storage_dtype=torch.uint8, fp8=E4M3)
    with pytest.raises(ValueError, match="storage_dtype"):
        KVCacheDtype(name="fp8_e4m3", storage_dtype=torch.float8_e4m3fn, fp8=E4M3)
    with pytest.raises(ValueError, match="fp8="):
        KVCacheDtype(name="fp8_e5m2", storage_dtype=torch.uint8, fp8=E4M3)
    with pytest.raises(ValueError, match="storage_dtype"):
        KVCacheDtype(name="bfloat16", storage_dtype=torch.float16, fp8=None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        resolve_kv_cache_dtype("fp8", torch.float16).name = "float16"  # type: ignore[misc]
