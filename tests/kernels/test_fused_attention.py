"""The fused CPU kernels (kv8.kernels.cpu.attention / csrc/attention/attention.cpp) against the torch reference.

* FP8 decode: both decoders (bits: generic path; bf16 tables: AVX-512 path) equal the format's value table
  for all 256 codes of all three formats, bit for bit (NaN where the table has NaN), also with the calling
  thread's DAZ/FTZ set.
* Store: bit-exact with :meth:`PagedKVCache.store` for every KV dtype, scale granularity (tensor, head,
  channel, dynamic per-token) and input dtype, on random data with special values, and on a dense sweep of
  float32 inputs (every sign/exponent/top-mantissa pattern, every midpoint between FP8 neighbours and its
  float32 neighbours); int4_per_group32's scale search (AVX-512; AVX2 and the scalar reference: portable builds)
  byte for byte with INT4_G32.encode on groups that reach each of its outcomes (negative scales, the code -8,
  clipping, the refit, ties, clamped and subnormal scales, non-finite and zero groups), head_dim 32 / 64 / 96 / 256.
* Attention: equals :func:`paged_attention_reference` over the same stored cache for all 6 KV dtypes x
  granularities, q in bf16 and fp32 (fp16 once), ragged batches mixing decode and chunked prefill over a
  cached prefix, lengths at and across block boundaries (block sizes 16, 8, 32), GQA 1/3/8, head_dim
  64/128/256 (and 80 / 72: tail handling and the generic path), forced context partitions, dynamic scales,
  and the generic (non-AVX-512) build; long prefills in the tile kernel's prefill loop, and scores that move
  its lazy softmax reference over and over; long prefills of the int8 / int4 / FP4 / int4_per_group32 caches on
  the tile kernel's staged bf16 tiles (int4_per_group32's values round to bf16 there: 2^-9 relative, within the
  bf16 output's tolerance; it keeps the generic kernel with fp16 / fp32 compute).

Tolerances (the kernels accumulate in fp32; the fast path carries q and the softmax weights as bf16 hi+lo,
~16 significant bits, except the weights of a bf16 output, which are bf16; int4 per token and head's decode items
carry both as int16 fixed point, summed exactly in int32): with M = 1 + max|ref|,
  fp32 output: |out - ref| <= 5e-5 * M    (observed <= ~1e-5 * M)
  fp16 output: |out - ref| <= 2^-10 * M   (one fp16 ulp at the top of the range)
  bf16 output: |out - ref| <= 2^-7 * M    (one bf16 ulp at the top of the range: both sides round to bf16)
"""

from __future__ import annotations

import ctypes
import dataclasses
import math

import pytest
import torch

from kv8.attention.metadata import AttentionMetadata
from kv8.attention.reference import paged_attention_reference
from kv8.cache.paged_cache import CacheShape, PagedKVCache
from kv8.kernels.cpu import attention as kernels
from kv8.kernels.cpu.abi import check_abi
from kv8.kernels.cpu.attention import KernelUnavailable, paged_attention_fused, store_kv_fused
from kv8.quant.formats import FP8_FORMATS, resolve_kv_cache_dtype
from kv8.quant.int4_group import INT4_G32
from kv8.quant.scales import KVScales
from tests.helpers.kernels import (
    FP4,
    FP8,
    I4G,
    INT4,
    INT8,
    STAGED,
    TOL,
    decode_kernel,
    make_cache,
    make_case,
    make_scales,
    portable_path,
    prefill_kernel,
    random_kv,
    stored,
)

KV_DTYPES = ["fp8_e4m3", "fp8_e4m3fnuz", "fp8_e5m2", "bfloat16", "float16", "float32", INT8, INT4, FP4, I4G]



def attention_path(lib: kernels.KernelLibrary, kv_name: str, q_dtype: torch.dtype, dim: int) -> str:
    """"fast" (an AVX-512 BF16 item kernel serves prefill-sized items), "avx2" or "generic"."""
    kernel = kernels.KernelTesting(lib).item_kernel(kv_name, q_dtype, dim)
    return kernel if kernel in ("generic", "avx2") else "fast"


def uses_decode_kernel(lib: kernels.KernelLibrary, kv_name: str, q_dtype: torch.dtype, dim: int, bs: int,
                       rows: int) -> bool:
    """Whether a decode-item kernel (AMX or AVX-512) serves items of ``rows`` rows."""
    return kernels.KernelTesting(lib).item_kernel(kv_name, q_dtype, dim, bs, rows) in ("decode", "amx_decode")


def check_attention(lib: kernels.KernelLibrary, cache: PagedKVCache, meta: AttentionMetadata, q: torch.Tensor,
                    partition_size: int = 0) -> None:
    scale = q.shape[-1] ** -0.5
    ref = paged_attention_reference(q, cache, 1, meta, scale).float()
    got = paged_attention_fused(lib, q, cache, 1, meta, scale, partition_size)
    assert got.dtype == q.dtype and got.shape == q.shape
    err = (got.float() - ref).abs().max().item()
    bound = TOL[q.dtype] * (1.0 + ref.abs().max().item())
    assert err <= bound, f"max |fused - reference| = {err:.3g} > {bound:.3g}"


# ------------------------------------------------------------------------------------------------
# FP8 decode
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FP8)
@pytest.mark.parametrize("path", ["bits", "tables"])
@pytest.mark.parametrize("flush_denormal", [False, True])
def test_fp8_decode_all_codes(lib: kernels.KernelLibrary, fmt: str, path: str, flush_denormal: bool) -> None:
    codes = torch.arange(256, dtype=torch.uint8)
    if path == "tables" and not lib.has_fast_path:
        with pytest.raises(ValueError, match="not available"):
            kernels.KernelTesting(lib).decode_fp8(fmt, codes, path)
        return
    want = torch.tensor(FP8_FORMATS[fmt].values(), dtype=torch.float32)
    torch.set_flush_denormal(flush_denormal)
    try:
        got = kernels.KernelTesting(lib).decode_fp8(fmt, codes, path)
    finally:
        torch.set_flush_denormal(False)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(got), nan)
    assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32))  # bitwise: -0.0, subnormals


@pytest.mark.parametrize("form,poly", [("bf16", 7.6e-5), ("precise", 2e-7)])
@pytest.mark.parametrize("ref", [0.5, -30.0, 41.0])
def test_softmax_weights_against_exp(lib: kernels.KernelLibrary, form: str, poly: float, ref: float) -> None:
    """The AVX-512 kernels' softmax weights e^(s - ref) (exp2_weights): within their polynomial's relative error
    (degree 3 for weights then rounded to bf16, degree 5 where they keep 16 bits) plus the rounding of
    t = s log2(e) - ref log2(e) (ln 2 x 2^-24 x each term's size), over s - ref in [-86.5, 8] (what the lazy
    reference leaves; with ref = 0.5 the polynomial's error dominates the bound near s = ref); 0 below e^-87
    (never a subnormal), for -inf and for NaN."""
    k = kernels.KernelTesting(lib)
    scores = ref + torch.linspace(-86.5, 8.0, 400_003, dtype=torch.float64)
    scores = scores.float()
    if not lib.has_fast_path:
        with pytest.raises(ValueError, match="AVX-512"):
            k.softmax_weights(scores, ref, form)
        return
    got = k.softmax_weights(scores, ref, form).double()
    x = scores.double() - ref
    want = torch.exp(x)
    log2e = 1.4426950408889634
    bound = poly + math.log(2) * 2.0 ** -24 * (scores.double().abs() * log2e + abs(ref) * log2e + x.abs() * log2e) \
        + 2.0 ** -23
    rel = (got - want).abs() / want
    worst = int(torch.argmax(rel / bound))
    assert bool((rel <= bound).all()), (form, float(x[worst]), float(rel[worst]), float(bound[worst]))
    # below e^-87: zeros, never subnormals; masked lanes (-inf, NaN) weigh 0
    low = ref + torch.tensor([-87.5, -90.0, -120.0, -1e4, float("-inf"), float("nan")])
    assert torch.equal(k.softmax_weights(low.float(), ref, form), torch.zeros(6))
    assert float(got.min()) >= 2.0 ** -126
    with pytest.raises(ValueError, match="form="):
        k.softmax_weights(scores, ref, "fast")


