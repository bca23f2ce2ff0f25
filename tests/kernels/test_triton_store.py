"""kv8.kernels.triton.store (quantize-on-store) against the reference store, byte for byte.

The oracle is :meth:`kv8.cache.paged_cache.PagedKVCache.store` (through :meth:`KVCodec.encode` and
:func:`kv8.quant.formats.quantize`), always computed on the CPU. Without CUDA the kernels run in Triton's interpreter
on CPU tensors (``TRITON_INTERPRET=1``, set by ``tests/conftest.py`` before any kernel is decorated); with CUDA and no
``TRITON_INTERPRET`` they run compiled on CUDA tensors. The device parameter is the one this process can run.

Each test fills both caches with the same sentinel bytes first, so a byte written where the reference writes none
(a skipped slot, a padded head or channel) fails too. int8 caches (``int8_per_token_head``: int8 codes, dynamic
scales) and int4 caches (``int4_per_token_head``: two codes per byte) are checked the same way, with rows built to
hit every rounding tie of their codes. What the interpreter
cannot show (numpy divides exactly where Triton's ``/`` would be an approximate ``div.full.f32`` on a GPU; that
int8's rounding survives compilation as two IEEE adds) is checked on the PTX of the kernel compiled for sm_90,
which needs no GPU.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import triton
from triton.runtime.jit import JITFunction

import kv8.kernels.triton.interpreter as triton_interpreter
import kv8.kernels.triton.store as triton_store
from kv8.cache.codec import KVCodec
from kv8.cache.paged_cache import CacheShape, PagedKVCache
from kv8.quant.formats import (
    E4M3,
    FP8_FORMATS,
    INT4,
    INT8,
    CodeFormat,
    FP8Format,
    IntFormat,
    pack_int4,
    quantize,
    resolve_kv_cache_dtype,
)
from kv8.quant.fp4 import FP4_E2M1
from kv8.quant.int4_group import INT4_G32
from kv8.quant.scales import KVScales, ScaleGranularity
from tests.helpers.triton import DEVICES
from tests.helpers.triton import INTERPRETED as INTERPRET

store_kv = triton_store.store_kv
device_param = pytest.mark.parametrize("device", DEVICES)
FORMATS = list(FP8_FORMATS.values())   # every kv8 format: the kernels' constants are derived from each
fmt_param = pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.name)
code_fmt_param = pytest.mark.parametrize("fmt", [*FORMATS, INT8, INT4], ids=lambda f: f.name)   # dynamic scales
int_fmt_param = pytest.mark.parametrize("fmt", [INT8, INT4], ids=lambda f: f.name)
INPUT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# a valid FP8 format (AMD's E5M2FNUZ) whose 5-bit exponent is not IEEE's: the kernels' bit decode cannot build it
E5M2FNUZ = FP8Format(name="fp8_e5m2fnuz", exponent_bits=5, mantissa_bits=2, exponent_bias=16, max_finite=57344.0,
                     min_subnormal=2.0 ** -17, torch_dtype=torch.float8_e5m2fnuz, has_negative_zero=False,
                     has_inf=False, nan_codes=(0x80,), nan_code=0x80)
in_dtype_param = pytest.mark.parametrize("in_dtype", INPUT_DTYPES, ids=lambda d: str(d).removeprefix("torch."))

# numpy's warnings from the interpreter's float32 ops (inf/NaN lanes, later saturated or selected away)
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning:triton.runtime.interpreter")


def test_kernels_run_where_this_process_can_run_them() -> None:
    assert triton_interpreter.INTERPRETED == INTERPRET
    assert isinstance(triton_store._store_kv_kernel, JITFunction) != INTERPRET   # decided with the kernels
    assert INTERPRET or torch.cuda.is_available()


# ----------------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------------

def make_cache(kv_name: str, *, heads: int, dim: int, blocks: int, block_size: int = 16, dynamic: bool = False,
               scales: KVScales | None = None) -> PagedKVCache:
    """A one-layer cache whose bytes (and token scales) are a sentinel pattern."""
    kv_dtype = resolve_kv_cache_dtype(kv_name, torch.bfloat16)
    if kv_dtype.is_fp8 and not dynamic and scales is None:
        scales = KVScales.default(1)
    codec = KVCodec.build(kv_dtype, dim, scale_mode="dynamic" if dynamic else "static", scales=scales)
    cache = PagedKVCache(CacheShape(1, blocks, heads, block_size, dim), codec)
    for codes in (cache.k_data, cache.v_data):
        codes.view(torch.uint8).fill_(0xA5)
    for ts in (cache.k_token_scales, cache.v_token_scales):
        if ts is not None:
            ts.view(torch.int32).fill_(0x7FA5A5A5)   # a NaN pattern no scale can be
    return cache


def clone_cache(cache: PagedKVCache) -> PagedKVCache:
    other = PagedKVCache(cache.shape, cache.codec)
    for dst, src in zip(other.tensors, cache.tensors, strict=True):
        dst.copy_(src)
    return other


def kernel_store(cache: PagedKVCache, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
                 device: str) -> None:
    """store_kv into ``cache`` (layer 0), run on ``device`` with copies of the cache tensors."""
    moved = [t.to(device) for t in cache.tensors]   # K codes, V codes[, K token scales, V token scales]
    kwargs: dict[str, torch.Tensor] = {}
    if len(moved) == 4:
        kwargs = dict(k_token_scales=moved[2][0], v_token_scales=moved[3][0])
    elif cache.scales is not None:
        k_scale, v_scale = cache.layer_scales(0)  # type: ignore[misc]
        kwargs = dict(k_scale=k_scale.to(device), v_scale=v_scale.to(device))
    store_kv(key.to(device), value.to(device), moved[0][0], moved[1][0], slots.to(device), fp8=cache.kv_dtype.codes,
             **kwargs)
    for dst, src in zip(cache.tensors, moved, strict=True):
        dst.copy_(src.cpu())


def reference_store(cache: PagedKVCache, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor) -> None:
    keep = slots >= 0
    cache.store(0, key[keep], value[keep], slots[keep])


def assert_same_bits(want: torch.Tensor, got: torch.Tensor, what: str, nan_payloads: bool = True) -> None:
    """Bit patterns equal; with ``nan_payloads=False`` two NaNs match whatever their bits (16/32-bit casts)."""
    assert want.shape == got.shape and want.dtype == got.dtype
    int_dtype = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[want.element_size()]
    same = want.view(int_dtype) == got.view(int_dtype)
    if not nan_payloads and want.dtype.is_floating_point:
        same |= torch.isnan(want) & torch.isnan(got)
    bad = (~same).nonzero()
    assert bad.shape[0] == 0, (f"{what}: {bad.shape[0]} of {same.numel()} differ, first at {bad[:4].tolist()}: "
                               f"want {[want[tuple(i)].item() for i in bad[:4]]} got "
                               f"{[got[tuple(i)].item() for i in bad[:4]]}")


def assert_stores_like_reference(cache: PagedKVCache, key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor,
                                 device: str) -> None:
    want, got = clone_cache(cache), clone_cache(cache)
    reference_store(want, key, value, slots)
    kernel_store(got, key, value, slots, device)
    float_cache = not cache.kv_dtype.is_quantized
    for which, a, b in (("K", want.k_data, got.k_data), ("V", want.v_data, got.v_data)):
        assert_same_bits(a, b, f"{cache.kv_dtype.name} cache {which} bytes", nan_payloads=not float_cache)
    for a, b in zip(want.tensors[2:], got.tensors[2:], strict=True):
        assert_same_bits(a, b, "token scales")


def f32(bits: list[int] | np.ndarray) -> np.ndarray:
    return np.asarray(bits, dtype=np.uint32).view(np.float32)


def as_tokens(x: np.ndarray | torch.Tensor, heads: int, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A flat sweep as ``[T, heads, dim]`` in ``dtype``, padded with copies of its first values."""
    flat = torch.as_tensor(np.asarray(x, dtype=np.float32)) if isinstance(x, np.ndarray) else x
    per_token = heads * dim
    tokens = -(-flat.numel() // per_token)
    flat = torch.cat([flat, flat[: tokens * per_token - flat.numel()]]) if tokens * per_token > flat.numel() else flat
    return flat.reshape(tokens, heads, dim).to(dtype)


def sweep_values() -> np.ndarray:
    """Every value of the three FP8 formats and every midpoint between neighbours, each with its float32
    neighbours, both signs; the subnormal/underflow edge, saturation (max + half an ulp, huge, float32 max, inf),
    float32 subnormals, ±0 and NaNs of both signs with several payloads."""
    parts = []
    for fmt in FORMATS:
        vals = np.unique(np.abs(np.nan_to_num(np.array(fmt.values()), nan=0.0, posinf=0.0, neginf=0.0)))
        mids = (vals[:-1] + vals[1:]) / 2                    # exact in float32: one more significant bit
        top = vals[-1] - vals[-2]
        edge = [fmt.max_finite + top / 2, fmt.max_finite + top, 2 * fmt.max_finite, fmt.min_subnormal / 2,
                fmt.min_subnormal / 4, fmt.min_subnormal * 0.75, fmt.min_subnormal * 1.5]
        parts += [vals, mids, np.array(edge)]
    base = np.concatenate(parts).astype(np.float32)
    big = np.array([1e30, np.finfo(np.float32).max, np.finfo(np.float32).tiny, 1e-40, 1e-45], dtype=np.float32)
    base = np.concatenate([base, big])
    with np.errstate(over="ignore"):
        near = np.concatenate([base, np.nextafter(base, np.float32(np.inf)), np.nextafter(base, np.float32(-np.inf))])
    specials = np.concatenate([np.array([np.inf, -np.inf, 0.0, -0.0], dtype=np.float32),
                               f32([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FFFFFFF, 0xFFFFFFFF])])
    return np.concatenate([near, -near, specials])


# ----------------------------------------------------------------------------------------------------------------
# FP8 codes: every rounding boundary
# ----------------------------------------------------------------------------------------------------------------

@device_param
@fmt_param
@in_dtype_param
def test_boundary_sweep_is_bit_exact(device: str, fmt: FP8Format, in_dtype: torch.dtype) -> None:
    """Scale 1: the codes are encode(x) itself, at and around every value and tie of all three formats."""
    x = sweep_values()
    assert x.size > 4000
    key = as_tokens(x, 8, 128, in_dtype)
    value = as_tokens(x[::-1].copy(), 8, 128, in_dtype)
    t = key.shape[0]
    cache = make_cache(fmt.name, heads=8, dim=128, blocks=1, block_size=t)
    assert_stores_like_reference(cache, key, value, torch.arange(t), device)
    # and independently of the store: the codes at their slots are quantize(x, 1.0)
    got = clone_cache(cache)
    kernel_store(got, key, value, torch.arange(t), device)
    codes = got.layer(0)[0][0].transpose(0, 1)                              # [T, H, D]
    assert torch.equal(codes, quantize(key, 1.0, fmt))


@device_param
@fmt_param
def test_random_float32_bits_are_bit_exact(device: str, fmt: FP8Format) -> None:
    """Random bit patterns over the whole float32 range and log-uniform values over the format's range."""
    rng = np.random.default_rng(7)
    bits = rng.integers(0, 2 ** 32, size=16384, dtype=np.uint64).astype(np.uint32)
    exps = rng.uniform(math.log2(fmt.min_subnormal) - 3, math.log2(fmt.max_finite) + 2, size=16384)
    dense = (rng.choice(np.array([-1.0, 1.0]), size=exps.size) * np.exp2(exps)).astype(np.float32)
    key, value = as_tokens(f32(bits), 8, 128, torch.float32), as_tokens(dense, 8, 128, torch.float32)
    cache = make_cache(fmt.name, heads=8, dim=128, blocks=1, block_size=key.shape[0])
    assert_stores_like_reference(cache, key, value, torch.arange(key.shape[0]), device)


@device_param
@fmt_param
def test_every_16_bit_input_is_bit_exact(device: str, fmt: FP8Format) -> None:
    """Every bf16 pattern, then every fp16 pattern, as keys and values (reversed), with non-trivial scales per head."""
    patterns = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16)
    bf16 = patterns.view(torch.bfloat16).reshape(64, 8, 128)
    fp16 = patterns.view(torch.float16).reshape(64, 8, 128)
    per_head = torch.tensor([1.0, 0.37, 3.0, 1e-3, 2.0 ** -20, 5e3, 0.1, 7.0]).reshape(1, 8, 1)
    scales = KVScales(k=per_head, v=per_head.flip(1), granularity=ScaleGranularity.HEAD, source="test", made_for=None)
    cache = make_cache(fmt.name, heads=8, dim=128, blocks=4, scales=scales)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    assert_stores_like_reference(cache, bf16, bf16.flip(0), slots, device)
    assert_stores_like_reference(cache, fp16, fp16.flip(0), slots, device)


