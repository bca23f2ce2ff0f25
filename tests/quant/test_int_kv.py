"""The integer KV caches (``kv_cache_dtype="int8_per_token_head"`` / ``"int4_per_token_head"``, aliases ``int8`` /
``int4``): their codes (:class:`IntFormat` against numpy's round-half-even as the oracle; int4 packed two per byte),
the resolved dtypes, the codec (always a scale per token and KV head, never static scales), the options' checks and
their bytes per token. The fused kernels' store and attention are
checked bit for bit / against the reference in tests/kernels/test_fused_attention.py, the engine's batching,
prefix caching, preemption, sliding windows and tensor parallelism in the engine tests (KV_CONFIGS)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from kv8.cache.budget import KVBudget
from kv8.cache.codec import KVCodec
from kv8.cache.config import CacheConfig
from kv8.quant.formats import (
    INT4,
    INT8,
    IntFormat,
    KVCacheDtype,
    dequantize,
    pack_int4,
    quantize,
    resolve_kv_cache_dtype,
    unpack_int4,
)
from kv8.quant.scales import KVScales

INT8_KV = resolve_kv_cache_dtype("int8", torch.bfloat16)
INT4_KV = resolve_kv_cache_dtype("int4", torch.bfloat16)


def oracle(x: np.ndarray, m: float) -> np.ndarray:
    """clamp(round_half_even(x), -m, m) with NaN -> 0, in numpy."""
    y = np.nan_to_num(x.astype(np.float32), nan=0.0, posinf=m, neginf=-m)
    return np.rint(np.clip(y, -m, m)).astype(np.int8)


@pytest.mark.parametrize("fmt", [INT8, INT4], ids=["int8", "int4"])
def test_encode_matches_the_oracle_on_ties_specials_and_a_dense_sweep(fmt: IntFormat) -> None:
    m = fmt.max_finite
    ties = np.arange(-m - 3, m + 4, dtype=np.float32) + 0.5         # every .5 around and beyond the range
    near = np.nextafter(ties, np.float32(np.inf)), np.nextafter(ties, np.float32(-np.inf))
    specials = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 1e30, -1e30, m - 0.0001, m + 0.5, -m - 0.5,
                         -m - 1, 1e-40], dtype=np.float32)
    sweep = np.random.default_rng(0).uniform(-2.5 * m, 2.5 * m, 100_000).astype(np.float32)
    for x in (ties, *near, specials, sweep):
        got = fmt.encode(torch.from_numpy(x)).numpy()
        np.testing.assert_array_equal(got, oracle(x, m))
    assert fmt.encode(torch.tensor([2.5, 3.5, -2.5])).tolist() == [2, 4, -2]   # ties to even
    assert int(fmt.encode(torch.tensor([-1e9])).item()) == -m                   # -(m + 1) is never written


def test_int4_packs_two_codes_per_byte_low_nibble_first() -> None:
    codes = torch.arange(-8, 8, dtype=torch.int8)
    packed = pack_int4(codes)
    assert packed.dtype == torch.uint8 and packed.tolist() == [0x98, 0xBA, 0xDC, 0xFE, 0x10, 0x32, 0x54, 0x76]
    every = torch.cartesian_prod(codes, codes).to(torch.int8)            # all 256 pairs
    assert torch.equal(unpack_int4(pack_int4(every)), every)
    with pytest.raises(ValueError, match="even last dim"):
        pack_int4(torch.zeros(3, dtype=torch.int8))
    with pytest.raises(ValueError, match="must be uint8"):
        unpack_int4(torch.zeros(2, dtype=torch.int8))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
def test_decode_is_exact_for_every_code(dtype: torch.dtype) -> None:
    codes = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8)
    assert INT8.decode(codes, dtype).tolist() == list(range(-128, 128))
    assert INT8.decode(codes, dtype).dtype == dtype


def test_bad_inputs_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="floating-point"):
        INT8.encode(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="torch.int8"):
        INT8.decode(torch.tensor([1, 2], dtype=torch.uint8))
    with pytest.raises(ValueError, match="8 or 4 bits"):
        IntFormat("int2", 2)


def test_quantize_and_dequantize_take_the_int_format() -> None:
    x = torch.randn(5, 3, 16, generator=torch.Generator().manual_seed(0))
    s = x.abs().amax(-1, keepdim=True) / 127.0
    codes = quantize(x, s, INT8)
    assert codes.dtype == torch.int8 and int(codes.abs().max()) == 127
    back = dequantize(codes, s, INT8)
    assert bool(((back - x).abs() <= s / 2 * (1 + 1e-6)).all())   # within half a step


def test_names_resolve_to_one_dtype_with_per_token_scales() -> None:
    assert resolve_kv_cache_dtype("int8_per_token_head", torch.float32) == INT8_KV
    assert INT8_KV.name == "int8_per_token_head" and INT8_KV.storage_dtype == torch.int8
    assert INT8_KV.codes is INT8 and INT8_KV.is_quantized and INT8_KV.per_token_scales and not INT8_KV.is_fp8
    assert INT8_KV.bytes_per_element == 1
    fp8 = resolve_kv_cache_dtype("fp8", torch.bfloat16)
    assert fp8.codes is fp8.fp8 and fp8.is_quantized and not fp8.per_token_scales
    bf16 = resolve_kv_cache_dtype("auto", torch.bfloat16)
    assert bf16.codes is None and not bf16.is_quantized
    with pytest.raises(ValueError, match="int_codes=None, group=None must be torch.int8"):
        KVCacheDtype("int8_per_token_head", torch.int8, None)
    assert INT4_KV.name == "int4_per_token_head" and INT4_KV.storage_dtype == torch.uint8
    assert INT4_KV.codes is INT4 and INT4_KV.bits_per_value == 4 and INT4_KV.stored_width(64) == 32
    assert INT8_KV.bits_per_value == 8 and INT8_KV.stored_width(64) == 64
    assert resolve_kv_cache_dtype("fp8", torch.bfloat16).stored_width(64) == 64
    with pytest.raises(ValueError, match="int_codes=int4, group=None must be torch.uint8"):
        KVCacheDtype("int4_per_token_head", torch.int8, None, INT4)
    with pytest.raises(ValueError, match="not supported"):
        resolve_kv_cache_dtype("int2", torch.bfloat16)


def test_codec_is_always_dynamic_and_refuses_static_scales() -> None:
    codec = KVCodec.build(INT8_KV, 64)                     # scale_mode "static" by default: int8 is dynamic anyway
    assert codec.dynamic and codec.scales is None
    with pytest.raises(ValueError, match="int8_per_token_head.*computes scales per token"):
        KVCodec.build(INT8_KV, 64, scales=KVScales.default(2))
    assert KVCodec.bytes_per_head(INT8_KV, 64, dynamic=False) == 64 + 4
    assert KVCodec.bytes_per_head(INT8_KV, 64, dynamic=True) == 64 + 4
    assert KVCodec.bytes_per_head(INT4_KV, 64, dynamic=False) == 32 + 4
    with pytest.raises(ValueError, match="even head_dim, not 63"):
        KVCodec.build(INT4_KV, 63)


@pytest.mark.parametrize("kv", [INT8_KV, INT4_KV], ids=["int8", "int4"])
def test_codec_round_trip_is_within_half_a_step_of_each_token_heads_scale(kv: KVCacheDtype) -> None:
    codec = KVCodec.build(kv, 64, rotation="hadamard")
    m = kv.codes.max_finite  # type: ignore[union-attr]
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(40, 3, 64, generator=gen) * torch.exp(torch.randn(40, 3, 1, generator=gen) * 3)
    x[5, 1] = 0.0                                                 # an all-zero vector: scale 1.0, codes 0
    stored, ts = codec.encode(x, 0, 0)
    assert stored.dtype == kv.storage_dtype and stored.shape == (40, 3, kv.stored_width(64))
    assert ts is not None and ts.shape == (40, 3)
    assert float(ts[5, 1]) == 1.0 and int(stored[5, 1].abs().max()) == 0
    torch.testing.assert_close(ts, torch.where(x.abs().amax(-1) > 0, x.abs().amax(-1) / m, 1.0), rtol=0, atol=0)
    back, clipped = codec.round_trip(x, 0, 0)
    assert clipped == 0
    assert bool(((back - x).abs() <= ts.unsqueeze(-1) / 2 * (1 + 1e-6)).all())
    # a non-finite value: the token head's scale is 1.0, finite values saturate, NaN stores 0
    y = torch.zeros(1, 1, 64)
    y[0, 0, :3] = torch.tensor([math.nan, 500.0, -2.6])
    stored, ts = codec.encode(y, 0, 1)
    assert ts is not None and float(ts) == 1.0
    assert codec.decode(stored, 0, 1, torch.float32, ts)[0, 0, :3].tolist() == [0, m, -3]


def _cache(kv: str, **kw) -> CacheConfig:
    return CacheConfig(kv_dtype=resolve_kv_cache_dtype(kv, torch.bfloat16), kv_cache_dtype=kv, **kw)


def test_options_int8_is_dynamic_takes_skip_layers_and_refuses_a_scales_file() -> None:
    assert _cache("int8").dynamic_scales and _cache("int8", kv_cache_scale_mode="dynamic").dynamic_scales
    assert _cache("int8", kv_cache_dtype_skip_layers=(0, "sliding_window")).kv_cache_dtype_skip_layers
    with pytest.raises(ValueError, match="kv_cache_dtype='int8' computes scales per token.*quantization_param_path"):
        _cache("int8", quantization_param_path="scales.json")
    with pytest.raises(ValueError, match="needs an FP8 cache.*int8_per_token_head"):
        _cache("bfloat16", kv_cache_scale_mode="dynamic")


def test_budget_counts_the_codes_and_a_float32_scale_per_token_head() -> None:
    b = KVBudget.build(_cache("int8"), [None] * 4, head_dim=64, kv_heads=2, max_model_len=256,
                       max_num_batched_tokens=256)
    assert b.token_bytes == (2 * 2 * (64 + 4),)
    fp8_dynamic = KVBudget.build(_cache("fp8", kv_cache_scale_mode="dynamic"), [None] * 4, head_dim=64, kv_heads=2,
                                 max_model_len=256, max_num_batched_tokens=256)
    assert b.token_bytes == fp8_dynamic.token_bytes
    b4 = KVBudget.build(_cache("int4"), [None] * 4, head_dim=64, kv_heads=2,
                        max_model_len=256, max_num_batched_tokens=256)
    assert b4.token_bytes == (2 * 2 * (32 + 4),)