def test_portable_builds_decode_on_bits(portable_lib: kernels.KernelLibrary) -> None:
    """Without AVX-512: the scalar bit decoder, and the AVX2 kernel's 8-lane one where the build has it, give every
    code's value bit for bit (subnormals, -0, NaN) -- with torch's flush-denormal mode on as well."""
    assert not portable_lib.has_fast_path
    paths = ["bits", "avx2"] if portable_lib.has_avx2_path else ["bits"]
    for fmt in FP8:
        want = torch.tensor(FP8_FORMATS[fmt].values(), dtype=torch.float32)
        nan = torch.isnan(want)
        for path in paths:
            for flush in (False, True):
                torch.set_flush_denormal(flush)
                try:
                    got = kernels.KernelTesting(portable_lib).decode_fp8(fmt, torch.arange(256, dtype=torch.uint8),
                                                                         path)
                finally:
                    torch.set_flush_denormal(False)
                assert torch.equal(torch.isnan(got), nan), (fmt, path)
                assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32)), (fmt, path)
    for path in [p for p in ("tables", "avx2") if p not in paths]:
        with pytest.raises(ValueError, match="not available"):
            kernels.KernelTesting(portable_lib).decode_fp8("fp8_e4m3", torch.arange(256, dtype=torch.uint8), path)


# ------------------------------------------------------------------------------------------------
# Store
# ------------------------------------------------------------------------------------------------