# ----------------------------------------------------------------------------------------------------------------
# static scales
# ----------------------------------------------------------------------------------------------------------------

def layer_scales(granularity: ScaleGranularity, heads: int, dim: int, seed: int) -> KVScales:
    """Scales spread over four decades (and one subnormal-producing extreme value for channel scales)."""
    g = torch.Generator().manual_seed(seed)
    shape = {ScaleGranularity.TENSOR: (1, 1, 1), ScaleGranularity.HEAD: (1, heads, 1),
             ScaleGranularity.CHANNEL: (1, heads, dim)}[granularity]
    k = torch.exp(torch.empty(shape).uniform_(-5, 4, generator=g))
    v = torch.exp(torch.empty(shape).uniform_(-5, 4, generator=g))
    if granularity is ScaleGranularity.CHANNEL:
        k[0, 0, 0] = 3e38
        v[0, -1, -1] = 1e-30
    return KVScales(k=k, v=v, granularity=granularity, source="test", made_for=None)


@device_param
@fmt_param
@pytest.mark.parametrize("granularity", list(ScaleGranularity), ids=lambda g: g.value)
@in_dtype_param
def test_static_scales_of_each_granularity(device: str, fmt: FP8Format, granularity: ScaleGranularity,
                                           in_dtype: torch.dtype) -> None:
    heads, dim, blocks = 2, 96, 6
    seed = 10 * FORMATS.index(fmt) + list(ScaleGranularity).index(granularity)
    scales = layer_scales(granularity, heads, dim, seed)
    cache = make_cache(fmt.name, heads=heads, dim=dim, blocks=blocks, scales=scales)
    g = torch.Generator().manual_seed(3)
    t = 13
    key = (torch.randn(t, heads, dim, generator=g) * torch.exp(torch.randn(t, heads, 1, generator=g) * 3))
    value = torch.randn(t, heads, dim, generator=g) * 1e-3
    key[0, 0, :8] = torch.tensor([0.0, -0.0, math.inf, -math.inf, math.nan, -math.nan, 1e38, -1e-39])
    slots = torch.randperm(blocks * 16, generator=g)[:t]
    assert_stores_like_reference(cache, key.to(in_dtype), value.to(in_dtype), slots, device)


@device_param
def test_static_scale_of_shape_1_by_d(device: str) -> None:
    """[1, D] broadcasts too (KVScales has no such granularity; the kernel takes any [H, D]-broadcastable scale)."""
    heads, dim = 2, 64
    g = torch.Generator().manual_seed(5)
    key, value = torch.randn(5, heads, dim, generator=g) * 50, torch.randn(5, heads, dim, generator=g)
    k_scale = torch.exp(torch.randn(1, dim, generator=g))
    v_scale = torch.exp(torch.randn(dim, generator=g))                         # 1-D: [D]
    k_cache = torch.zeros(2, heads, 16, dim, dtype=torch.uint8)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([3, 17, 0, 31, 8])
    k_cache_d, v_cache_d = k_cache.to(device), v_cache.to(device)
    store_kv(key.to(device), value.to(device), k_cache_d, v_cache_d, slots.to(device), fp8=E4M3,
             k_scale=k_scale.to(device), v_scale=v_scale.to(device))
    got_k, got_v = k_cache_d.cpu(), v_cache_d.cpu()
    blocks, offsets = slots // 16, slots % 16
    assert torch.equal(got_k[blocks, :, offsets], quantize(key, k_scale, E4M3))
    assert torch.equal(got_v[blocks, :, offsets], quantize(value, v_scale, E4M3))
    assert int(got_k.count_nonzero()) == int(quantize(key, k_scale, E4M3).count_nonzero())


# ----------------------------------------------------------------------------------------------------------------
# dynamic scales
# ----------------------------------------------------------------------------------------------------------------

def dynamic_rows(fmt: CodeFormat, dim: int, seed: int) -> torch.Tensor:
    """Rows [N, dim] float32 whose amax hits every case of token_scales: zero (±0), float32 subnormal, amax just
    below / at / above max_finite * 2^-126 (a subnormal or the smallest normal scale), ordinary values, float32
    max, ±inf, NaN (with a larger finite value beside it), and random rows."""
    g = torch.Generator().manual_seed(seed)
    edge = fmt.max_finite * 2.0 ** -126
    amaxes = [0.0, 1e-45, 1e-40, 2.0 ** -126, edge, 1e-36, 1.0, 3.14159, fmt.max_finite, 1e4, 3.4028234663852886e38]
    near = np.array(amaxes + [fmt.max_finite * 2.0 ** -127], dtype=np.float32)
    with np.errstate(over="ignore"):
        near = np.unique(np.concatenate([near, np.nextafter(near, np.float32(np.inf)),
                                         np.nextafter(near, np.float32(0))]))
    rows = []
    for a in near.tolist():
        row = torch.rand(dim, generator=g) * a * (torch.randint(0, 2, (dim,), generator=g) * 2 - 1)
        row[int(torch.randint(0, dim, (1,), generator=g))] = -a if len(rows) % 2 else a
        rows.append(row)
    zero = torch.zeros(dim)
    zero[::3] = -0.0
    rows.append(zero)
    for special in (math.inf, -math.inf, math.nan, -math.nan):
        row = torch.randn(dim, generator=g)
        row[1], row[2] = special, 1e30
        rows.append(row)
    rows.append(torch.randn(dim, generator=g) * 1e-20)
    rows += list(torch.randn(12, dim, generator=g) * torch.exp(torch.randn(12, 1, generator=g) * 8))
    return torch.stack(rows)


@device_param
@code_fmt_param
@in_dtype_param
def test_dynamic_scales_codes_and_token_scales(device: str, fmt: CodeFormat, in_dtype: torch.dtype) -> None:
    heads, dim = 8, 96
    rows = dynamic_rows(fmt, dim, seed=11)
    t = -(-rows.shape[0] // heads)
    rows = torch.cat([rows, rows[: t * heads - rows.shape[0]]]).reshape(t, heads, dim)
    cache = make_cache(fmt.name, heads=heads, dim=dim, blocks=4, dynamic=True)
    slots = torch.randperm(4 * 16, generator=torch.Generator().manual_seed(2))[:t]
    slots[1] = -1
    assert_stores_like_reference(cache, rows.to(in_dtype), rows.flip(0).to(in_dtype) * 3, slots, device)


@device_param
@code_fmt_param
def test_dynamic_scale_values_are_codec_token_scales(device: str, fmt: CodeFormat) -> None:
    """The stored scales are KVCodec.token_scales of each (token, head), at the token's slot, exactly."""
    heads, dim = 2, 64
    rows = dynamic_rows(fmt, dim, seed=4)[: 2 * 12].reshape(12, heads, dim)
    cache = make_cache(fmt.name, heads=heads, dim=dim, blocks=2, dynamic=True)
    slots = torch.tensor([5, 16, 0, 31, 7, 9, 30, 1, 2, 17, 18, 4])
    kernel_store(cache, rows, rows * 0.5, slots, device)
    ts = cache.codec.token_scales(rows)                                       # [T, H]
    k_ts, v_ts = cache.layer_token_scales(0)  # type: ignore[misc]
    assert torch.equal(k_ts[slots // 16, :, slots % 16].view(torch.int32), ts.view(torch.int32))
    assert torch.equal(v_ts[slots // 16, :, slots % 16].view(torch.int32),
                       cache.codec.token_scales(rows * 0.5).view(torch.int32))
    assert bool((ts[~torch.isfinite(rows).all(-1)] == 1.0).all())


# ----------------------------------------------------------------------------------------------------------------
# int8 codes: every rounding tie
# ----------------------------------------------------------------------------------------------------------------

def int_tie_rows(fmt: IntFormat, dim: int) -> torch.Tensor:
    """Rows [N, dim] float32 whose scaled values hit every case of the integer format's rounding: each row holds
    ±max * 2^k (max 127 or 7, so its scale is exactly 2^k and ``x / scale`` is exact) beside every multiple of 0.5
    in [-max, max] (the integers and the ties n + 0.5, which round to even) and their float32 neighbours, times
    2^k; k = 0, -3, 7 and -133 (a subnormal scale, where the smallest values lose bits)."""
    top = int(fmt.max_finite)
    grid = np.arange(-2 * top, 2 * top + 1, dtype=np.float32) / 2
    vals = np.concatenate([grid, np.nextafter(grid, np.float32(np.inf)), np.nextafter(grid, np.float32(-np.inf))])
    vals = vals[np.abs(vals) <= top]
    per_row = dim - 1
    vals = np.concatenate([vals, vals[: -vals.size % per_row]]).reshape(-1, per_row)
    peak = np.where(np.arange(vals.shape[0]) % 2 == 0, top, -top).astype(np.float32)[:, None]
    rows = torch.from_numpy(np.concatenate([peak, vals], axis=1))
    return torch.cat([rows * 2.0 ** k for k in (0, -3, 7, -133)])


@device_param
@int_fmt_param
@in_dtype_param
def test_int_ties_round_to_even_and_specials(device: str, fmt: IntFormat, in_dtype: torch.dtype) -> None:
    """Every tie and integer of the int8 (int4) range and its neighbours at four exact scales, then the
    dynamic_rows (zero, subnormal, huge, ±inf and NaN rows: scale 1.0, NaN -> 0, inf -> ±max), as K and V, one
    skipped token; int4's codes packed two per byte."""
    heads, dim = 4, 96
    rows = torch.cat([int_tie_rows(fmt, dim), dynamic_rows(fmt, dim, seed=5)])
    t = -(-rows.shape[0] // heads)
    rows = torch.cat([rows, rows[: t * heads - rows.shape[0]]]).reshape(t, heads, dim)
    cache = make_cache(fmt.name, heads=heads, dim=dim, blocks=-(-t // 16) + 1)
    slots = torch.randperm(cache.shape.num_blocks * 16, generator=torch.Generator().manual_seed(3))[:t]
    slots[2] = -1
    assert_stores_like_reference(cache, rows.to(in_dtype), rows.flip(0).to(in_dtype) * 0.25, slots, device)


@device_param
def test_int8_codes_are_round_half_to_even(device: str) -> None:
    """Independently of the reference: at scale 1 (a row whose largest |x| is 127) the codes of the ties are the
    even neighbours, NaN is 0, inf is 127, and the scale is 1.0."""
    x = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.49999976, -0.0, 0.0, 6.5, 125.5])
    want = torch.tensor([127, 0, 2, 2, 0, -2, -2, 126, -126, 3, 0, 0, 6, 126], dtype=torch.int8)
    special = torch.tensor([math.nan, math.inf, -math.inf, 2.5] + [0.0] * 10)
    cache = make_cache("int8", heads=2, dim=14, blocks=1)
    kernel_store(cache, torch.stack([x, special]).unsqueeze(0), torch.stack([-x, x]).unsqueeze(0),
                 torch.tensor([5]), device)
    k, v = cache.layer(0)
    assert torch.equal(k[0, 0, 5], want) and torch.equal(v[0, 1, 5], want) and torch.equal(v[0, 0, 5], -want)
    assert k[0, 1, 5, :4].tolist() == [0, 127, -127, 2]
    k_ts, v_ts = cache.layer_token_scales(0)  # type: ignore[misc]
    assert k_ts[0, :, 5].tolist() == [1.0, 1.0] and v_ts[0, :, 5].tolist() == [1.0, 1.0]


@device_param
def test_int4_codes_are_packed_low_nibble_first(device: str) -> None:
    """Independently of the reference: at scale 1 (a row whose largest |x| is 7) channel 2j's code is byte j's low
    nibble, 2j + 1's its high one, two's complement; ties round to even, NaN is 0, ±inf ±7; a row of 14 values is 7
    bytes (an odd count of bytes: the last pair of a row padded to BLOCK_D / 2 bytes is not written)."""
    x = torch.tensor([7.0, 1.0, -1.0, 2.5, -7.0, 0.5, 3.5, -3.5, -0.0, 6.5, 1.5, -1.5, -2.5, 5.0])
    codes = [7, 1, -1, 2, -7, 0, 4, -4, 0, 6, 2, -2, -2, 5]
    want = torch.tensor([(a & 0xF) | (b & 0xF) << 4 for a, b in zip(codes[0::2], codes[1::2])], dtype=torch.uint8)
    special = torch.tensor([math.nan, math.inf, -math.inf, 2.5] + [0.0] * 10)
    cache = make_cache("int4", heads=2, dim=14, blocks=1)
    kernel_store(cache, torch.stack([x, special]).unsqueeze(0), torch.stack([-x, x]).unsqueeze(0),
                 torch.tensor([5]), device)
    k, v = cache.layer(0)
    assert k.shape[-1] == 7
    assert torch.equal(k[0, 0, 5], want) and torch.equal(v[0, 1, 5], want)
    assert torch.equal(v[0, 0, 5], pack_int4(-torch.tensor(codes, dtype=torch.int8)))
    assert k[0, 1, 5, :2].tolist() == [(0 | 7 << 4), ((-7 & 0xF) | 2 << 4)]    # NaN, inf | -inf, 2.5 (ts 1.0)
    assert bool((cache.layer(0)[0][0, :, 4] == 0xA5).all())                    # the neighbouring slot untouched


@device_param
@int_fmt_param
def test_int_every_16_bit_input(device: str, fmt: IntFormat) -> None:
    """Every bf16 pattern, then every fp16 pattern, as keys and values (reversed) of an int8 (int4) cache."""
    patterns = torch.arange(-(2 ** 15), 2 ** 15, dtype=torch.int32).to(torch.int16)
    cache = make_cache(fmt.name, heads=8, dim=128, blocks=4)
    slots = torch.randperm(64, generator=torch.Generator().manual_seed(0))
    for dtype in (torch.bfloat16, torch.float16):
        x = patterns.view(dtype).reshape(64, 8, 128)
        assert_stores_like_reference(cache, x, x.flip(0), slots, device)


# ----------------------------------------------------------------------------------------------------------------
# int4 codes with a float16 scale per group of 32 values, in the row
# ----------------------------------------------------------------------------------------------------------------

def group32_rows(dim: int, seed: int) -> torch.Tensor:
    """Rows [N, dim] float32 (dim a multiple of 32) whose groups hit every case of the group scale: a group whose
    largest |x| is 7 * 2^k beside every multiple of 0.5 in [-7, 7] and their neighbours (at the first candidate,
    2^k, every half a rounding tie; the search ends on a refitted scale); amax / 7 a float16 subnormal, below
    float16's smallest subnormal (clamped up), above 65504 (clamped down: the codes saturate), a tie of float16's
    rounding; zero, ±inf and NaN groups (scale 1.0); float32 subnormals; random groups of every magnitude. Groups
    of one row differ (each has its own scale)."""
    g = torch.Generator().manual_seed(seed)
    grid = np.arange(-14, 15, dtype=np.float32) / 2
    ties = np.concatenate([grid, np.nextafter(grid, np.float32(np.inf))])[:31]
    groups = [torch.from_numpy(np.concatenate([[7.0], ties]).astype(np.float32)) * 2.0 ** k for k in (0, -5, 9)]
    for amax in (7 * 2.0 ** -20, 7 * 2.0 ** -26, 7 * 70000.0, 7 * (1 + 2.0 ** -11), 1e-40, 3.4e38):
        row = torch.rand(32, generator=g) * amax
        row[int(torch.randint(0, 32, (1,), generator=g))] = -amax
        groups.append(row)
    zero = torch.zeros(32)
    zero[::3] = -0.0
    groups.append(zero)
    for special in (math.inf, -math.inf, math.nan):
        row = torch.randn(32, generator=g)
        row[4], row[5] = special, 1e30
        groups.append(row)
    groups += list(torch.randn(16, 32, generator=g) * torch.exp(torch.randn(16, 1, generator=g) * 6))
    flat = torch.cat(groups)
    per_row = -(-flat.numel() // dim) * dim
    flat = torch.cat([flat, flat[: per_row - flat.numel()]])
    return flat.reshape(-1, dim)


@device_param
@in_dtype_param
@pytest.mark.parametrize("dim", [32, 96, 128])
def test_group32_codes_and_scales_are_the_codecs(device: str, in_dtype: torch.dtype, dim: int) -> None:
    """int4_per_group32 rows (packed codes, then each group's float16 scale, little-endian) equal KVCodec.encode's
    byte for byte, as K and V (reversed), one skipped token; with D = 96 the tile's fourth group is padding, never
    written."""
    heads = 3
    rows = group32_rows(dim, seed=dim)
    t = -(-rows.shape[0] // heads)
    rows = torch.cat([rows, rows[: t * heads - rows.shape[0]]]).reshape(t, heads, dim)
    cache = make_cache("int4_per_group32", heads=heads, dim=dim, blocks=-(-t // 16) + 1)
    assert cache.k_data.shape[-1] == cache.v_data.shape[-1] == INT4_G32.row_bytes(dim)
    slots = torch.randperm(cache.shape.num_blocks * 16, generator=torch.Generator().manual_seed(4))[:t]
    slots[1] = -1
    assert_stores_like_reference(cache, rows.to(in_dtype), rows.flip(0).to(in_dtype) * 0.5, slots, device)


@device_param
def test_group32_row_layout(device: str) -> None:
    """Independently of the reference: a group of integers whose largest |x| is 7 has scale 1.0 (0x3C00: bytes 00 3C
    after the codes; every code exact, so no later candidate's error is smaller), [16, -14, 0, ..] scale -2.0
    (0xC000: codes -8, 7 are exact, while +2.0 clips 16 to 7 * 2 and every earlier candidate misses), [-16, 14, ..]
    scale 2.0 (0x4000), a zero group 1.0 with zero codes; codes two's complement nibbles, channel 2j low."""
    x = torch.zeros(2, 64)
    x[0, 0], x[0, 1], x[0, 2], x[0, 3] = 7.0, -2.0, 3.0, -7.0
    x[0, 32], x[0, 33] = 16.0, -14.0
    x[1, 0], x[1, 1] = -16.0, 14.0
    cache = make_cache("int4_per_group32", heads=2, dim=64, blocks=1)
    kernel_store(cache, x.reshape(1, 2, 64), torch.zeros(1, 2, 64), torch.tensor([2]), device)
    k, v = cache.layer(0)
    row = k[0, 0, 2]
    assert row[:2].tolist() == [(7 & 0xF) | (-2 & 0xF) << 4, 3 | (-7 & 0xF) << 4] and row[2:16].eq(0).all()
    assert row[16].item() == (-8 & 0xF) | 7 << 4 and row[17:32].eq(0).all()     # 16 / -2, -14 / -2 -> -8, 7
    assert row[32:].tolist() == [0x00, 0x3C, 0x00, 0xC0]
    row = k[0, 1, 2]
    assert row[0].item() == (-8 & 0xF) | 7 << 4 and row[1:32].eq(0).all()      # -16 / 2, 14 / 2 -> -8, 7
    assert row[32:].tolist() == [0x00, 0x40, 0x00, 0x3C]
    assert v[0, :, 2, 32:].eq(torch.tensor([0x00, 0x3C] * 2, dtype=torch.uint8)).all() and v[0, :, 2, :32].eq(0).all()


def group32_search_groups(seed: int) -> torch.Tensor:
    """Groups ``[N, 32]`` float32 that steer the scale search (:mod:`kv8.quant.int4_group`) into each of its
    branches: a positive outlier over small values (the best scale negative: the outlier coded -8) and its mirror;
    Gaussian, uniform and heavy-tailed groups (clipping the largest value, the refit); ties -- 32 equal values,
    one nonzero value (its -8 candidate exact), integers up to 7 (the first candidate exact, every later one tied or
    worse), halves (round-half-even ties at scale 1); amax / c below float16's smallest subnormal (clamped up, codes
    0), float16 subnormal scales, float32 subnormals, amax past 65504 * 8.75 (clamped down, codes saturated); zero
    (±0), NaN, ±inf and mixed non-finite groups."""
    g = torch.Generator().manual_seed(seed)
    groups: list[torch.Tensor] = []
    for sign in (1.0, -1.0):
        for spread in (0.1, 0.3, 0.5):
            row = torch.randn(32, generator=g) * spread
            row[int(torch.randint(0, 32, (1,), generator=g))] = 2.0 * sign
            groups.append(row)
    for k in (-12, -3, 0, 4, 11):
        groups.append(torch.randn(32, generator=g) * 2.0 ** k)
        groups.append((torch.rand(32, generator=g) * 2 - 1) * 2.0 ** k)
        groups.append(torch.randn(32, generator=g) ** 3 * 2.0 ** k)
    for v in (1.0, -1.0, 0.1, 7.0, -3e-3, 2.0 ** -20):
        groups.append(torch.full((32,), v))
    for v in (3.0, -3.0, 1e-3, -65504.0 * 9, 2.0 ** -30):
        row = torch.zeros(32)
        row[int(torch.randint(0, 32, (1,), generator=g))] = v
        groups.append(row)
    groups.append(torch.arange(32, dtype=torch.float32).remainder(15) - 7)
    groups.append(torch.arange(32, dtype=torch.float32).remainder(16) / 2 - 4)
    for amax in (2.0 ** -30, 1e-40, 3e-6, 2.0 ** -20, 3e-5, 65504.0 * 9, 1e30):
        row = (torch.rand(32, generator=g) * 2 - 1) * amax
        row[int(torch.randint(0, 32, (1,), generator=g))] = amax
        groups.append(row)
    zero = torch.zeros(32)
    zero[1::2] = -0.0
    groups.append(zero)
    for specials in ((math.nan,), (math.inf,), (-math.inf,), (math.inf, -math.inf), (math.nan, math.inf)):
        row = torch.randn(32, generator=g) * 9
        row[: len(specials)] = torch.tensor(specials)
        groups.append(row.roll(int(torch.randint(0, 32, (1,), generator=g))))
    return torch.stack(groups)


def test_group32_search_groups_reach_every_branch() -> None:
    """The groups of :func:`group32_search_groups`, encoded by the reference, do reach what they aim at (so that the
    byte-for-byte test below is not vacuous): negative scales, code -8, clipped values, refitted scales (not one of
    the 16 candidates), tied errors kept by the first candidate, clamped and float16-subnormal scales, scale 1.0 for
    the non-finite and zero groups."""
    x = group32_search_groups(seed=5)
    rows = INT4_G32.encode(x)
    codes, scales = INT4_G32.split(rows, 32)
    s = scales.to(torch.float32)[:, 0]
    amax = x.abs().amax(dim=-1)
    finite = torch.isfinite(amax) & (amax > 0)
    cands = torch.stack([INT4_G32.encode_scale(amax / torch.tensor(7.0 + 0.25 * k)).to(torch.float32)
                         for k in range(8)], dim=-1)
    refit = finite & ~((cands == s[:, None]) | (cands == -s[:, None])).any(dim=-1)
    assert int((s < 0).sum()) >= 5 and int((codes == -8).sum()) >= 10
    assert INT4_G32.clipped(x[finite], rows[finite]) >= 3
    assert int(refit.sum()) >= 3
    assert int((s.abs() == 2.0 ** -24).sum()) >= 2 and int((s.abs() == 65504.0).sum()) >= 2
    assert int(((s.abs() < 2.0 ** -14) & (s.abs() > 2.0 ** -24)).sum()) >= 1
    assert bool((s[~finite] == 1.0).all()) and int((~finite).sum()) == 6
    sevens = torch.full((1, 32), 7.0)
    assert INT4_G32.split(INT4_G32.encode(sevens), 32)[1].item() == 1.0   # tied at 0 with -0.875 (c = 8): first kept


@device_param
@in_dtype_param
@pytest.mark.parametrize("dim", [32, 64, 96, 256])
def test_group32_search_is_int4_g32_encode(device: str, in_dtype: torch.dtype, dim: int) -> None:
    """Every group of :func:`group32_search_groups` (and its negation, as the values), stored by the kernel, reads
    back byte for byte as :meth:`INT4_G32.encode` of the same ``in_dtype`` values: codes and float16 scales."""
    heads = 2
    flat = group32_search_groups(seed=dim).flatten()
    per_token = heads * dim
    t = -(-flat.numel() // per_token)
    flat = torch.cat([flat, flat[: t * per_token - flat.numel()]])
    key = flat.reshape(t, heads, dim).to(in_dtype)
    value = -key
    cache = torch.full((-(-t // 16), heads, 16, INT4_G32.row_bytes(dim)), 0xA5, dtype=torch.uint8)
    v_cache = cache.clone()
    slots = torch.arange(t, dtype=torch.int64)
    k_dev, v_dev = cache.to(device), v_cache.to(device)
    store_kv(key.to(device), value.to(device), k_dev, v_dev, slots.to(device), fp8=INT4_G32)
    for x, got in ((key, k_dev), (value, v_dev)):
        rows = got.cpu().permute(0, 2, 1, 3).reshape(-1, heads, INT4_G32.row_bytes(dim))[:t]
        assert_same_bits(INT4_G32.encode(x), rows, f"int4_g32 rows, D={dim}, {in_dtype}")


@device_param
def test_group32_takes_no_scales_and_whole_groups(device: str) -> None:
    key = torch.zeros(3, 2, 64, device=device)
    cache = torch.zeros(4, 2, 16, INT4_G32.row_bytes(64), dtype=torch.uint8, device=device)
    args = dict(key=key, value=key.clone(), k_cache=cache, v_cache=cache.clone(),
                slot_mapping=torch.arange(3, device=device), fp8=INT4_G32)
    store_kv(**args)
    ts = torch.ones(4, 2, 16, device=device)
    with pytest.raises(ValueError, match=r"an int4_g32 cache keeps a scale per group of 32 values in each row; it "
                                         r"takes no k_token_scales, v_token_scales"):
        store_kv(**{**args, "k_token_scales": ts, "v_token_scales": ts})
    narrow = torch.zeros(4, 2, 16, 32, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match=r"W=36 \(D / 2 bytes of codes, 2 per group's scale\)"):
        store_kv(**{**args, "k_cache": narrow, "v_cache": narrow.clone()})
    odd = torch.zeros(3, 2, 48, device=device)
    with pytest.raises(ValueError, match=r"an int4_g32 cache has a scale per group of 32 values: key/value need a "
                                         r"head dim that is a multiple of 32"):
        store_kv(**{**args, "key": odd, "value": odd.clone()})


# ----------------------------------------------------------------------------------------------------------------
# fp4_e2m1: E2M1 codes with an E4M3 scale per group of 16 values, in the row
# ----------------------------------------------------------------------------------------------------------------

def fp4_groups(seed: int) -> list[torch.Tensor]:
    """Groups of 16 float32 values, the one that sets the group's amax first, that hit every case of
    :meth:`FP4GroupFormat.encode`: amax 6 (scale 1.0, exact) beside every multiple of 0.25 in [-6, 6] -- the grid
    values and every midpoint, ties to the even code -- and their float32 neighbours, also times 2^-5 and 2^3;
    amax / 6 a tie of E4M3's rounding (6 * 1.0625: the scale rounds down to 1.0, the largest values saturate), an
    E4M3 subnormal scale, below E4M3's smallest subnormal (clamped up to 2^-9), past 448 (clamped down: the codes
    saturate); amax a float32 subnormal whose quotient by 6 underflows to 0 (scale 1.0) or does not (clamped up);
    zero groups (±0: code 8), NaN (-> +0) and ±inf (-> ±6) groups (scale 1.0); random groups of every magnitude."""
    g = torch.Generator().manual_seed(seed)
    grid = np.arange(-24, 25, dtype=np.float32) / 4
    vals = np.concatenate([grid, np.nextafter(grid, np.float32(np.inf)), np.nextafter(grid, np.float32(-np.inf))])
    vals = vals[np.abs(vals) <= 6]
    vals = np.concatenate([vals, vals[: -vals.size % 15]]).reshape(-1, 15)
    groups = [torch.cat([torch.tensor([6.0 if i % 2 else -6.0]), torch.from_numpy(v)]) * 2.0 ** k
              for k in (0, -5, 3) for i, v in enumerate(vals)]
    for amax in (6 * 1.0625, 6 * 1.0625 * (1 + 2.0 ** -20), 6 * 3 * 2.0 ** -9, 6 * 2.0 ** -7, 1e-4, 6 * 500.0, 1e30,
                 3 * 2.0 ** -149, 4 * 2.0 ** -149, 1e-40):
        row = (torch.rand(16, generator=g) * 2 - 1) * amax
        row[0] = amax
        groups.append(row)
    zero = torch.zeros(16)
    zero[1::2] = -0.0
    groups.append(zero)
    for specials in ((math.nan,), (math.inf,), (-math.inf,), (math.inf, -math.inf), (-math.nan, 5.0)):
        row = torch.randn(16, generator=g) * 3
        row[: len(specials)] = torch.tensor(specials)
        groups.append(row)
    groups += list(torch.randn(24, 16, generator=g) * torch.exp(torch.randn(24, 1, generator=g) * 6))
    return groups


def fp4_rows(dim: int, seed: int) -> torch.Tensor:
    """Rows ``[N, dim]`` (``dim`` even) made of :func:`fp4_groups`: each of a row's groups (16 values, the last one
    ``dim % 16`` when shorter) takes the next group's first values, so every designed group keeps its amax."""
    groups = fp4_groups(seed)
    sizes = [16] * (dim // 16) + ([dim % 16] if dim % 16 else [])
    rows = []
    for r in range(-(-len(groups) // len(sizes))):
        rows.append(torch.cat([groups[(r * len(sizes) + i) % len(groups)][:n] for i, n in enumerate(sizes)]))
    return torch.stack(rows)


def test_fp4_groups_reach_every_case() -> None:
    """The groups of :func:`fp4_groups`, encoded by the reference, reach what they aim at (so that the
    byte-for-byte tests below are not vacuous): every code, saturated values, scales clamped to 2^-9 and to 448,
    E4M3 subnormal scales, scale 1.0 for the zero, NaN and inf groups and for an amax whose quotient underflows."""
    x = torch.stack(fp4_groups(seed=3))
    codes, scales = FP4_E2M1.split(FP4_E2M1.encode(x), 16)
    s = FP4_E2M1.decode_scale(scales)[:, 0]
    assert set(codes.unique().tolist()) == set(range(16))
    finite = torch.isfinite(x).all(-1)
    assert FP4_E2M1.clipped(x[finite], FP4_E2M1.encode(x[finite])) >= 16   # the groups past 6 * 448
    tie = x.abs().amax(-1) == 6 * 1.0625                                    # its scale rounds down to 1.0: 6.375 -> 6
    assert float(s[tie]) == 1.0 and float(FP4_E2M1.decode(FP4_E2M1.encode(x[tie]), 16).abs().max()) == 6.0
    assert {2.0 ** -9, 448.0} <= set(s.tolist()) and bool(((s < 2.0 ** -6) & (s > 2.0 ** -9)).any())
    assert int((s[~finite] == 1.0).sum()) == 5 and float(s[x.abs().amax(-1) == 3 * 2.0 ** -149]) == 1.0


@device_param
@in_dtype_param
@pytest.mark.parametrize("dim", [8, 16, 40, 64, 96, 128])
def test_fp4_codes_and_scales_are_the_codecs(device: str, in_dtype: torch.dtype, dim: int) -> None:
    """fp4_e2m1 rows (packed E2M1 codes, then each group's E4M3 scale code) equal KVCodec.encode's byte for byte, as
    K and V (reversed), one skipped token; D = 8 and 40 end in a short group (8 values), D = 8 with a tile of 16."""
    heads = 3
    rows = fp4_rows(dim, seed=dim)
    t = -(-rows.shape[0] // heads)
    rows = torch.cat([rows, rows[: t * heads - rows.shape[0]]]).reshape(t, heads, dim)
    cache = make_cache("fp4_e2m1", heads=heads, dim=dim, blocks=-(-t // 16) + 1)
    assert cache.k_data.shape[-1] == cache.v_data.shape[-1] == FP4_E2M1.row_bytes(dim)
    slots = torch.randperm(cache.shape.num_blocks * 16, generator=torch.Generator().manual_seed(4))[:t]
    slots[1] = -1
    assert_stores_like_reference(cache, rows.to(in_dtype), rows.flip(0).to(in_dtype) * 0.5, slots, device)


@device_param
def test_fp4_row_layout(device: str) -> None:
    """Independently of the reference, D = 20 (a group of 16, one of 4): a group whose amax is 6 has scale 1.0 (E4M3
    0x38) and its codes are the grid's nearest, ties to the even code (1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 ->
    4, 0.25 -> 0, 0.75 -> 1), -0.0 and -0.1 code 8; the short group [NaN, inf, -inf, 1] scale 1.0, NaN +0, inf ±6;
    a group of zeros and -0.0 scale 1.0; [3e-3, 0, 0, 0] scale 2^-9 (0x01, clamped up: 3e-3 / 6 is below it), code
    1.5 (3); E2M1 codes channel 2j in the low nibble, the scale codes after the 10 code bytes."""
    g0 = [6.0, -0.5, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 0.25, 0.75, -0.0, -0.1, 2.75, -6.0, 1.0, 0.0]
    c0 = [7, 9, 2, 4, 4, 6, 6, 14, 0, 2, 8, 8, 5, 15, 2, 0]
    x = torch.zeros(2, 20)
    x[0] = torch.tensor(g0 + [math.nan, math.inf, -math.inf, 1.0])
    x[1, 1:16:2] = -0.0
    x[1, 16] = 3e-3
    codes = [c0 + [0, 7, 15, 2], [0, 8] * 8 + [3, 0, 0, 0]]
    want = [[a | b << 4 for a, b in zip(c[0::2], c[1::2])] for c in codes]
    cache = make_cache("fp4_e2m1", heads=2, dim=20, blocks=1)
    kernel_store(cache, x.reshape(1, 2, 20), -x.reshape(1, 2, 20), torch.tensor([2]), device)
    k, v = cache.layer(0)
    assert k.shape[-1] == 10 + 2
    assert k[0, 0, 2].tolist() == want[0] + [0x38, 0x38]
    assert k[0, 1, 2].tolist() == want[1] + [0x38, 0x01]
    # V = -K: every code's sign bit flips (-(-0.0) is code 0, -(0.0) code 8), but NaN's (+0 whatever its sign)
    neg = [[c ^ 8 if not (r == 0 and i == 16) else c for i, c in enumerate(cs)] for r, cs in enumerate(codes)]
    assert [v[0, r, 2].tolist() for r in (0, 1)] == [
        [a | b << 4 for a, b in zip(c[0::2], c[1::2])] + [0x38, sc] for c, sc in zip(neg, (0x38, 0x01))]
    assert bool((k[0, :, 1] == 0xA5).all()) and bool((k[0, :, 3] == 0xA5).all())   # the neighbouring slots


@device_param
def test_fp4_takes_no_scales_and_even_head_dims(device: str) -> None:
    key = torch.zeros(3, 2, 40, device=device)
    cache = torch.zeros(4, 2, 16, FP4_E2M1.row_bytes(40), dtype=torch.uint8, device=device)
    args = dict(key=key, value=key.clone(), k_cache=cache, v_cache=cache.clone(),
                slot_mapping=torch.arange(3, device=device), fp8=FP4_E2M1)
    store_kv(**args)
    ts = torch.ones(4, 2, 16, device=device)
    with pytest.raises(ValueError, match=r"an e2m1 cache keeps a scale per group of 16 values in each row; it "
                                         r"takes no k_token_scales, v_token_scales"):
        store_kv(**{**args, "k_token_scales": ts, "v_token_scales": ts})
    narrow = torch.zeros(4, 2, 16, 20, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match=r"W=23 \(D / 2 bytes of codes, 1 per group's scale\)"):
        store_kv(**{**args, "k_cache": narrow, "v_cache": narrow.clone()})
    odd = torch.zeros(3, 2, 39, device=device)
    with pytest.raises(ValueError, match=r"an e2m1 cache packs two codes per byte: key/value need an even head dim"):
        store_kv(**{**args, "key": odd, "value": odd.clone()})


# ----------------------------------------------------------------------------------------------------------------
# 16/32-bit caches
# ----------------------------------------------------------------------------------------------------------------

def cast_sweep() -> np.ndarray:
    """float32 values at and around every rounding boundary of bf16 and fp16: exact ties (RNE), their float32
    neighbours, subnormals, the fp16 overflow edge (65520 rounds to inf), random bit patterns, ±0, ±inf, NaN."""
    rng = np.random.default_rng(3)
    hi = rng.integers(0, 2 ** 16, size=4096, dtype=np.uint64).astype(np.uint32) << 16
    bf16_ties = np.concatenate([hi | 0x8000, hi | 0x8001, hi | 0x7FFF, hi | 0x18000]).astype(np.uint32)
    fp16 = np.arange(0, 0x7C00, dtype=np.uint16).view(np.float16).astype(np.float64)
    fp16_ties = ((fp16[:-1] + fp16[1:]) / 2).astype(np.float32)
    fp16_ties = np.concatenate([fp16_ties[:1024], fp16_ties[1024::5]])     # all subnormal ties, a fifth of the rest
    edge = np.array([65504.0, 65519.996, 65520.0, 65536.0, 2.0 ** -25, 2.0 ** -24, 3 * 2.0 ** -26], dtype=np.float32)
    base = np.concatenate([f32(bf16_ties), fp16_ties, edge,
                           f32(rng.integers(0, 2 ** 32, size=8192, dtype=np.uint64).astype(np.uint32))])
    base = base[~np.isnan(base)]
    with np.errstate(over="ignore"):
        near = np.concatenate([base, np.nextafter(base, np.float32(np.inf)), np.nextafter(base, np.float32(-np.inf))])
    specials = np.concatenate([np.array([0.0, -0.0, np.inf, -np.inf, 1e-45, -1e-40], dtype=np.float32),
                               f32([0x7FC00000, 0xFFC00000, 0x7F800001])])
    return np.concatenate([near, -near[::7], specials])


@device_param
@pytest.mark.parametrize("kv_name", ["bfloat16", "float16", "float32"])
@in_dtype_param
def test_float_caches_are_a_round_to_nearest_even_cast(device: str, kv_name: str, in_dtype: torch.dtype) -> None:
    x = cast_sweep()
    key = as_tokens(x, 8, 128, in_dtype)
    value = as_tokens(np.roll(x, 12345), 8, 128, in_dtype)
    t = key.shape[0]
    cache = make_cache(kv_name, heads=8, dim=128, blocks=-(-t // 16))
    slots = torch.randperm(cache.shape.num_blocks * 16, generator=torch.Generator().manual_seed(1))[:t]
    assert_stores_like_reference(cache, key, value, slots, device)


# ----------------------------------------------------------------------------------------------------------------
# layout: slots, shapes, strides
# ----------------------------------------------------------------------------------------------------------------

@device_param
@pytest.mark.parametrize("heads", [1, 2, 8])
@pytest.mark.parametrize("dim", [64, 96, 128, 256])
def test_shapes_scattered_slots_and_skipped_tokens(device: str, heads: int, dim: int) -> None:
    """21 tokens (not a multiple of block_size 16) scattered over 5 blocks, 3 of them skipped (slot -1)."""
    g = torch.Generator().manual_seed(heads * 1000 + dim)
    t, blocks = 21, 5
    key = torch.randn(t, heads, dim, generator=g).to(torch.bfloat16) * 30
    value = torch.randn(t, heads, dim, generator=g).to(torch.bfloat16)
    slots = torch.randperm(blocks * 16, generator=g)[:t]
    slots[torch.tensor([0, 7, 20])] = -1
    kv_name, dynamic = [("fp8_e4m3", True), ("fp8_e5m2", False), ("fp8_e4m3fnuz", True)][(heads + dim) % 3]
    assert_stores_like_reference(make_cache(kv_name, heads=heads, dim=dim, blocks=blocks, dynamic=dynamic),
                                 key, value, slots, device)


@device_param
@pytest.mark.parametrize(("heads", "dim"), [(3, 96), (24, 256)])
def test_padded_heads_and_heads_split_over_programs(device: str, heads: int, dim: int) -> None:
    """H not a power of two (masked head lanes), and H * D over one tile (24 x 256: two programs per token, the
    second half masked), with dynamic scales (FP8, int8 and int4) and with channel scales."""
    assert triton.next_power_of_2(heads) * dim > 4096 or heads & (heads - 1)
    g = torch.Generator().manual_seed(heads)
    t = 5
    key = torch.randn(t, heads, dim, generator=g) * 40
    value = torch.randn(t, heads, dim, generator=g)
    slots = torch.tensor([17, 2, -1, 31, 16])
    assert_stores_like_reference(make_cache("fp8_e4m3", heads=heads, dim=dim, blocks=2, dynamic=True),
                                 key, value, slots, device)
    assert_stores_like_reference(make_cache("int8", heads=heads, dim=dim, blocks=2), key, value, slots, device)
    assert_stores_like_reference(make_cache("int4", heads=heads, dim=dim, blocks=2), key, value, slots, device)
    scales = layer_scales(ScaleGranularity.CHANNEL, heads, dim, seed=heads)
    assert_stores_like_reference(make_cache("fp8_e5m2", heads=heads, dim=dim, blocks=2, scales=scales),
                                 key, value, slots, device)


@device_param
def test_negative_slots_leave_every_byte_untouched(device: str) -> None:
    cache = make_cache("fp8_e4m3", heads=2, dim=64, blocks=2, dynamic=True)
    before = clone_cache(cache)
    key = torch.randn(6, 2, 64)
    kernel_store(cache, key, key, torch.full((6,), -1), device)
    for now, then in zip(cache.tensors, before.tensors, strict=True):
        assert torch.equal(now.view(torch.uint8), then.view(torch.uint8))
    bf16 = make_cache("bfloat16", heads=2, dim=64, blocks=2)
    snapshot = [t.clone() for t in bf16.tensors]
    kernel_store(bf16, key, key, torch.tensor([-1, -5, 3, -1, -1, -2]), device)
    for codes, old in zip(bf16.tensors, snapshot, strict=True):
        changed = (codes.view(torch.int16) != old.view(torch.int16)).nonzero()
        assert {tuple(r[[1, 3]].tolist()) for r in changed} <= {(0, 3)}     # only slot 3's rows
        assert torch.equal(codes[0, 0, :, 3], key[2].to(torch.bfloat16))


@device_param
def test_strided_inputs_block_size_and_empty_batch(device: str) -> None:
    """key/value as column slices of a fused qkv tensor (row stride 3 * H * D), block_size 8, then T = 0."""
    heads, dim, t = 2, 96, 11
    qkv = torch.randn(t, heads, 3 * dim, generator=torch.Generator().manual_seed(9)) * 20
    key, value = qkv[:, :, dim:2 * dim], qkv[:, :, 2 * dim:]
    assert not key.is_contiguous() and key.stride(-1) == 1
    cache = make_cache("fp8_e5m2", heads=heads, dim=dim, blocks=3, block_size=8, dynamic=True)
    assert_stores_like_reference(cache, key, value, torch.tensor([23, 0, 8, 7, 15, 16, 1, 9, 22, 2, 3]), device)
    before = clone_cache(cache)
    kernel_store(cache, key[:0], value[:0], torch.zeros(0, dtype=torch.int64), device)
    for now, then in zip(cache.tensors, before.tensors, strict=True):
        assert torch.equal(now.view(torch.uint8), then.view(torch.uint8))


# ----------------------------------------------------------------------------------------------------------------
# the compiled kernel (no GPU needed: Triton compiles for sm_90 with its bundled ptxas)
# ----------------------------------------------------------------------------------------------------------------

_COMPILE_SCRIPT = r"""
import json, os, re, sys
os.environ.pop("TRITON_INTERPRET", None)
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import kv8.kernels.triton.store as store
from kv8.kernels.triton.formats import kernel_format
from kv8.quant.formats import FP8_FORMATS, INT4, INT8
from kv8.quant.fp4 import FP4_E2M1
from kv8.quant.int4_group import INT4_G32
fn = store._store_kv_kernel
float_ptr = {0: "*fp32", 1: "*fp16", 2: "*bf16"}
out = []
for mode, fmt, kind_in, kind_out in json.loads(sys.argv[1]):
    fmt = None if fmt is None else kernel_format({**FP8_FORMATS, "int8": INT8, "int4": INT4, "int4_g32": INT4_G32,
                                                  "fp4": FP4_E2M1}[fmt])
    consts = dict(MODE=mode, FMT=fmt, IN=kind_in, OUT=kind_out, BLOCK_H=4, BLOCK_D=128, V_MODE=mode, V_FMT=fmt,
                  V_OUT=kind_out)   # one format: V's constexprs are K's
    sig = {}
    for name in fn.arg_names:
        if name in consts:
            sig[name] = "constexpr"
        elif name in ("key_ptr", "value_ptr"):
            sig[name] = float_ptr[kind_in]
        elif name in ("k_cache_ptr", "v_cache_ptr"):
            sig[name] = ("*i8" if fmt.int_codes and not fmt.packed else "*u8") if mode else float_ptr[kind_out]
        elif name == "slot_ptr":
            sig[name] = "*i64"
        elif name.endswith("_ptr"):
            sig[name] = "*fp32"
        elif name == "max_finite":
            sig[name] = "fp32"
        else:
            sig[name] = "i64" if name.endswith("cb") else "i32"
    kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, **store._compile_options(mode, mode)})
    ptx = kernel.asm["ptx"]
    out.append(dict(ops=sorted(set(re.findall(r"\b(?:div|rcp|cvt|fma|mul)\.[a-z0-9.]+", ptx))), ftz=".ftz" in ptx,
                    cubin=len(kernel.asm["cubin"]),
                    magic=sorted(set(re.findall(r"\badd(?:\.rn)?\.f32\s+%r\d+, %r\d+, (0f[4C]B400000);", ptx)))))
print(json.dumps(out))
"""


def test_compiles_for_sm90_with_exact_float_ops(tmp_path) -> None:
    """Compiled (not interpreted) for an H100: the only float division is div.rn.f32 (IEEE, subnormals kept; never
    div.full/approx), nothing flushes to zero, no hardware fp8 conversion, the 16-bit casts are cvt.rn; int8 codes
    (the int8 and int4 formats) round by adding and subtracting 1.5 * 2^23 (both adds kept, not folded away). The
    group store's search (int4_g32) multiplies only with mul.rn.f32 (compiled without FP fusion: no FMA, and
    ptxas may not contract a .rn multiply into one). fp4_e2m1's store divides (div.rn) and decodes its E4M3 scale
    by bits: a half widened (cvt.f32.f16) after one exact multiply by 2^8 (mul.rn.f16), no other float op."""
    pytest.importorskip("triton.backends.nvidia")
    variants = [(1, "fp8_e4m3", 2, 0), (2, "fp8_e4m3fnuz", 1, 0), (2, "fp8_e5m2", 0, 0), (0, None, 0, 2),
                (0, None, 2, 1), (2, "int8", 2, 0), (2, "int8", 0, 0), (2, "int4", 2, 0),
                (2, "int4", 1, 0), (3, "int4_g32", 2, 0), (3, "fp4", 2, 0), (3, "fp4", 0, 0)]   # MODE, FMT, IN, OUT
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(variants)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    for (mode, fmt, kind_in, kind_out), result in zip(variants, results):
        ops = set(result["ops"])
        assert result["magic"] == (["0f4B400000", "0fCB400000"] if fmt in ("int8", "int4", "int4_g32") else []), result
        assert result["cubin"] > 0 and not result["ftz"], result
        inexact = {op for op in ops if op.startswith(("div.full", "div.approx", "rcp"))
                   or op.startswith(("fma", "mul")) and op.endswith(("f32", "f16"))
                   and not (fmt == "int4_g32" and op == "mul.rn.f32") and not (fmt == "fp4" and op == "mul.rn.f16")}
        assert not inexact, ops
        assert ("mul.rn.f32" in ops) == (fmt == "int4_g32"), ops
        assert ("mul.rn.f16" in ops) == (fmt == "fp4"), ops
        assert not {op for op in ops if "e4m3" in op or "e5m2" in op or "satfinite" in op}, ops
        assert ("div.rn.f32" in ops) == (mode != 0), ops
        # fp16 widens exactly, bf16 by its bits; int4_g32's float16 group scales round once (RNE) and widen back;
        # fp4's E4M3 scales are decoded through a half
        assert ("cvt.f32.f16" in ops) == (kind_in == 1 or fmt in ("int4_g32", "fp4")), ops
        assert ("cvt.rn.f16.f32" in ops) == (fmt == "int4_g32" or mode == 0 and kind_out == 1), ops
        assert not {op for op in ops if "bf16" in op}, ops
        if mode == 0 and kind_out == 1:
            assert "cvt.rn.f16.f32" in ops, ops


_GROUP_COMPILE_SCRIPT = r"""
import json, os, re, subprocess, sys, tempfile
os.environ.pop("TRITON_INTERPRET", None)
import torch
from triton.backends.nvidia.compiler import get_ptxas
import kv8.kernels.triton.store as store
from kv8.kernels.triton.formats import kernel_format
from kv8.quant.fp4 import FP4_E2M1
from kv8.quant.int4_group import INT4_G32
from tests.helpers.sm90 import compile_launch
ptxas = get_ptxas(90).path   # the ptxas Triton itself runs for sm_90 (Triton 3.9's PTX 9.4 needs its newer one)
out = []
for name, dtype, heads, dim in json.loads(sys.argv[1]):
    fmt = {"int4_g32": INT4_G32, "fp4": FP4_E2M1}[name]
    key = torch.zeros(32, heads, dim, dtype=getattr(torch, dtype))
    cache = torch.zeros(16, heads, 16, fmt.row_bytes(dim), dtype=torch.uint8)
    slots = torch.arange(32, dtype=torch.int64)
    launch = store.store_launch(key, key.clone(), cache, cache.clone(), slots, slots, slots, slots, slots,
                                (0, 0, 0, 0), (0, 0, 0) * 2, mode=3, fmt=kernel_format(fmt))
    ptx = compile_launch(launch).asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    log = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    assert log.returncode == 0, log.stderr
    out.append(dict(registers=int(re.search(r"Used (\d+) registers", log.stderr).group(1)),
                    spill_bytes=sum(int(x) for x in re.findall(r"(\d+) bytes spill", log.stderr)),
                    fma=len(re.findall(r"\bfma\.", ptx)), mul=sorted(set(re.findall(r"\bmul\.[a-z0-9.]*f32", ptx))),
                    tile=launch.kwargs["BLOCK_H"] * launch.kwargs["BLOCK_D"]))
print(json.dumps(out))
"""


def test_group_store_compiles_for_sm90_without_spills(tmp_path) -> None:
    """The int4_per_group32 and fp4_e2m1 stores as :func:`store_kv` launches them (Llama-3.1-8B's 8 KV heads of
    128, 32 heads, head_dims 96, 256 and 2048; fp4 also 40, a short last group; bf16, float16 and float32 keys),
    compiled for an H100 with Triton's ptxas: no register spills (int4_per_group32's tile is at most 1024
    elements, fp4_e2m1's 4096), no FMA (the launch turns FP fusion off), multiplies ``mul.rn`` (int4_per_group32's;
    fp4_e2m1 multiplies no float32). The figures are printed (``pytest -s``)."""
    pytest.importorskip("triton.backends.nvidia")
    variants = [(fmt, *v) for fmt in ("int4_g32", "fp4") for v in (
        ("bfloat16", 8, 128), ("float32", 8, 128), ("bfloat16", 32, 128), ("float16", 2, 96), ("float32", 8, 256),
        ("bfloat16", 2, 2048))] + [("fp4", "bfloat16", 8, 40)]
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("TRITON_INTERPRET", None)
    run = subprocess.run([sys.executable, "-c", _GROUP_COMPILE_SCRIPT, json.dumps(variants)], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    for variant, fig in zip(variants, json.loads(run.stdout.strip().splitlines()[-1])):
        searched = variant[0] == "int4_g32"
        assert fig["spill_bytes"] == 0 and fig["fma"] == 0, (variant, fig)
        assert fig["mul"] == (["mul.rn.f32"] if searched else []), (variant, fig)
        assert fig["tile"] <= (1024 if searched else 4096) or variant[3] > 1024, (variant, fig)
        print(variant, fig)


# ----------------------------------------------------------------------------------------------------------------
# errors
# ----------------------------------------------------------------------------------------------------------------

def good_args(device: str, fp8: bool = True) -> dict:
    key = torch.zeros(3, 2, 64, device=device)
    cache = torch.zeros(4, 2, 16, 64, dtype=torch.uint8 if fp8 else torch.bfloat16, device=device)
    args = dict(key=key, value=key.clone(), k_cache=cache, v_cache=cache.clone(),
                slot_mapping=torch.arange(3, device=device), fp8=E4M3 if fp8 else None)
    if fp8:
        args.update(k_scale=torch.ones(1, 1, device=device), v_scale=torch.ones(2, 1, device=device))
    return args


def _bad_cases(device: str) -> list[tuple[str, dict, str]]:
    ts = torch.ones(4, 2, 16, device=device)
    meta_key = torch.zeros(3, 2, 64, device="meta")
    return [
        ("key 2-D", dict(key=torch.zeros(3, 64, device=device)), r"key must be a 3-D tensor .* got a .*\[3, 64\]"),
        ("key int", dict(key=torch.zeros(3, 2, 64, dtype=torch.int32, device=device)), r"key must .*bfloat16"),
        ("value shape", dict(value=torch.zeros(3, 2, 32, device=device)), r"value has shape \[3, 2, 32\], key"),
        ("value dtype", dict(value=torch.zeros(3, 2, 64, dtype=torch.float16, device=device)),
         r"value must be a 3-D tensor of dtype torch.float32"),
        ("key strided", dict(key=torch.zeros(3, 2, 128, device=device)[:, :, ::2]), r"key's last dim must be contig"),
        ("cache heads", dict(k_cache=torch.zeros(4, 3, 16, 64, dtype=torch.uint8, device=device)),
         r"\[num_blocks, H=2, block_size, D=64\]"),
        ("v_cache shape", dict(v_cache=torch.zeros(5, 2, 16, 64, dtype=torch.uint8, device=device)),
         r"v_cache \[5, 2, 16, 64\]"),
        ("fp8 cache float", dict(k_cache=torch.zeros(4, 2, 16, 64, device=device)),
         r"k_cache must be a 4-D tensor of dtype torch.uint8"),
        ("v_cache dtype", dict(v_cache=torch.zeros(4, 2, 16, 64, dtype=torch.int8, device=device)),
         r"v_cache must be .*torch.uint8"),
        ("uint8 cache, fp8=None", dict(fp8=None, k_scale=None, v_scale=None),
         r"k_cache must be a 4-D tensor of dtype torch.bfloat16 or torch.float16 or torch.float32"),
        ("slots int32", dict(slot_mapping=torch.arange(3, dtype=torch.int32, device=device)),
         r"slot_mapping must be a 1-D tensor of dtype torch.int64"),
        ("slots length", dict(slot_mapping=torch.arange(4, device=device)), r"slot_mapping has 4 entries for 3 tok"),
        ("no scales", dict(k_scale=None, v_scale=None), r"needs either k_scale and v_scale .* got none"),
        ("one scale", dict(v_scale=None), r"got \['k_scale'\]"),
        ("mixed", dict(k_token_scales=ts), r"got \['k_scale', 'v_scale', 'k_token_scales'\]"),
        ("scale float64", dict(k_scale=torch.ones(1, 1, dtype=torch.float64, device=device)),
         r"k_scale must be a float32 tensor .* got a torch.float64"),
        ("scale shape", dict(v_scale=torch.ones(3, 1, device=device)), r"v_scale of shape \[3, 1\] does not broadcast"),
        ("scale 3-D", dict(k_scale=torch.ones(1, 2, 1, device=device)), r"k_scale of shape \[1, 2, 1\] does not"),
        ("token scales shape", dict(k_scale=None, v_scale=None, k_token_scales=ts,
                                    v_token_scales=torch.ones(4, 2, 8, device=device)),
         r"v_token_scales has shape \[4, 2, 8\], must be \[num_blocks, H, block_size\] = \[4, 2, 16\]"),
        ("token scales dtype", dict(k_scale=None, v_scale=None, k_token_scales=ts.half(), v_token_scales=ts),
         r"k_token_scales must be a 3-D tensor of dtype torch.float32"),
        ("not a format", dict(fp8=SimpleNamespace(name="fp8_e3m4")), r"store_kv: fp8=.* has no exponent_bits"),
        ("layout", dict(fp8=E5M2FNUZ), r"store_kv: fp8 format 'fp8_e5m2fnuz': 5 exponent bits with exponent_bias=16"),
        ("device", dict(k_cache=torch.zeros(4, 2, 16, 64, dtype=torch.uint8, device="meta")),
         rf"k_cache must be .* on {device}; got .* on meta"),
        ("value device", dict(value=meta_key), rf"value must be .* on {device}"),
    ]


BAD_CASES = [name for name, _, _ in _bad_cases("cpu")]


@device_param
def test_good_inputs_pass_validation(device: str) -> None:
    store_kv(**good_args(device))
    store_kv(**good_args(device, fp8=False))


@device_param
@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_inputs_raise_value_errors_that_name_them(device: str, case: str) -> None:
    _, change, message = next(c for c in _bad_cases(device) if c[0] == case)
    with pytest.raises(ValueError, match=message):
        store_kv(**{**good_args(device), **change})


@device_param
def test_scales_for_a_float_cache_and_a_non_tensor_key_are_refused(device: str) -> None:
    with pytest.raises(ValueError, match=r"k_scale, v_scale given for a torch.bfloat16 cache \(fp8=None\)"):
        store_kv(**{**good_args(device, fp8=False), "k_scale": torch.ones(1, 1, device=device),
                    "v_scale": torch.ones(1, 1, device=device)})
    with pytest.raises(ValueError, match=r"key must be a \[T, H, D\] tensor, got a list"):
        store_kv(**{**good_args(device), "key": [1.0]})


@device_param
def test_int8_needs_an_int8_cache_and_token_scales(device: str) -> None:
    key = torch.zeros(3, 2, 64, device=device)
    cache = torch.zeros(4, 2, 16, 64, dtype=torch.int8, device=device)
    ts = torch.ones(4, 2, 16, device=device)
    args = dict(key=key, value=key.clone(), k_cache=cache, v_cache=cache.clone(),
                slot_mapping=torch.arange(3, device=device), fp8=INT8, k_token_scales=ts, v_token_scales=ts.clone())
    store_kv(**args)
    with pytest.raises(ValueError, match=r"k_cache must be a 4-D tensor of dtype torch.int8"):
        store_kv(**{**args, "k_cache": cache.view(torch.uint8)})
    static = dict(k_token_scales=None, v_token_scales=None, k_scale=torch.ones(1, 1, device=device),
                  v_scale=torch.ones(1, 1, device=device))
    with pytest.raises(ValueError, match=r"an int8 cache needs k_token_scales and v_token_scales .*got "
                                         r"\['k_scale', 'v_scale'\]"):
        store_kv(**{**args, **static})
    with pytest.raises(ValueError, match=r"integer format 'int8': bits=7, max_finite=63.0; the Triton kernels read "
                                         r"and write symmetric codes of 8 bits \(one per signed byte"):
        store_kv(**{**args, "fp8": SimpleNamespace(name="int8", bits=7, max_finite=63.0)})


@device_param
def test_int4_needs_rows_of_half_the_head_dim_in_bytes(device: str) -> None:
    key = torch.zeros(3, 2, 64, device=device)
    cache = torch.zeros(4, 2, 16, 32, dtype=torch.uint8, device=device)
    ts = torch.ones(4, 2, 16, device=device)
    args = dict(key=key, value=key.clone(), k_cache=cache, v_cache=cache.clone(),
                slot_mapping=torch.arange(3, device=device), fp8=INT4, k_token_scales=ts, v_token_scales=ts.clone())
    store_kv(**args)
    with pytest.raises(ValueError, match=r"k_cache must be a 4-D tensor of dtype torch.uint8"):
        store_kv(**{**args, "k_cache": cache.view(torch.int8)})
    wide = torch.zeros(4, 2, 16, 64, dtype=torch.uint8, device=device)
    with pytest.raises(ValueError, match=r"must both be \[num_blocks, H=2, block_size, W=32 \(D / 2 bytes\)\]"):
        store_kv(**{**args, "k_cache": wide, "v_cache": wide.clone()})
    odd = torch.zeros(3, 2, 63, device=device)
    with pytest.raises(ValueError, match=r"an int4 cache packs two codes per byte: key/value need an even head dim"):
        store_kv(**{**args, "key": odd, "value": odd.clone()})


def test_cpu_tensors_without_the_interpreter_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(triton_interpreter, "INTERPRETED", False)
    with pytest.raises(ValueError, match="CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1"):
        store_kv(**good_args("cpu"))