def special_values(n: int, fmt_max: float) -> torch.Tensor:
    base = torch.tensor([0.0, -0.0, math.inf, -math.inf, fmt_max, -fmt_max, fmt_max * 1.0001, fmt_max * 2,
                         -fmt_max * 3, 2.0 ** -9, -(2.0 ** -9), 2.0 ** -10, 3 * 2.0 ** -11, 2.0 ** -17, 1.0625, 1e30])
    return base.repeat(n // base.numel() + 1)[:n]


@pytest.mark.parametrize("kv_name,gran", [(k, g) for k in FP8 for g in ("tensor", "head", "channel", "dynamic")]
                         + [(k, "none") for k in ("bfloat16", "float16", "float32")]
                         + [(INT8, "dynamic"), (INT4, "dynamic"), (FP4, "none"), (I4G, "none")])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_store_bit_exact(lib: kernels.KernelLibrary, kv_name: str, gran: str, in_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    heads, dim, bs, tokens = 3, 64, 16, 50
    kv = resolve_kv_cache_dtype(kv_name, torch.bfloat16)
    scales = make_scales(kv_name, gran, 2, heads, dim, gen)
    shape = CacheShape(2, 8, heads, bs, dim)
    ref = make_cache(shape, kv, scales, gran == "dynamic")
    mine = make_cache(shape, kv, scales, gran == "dynamic")
    key, value = random_kv(tokens, heads, dim, gen), random_kv(tokens, heads, dim, gen)
    if kv.codes is not None:  # special values (NaN and inf included) in a few heads of a few tokens
        fmax = kv.codes.max_finite
        key[::7, 0] = special_values(dim, fmax) * (0.01 if gran != "dynamic" else 1.0)
        value[3::5, 1] = special_values(dim, fmax).flip(0) * 0.02
        key[4, 2, 5] = math.nan
        value[9, 0, 0] = -math.nan
        key[11, 1] = 0.0  # an all-zero vector: dynamic scale 1.0
    key, value = key.to(in_dtype), value.to(in_dtype)
    slots = torch.randperm(shape.num_blocks * bs, generator=gen)[:tokens]
    ref.store(1, key, value, slots)
    store_kv_fused(lib, mine, 1, key, value, slots)
    for a, b in zip(stored(ref, 1, slots), stored(mine, 1, slots)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("kv_name", ["fp8_e4m3", INT8, "bfloat16"])
def test_store_skips_negative_slots(lib: kernels.KernelLibrary, kv_name: str) -> None:
    """A negative slot (a decode graph's padded row) stores nothing, as the reference store; a slot past the cache
    is still an error."""
    gen = torch.Generator().manual_seed(3)
    heads, dim, bs = 2, 64, 16
    kv = resolve_kv_cache_dtype(kv_name, torch.bfloat16)
    gran = "none" if kv.codes is None else "dynamic" if kv_name == INT8 else "tensor"
    scales = make_scales(kv_name, gran, 1, heads, dim, gen)
    shape = CacheShape(1, 4, heads, bs, dim)
    ref, mine = (make_cache(shape, kv, scales, gran == "dynamic") for _ in range(2))
    for cache in (ref, mine):   # a sentinel in every byte, so that a stray write shows
        for t in cache.tensors[:2]:
            t.view(torch.uint8).fill_(0xA5)
        for t in cache.tensors[2:]:
            t.view(torch.uint8).fill_(0x5A)
    key, value = random_kv(5, heads, dim, gen), random_kv(5, heads, dim, gen)
    slots = torch.tensor([7, -1, 20, -1, 3])
    before = [t.view(torch.uint8).clone() for t in mine.tensors[:2]]
    ref.store(0, key, value, slots)
    store_kv_fused(lib, mine, 0, key, value, slots)
    assert len(mine.tensors) == len(ref.tensors)
    for got, want in zip(mine.tensors, ref.tensors):
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert all(not torch.equal(t.view(torch.uint8), b) for t, b in zip(mine.tensors, before))
    with pytest.raises(ValueError, match="slot outside the cache"):
        store_kv_fused(lib, mine, 0, key, value, torch.tensor([7, -1, 64, 2, 3]))


@pytest.mark.parametrize("fmt", FP8)
def test_store_dense_fp32_sweep(lib: kernels.KernelLibrary, fmt: str) -> None:
    """Every float32 sign/exponent/7-bit-mantissa prefix with several low parts, plus every midpoint between
    adjacent FP8 values and its float32 neighbours: the kernel's encoder equals the reference's."""
    hi = torch.arange(1 << 16, dtype=torch.int64) << 16
    lows = torch.tensor([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF, 0x4321], dtype=torch.int64)
    pats = (hi.unsqueeze(1) | lows.unsqueeze(0)).reshape(-1)
    x = pats.to(torch.int32).view(torch.float32)
    vals = torch.tensor(FP8_FORMATS[fmt].values(), dtype=torch.float32)
    pos = vals[torch.isfinite(vals) & (vals >= 0)].unique().sort().values
    mid = (pos[1:] + pos[:-1]) / 2
    near = torch.cat([mid, torch.nextafter(mid, torch.tensor(0.0)), torch.nextafter(mid, torch.tensor(math.inf)),
                      pos, pos[-1:] * 1.0625])
    x = torch.cat([x, near, -near])
    dim, heads, bs = 64, 1, 16
    x = torch.cat([x, torch.zeros((-x.numel()) % dim)]).view(-1, heads, dim)
    tokens = x.shape[0]
    kv = resolve_kv_cache_dtype(fmt, torch.float32)
    shape = CacheShape(1, tokens // bs + 1, heads, bs, dim)
    ref, mine = make_cache(shape, kv, KVScales.default(1)), make_cache(shape, kv, KVScales.default(1))
    slots = torch.arange(tokens)
    ref.store(0, x, x, slots)
    store_kv_fused(lib, mine, 0, x, x, slots)
    for a, b in zip(stored(ref, 0, slots), stored(mine, 0, slots)):
        assert torch.equal(a, b)


def int4_group_stress(groups: int, gen: torch.Generator) -> torch.Tensor:
    """``groups`` groups of 32 float32 values ``[groups, 32]`` that exercise int4_per_group32's scale search, in a
    random order: Gaussian groups over 2^-20 .. 2^10; heavy-tailed ones (an outlier 2-6x the rest, which a clipping
    scale serves best); integers -7..8 with an 8 times a power of two (a negative scale is exact: codes -8..7); equal
    values and groups of one nonzero value (ties between a candidate and its negative); amax so small that the
    scales clamp to 2^-24 or are float16 subnormals, float32 subnormals; so large that they clamp to 65504 or the
    squared errors overflow to inf; groups with a NaN, an infinity or only zeros (either sign)."""
    def normal(n: int) -> torch.Tensor:
        return torch.randn(n, 32, generator=gen)

    def uniform(n: int, lo: float, hi: float) -> torch.Tensor:
        return torch.empty(n, 1).uniform_(lo, hi, generator=gen)

    def one_at(n: int, v: torch.Tensor) -> torch.Tensor:
        x = torch.zeros(n, 32)
        x[torch.arange(n), torch.randint(0, 32, (n,), generator=gen)] = v.flatten()
        return x

    def heavy(n: int) -> torch.Tensor:
        x = normal(n)
        outlier = x.abs().amax(-1, keepdim=True) * uniform(n, 1.0, 5.0) * torch.randn(n, 1, generator=gen).sign()
        return x + one_at(n, outlier)

    def integers(n: int) -> torch.Tensor:
        x = torch.randint(-7, 9, (n, 32), generator=gen).float()
        x[:, 0] = 8.0
        return x * torch.exp2(torch.randint(-6, 6, (n, 1), generator=gen).float())

    nan_group = normal(1) * 3
    nan_group[0, 5] = math.nan
    makers = [
        lambda n: normal(n) * torch.exp2(uniform(n, -20.0, 10.0)),
        heavy,
        integers,
        lambda n: torch.ones(n, 32) * torch.randn(n, 1, generator=gen) * torch.exp2(uniform(n, -8.0, 8.0)),
        lambda n: one_at(n, torch.randn(n, 1, generator=gen) * torch.exp2(uniform(n, -8.0, 8.0))),
        lambda n: normal(n) * torch.exp2(uniform(n, -40.0, -24.0)),          # scales clamped to 2^-24
        lambda n: normal(n) * torch.exp2(uniform(n, -24.0, -14.0)),          # float16 subnormal scales
        lambda n: normal(n) * 1e-40,                                          # float32 subnormal values
        lambda n: normal(n) * torch.exp2(uniform(n, 19.0, 40.0)),            # scales clamped to 65504
        lambda n: normal(n) * 1e37,                                           # squared errors overflow
        lambda n: torch.cat([nan_group, normal(1).abs() * math.inf, -torch.ones(1, 32) / 0.0, torch.zeros(1, 32),
                             -torch.zeros(1, 32), normal(1).clamp(-1, 1) * math.inf])[torch.arange(n) % 6],
    ]
    per = -(-groups // len(makers))
    x = torch.cat([make(per) for make in makers])
    return x[torch.randperm(x.shape[0], generator=gen)[:groups]]


def int4_group_coverage(x: torch.Tensor) -> set[str]:
    """Which of the scale search's outcomes occur among groups ``x`` ``[N, 32]`` (their float dtype) as
    INT4_G32.encode stores them."""
    codes, scales = INT4_G32.group_codes(x)
    codes, scales = codes.view(-1, 32).float(), scales.flatten().float()
    g = x.float().view(-1, 32)
    amax = g.abs().amax(-1)
    ok = torch.isfinite(amax) & (amax > 0)
    first = (amax / 7.0).clamp(2.0 ** -24, 65504.0).half().float()
    cands = torch.stack([(amax / (7.0 + 0.25 * k)).clamp(2.0 ** -24, 65504.0).half().float() for k in range(8)], -1)
    gf = torch.where(ok.unsqueeze(-1), g, torch.zeros_like(g))
    errs = torch.stack([INT4_G32._quantize(gf, sign * cands[:, k])[1] for k in range(8) for sign in (1, -1)], -1)
    found = {
        "negative": bool((scales < 0).any()),
        "code -8": bool((codes == -8).any()),
        "clipped": bool(((g / scales.unsqueeze(-1) > 7.5) | (g / scales.unsqueeze(-1) < -8.5))[ok].any()),
        "not amax / 7": bool((scales[ok] != first[ok]).any()),
        "refit": bool((ok & ~(scales.abs().unsqueeze(-1) == cands).any(-1)).any()),
        "tie": bool((ok & ((errs == errs.amin(-1, keepdim=True)).sum(-1) > 1)).any()),
        "2^-24": bool((scales == 2.0 ** -24).any()),
        "subnormal": bool(((scales.abs() < 2.0 ** -14) & (scales.abs() > 2.0 ** -24)).any()),
        "65504": bool((scales.abs() == 65504.0).any()),
        "not finite or zero": bool((~ok).any()),
    }
    return {name for name, hit in found.items() if hit}


def int4_group_outcomes(in_dtype: torch.dtype) -> set[str]:
    """The outcomes of int4_group_coverage that int4_group_stress groups in ``in_dtype`` reach (float16 reaches no
    scale clamped to 65504: its largest finite value is 65504)."""
    every = {"negative", "code -8", "clipped", "not amax / 7", "refit", "tie", "2^-24", "subnormal", "65504",
             "not finite or zero"}
    return every - {"65504"} if in_dtype == torch.float16 else every


def check_int4_group_store(lib: kernels.KernelLibrary, dim: int, in_dtype: torch.dtype, seed: int) -> set[str]:
    """Stores int4_group_stress rows (3 heads of head_dim ``dim``, 128 tokens; V the rows reversed and negated) with
    the fused store and compares every byte with INT4_G32.encode; returns int4_group_coverage of the K rows."""
    gen = torch.Generator().manual_seed(seed)
    heads, tokens, bs = 3, 128, 16
    key = int4_group_stress(tokens * heads * dim // 32, gen).view(tokens, heads, dim).to(in_dtype)
    value = -key.flip(0)
    shape = CacheShape(1, tokens // bs + 1, heads, bs, dim)
    cache = make_cache(shape, resolve_kv_cache_dtype(I4G, torch.bfloat16), None)
    slots = torch.randperm(shape.num_blocks * bs, generator=gen)[:tokens]
    store_kv_fused(lib, cache, 0, key, value, slots)
    for got, x in zip(stored(cache, 0, slots), (key, value)):
        want = INT4_G32.encode(x)
        bad = (got != want).any(-1).nonzero().tolist()
        assert not bad, f"{len(bad)} rows differ from INT4_G32.encode, first (token, head) {bad[0]}"
    return int4_group_coverage(key.view(-1, 32))


@pytest.mark.parametrize("dim", [32, 64, 96, 256])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_store_int4_group_search(lib: kernels.KernelLibrary, dim: int, in_dtype: torch.dtype) -> None:
    """int4_per_group32's store (the AVX-512 search where the build has it) equals INT4_G32.encode byte for byte on
    groups that reach every outcome of the scale search: a negative scale, the code -8, a clipped largest value, the
    least-squares refit, ties, clamped and subnormal scales, and the groups that get scale 1.0."""
    found = check_int4_group_store(lib, dim, in_dtype, seed=dim)
    assert int4_group_outcomes(in_dtype) <= found


@pytest.mark.parametrize("dim", [32, 96])
def test_store_int4_group_portable(portable_lib: kernels.KernelLibrary, dim: int) -> None:
    """The encoders of the builds without AVX-512 -- the scalar reference (x86-64-v2) and the AVX2 search
    (x86-64-v3) -- equal INT4_G32.encode byte for byte as well."""
    for in_dtype in (torch.bfloat16, torch.float16, torch.float32):
        assert int4_group_outcomes(in_dtype) <= check_int4_group_store(portable_lib, dim, in_dtype, seed=dim + 1)


# ------------------------------------------------------------------------------------------------
# Attention
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_name,gran", [(k, g) for k in FP8 for g in ("tensor", "head", "channel")]
                         + [(k, "none") for k in ("bfloat16", "float16", "float32")]
                         + [(INT8, "dynamic"), (INT4, "dynamic"), (FP4, "none"), (I4G, "none")])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_attention_dtypes_and_scales(lib: kernels.KernelLibrary, kv_name: str, gran: str,
                                     q_dtype: torch.dtype) -> None:
    cache, meta, q = make_case(kv_name, gran, q_dtype)
    fast = kv_name in FP8 + ["bfloat16"] or (kv_name in STAGED and (kv_name != I4G or q_dtype == torch.bfloat16))
    expected = "fast" if fast and lib.has_fast_path else portable_path(lib, 64, kv_name)
    assert attention_path(lib, kv_name, q_dtype, 64) == expected
    check_attention(lib, cache, meta, q)


@pytest.mark.parametrize("group,dim,bs", [(1, 64, 16), (3, 64, 8), (8, 64, 32), (1, 128, 16), (3, 128, 32),
                                          (8, 128, 16), (1, 256, 8), (3, 256, 16), (8, 256, 16)])
@pytest.mark.parametrize("kv_name", ["fp8_e4m3", "bfloat16"])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_attention_shapes(lib: kernels.KernelLibrary, group: int, dim: int, bs: int, kv_name: str,
                          q_dtype: torch.dtype) -> None:
    cache, meta, q = make_case(kv_name, "head", q_dtype, group=group, dim=dim, bs=bs, heads=2,
                               query_lens=[1, 9, 1, 3], seq_lens=[bs, 2 * bs + 3, 5 * bs + 1, 40], seed=group + dim)
    check_attention(lib, cache, meta, q)


@pytest.mark.parametrize("kv_name", ["fp8_e5m2", "bfloat16", "float16", INT8, INT4, FP4])
@pytest.mark.parametrize("dim", [80, 72, 20])
def test_attention_odd_head_dim(lib: kernels.KernelLibrary, kv_name: str, dim: int) -> None:
    """D = 80 takes the fast path with a partial 64-channel chunk (int8 / int4 / FP4: prefill items on staged bf16
    tiles of 40 code bytes a row, the last 16 channels apart); D = 72 (not a multiple of 16) the AVX2 kernel with a
    last 8-channel chunk, D = 20 (not a multiple of 8) the generic (FP4: the generic kernel outside the fast path)."""
    ints = (INT8, INT4)
    cache, meta, q = make_case(kv_name, "dynamic" if kv_name in ints else "channel", torch.float32, dim=dim, heads=2)
    fast = dim == 80 and kv_name != "float16" and lib.has_fast_path
    assert attention_path(lib, kv_name, torch.float32, dim) == ("fast" if fast else portable_path(lib, dim, kv_name))
    check_attention(lib, cache, meta, q)


@pytest.mark.parametrize("dim", [32, 96, 160])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_attention_int4_group_head_dims(lib: kernels.KernelLibrary, dim: int, q_dtype: torch.dtype) -> None:
    """int4_per_group32 at head dims of one, three and five groups, GQA groups of 3, blocks of 8, against the
    reference attention: prefill items on staged bf16 tiles with bf16 compute, the generic kernel with fp32 compute
    (and for every item the decode kernel does not take: these head dims and blocks); a head_dim that is not a
    multiple of 32 is refused by its codec."""
    cache, meta, q = make_case(I4G, "none", q_dtype, dim=dim, heads=2, bs=8, query_lens=[1, 7, 1, 2],
                               seq_lens=[1, 23, 40, 9], seed=dim)
    fast = lib.has_fast_path and q_dtype == torch.bfloat16
    assert attention_path(lib, I4G, q_dtype, dim) == ("fast" if fast else portable_path(lib, dim, I4G))
    check_attention(lib, cache, meta, q)
    check_attention(lib, cache, meta, q, partition_size=16)


@pytest.mark.parametrize("partition", [16, 48, 256])
@pytest.mark.parametrize("kv_name,q_dtype", [("fp8_e4m3", torch.bfloat16), ("fp8_e4m3fnuz", torch.float32),
                                             ("bfloat16", torch.float32), ("float32", torch.bfloat16)])
def test_attention_partitions(lib: kernels.KernelLibrary, partition: int, kv_name: str, q_dtype: torch.dtype) -> None:
    """Forced context splits (combined by log-sum-exp), including partitions a causal row does not reach."""
    cache, meta, q = make_case(kv_name, "head", q_dtype, query_lens=[1, 20, 1], seq_lens=[700, 300, 33])
    check_attention(lib, cache, meta, q, partition_size=partition)


def test_attention_auto_partition_single_sequence(lib: kernels.KernelLibrary) -> None:
    """One long decode sequence: the automatic split across threads gives the reference result."""
    cache, meta, q = make_case("fp8_e4m3", "tensor", torch.bfloat16, query_lens=[1], seq_lens=[3000])
    check_attention(lib, cache, meta, q)


@pytest.mark.parametrize("kv_name", [*FP8, INT8, INT4])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_attention_dynamic_scales(lib: kernels.KernelLibrary, kv_name: str, q_dtype: torch.dtype) -> None:
    cache, meta, q = make_case(kv_name, "dynamic", q_dtype)
    check_attention(lib, cache, meta, q)


@pytest.mark.parametrize("kv_name,gran", [("fp8_e4m3", "channel"), ("fp8_e5m2", "dynamic"),
                                          ("fp8_e4m3fnuz", "head"), ("bfloat16", "none"), (INT8, "dynamic"),
                                          (INT4, "dynamic"), (FP4, "none"), (I4G, "none")])
def test_attention_portable_builds(portable_lib: kernels.KernelLibrary, kv_name: str, gran: str) -> None:
    assert attention_path(portable_lib, kv_name, torch.bfloat16, 64) == portable_path(portable_lib, 64, kv_name)
    for q_dtype in (torch.bfloat16, torch.float32):
        cache, meta, q = make_case(kv_name, gran, q_dtype)
        check_attention(portable_lib, cache, meta, q, partition_size=32)


@pytest.mark.parametrize("kv_name", [INT8, INT4])
@pytest.mark.parametrize("dim", [16, 24, 72, 136])
def test_integer_cache_shapes(portable_lib: kernels.KernelLibrary, kv_name: str, dim: int) -> None:
    """int8 / int4 caches around the AVX2 kernel's int4 decode, 16 channels at a time in a permuted order (16: one
    group; 24, 72, 136: groups and a last 8 channels in natural order): odd token counts across 16-token tiles and
    8-token blocks, every 5th context token stored as all zeros (codes 0; the codec gives such a row scale 1, and a
    zero scale is not a valid cache state: the reference's dequantize rejects it), fp32 and bf16 queries, on both
    portable builds (x86-64-v3: the AVX2 kernel; x86-64-v2: the generic one)."""
    assert attention_path(portable_lib, kv_name, torch.float32, dim) == portable_path(portable_lib, dim)
    seq_lens = [1, 17, 31, 45]
    for q_dtype in (torch.float32, torch.bfloat16):
        cache, meta, q = make_case(kv_name, "dynamic", q_dtype, dim=dim, bs=8, heads=2, query_lens=[1, 3, 1, 7],
                                   seq_lens=seq_lens, seed=dim)
        slots = [int(meta.block_tables[i, pos // 8]) * 8 + pos % 8 for i, n in enumerate(seq_lens)
                 for pos in range(0, n, 5)]
        zeros = torch.zeros(len(slots), 2, dim, dtype=q_dtype)
        cache.store(1, zeros, zeros, torch.tensor(slots, dtype=torch.int64))
        assert all(not codes[1, s // 8, :, s % 8].any() for s in slots for codes in (cache.k_data, cache.v_data))
        check_attention(portable_lib, cache, meta, q, partition_size=16)
        check_attention(portable_lib, cache, meta, q)


@pytest.mark.parametrize("kv_name", ["fp8_e4m3", "fp8_e4m3fnuz"])
@pytest.mark.parametrize("which", ["k", "v"])
def test_nan_code_in_one_tile(portable_lib: kernels.KernelLibrary, kv_name: str, which: str) -> None:
    """One NaN code in a K or V row of an E4M3 cache (the AVX2 kernel reads NaN-free tiles through fp16, where a NaN
    code would read as a finite number): the rows that see it are NaN (a K code: the whole row; a V code: its
    channel), as in the reference, and every other row equals the reference -- decode rows, other sequences, and
    for a K code prefill rows before and after its position (the reference's P.V multiplies a V row's NaN by the
    zero weights of the rows that do not see it, which no kernel does, so V codes are checked on decode rows)."""
    query_lens = [1, 1, 20] if which == "k" else [1, 1, 1]
    cache, meta, q = make_case(kv_name, "head", torch.float32, query_lens=query_lens, seq_lens=[40, 70, 60],
                               seed=3)
    pos, head = 50, 1   # tile 48..63 of sequences 1 and 2 (K: sequence 2's rows at positions >= 50 see it)
    for seq in (1, 2):
        block = int(meta.block_tables[seq, pos // 16])
        cache.layer(1)[0 if which == "k" else 1][block, head, pos % 16, 5] = FP8_FORMATS[kv_name].nan_code
    scale = 64 ** -0.5
    want = paged_attention_reference(q, cache, 1, meta, scale).float()
    got = paged_attention_fused(portable_lib, q, cache, 1, meta, scale, partition_size=32).float()
    nan = torch.isnan(want)
    assert nan.any() and not nan.all()
    assert torch.equal(torch.isnan(got), nan)
    err = (got[~nan] - want[~nan]).abs().max().item()
    assert err <= TOL[torch.float32] * (1.0 + want[~nan].abs().max().item())


def test_attention_with_flush_denormal(lib: kernels.KernelLibrary) -> None:
    """DAZ/FTZ set by the caller (torch.set_flush_denormal) must not zero FP8 subnormals inside the kernel."""
    cache, meta, q = make_case("fp8_e4m3", "tensor", torch.float32)
    torch.set_flush_denormal(True)
    try:
        check_attention(lib, cache, meta, q)
    finally:
        torch.set_flush_denormal(False)


@pytest.mark.slow
@pytest.mark.parametrize("kv_name,gran", [(k, g) for k in FP8 for g in ("tensor", "head", "channel", "dynamic")]
                         + [("bfloat16", "none"), (INT8, "dynamic"), (INT4, "dynamic"), (I4G, "none"), (FP4, "none")])
@pytest.mark.parametrize("group,dim", [(1, 64), (2, 128), (3, 64), (4, 256)])
@pytest.mark.parametrize("bs", [16, 32])
def test_decode_item_kernel(lib: kernels.KernelLibrary, kernel_path: str, kv_name: str, gran: str, group: int,
                            dim: int, bs: int) -> None:
    """The fast path's decode-item kernel (bf16 compute, blocks of a multiple of 16 tokens, items of <= 4 rows
    = query heads per KV head x query tokens) serves every item of these batches (asserted), and equals the
    reference: ragged lengths at and across the 16-token tiles and 64-token softmax chunks, up to 4 query tokens
    per sequence with causal limits, NaN in every slot past the context (never read), automatic and forced
    partitions, including partitions the early query rows of a sequence do not reach."""
    per_seq = 4 // group  # query tokens per sequence that keep items at <= 4 rows
    seq_lens = [1, 15, 16, 17, 63, 64, 65, 129, 300]
    query_lens = [min(1 + i % per_seq, n) for i, n in enumerate(seq_lens)]
    decode_kernel(lib, kv_name, gran, dim, bs, group * per_seq)
    assert not uses_decode_kernel(lib, kv_name, torch.bfloat16, dim, bs, 5)
    assert not uses_decode_kernel(lib, kv_name, torch.float32, dim, bs, group)
    cache, meta, q = make_case(kv_name, gran, torch.bfloat16, group=group, dim=dim, bs=bs, heads=2,
                               query_lens=query_lens, seq_lens=seq_lens, seed=group * dim + bs, poison=True)
    for partition in (0, 16, 48):
        check_attention(lib, cache, meta, q, partition_size=partition)


@pytest.mark.parametrize("heads,group", [(1, 3), (4, 1), (5, 2), (6, 3), (9, 4)])
@pytest.mark.parametrize("kv_name,gran", [("fp8_e4m3", "head"), ("fp8_e5m2", "dynamic"), ("bfloat16", "none"),
                                          (INT8, "dynamic"), (INT4, "dynamic"), (I4G, "none"), (FP4, "none")])
def test_decode_items_of_several_heads(lib: kernels.KernelLibrary, kernel_path: str, heads: int, group: int,
                                       kv_name: str, gran: str) -> None:
    """The AMX decode kernel's items read up to 4 KV heads of a sequence together (6 heads: items of 4 and
    2, 9: 4, 4 and 1), each head with its own K/V scales, queries and output rows, unsplit and split into
    partitions (each head's partial result in its own workspace rows); the AVX-512 kernel's items one head.
    Every head equals the reference (a head mixed up with another, or a partial written over another head's,
    differs by far more than the bound). NaN in every slot past the context."""
    seq_lens = [1, 17, 64, 200, 333]
    cache, meta, q = make_case(kv_name, gran, torch.bfloat16, group=group, heads=heads, query_lens=[1] * 5,
                               seq_lens=seq_lens, seed=heads * 10 + group, poison=True)
    amx = kernel_path == "amx" and kv_name not in (INT4, I4G, FP4)
    assert decode_kernel(lib, kv_name, gran, 64, 16, group) in ("amx_decode" if amx else "decode",
                                                                 portable_path(lib, 64, kv_name))
    for partition in (0, 16, 96):
        check_attention(lib, cache, meta, q, partition_size=partition)


@pytest.mark.parametrize("q_form", ["outlier", "peaked", "zero_row", "nan_row"])
@pytest.mark.parametrize("dim", [64, 256])
def test_int4_decode_fixed_point(lib: kernels.KernelLibrary, q_form: str, dim: int) -> None:
    """int4 per token and head's decode kernel multiplies in integers (fast_simd.h, kv_int_dot: each query row as
    int16 with one scale, each row's softmax weights of a 64-token chunk as int16 with one scale, exact int32 sums):
    equal to the reference where that fixed point is pressed hardest -- one query channel 100x the others (the
    others keep ~2^-9 of their size), scores 8x sharper (weights over many octaves within a chunk), an all-zero
    query row (scale 0: uniform weights). A NaN query row gives NaN in its own output row and nowhere else."""
    decode_kernel(lib, INT4, "dynamic", dim, 16, 3)
    seq_lens = [1, 17, 64, 200, 333]
    cache, meta, q = make_case(INT4, "dynamic", torch.bfloat16, group=3, dim=dim, heads=2, query_lens=[1] * 5,
                               seq_lens=seq_lens, seed=dim, poison=True)
    if q_form == "outlier":
        q[:, :, 5] *= 100
    elif q_form == "peaked":
        q *= 8
    else:
        q[2, 4] = 0.0 if q_form == "zero_row" else float("nan")
    if q_form != "nan_row":
        check_attention(lib, cache, meta, q)
        return
    got = paged_attention_fused(lib, q, cache, 1, meta, dim ** -0.5, 0).float()
    ref = paged_attention_reference(q, cache, 1, meta, dim ** -0.5).float()
    bad = torch.zeros_like(got, dtype=torch.bool)
    bad[2, 4] = True
    assert got[bad].isnan().all() and not got[~bad].isnan().any()
    bound = TOL[torch.bfloat16] * (1.0 + ref[~bad].abs().max().item())
    assert (got[~bad] - ref[~bad]).abs().max().item() <= bound


def test_decode_item_kernel_conditions(lib: kernels.KernelLibrary) -> None:
    """Where the decode-item kernel does not apply, the general fast path serves (tested above)."""
    fast = lib.has_fast_path
    assert uses_decode_kernel(lib, "fp8_e4m3", torch.bfloat16, 64, 16, 3) == fast
    assert uses_decode_kernel(lib, "fp8_e5m2", torch.bfloat16, 128, 48, 4) == fast
    assert uses_decode_kernel(lib, "fp8_e4m3fnuz", torch.bfloat16, 256, 16, 1) == fast
    assert not uses_decode_kernel(lib, "fp8_e4m3", torch.bfloat16, 64, 8, 3)     # blocks of 8 tokens
    assert not uses_decode_kernel(lib, "fp8_e4m3", torch.bfloat16, 80, 16, 3)    # head_dim 80
    assert not uses_decode_kernel(lib, "fp8_e4m3", torch.float16, 64, 16, 3)     # fp16 compute
    assert not uses_decode_kernel(lib, "float16", torch.bfloat16, 64, 16, 3)     # fp16 cache: AVX2 / generic
    assert not uses_decode_kernel(lib, "fp8_e4m3", torch.bfloat16, 64, 16, 16)   # prefill-sized items
    for ints in (INT8, INT4):  # a decode kernel (int8: on AMX tiles where the library has them), else fp32 ones
        assert kernels.KernelTesting(lib).item_kernel(ints, torch.bfloat16, 128, 32, 4) == (
            portable_path(lib, 128) if not fast else "amx_decode" if lib.amx and ints == INT8 else "decode")
        assert not uses_decode_kernel(lib, ints, torch.bfloat16, 64, 8, 3)       # blocks of 8 tokens
        assert not uses_decode_kernel(lib, ints, torch.bfloat16, 80, 16, 3)      # head_dim 80
        assert not uses_decode_kernel(lib, ints, torch.float32, 64, 16, 3)       # fp32 compute
        assert kernels.KernelTesting(lib).item_kernel(ints, torch.float32, 64, 16, 3) == portable_path(lib, 64)
        assert kernels.KernelTesting(lib).item_kernel(ints, torch.bfloat16, 64, 16, 16) == (   # prefill: staged
            portable_path(lib, 64) if not fast else "amx" if lib.amx else "prefill")
    # int4_per_group32 and fp4_e2m1: the AVX-512 decode kernel too (never its AMX form), else the generic kernel
    for group_scaled in (I4G, FP4):
        for dim in (64, 128, 256):
            assert kernels.KernelTesting(lib).item_kernel(group_scaled, torch.bfloat16, dim, 16, 4) == (
                "decode" if fast else "generic")
        assert not uses_decode_kernel(lib, group_scaled, torch.bfloat16, 96, 16, 3)    # head_dim 96
        assert not uses_decode_kernel(lib, group_scaled, torch.bfloat16, 64, 8, 3)     # blocks of 8 tokens
        assert not uses_decode_kernel(lib, group_scaled, torch.float32, 64, 16, 3)     # fp32 compute
        assert kernels.KernelTesting(lib).item_kernel(group_scaled, torch.float32, 64, 16, 3) == "generic"
    # their prefill items staged (int4_per_group32: bf16 compute only; FP4 exact: any compute dtype), the rest generic;
    # with bf16 compute on AMX tiles where the library has them
    amx = fast and lib.amx
    assert kernels.KernelTesting(lib).item_kernel(I4G, torch.bfloat16, 64, 16, 16) == (
        "amx" if amx else "prefill" if fast else "generic")
    assert kernels.KernelTesting(lib).item_kernel(I4G, torch.float32, 64, 16, 16) == "generic"   # staged: bf16 only
    for q_dtype in (torch.bfloat16, torch.float32):
        bf16_amx = amx and q_dtype == torch.bfloat16
        assert kernels.KernelTesting(lib).item_kernel(FP4, q_dtype, 64, 16, 16) == (
            "amx" if bf16_amx else "prefill" if fast else "generic")
        assert kernels.KernelTesting(lib).item_kernel(FP4, q_dtype, 256, 16, 16) == (
            "amx" if bf16_amx else "tile" if fast else "generic")


@pytest.mark.parametrize("group,dim,bs", [(1, 64, 16), (2, 128, 32), (3, 64, 16), (4, 256, 16)])
def test_fp4_decode_special_groups(lib: kernels.KernelLibrary, group: int, dim: int, bs: int) -> None:
    """FP4 decode items in the decode kernel (asserted) over stored groups of every kind the store writes: all zeros
    and NaN (scale 1.0, codes 0), +-inf (scale 1.0, codes +-6), values past 6 x 448 (the scale saturates at 448, the
    codes at 6), values below 6 x 2^-9 (the scale clamps to E4M3's smallest subnormal, 2^-9) and mixed groups, in
    K and V of every 3rd context token, contexts that are not a multiple of 16, GQA groups of 1-4 rows; equal to
    the reference, unsplit and split."""
    seq_lens = [1, 15, 17, 47, 63, 65, 130, 200]
    decode_kernel(lib, FP4, "none", dim, bs, group)
    cache, meta, q = make_case(FP4, "none", torch.bfloat16, group=group, dim=dim, bs=bs, heads=2,
                               query_lens=[1] * len(seq_lens), seq_lens=seq_lens, seed=group * dim, poison=True)
    kinds = torch.tensor([[0.0] * 16, [math.nan] * 16, [math.inf, -math.inf] * 8, [1e4, -3e3] * 8,
                          [2.0 ** -12, -(2.0 ** -11)] * 8,
                          [0.0, 5.0, math.nan, -1e5, 2.0 ** -14, -0.3, math.inf, 1.0] * 2])
    slots = [int(meta.block_tables[i, pos // bs]) * bs + pos % bs for i, n in enumerate(seq_lens)
             for pos in range(0, n, 3)]
    gen = torch.Generator().manual_seed(dim)
    rows = kinds[torch.randint(0, len(kinds), (len(slots), 2, 2, dim // 16), generator=gen)]   # [tokens, k/v, head]
    rows = rows.reshape(len(slots), 2, 2, dim).to(torch.bfloat16)
    cache.store(1, rows[:, 0], rows[:, 1], torch.tensor(slots, dtype=torch.int64))
    for partition in (0, 32):
        check_attention(lib, cache, meta, q, partition_size=partition)


def test_fp4_decode_every_scale_byte(lib: kernels.KernelLibrary) -> None:
    """The decode kernel's E4M3 scale decode on every byte, those the store never writes included (negative, NaN):
    V: one-token contexts whose V group g of sequence i has scale byte 16i + g and codes 1.0, so the output is the
    byte's value exactly (NaN where it is NaN); K: two-token contexts whose first K row has those scale bytes (the
    NaN ones replaced) and codes 1.0 beside a zero row, against the reference."""
    dim, bs, seqs = 256, 16, 16
    decode_kernel(lib, FP4, "none", dim, bs, 1)
    e4m3 = torch.tensor(FP8_FORMATS["fp8_e4m3"].values(), dtype=torch.float32)
    for tokens in (1, 2):
        cache, meta, q = make_case(FP4, "none", torch.bfloat16, group=1, dim=dim, bs=bs, heads=1,
                                   query_lens=[1] * seqs, seq_lens=[tokens] * seqs, seed=tokens)
        scale_bytes = torch.arange(256, dtype=torch.uint8).reshape(seqs, dim // 16)
        ones = torch.cat([torch.full((dim // 2,), 0x22, dtype=torch.uint8), torch.full((dim // 16,), 0x38,
                                                                                        dtype=torch.uint8)])  # 1.0
        for i in range(seqs):
            block = int(meta.block_tables[i, 0])
            cache.k_data[1, block, 0, :tokens] = 0
            cache.v_data[1, block, 0, :tokens] = 0
            if tokens == 1:   # V codes 1.0 times the scale byte under test
                cache.v_data[1, block, 0, 0, :dim // 2] = 0x22
                cache.v_data[1, block, 0, 0, dim // 2:] = scale_bytes[i]
            else:             # K codes 1.0 times the scale bytes (NaN ones as 1.0), V of token 0 all 1.0
                k_bytes = scale_bytes[i].clone()
                k_bytes[(k_bytes & 0x7F) == 0x7F] = 0x38
                cache.k_data[1, block, 0, 0, :dim // 2] = 0x22
                cache.k_data[1, block, 0, 0, dim // 2:] = k_bytes
                cache.v_data[1, block, 0, 0] = ones
        if tokens == 1:
            got = paged_attention_fused(lib, q, cache, 1, meta, dim ** -0.5, 0).float()
            want = e4m3.reshape(seqs, dim // 16, 1).expand(seqs, dim // 16, 16).reshape(seqs, 1, dim)
            nan = torch.isnan(want)
            assert torch.equal(torch.isnan(got), nan)
            assert torch.equal(got[~nan], want[~nan])   # -0.0 scales give +0.0: the sums start at +0.0
        else:
            check_attention(lib, cache, meta, q)


# ------------------------------------------------------------------------------------------------
# The tile kernel's prefill loop (items of more than 4 rows, head_dim <= 128)
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_name,gran,q_dtype", [
    ("fp8_e4m3", "tensor", torch.bfloat16), ("fp8_e4m3", "channel", torch.bfloat16),
    ("fp8_e5m2", "dynamic", torch.bfloat16), ("fp8_e4m3fnuz", "head", torch.float32),
    ("fp8_e4m3", "head", torch.float16), ("bfloat16", "none", torch.bfloat16), ("bfloat16", "none", torch.float32)])
@pytest.mark.parametrize("group,dim,bs", [(3, 64, 16), (1, 128, 8), (4, 80, 32), (8, 32, 16)])
def test_attention_long_prefill(lib: kernels.KernelLibrary, kernel_path: str, kv_name: str, gran: str,
                                q_dtype: torch.dtype, group: int, dim: int, bs: int) -> None:
    """Long causal prefill in the prefill loop (asserted to serve; on AMX tiles and on AVX-512 where both
    exist): a 300-token prompt from an empty cache and chunked prefills of 77 and 200 tokens over cached
    prefixes (hundreds of tiles, diagonal chunks at every offset, lengths that end mid-tile), next to a decode
    and a 5-token prompt; GQA 1 / 3 / 4 / 8; head_dim 32 / 80 (partial 64-byte chunks) / 64 / 128; blocks of 8
    (tiles across blocks), 16, 32; NaN past every context; automatic and forced partitions."""
    _long_prefills(lib, kv_name, gran, q_dtype, group, dim, bs)


def _long_prefills(lib: kernels.KernelLibrary, kv_name: str, gran: str, q_dtype: torch.dtype, group: int, dim: int,
                   bs: int) -> None:
    """The prefill kernel asserted to serve, then a 300-token prompt and chunked prefills of 77 and 200 tokens over
    cached prefixes next to a decode and a 5-token prompt, NaN past every context, against the reference with
    automatic and forced partitions."""
    prefill_kernel(lib, kv_name, gran, q_dtype, dim, bs)
    cache, meta, q = make_case(kv_name, gran, q_dtype, group=group, dim=dim, bs=bs, heads=2,
                               query_lens=[300, 77, 1, 200, 5], seq_lens=[300, 500, 37, 1000, 5],
                               seed=group + dim + bs, poison=True)
    for partition in (0, 112):
        check_attention(lib, cache, meta, q, partition_size=partition)


STAGED_SHAPES = [(3, 64, 16), (1, 128, 8), (4, 80, 32), (8, 32, 16), (2, 96, 16), (3, 256, 16)]


@pytest.mark.parametrize("kv_name,gran,group,dim,bs", [
    (kv_name, gran, *shape) for kv_name, gran in ((INT8, "dynamic"), (INT4, "dynamic"), (FP4, "none"), (I4G, "none"))
    for shape in STAGED_SHAPES if kv_name != I4G or shape[1] % 32 == 0])   # int4_per_group32: whole groups of 32
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_staged_prefill(lib: kernels.KernelLibrary, kernel_path: str, kv_name: str, gran: str, q_dtype: torch.dtype,
                        group: int, dim: int, bs: int) -> None:
    """Prefill items of the integer and group-scaled caches on the tile kernel, their K / V tiles decoded to bf16
    (item_staged.h; asserted to serve: with bf16 compute and head_dim a multiple of 64 the prefill loop on AMX tiles
    where the library has them, else the prefill loop for head_dim <= 128 and the chunked tile loop for 256; the
    generic kernel for int4_per_group32 with fp16 / fp32 compute): a 300-token prompt and chunked prefills of 77 and
    200 tokens over cached prefixes (lengths that end mid-tile), next to a decode and a 5-token prompt; GQA 1 / 2 / 3
    / 4 / 8; head_dim 32 / 64 / 96 / 128 / 256 and 80 (int4 / FP4 rows of 40 bytes: a last 16 channels apart);
    blocks of 8, 16, 32; NaN past every context (int8 / int4: NaN token scales; FP4 / int4_per_group32: NaN group
    scales); automatic and forced partitions."""
    _long_prefills(lib, kv_name, gran, q_dtype, group, dim, bs)


@pytest.mark.parametrize("kv_name", ["fp8_e4m3", "bfloat16"])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_prefill_softmax_reference_moves(lib: kernels.KernelLibrary, kernel_path: str, kv_name: str,
                                        q_dtype: torch.dtype) -> None:
    """Scores that climb by ~10 per 64 tokens, then by ~100, zigzag by 40 and fall along a 700-token prefill,
    so the prefill loop's softmax reference moves over and over (small steps past its slack, large jumps), in
    rows whose maximum comes late (query head 0) or early (head 1, the negated scores): equal to the reference
    and finite (a reference that lagged the scores by more than ~88 would overflow e^(score - reference))."""
    gen = torch.Generator().manual_seed(11)
    n, dim, bs = 700, 64, 16
    prefill_kernel(lib, kv_name, "tensor", q_dtype, dim)
    kv = resolve_kv_cache_dtype(kv_name, torch.bfloat16)
    blocks = math.ceil(n / bs)
    cache = make_cache(CacheShape(2, blocks + 2, 1, bs, dim), kv, KVScales.default(2) if kv.is_fp8 else None)
    t = torch.arange(n, dtype=torch.float32)
    a = torch.where(t < 120, 0.15 * t, torch.where(t < 200, 18.0 + 1.5 * (t - 120),
                    torch.where(t < 260, 138.0 + 40.0 * (t % 2), 178.0 - 0.5 * (t - 260))))
    # score of head h, key t: (+-1 * 8 / sqrt(dim)) * sum_d k_t,d = +-a_t, plus noise
    k = (a / 8.0)[:, None, None] + 0.3 * torch.randn(n, 1, dim, generator=gen)
    v = torch.randn(n, 1, dim, generator=gen)
    table = (torch.randperm(blocks + 2, generator=gen)[:blocks]).tolist()
    dtype = q_dtype if kv.is_fp8 else kv.storage_dtype
    cache.store(1, k.to(dtype), v.to(dtype), AttentionMetadata.build([n], [n], [table], bs).slot_mapping)
    meta = AttentionMetadata.build([n], [n], [table], bs)
    sign = torch.tensor([1.0, -1.0])[None, :, None]
    q = (sign + 0.3 * torch.randn(n, 2, dim, generator=gen)).to(q_dtype)
    ref = paged_attention_reference(q, cache, 1, meta, dim ** -0.5).float()
    for partition in (0, 192):
        got = paged_attention_fused(lib, q, cache, 1, meta, dim ** -0.5, partition).float()
        assert torch.isfinite(got).all()
        err = (got - ref).abs().max().item()
        bound = TOL[q_dtype] * (1.0 + ref.abs().max().item())
        assert err <= bound, f"max |fused - reference| = {err:.3g} > {bound:.3g} (partition_size={partition})"


# ------------------------------------------------------------------------------------------------
# Errors
# ------------------------------------------------------------------------------------------------

def test_missing_compiler_is_reported(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.setenv("CXX", "kv8-no-such-compiler")
    monkeypatch.setenv("KV8_CACHE_DIR", str(tmp_path))
    with pytest.raises(KernelUnavailable, match="kv8-no-such-compiler"):
        kernels._build("native")


def test_bad_inputs_raise(lib: kernels.KernelLibrary) -> None:
    cache, meta, q = make_case("fp8_e4m3", "tensor", torch.bfloat16, query_lens=[1, 2], seq_lens=[5, 20])
    with pytest.raises(ValueError, match="dtype"):
        paged_attention_fused(lib, q.to(torch.float64), cache, 1, meta, 0.1)
    with pytest.raises(ValueError, match="head_dim"):
        paged_attention_fused(lib, q[..., :32], cache, 1, meta, 0.1)
    bad = AttentionMetadata.build([1, 2], [5, 20], [[cache.shape.num_blocks + 5], [0, 1]], cache.shape.block_size)
    with pytest.raises(ValueError, match="block id"):
        paged_attention_fused(lib, q, cache, 1, bad, 0.1)
    k = torch.zeros(1, cache.shape.num_kv_heads, cache.shape.head_dim)
    with pytest.raises(ValueError, match="slot"):
        store_kv_fused(lib, cache, 1, k, k, torch.tensor([cache.shape.num_blocks * cache.shape.block_size]))


def test_codes_and_messages_come_from_the_library(lib: kernels.KernelLibrary) -> None:
    assert set(lib.kv_dtype_codes) == set(KV_DTYPES)
    assert set(lib.compute_codes) == {torch.bfloat16, torch.float16, torch.float32}
    assert "block id" in lib.error_message(1) and lib.error_message(999) == "error 999"


def test_struct_mirror_mismatch_is_refused(lib: kernels.KernelLibrary) -> None:
    """A library whose argument structs differ from the ctypes mirror is KernelUnavailable, with both layouts."""
    c_layout = lib.abi_layout()
    check_abi(c_layout, lib.STRUCTS, "kv8.kernels.cpu.attention")  # the real mirror matches

    class Swapped(ctypes.Structure):
        _fields_ = [(n, t) for n, t in reversed(kernels.StoreCall._fields_)]

    structs = tuple((name, Swapped if struct is kernels.StoreCall else struct) for name, struct in lib.STRUCTS)
    with pytest.raises(KernelUnavailable, match="mirror in kv8.kernels.cpu.attention"):
        check_abi(c_layout, structs, "kv8.kernels.cpu.attention")


def test_layer_args_follow_replaced_scales(lib: kernels.KernelLibrary) -> None:
    """The per-layer argument struct is rebuilt when the cache's codec (here: its scales) is replaced."""
    cache, meta, q = make_case("fp8_e4m3", "head", torch.float32)
    check_attention(lib, cache, meta, q)
    first = lib.layer_args(cache, 1)
    assert lib.layer_args(cache, 1) is first  # reused
    old = cache.codec.scales
    cache.codec = dataclasses.replace(cache.codec, scales=KVScales(k=old.k * 2, v=old.v * 2,
                                                                   granularity=old.granularity, source="test",
                                                                   made_for=None))
    assert lib.layer_args(cache, 1) is not first
    check_attention(lib, cache, meta, q)
