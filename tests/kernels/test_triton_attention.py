"""The Triton paged attention (:mod:`kv8.kernels.triton.attention`) against the reference attention.

Without a CUDA device the kernels run in Triton's interpreter on CPU tensors (``tests/conftest.py`` sets
``TRITON_INTERPRET=1`` before any kernel is decorated: :mod:`tests.helpers.triton`). With a CUDA device (and no
``TRITON_INTERPRET``) the same tests run compiled on it. What the interpreter cannot show -- the compiled
constexpr branches, tl.dot shapes, the native FP8 conversions, register pressure -- is checked on the kernels
compiled for sm_90, which needs no GPU (Triton's compiler and its bundled ptxas, in a subprocess).

The (cache dtype x head_dim/GQA x window/split x query dtype) sweep runs a fixed sample of 16 of its 480 cases;
``KV8_TRITON_FULL_SWEEP=1`` runs them all (slow in the interpreter: 30x the sample).

Every case builds a :class:`PagedKVCache` through kv8's own codec and reference store, with the cache and the
token scales first filled with poison (NaN values, the format's NaN code; int8 and int4 codes have no NaN, so
there the token scales' NaN is the poison): the kernel reading any slot it must not
(a slot past a sequence, a block before a sliding window, an unused block) turns its output into NaN. Block ids are
shuffled, last blocks partial, batches mixed (decode rows, prefill chunks over cached context, fresh prefills, an
empty row) and padded with rows past ``query_start_loc[B]`` that must stay untouched.

Tolerances (see :func:`_tolerance`): float32 queries are compared at float32 level, 16-bit queries at the dtype's
rounding -- the reference and the kernel differ in the order of their float32 sums and in the kernel's rounding of
the probabilities to the query's dtype for the tensor-core product.
"""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

import kv8.kernels.triton.attention as triton_attention
import kv8.kernels.triton.dequant as triton_dequant
import kv8.kernels.triton.interpreter as triton_interpreter
import kv8.kernels.triton.store as triton_store
from kv8.attention.metadata import AttentionMetadata
from kv8.attention.reference import paged_attention_reference
from kv8.cache.codec import K, KVCodec, V
from kv8.cache.paged_cache import CacheShape, PagedKVCache
from kv8.kernels.triton.formats import COMPILED_PACKED_MAX_HEAD_DIM, kernel_format
from kv8.platform import CPU, Platform
from kv8.quant.formats import E4M3, FP8_FORMATS, INT4, INT8, FP8Format, resolve_kv_cache_dtype, unpack_int4
from kv8.quant.fp4 import FP4_E2M1
from kv8.quant.int4_group import INT4_G32
from kv8.quant.scales import KVScales, ScaleGranularity
from tests.helpers.triton import DEVICES, INTERPRETED, on_device

MAX_KV_SPLITS = triton_attention.MAX_KV_SPLITS
choose_num_kv_splits = triton_attention.choose_num_kv_splits
launch_config = triton_attention.launch_config
unified_attention = triton_attention.unified_attention
decode_fp8 = triton_dequant.decode_fp8
decode_fp8_bits = triton_dequant.decode_fp8_bits
group_scales = triton_dequant.group_scales
apply_group_scales = triton_dequant.apply_group_scales
FLOAT_CACHES = ("bfloat16", "float16", "float32")
FP8_CACHES = tuple(FP8_FORMATS)     # every kv8 format: the kernels' constants are derived from each
INT8_CACHE = "int8_per_token_head"   # int8 codes, always dynamic scales
INT4_CACHE = "int4_per_token_head"   # int4 codes, two per byte, always dynamic scales
INT4G_CACHE = "int4_per_group32"     # int4 codes, two per byte, a float16 scale per 32 values after them
FP4_CACHE = "fp4_e2m1"               # E2M1 codes, two per byte, an E4M3 scale code per 16 values after them
FORMATS = FP8_FORMATS


def test_kernels_run_where_this_process_can_run_them() -> None:
    assert triton_interpreter.INTERPRETED == INTERPRETED
    for kernel in (triton_attention._paged_attention_kernel, triton_attention._merge_splits_kernel):
        assert isinstance(kernel, JITFunction) != INTERPRETED     # decided with the kernels
    assert INTERPRETED or torch.cuda.is_available()


@dataclass(frozen=True)
class Batch:
    query_lens: tuple[int, ...]
    seq_lens: tuple[int, ...]


# decode over 36 cached tokens; a prefill chunk of 6 over 34 cached; a fresh prefill; an empty row; a decode
# at a block boundary (bs 16)
MIXED = Batch((1, 6, 19, 0, 1), (37, 40, 19, 5, 16))
PAD_ROWS = 2  # query rows past query_start_loc[B]: out must keep them as they were


@dataclass
class Problem:
    query: torch.Tensor            # [T + PAD_ROWS, Hq, D] on the CPU
    cache: PagedKVCache            # on the CPU
    meta: AttentionMetadata
    scale: float
    v_max: float                   # bound on |V| as read back (for the 16-bit tolerance)
    num_tokens: int                # T


def _poison(cache: PagedKVCache) -> None:
    for which, codes in enumerate((cache.k_data, cache.v_data)):
        kv_dtype = cache.codec.dtype_of(which)
        fmt = kv_dtype.fp8
        if kv_dtype.group is not None:
            codes.fill_(0xFF)             # group formats: codes -1 / -6 beside NaN float16 / E4M3 scales
        elif kv_dtype.int_codes is not None:
            # never written (int8 codes are -127 .. 127, int4 nibbles -7 .. 7: 0x80 is 0 | -8); NaN scales poison
            codes.view(torch.uint8).fill_(0x80)
        elif fmt is None:
            codes.fill_(float("nan"))
        else:
            codes.fill_(fmt.nan_code)
    for ts in cache.tensors[2:]:
        ts.fill_(float("nan"))


def _static_scales(x_k: torch.Tensor, x_v: torch.Tensor, fmt: FP8Format, granularity: str,
                   g: torch.Generator) -> KVScales:
    """Calibration-like scales: amax / format max over the granularity's groups, times U(0.8, 1.6) (so some
    values saturate, as with real calibrated scales)."""
    dims = {"tensor": (0, 1, 2), "head": (0, 2), "channel": (0,)}[granularity]
    out = []
    for x in (x_k, x_v):
        amax = x.abs().amax(dim=dims, keepdim=True)                     # keepdim on [N, H, D]
        s = amax / fmt.max_finite * (0.8 + 0.8 * torch.rand(amax.shape, generator=g))
        out.append(s.reshape(1, s.shape[1], s.shape[2]).float())
    return KVScales(k=out[0], v=out[1], granularity=ScaleGranularity(granularity), source="test", made_for=None)


def _build(kv: str, q_dtype: torch.dtype, *, head_dim: int = 64, kv_heads: int = 2, group: int = 2,
           block_size: int = 16, batch: Batch = MIXED, window: int | None = None, scales: str = "tensor",
           rotation: str = "none", garbage: tuple[int, ...] | None = None, seed: int = 0) -> Problem:
    """A poisoned cache holding the batch's context, its metadata and queries (module docstring). ``scales``:
    "tensor" / "head" / "channel" static scales or "dynamic" (FP8; an int8 cache is always dynamic). ``garbage``:
    block ids written into the table entries before each window's first block (default: ids of poisoned,
    never-stored blocks)."""
    g = torch.Generator().manual_seed(seed)
    kv_dtype = resolve_kv_cache_dtype(kv, torch.float32)
    bs, d = block_size, head_dim
    nblocks = [-(-s // bs) for s in batch.seq_lens]
    spare = 3
    num_blocks = sum(nblocks) + spare
    perm = torch.randperm(num_blocks, generator=g).tolist()
    spares, free = perm[:spare], perm[spare:]

    tables: list[list[int]] = []
    slots: list[int] = []
    for q_len, s_len, n in zip(batch.query_lens, batch.seq_lens, nblocks):
        table = [free.pop() for _ in range(n)]
        if q_len == 0:                     # never read: point it at poison
            tables.append([spares[b % spare] for b in range(n)])
            continue
        first_key = max(0, s_len - q_len + 1 - window) if window is not None else 0
        first_block = first_key // bs
        for b in range(first_block):
            table[b] = garbage[b % len(garbage)] if garbage else spares[b % spare]
        slots += [table[p // bs] * bs + p % bs for p in range(first_block * bs, s_len)]
        tables.append(table)

    amp = 1.0 + 3.0 * torch.rand(d, generator=g)                      # uneven key channels, like real keys
    key = torch.randn(len(slots), kv_heads, d, generator=g) * amp
    value = torch.randn(len(slots), kv_heads, d, generator=g)
    fmt = kv_dtype.fp8
    static = None
    if fmt is not None and scales != "dynamic":
        static = _static_scales(key, value, fmt, scales, g)
    codec = KVCodec.build(kv_dtype, d, scale_mode="dynamic" if scales == "dynamic" and fmt else "static",
                          rotation=rotation, scales=static)
    cache = PagedKVCache(CacheShape(1, num_blocks, kv_heads, bs, d), codec)
    _poison(cache)
    key, value = codec.to_stored_basis(key, K), codec.to_stored_basis(value, V)
    cache.store(0, key, value, torch.tensor(slots, dtype=torch.int64))

    meta = AttentionMetadata.build(list(batch.query_lens), list(batch.seq_lens), tables, bs, sliding_window=window)
    num_tokens = sum(batch.query_lens)
    query = codec.to_stored_basis(1.5 * torch.randn(num_tokens + PAD_ROWS, kv_heads * group, d, generator=g), K)
    v_max = 1.25 * float(value.abs().max()) if value.numel() else 1.0
    return Problem(query.to(q_dtype), cache, meta, d ** -0.5, v_max, num_tokens)


def _at_offset(cache: torch.Tensor, offset: int) -> torch.Tensor:
    """A copy of ``cache`` (contiguous) whose data starts ``offset`` elements into a fresh allocation."""
    flat = torch.zeros(cache.numel() + offset, dtype=cache.dtype, device=cache.device)
    moved = flat[offset:].view(cache.shape)
    moved.copy_(cache)
    return moved


def _run(p: Problem, device: str, *, num_kv_splits: int | None = 1, table_dtype: torch.dtype = torch.int64,
         sentinel: float = 7.0, cache_offset: int = 0) -> torch.Tensor:
    """The kernel's output ``[T + PAD_ROWS, Hq, D]`` (on the CPU) for problem ``p``; out starts as ``sentinel``.
    ``cache_offset``: the K and V caches are copied to start that many elements into their allocations."""
    k_cache, v_cache = (_at_offset(c.to(device), cache_offset) if cache_offset else c.to(device)
                        for c in p.cache.layer(0))
    static = p.cache.layer_scales(0)
    dynamic = p.cache.layer_token_scales(0)
    query = p.query.to(device)
    out = torch.full_like(query, sentinel)
    m = p.meta
    res = unified_attention(
        query, k_cache, v_cache, out,
        query_start_loc=m.query_start_loc.to(device), seq_lens=m.seq_lens.to(device),
        block_tables=m.block_tables.to(device=device, dtype=table_dtype),
        max_query_len=max(m.query_lens_list), max_seq_len=max(m.seq_lens_list), scale=p.scale,
        sliding_window=m.sliding_window, fp8=p.cache.kv_dtype.codes,
        k_scale=static[0].to(device) if static else None, v_scale=static[1].to(device) if static else None,
        k_token_scales=dynamic[0].to(device) if dynamic else None,
        v_token_scales=dynamic[1].to(device) if dynamic else None,
        num_kv_splits=num_kv_splits)
    assert res is out
    return out.cpu()


def _reference(p: Problem) -> torch.Tensor:
    return paged_attention_reference(p.query, p.cache, 0, p.meta, p.scale)[:p.num_tokens]


def _tolerance(p: Problem) -> dict[str, float]:
    """float32 query: both sides compute in float32 and differ only in summation order and exp2-vs-exp, a few
    float32 ulps of an output bounded by v_max (1e-5 relative leaves room for ~D-term sums). 16-bit query: each side
    rounds a float32 value (equal to ~1e-6) to the dtype, so the outputs may sit one ulp apart (rtol = eps). Where
    the kernel multiplies 16-bit operands (an FP8 cache, or one of the query's dtype) it also rounds each probability
    to the dtype for the PV product, an error <= eps/2 * sum_j p_j |v_j| <= eps/2 * v_max, doubled as the atol;
    elsewhere its products are float32 and the atol stays at float32 level."""
    q_dtype = p.query.dtype
    if q_dtype == torch.float32:
        return {"rtol": 1e-5, "atol": 1e-5 * p.v_max}
    eps = torch.finfo(q_dtype).eps
    kv = p.cache.kv_dtype
    rounds_p = kv.is_quantized or kv.storage_dtype == q_dtype
    return {"rtol": eps, "atol": (eps if rounds_p else 1e-5) * p.v_max}


def _check(p: Problem, out: torch.Tensor, sentinel: float = 7.0) -> None:
    ref = _reference(p)
    got = out[:p.num_tokens]
    assert not got.isnan().any(), "NaN in the output: the kernel read a poisoned slot"
    torch.testing.assert_close(got.float(), ref.float(), **_tolerance(p))
    assert got.dtype == p.query.dtype
    assert bool((out[p.num_tokens:] == sentinel).all()), "rows past query_start_loc[B] were written"


# ---- FP8 decode -----------------------------------------------------------------------------------------------

@triton.jit
def _decode_all_kernel(codes_ptr, out_ptr, FMT: tl.constexpr, NATIVE: tl.constexpr, OUT: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs, decode_fp8(tl.load(codes_ptr + offs), FMT, NATIVE, OUT).to(tl.float32))


def _decode_all(fmt: FP8Format, native: bool, device: str, out_dtype: tl.dtype = tl.float32) -> torch.Tensor:
    codes = torch.arange(256, dtype=torch.uint8, device=device)
    out = torch.empty(256, dtype=torch.float32, device=device)
    _decode_all_kernel[(1,)](codes, out, FMT=kernel_format(fmt), NATIVE=native, OUT=out_dtype)
    return out.cpu()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", [tl.float32, tl.float16, tl.bfloat16], ids=str)
@pytest.mark.parametrize("name", FP8_CACHES)
def test_bit_decode_is_exact_for_every_code(name: str, out_dtype: tl.dtype, device: str) -> None:
    """Every code decodes to its exact value (NaN to NaN, -0.0 to -0.0) straight into each dot dtype."""
    fmt = FORMATS[name]
    got = _decode_all(fmt, False, device, out_dtype)
    want = fmt.decode(torch.arange(256, dtype=torch.uint8))
    assert torch.equal(got.isnan(), want.isnan())
    finite = ~want.isnan()
    assert torch.equal(got[finite], want[finite])
    assert torch.equal(got[finite].signbit(), want[finite].signbit())     # -0.0 stays -0.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", ["fp8_e4m3", "fp8_e5m2"])
def test_native_decode_matches_bits_on_finite_codes(name: str, device: str) -> None:
    """The native conversion agrees with the exact decode on every finite code (the interpreter's own FP8
    conversion gets NaN/inf codes wrong, so those are compared only when compiled; E4M3FNUZ's float8e4b8 exists
    only on AMD gfx94x and is not exercised here)."""
    fmt = FORMATS[name]
    if device == "cuda" and not INTERPRETED and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("native FP8 conversion needs compute capability >= 8.9")
    got = _decode_all(fmt, True, device)
    want = fmt.decode(torch.arange(256, dtype=torch.uint8))
    finite = want.isfinite() if INTERPRETED else ~want.isnan()
    assert torch.equal(got[finite], want[finite])
    if not INTERPRETED:
        assert torch.equal(got.isnan(), want.isnan())


@pytest.mark.parametrize(("platform", "native"), [
    (Platform.cuda((9, 0), "H100", compute_units=132), {"fp8_e4m3", "fp8_e5m2"}),
    (Platform.cuda((8, 0), "A100", compute_units=108), set()),                       # no FP8 conversion: bits
    (Platform.cuda((9, 4), "MI300X", "gfx942:sramecc+:xnack-", compute_units=304), {"fp8_e4m3fnuz"}),
    (CPU, set()),
], ids=["hopper", "ampere", "mi300", "cpu"])
def test_native_fp8_is_the_platforms_choice(platform: Platform, native: set, monkeypatch: pytest.MonkeyPatch
                                            ) -> None:
    """Which formats decode natively follows the platform (its capability or AMD arch, read once by
    :meth:`Platform.resolve`), in the kernels' choice and in the launches planned for it; the interpreter never."""
    kwargs = _valid_kwargs()
    tensors = [kwargs.pop(n) for n in ("query", "k_cache", "v_cache", "out")]
    kwargs.update(k_token_scales=None, v_token_scales=None, num_kv_splits=None)
    monkeypatch.setattr(triton_interpreter, "INTERPRETED", False)     # the choice as compiled kernels make it
    for name, fmt in FP8_FORMATS.items():
        assert triton_dequant.native_fp8_supported(platform, kernel_format(fmt)) == (name in native), name
        launches = triton_attention.plan_launches(*tensors, **{**kwargs, "fp8": fmt}, platform=platform)
        assert [x.kwargs["NATIVE_FP8"] for x in launches if "NATIVE_FP8" in x.kwargs] == [name in native], name
    assert not triton_dequant.native_fp8_supported(platform, None)   # a 16/32-bit cache
    assert not triton_dequant.native_fp8_supported(platform, kernel_format(INT8))   # int8 codes: no FP8 type
    monkeypatch.setattr(triton_interpreter, "INTERPRETED", True)
    assert not any(triton_dequant.native_fp8_supported(platform, kernel_format(f)) for f in FP8_FORMATS.values())


@triton.jit
def _decode_int8_kernel(codes_ptr, out_ptr, FMT: tl.constexpr, OUT: tl.constexpr):
    offs = tl.arange(0, 256)
    tl.store(out_ptr + offs, decode_fp8(tl.load(codes_ptr + offs), FMT, False, OUT).to(tl.float32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", [tl.float32, tl.float16, tl.bfloat16], ids=str)
def test_int8_decode_is_exact_for_every_code(out_dtype: tl.dtype, device: str) -> None:
    """Every int8 code (-128 included, though never written) converts to its value in each dot dtype (the
    interpreter's own int8 -> bfloat16 cast does not: the decode goes through float32)."""
    codes = torch.arange(-128, 128, dtype=torch.int16).to(torch.int8).to(device)
    out = torch.empty(256, dtype=torch.float32, device=device)
    _decode_int8_kernel[(1,)](codes, out, FMT=kernel_format(INT8), OUT=out_dtype)
    assert torch.equal(out.cpu(), INT8.decode(codes.cpu()))


@triton.jit
def _decode_int4_kernel(codes_ptr, out_ptr, FMT: tl.constexpr, OUT: tl.constexpr):
    rows = tl.arange(0, 16)
    offs = tl.arange(0, 16)
    values = decode_fp8(tl.load(codes_ptr + rows[:, None] * 16 + offs[None, :]), FMT, False, OUT)   # [16, 32]
    tl.store(out_ptr + rows[:, None] * 32 + tl.arange(0, 32)[None, :], values.to(tl.float32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("out_dtype", [tl.float32, tl.float16, tl.bfloat16], ids=str)
def test_int4_decode_unpacks_every_byte(out_dtype: tl.dtype, device: str) -> None:
    """Every byte (both nibbles -8 .. 7, -8 included though never written) unpacks in registers to the codes
    kv8.quant.formats.unpack_int4 reads -- channel 2j from the low nibble, 2j + 1 from the high -- and converts to
    their values in each dot dtype."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(16, 16).to(device)
    out = torch.empty(16, 32, dtype=torch.float32, device=device)
    _decode_int4_kernel[(1,)](codes, out, FMT=kernel_format(INT4), OUT=out_dtype)
    assert torch.equal(out.cpu(), INT4.decode(unpack_int4(codes.cpu())))


@triton.jit
def _decode_int4_group_kernel(rows_ptr, out_ptr, FMT: tl.constexpr, AXIS: tl.constexpr):
    """Rows ``[16, 36]`` of int4_per_group32 (D = 64: 32 code bytes, two float16 scales) -> values ``[16, 64]``
    float32, the codes unpacked along ``AXIS`` (1: ``[R, B]``, 0: ``[B, R]``, the attention's K^T) and times their
    group's scale, as the attention kernel decodes them."""
    r = tl.arange(0, 16)
    b = tl.arange(0, 32)
    scales = group_scales(tl.load(rows_ptr + r[:, None] * 36 + 32 + tl.arange(0, 4)[None, :]))    # [16, 2]
    if AXIS == 1:
        values = apply_group_scales(decode_fp8(tl.load(rows_ptr + r[:, None] * 36 + b[None, :]), FMT, False,
                                               tl.float32, 1), scales, 1, 32)                      # [16, 64]
        tl.store(out_ptr + r[:, None] * 64 + tl.arange(0, 64)[None, :], values)
    else:
        values = apply_group_scales(decode_fp8(tl.load(rows_ptr + r[None, :] * 36 + b[:, None]), FMT, False,
                                               tl.float32, 0), scales, 0, 32)                      # [64, 16]
        tl.store(out_ptr + r[None, :] * 64 + tl.arange(0, 64)[:, None], values)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("axis", [1, 0])
def test_int4_group_decode_is_exact_for_every_code_and_scale_sign(axis: int, device: str) -> None:
    """int4_per_group32 rows with every code byte (both nibbles -8 .. 7; the store's search writes -8) and float16
    group scales of both signs -- ±1, ±2^-24, float16 subnormals, ±65504, negative zero's neighbours -- decode as
    :meth:`INT4_G32.decode` does, exactly (a 4-bit code times a float16 scale is exact in float32), along both
    channel axes the attention kernel unpacks."""
    codes = torch.arange(512, dtype=torch.int32).remainder(256).to(torch.uint8).reshape(16, 32)
    scales = torch.tensor([1.0, -1.0, 2.0 ** -24, -(2.0 ** -24), 3 * 2.0 ** -20, -5 * 2.0 ** -17, 65504.0, -65504.0,
                           0.1, -0.1, -2.0, 0.375, -0.125, 7.5, -1000.0, 2.0 ** -14, -(2.0 ** -14), 1.5, -3.0, 0.5,
                           -0.5, 0.25, -0.25, 4.0, -4.0, 8.0, -8.0, 16.0, -16.0, 1e-3, -1e-3, 2.0 ** -15],
                          dtype=torch.float16).reshape(16, 2)
    rows = torch.cat([codes, scales.view(torch.uint8)], dim=-1)
    assert rows.shape == (16, INT4_G32.row_bytes(64))
    out = torch.empty(16, 64, dtype=torch.float32, device=device)
    _decode_int4_group_kernel[(1,)](rows.to(device), out, FMT=kernel_format(INT4_G32), AXIS=axis)
    want = INT4_G32.decode(rows, 64)
    assert torch.equal(out.cpu(), want) and bool((want < 0).any())


@triton.jit
def _decode_fp4_kernel(rows_ptr, out_ptr, FMT: tl.constexpr, AXIS: tl.constexpr):
    """Rows ``[16, 36]`` of fp4_e2m1 (D = 64: 32 code bytes, four E4M3 scale codes) -> values ``[16, 64]`` float32,
    the codes unpacked along ``AXIS`` (1: ``[R, B]``, 0: ``[B, R]``, the attention's K^T) and times their group's
    scale, decoded by the bit path with ``FMT.scale_format``, as the attention kernel decodes them."""
    SCALE_FMT: tl.constexpr = FMT.scale_format
    r = tl.arange(0, 16)
    b = tl.arange(0, 32)
    scales = decode_fp8_bits(tl.load(rows_ptr + r[:, None] * 36 + 32 + tl.arange(0, 4)[None, :]), SCALE_FMT,
                             tl.float32)                                                          # [16, 4]
    if AXIS == 1:
        values = apply_group_scales(decode_fp8(tl.load(rows_ptr + r[:, None] * 36 + b[None, :]), FMT, False,
                                               tl.float32, 1), scales, 1, 16)                      # [16, 64]
        tl.store(out_ptr + r[:, None] * 64 + tl.arange(0, 64)[None, :], values)
    else:
        values = apply_group_scales(decode_fp8(tl.load(rows_ptr + r[None, :] * 36 + b[:, None]), FMT, False,
                                               tl.float32, 0), scales, 0, 16)                      # [64, 16]
        tl.store(out_ptr + r[None, :] * 64 + tl.arange(0, 64)[:, None], values)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("axis", [1, 0])
def test_fp4_decode_is_exact_for_every_code_and_scale_byte(axis: int, device: str) -> None:
    """fp4_e2m1 rows with every code byte (both nibbles 0 .. 15: ±0 .. ±6, -0.0 included) and every E4M3 scale
    byte (subnormals, 448, and the NaN codes 0x7F / 0xFF, which the store never writes: NaN, as the reference reads
    them) decode as :meth:`FP4_E2M1.decode` does, exactly (an E2M1 value times an E4M3 scale is exact in float32),
    along both channel axes the attention kernel unpacks."""
    codes = torch.arange(512, dtype=torch.int32).remainder(256).to(torch.uint8).reshape(16, 32)
    scales = torch.arange(64, dtype=torch.int32).to(torch.uint8).reshape(16, 4)
    out = torch.empty(16, 64, dtype=torch.float32, device=device)
    for first in range(0, 256, 64):
        rows = torch.cat([codes.roll(first, 0), scales + first], dim=-1)
        assert rows.shape == (16, FP4_E2M1.row_bytes(64))
        _decode_fp4_kernel[(1,)](rows.to(device), out, FMT=kernel_format(FP4_E2M1), AXIS=axis)
        want = FP4_E2M1.decode(rows, 64)
        got = out.cpu()
        assert torch.equal(got.isnan(), want.isnan())
        assert torch.equal(got.nan_to_num(), want.nan_to_num()), first
        assert torch.equal(got.signbit() & ~got.isnan(), want.signbit() & ~want.isnan()), first   # -0.0 stays
    assert bool(want.isnan().any())                                        # the last rows had 0x7F, 0xFF


# ---- attention against the reference ----------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kv", FLOAT_CACHES + FP8_CACHES + (INT8_CACHE, INT4_CACHE, INT4G_CACHE, FP4_CACHE))
def test_every_cache_dtype_mixed_batch(kv: str, q_dtype: torch.dtype, device: str) -> None:
    p = _build(kv, q_dtype, seed=1)
    _check(p, _run(p, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("scales", ["tensor", "head", "channel", "dynamic"])
def test_scales(scales: str, q_dtype: torch.dtype, device: str) -> None:
    """Static scales of every granularity (channel K scales take the float32 QK product) and dynamic ones."""
    p = _build("fp8_e4m3", q_dtype, kv_heads=2, group=2, scales=scales, seed=2)
    _check(p, _run(p, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv", ["fp8_e5m2", "fp8_e4m3fnuz"])
def test_dynamic_scales_other_formats(kv: str, device: str) -> None:
    p = _build(kv, torch.float32, scales="dynamic", seed=3)
    _check(p, _run(p, device, num_kv_splits=2))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv,scales", [("fp8_e4m3", "dynamic"), ("fp8_e4m3", "head"), ("float32", "tensor"),
                                       (INT8_CACHE, "dynamic"), (INT4_CACHE, "dynamic")])
def test_hadamard_rotated_codec(kv: str, scales: str, device: str) -> None:
    """q, K and V in the rotated (stored) basis: the same call. For a float32 cache, rotating the output back also
    gives attention over the unrotated q, K, V (the rotation is orthonormal)."""
    p = _build(kv, torch.float32, scales=scales, rotation="hadamard", seed=4)
    out = _run(p, device)
    _check(p, out)
    if kv == "float32":
        plain = _build(kv, torch.float32, scales=scales, rotation="none", seed=4)
        back = p.cache.codec.to_stored_basis(out[:p.num_tokens], V)
        torch.testing.assert_close(back, _reference(plain), rtol=1e-5, atol=1e-5 * p.v_max)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv,q_dtype,head_dim,group,block_size", [
    ("fp8_e4m3", torch.float32, 64, 1, 16),
    ("fp8_e4m3", torch.float32, 128, 4, 16),
    ("fp8_e5m2", torch.float16, 64, 8, 32),
    ("fp8_e4m3", torch.bfloat16, 96, 4, 16),      # not a power of two: D padded to 128 and masked
    ("float32", torch.float32, 96, 1, 32),
    ("fp8_e4m3", torch.bfloat16, 256, 2, 32),     # 16-key tiles inside 32-token blocks
    ("bfloat16", torch.bfloat16, 256, 8, 16),
    ("fp8_e4m3", torch.float16, 64, 2, 8),        # blocks smaller than a key tile: per-key table gather
    ("fp8_e4m3", torch.float32, 64, 2, 48),       # a block of three 16-key tiles
], ids=lambda v: str(v).replace("torch.", ""))
def test_gqa_head_dims_block_sizes(kv: str, q_dtype: torch.dtype, head_dim: int, group: int, block_size: int,
                                   device: str) -> None:
    p = _build(kv, q_dtype, head_dim=head_dim, kv_heads=1 if head_dim == 256 else 2, group=group,
               block_size=block_size, seed=5)
    _check(p, _run(p, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("window,splits", [(1, 1), (5, 1), (5, 3), (16, 2), (23, 1), (100, 2)])
def test_sliding_window(window: int, splits: int, device: str) -> None:
    """Windows smaller than a block, equal to it, spanning blocks, and wider than every sequence; the table entries
    before each window's first block point at poisoned blocks."""
    batch = Batch((1, 6, 19, 0, 1, 3), (37, 40, 19, 5, 16, 50))
    p = _build("fp8_e4m3", torch.float32, batch=batch, window=window, seed=6)
    _check(p, _run(p, device, num_kv_splits=splits))
    if window < 19:  # the case exercises the window: attention without it differs
        full = _build("fp8_e4m3", torch.float32, batch=batch, window=None, seed=6)
        assert not torch.allclose(_reference(p), _reference(full), atol=1e-3)


@pytest.mark.parametrize("device", DEVICES)
def test_window_never_reads_skipped_table_entries(device: str) -> None:
    """Table entries before the window hold -1 and an id far past the cache: any read of them (or of their blocks)
    would fault or read garbage."""
    batch = Batch((1, 4, 2), (70, 64, 45))
    p = _build("fp8_e4m3", torch.bfloat16, batch=batch, window=10, garbage=(-1, 1 << 40), seed=7)
    _check(p, _run(p, device, num_kv_splits=1))
    _check(p, _run(p, device, num_kv_splits=2, table_dtype=torch.int64))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("splits", [1, 2, 3, 8, None])
def test_split_k_long_decode_rows(splits: int | None, device: str) -> None:
    """Long decode rows (and one short prefill) with split-K off, on (more splits than some rows have key tiles:
    empty splits), and by the heuristic; split results equal the unsplit ones to float32 rounding."""
    batch = Batch((1, 1, 3, 1), (150, 33, 70, 1))
    p = _build("fp8_e4m3", torch.float32, batch=batch, kv_heads=2, group=4, seed=8)
    out = _run(p, device, num_kv_splits=splits, table_dtype=torch.int32)
    _check(p, out)
    if splits != 1:
        torch.testing.assert_close(out, _run(p, device, num_kv_splits=1), rtol=1e-5, atol=1e-5 * p.v_max)


@pytest.mark.parametrize("device", DEVICES)
def test_split_k_bf16_mixed_batch(device: str) -> None:
    p = _build("fp8_e5m2", torch.bfloat16, scales="dynamic", seed=9)
    _check(p, _run(p, device, num_kv_splits=4))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv", ["fp8_e4m3", INT8_CACHE, INT4_CACHE, INT4G_CACHE, FP4_CACHE])
def test_poison_is_detected(kv: str, device: str) -> None:
    """The harness can fail: poisoning a slot the batch does read (the decode row's newest key: its FP8 code, or
    its int8 / int4 token scale) shows up as NaN in exactly the rows that see it."""
    p = _build(kv, torch.float32, seed=10)
    block = int(p.meta.block_tables[0, 36 // 16])
    if kv in (INT8_CACHE, INT4_CACHE):
        k_ts, _ = p.cache.layer_token_scales(0)  # type: ignore[misc]
        k_ts[block, :, 36 % 16] = float("nan")
    elif kv == INT4G_CACHE:
        k_cache, _ = p.cache.layer(0)
        k_cache[block, :, 36 % 16, -2:] = 0xFF                  # the last group's float16 scale: NaN
    elif kv == FP4_CACHE:
        k_cache, _ = p.cache.layer(0)
        k_cache[block, :, 36 % 16, -1] = 0x7F                   # the last group's E4M3 scale: NaN
    else:
        k_cache, _ = p.cache.layer(0)
        k_cache[block, :, 36 % 16] = E4M3.nan_code
    out = _run(p, device)
    assert out[0].isnan().all()                        # the decode row (token 0) sees position 36
    assert not out[1:p.num_tokens].isnan().any()       # nobody else does


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("splits", [1, 2])
def test_output_rounds_to_nearest_even(q_dtype: torch.dtype, splits: int, device: str) -> None:
    """One-token sequences see only their own key: out = V exactly in float32 (a float32 cache), so the output is
    V rounded to the query's dtype, bit for bit -- by the attention kernel and by the split merge (the
    interpreter's own bfloat16 cast would truncate)."""
    p = _build("float32", q_dtype, batch=Batch((1, 1, 1), (1, 1, 1)), kv_heads=2, group=2, seed=14)
    out = _run(p, device, num_kv_splits=splits)
    _, v_cache = p.cache.layer(0)
    want = torch.stack([v_cache[int(p.meta.block_tables[i, 0]), :, 0] for i in range(3)])      # [3, Hkv, D]
    want = want.repeat_interleave(2, dim=1).to(q_dtype)                                         # [3, Hq, D]
    assert torch.equal(out[:3].view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batches_leave_out_alone(device: str) -> None:
    p = _build("float32", torch.float32, batch=Batch((0, 0), (5, 17)), seed=11)
    out = _run(p, device)
    assert bool((out == 7.0).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv", [INT8_CACHE, INT4_CACHE, INT4G_CACHE, FP4_CACHE])
@pytest.mark.parametrize("q_dtype,head_dim,group,block_size,window,splits", [
    (torch.bfloat16, 64, 4, 16, None, 3),        # decode rows split over key segments, a prefill chunk
    (torch.float16, 96, 2, 16, 13, 1),           # D padded to 128; a window spanning blocks
    (torch.float32, 128, 8, 8, 5, 2),            # blocks smaller than a key tile (per-key gather), window + split
    (torch.bfloat16, 256, 1, 32, None, 1),       # head_dim 256: 16-key tiles inside 32-token blocks
], ids=lambda v: str(v).replace("torch.", ""))
def test_int_caches(kv: str, q_dtype: torch.dtype, head_dim: int, group: int, block_size: int, window: int | None,
                    splits: int, device: str) -> None:
    """int8 and int4 codes (two per byte, unpacked in registers) with their per-token scales, int4 codes with their
    groups' float16 scales (int4_per_group32; D = 96: three groups, the tile's fourth masked) and E2M1 codes with
    their groups' E4M3 scales (fp4_e2m1; D = 96: six groups of 16, the tile's last two masked), over mixed batches
    (decode, prefill chunks, fresh prefills), GQA, sliding windows and split-K."""
    batch = Batch((1, 6, 19, 0, 1, 3), (37, 40, 19, 5, 16, 50))
    p = _build(kv, q_dtype, head_dim=head_dim, kv_heads=1 if head_dim == 256 else 2, group=group,
               block_size=block_size, batch=batch, window=window, seed=15)
    _check_or_refused(p, device, splits)


def _check_or_refused(p: Problem, device: str, splits: int) -> None:
    """:func:`_check` of the kernel's output, or, compiled with 4-bit codes above
    :data:`COMPILED_PACKED_MAX_HEAD_DIM` (wrong outputs measured on an H200), the wrapper's refusal."""
    head_dim = p.query.shape[-1]
    codes = p.cache.k_dtype.codes   # one format: K's is V's
    if not INTERPRETED and head_dim > COMPILED_PACKED_MAX_HEAD_DIM and codes is not None \
            and kernel_format(codes).packed:
        with pytest.raises(ValueError, match=rf"codes at head_dim={head_dim}: the compiled Triton attention reads "
                                             rf"4-bit codes up to head_dim {COMPILED_PACKED_MAX_HEAD_DIM} only"):
            _run(p, device, num_kv_splits=splits)
        return
    _check(p, _run(p, device, num_kv_splits=splits))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("q_dtype,head_dim,group,block_size,window,splits", [
    (torch.bfloat16, 40, 4, 16, None, 2),        # groups of 16, 16 and 8: the short one masked past D in the tile
    (torch.float16, 72, 2, 8, 7, 1),             # 4.5 groups, D padded to 128; a window, per-key table gathers
    (torch.float32, 8, 1, 16, None, 3),          # one group of 8 values in a 16-channel tile; MHA, split-K
    (torch.bfloat16, 200, 2, 32, 23, 1),         # 12.5 groups, D padded to 256
], ids=lambda v: str(v).replace("torch.", ""))
def test_fp4_head_dims_with_a_short_last_group(q_dtype: torch.dtype, head_dim: int, group: int, block_size: int,
                                               window: int | None, splits: int, device: str) -> None:
    """fp4_e2m1 takes any even head_dim: a last group shorter than 16 (its scale covers fewer values, the reference
    pads it with zeros) reads as the reference reads it, over a mixed batch, GQA, windows and split-K."""
    assert head_dim % 16
    batch = Batch((1, 6, 19, 0, 1, 3), (37, 40, 19, 5, 16, 50))
    p = _build(FP4_CACHE, q_dtype, head_dim=head_dim, kv_heads=2, group=group, block_size=block_size, batch=batch,
               window=window, seed=16)
    assert p.cache.k_data.shape[-1] == p.cache.v_data.shape[-1] == FP4_E2M1.row_bytes(head_dim)
    _check_or_refused(p, device, splits)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv,head_dim,offset,row_align", [
    (INT4G_CACHE, 128, 0, 8),    # 72-byte rows: every row start a multiple of 8 bytes
    (INT4G_CACHE, 128, 4, 4),    # the data 4 bytes into its allocation
    (INT4G_CACHE, 64, 3, 1),     # 36-byte rows, 3 bytes in
    (FP4_CACHE, 128, 0, 8),      # 72-byte rows
    (FP4_CACHE, 128, 2, 2),
    (FP4_CACHE, 40, 0, 1),       # 23-byte rows
    (INT4_CACHE, 72, 0, 4),      # 36-byte rows
    ("fp8_e4m3", 40, 0, 8),      # 40-byte rows
    ("fp8_e4m3", 64, 1, 1),
    ("bfloat16", 72, 1, 1),      # 144-byte rows one element (2 bytes) in
    ("bfloat16", 40, 0, 8),      # 80-byte rows: 16 bytes
    ("float32", 72, 2, 2),       # 288-byte rows 8 bytes in
])
def test_rows_of_any_alignment(kv: str, head_dim: int, offset: int, row_align: int, device: str) -> None:
    """Caches whose rows start at any alignment (row widths that are not 16-byte multiples, data at an offset into
    its allocation) read as the reference reads them, and the launch tells the kernel no more alignment than the
    rows have (``ROW_ALIGN``, in elements; the interpreter ignores the hint, so it is asserted here)."""
    q_dtype = torch.float32 if kv == "float32" else torch.bfloat16
    p = _build(kv, q_dtype, head_dim=head_dim, kv_heads=2, group=2, batch=Batch((1, 6, 1), (37, 40, 19)),
               scales="tensor", seed=31)
    k_cache, v_cache = (_at_offset(c.to(device), offset) for c in p.cache.layer(0))
    m = p.meta
    static = p.cache.layer_scales(0)
    dynamic = p.cache.layer_token_scales(0)
    launches = triton_attention.plan_launches(
        p.query.to(device), k_cache, v_cache, torch.empty_like(p.query, device=device),
        query_start_loc=m.query_start_loc.to(device), seq_lens=m.seq_lens.to(device),
        block_tables=m.block_tables.to(device), max_query_len=max(m.query_lens_list),
        max_seq_len=max(m.seq_lens_list), scale=p.scale, sliding_window=None, fp8=p.cache.kv_dtype.codes,
        k_scale=static[0].to(device) if static else None, v_scale=static[1].to(device) if static else None,
        k_token_scales=dynamic[0].to(device) if dynamic else None,
        v_token_scales=dynamic[1].to(device) if dynamic else None, num_kv_splits=1, platform=CPU)
    assert [x.kwargs["ROW_ALIGN"] for x in launches if "ROW_ALIGN" in x.kwargs] == [row_align] * len(launches)
    assert triton_attention.row_alignment(k_cache, v_cache) == row_align
    _check(p, _run(p, device, cache_offset=offset))


# ---- host-side logic ---------------------------------------------------------------------------------------------

def _row_alignment_reference(*caches: torch.Tensor) -> int:
    """The largest power of two (<= 16 bytes), in elements, dividing every row start's byte address, by listing
    them all."""
    align = 16
    for c in caches:
        n0, n1, n2 = c.shape[:3]
        idx = torch.stack(torch.meshgrid(torch.arange(n0), torch.arange(n1), torch.arange(n2), indexing="ij"))
        offsets = (idx[0] * c.stride(0) + idx[1] * c.stride(1) + idx[2] * c.stride(2)).flatten()
        for addr in (c.data_ptr() + offsets * c.element_size()).tolist():
            while addr % align:
                align //= 2
    return max(1, align // caches[0].element_size())


def test_row_alignment_is_every_row_starts() -> None:
    """:func:`row_alignment` claims exactly the alignment every row start has (listed, capped at 16 bytes, in
    elements): row widths of each format and odd head dims, data at offsets into its allocation, strided and
    non-contiguous views (the pool's per-layer K and V views, block/head subsets, padded rows), size-1 dims whose
    stride is never used, and the K and V caches together."""
    ra = triton_attention.row_alignment
    cases: list[tuple[torch.Tensor, ...]] = []
    widths = {torch.uint8: (72, 64, 36, 23, 41, 113, 40, 128, 1), torch.bfloat16: (128, 72, 40, 1),
              torch.float32: (128, 72, 3)}
    for dtype, ws in widths.items():
        for w in ws:
            for offset in (0, 1, 2, 4, 8):
                flat = torch.zeros(3 * 2 * 4 * w + offset, dtype=dtype)
                cases.append((flat[offset:].view(3, 2, 4, w),))
    base = torch.zeros(5, 4, 8, 80, dtype=torch.uint8)
    cases += [(base[:, :, :, :72],), (base[1:, 1:3, 2:, 3:75],), (base[:, ::2, ::2, :72],), (base[:, 1:2, :1, :72],),
              (base[:1, :1],), (base[:, :, :, :72], base[1:, :, :, 4:76])]
    for kv, d in (("int4_per_group32", 128), ("fp4_e2m1", 72), ("fp4_e2m1", 200), ("int4", 40), ("fp8_e4m3", 40),
                  ("bfloat16", 72), ("float32", 40)):
        kv_dtype = resolve_kv_cache_dtype(kv, torch.float32)
        mode = "dynamic" if kv in ("int4", "fp8_e4m3") else "static"
        pool = PagedKVCache(CacheShape(3, 5, 2, 16, d), KVCodec.build(kv_dtype, d, scale_mode=mode))
        cases += [pool.layer(layer) for layer in range(3)]
    for caches in cases:
        assert ra(*caches) == _row_alignment_reference(*caches), [(c.shape, c.stride(), c.data_ptr() % 16)
                                                                   for c in caches]
    # the group formats' 72-byte rows at head_dim 128 and 16-bit rows: by hand
    flat = torch.zeros(16 * 8 * 16 * 72 + 16, dtype=torch.uint8)
    assert flat.data_ptr() % 16 == 0
    assert [ra(flat[o:o + 16 * 8 * 16 * 72].view(16, 8, 16, 72)) for o in (0, 4, 8, 16, 1)] == [8, 4, 8, 8, 1]
    assert ra(torch.zeros(4, 8, 16, 128, dtype=torch.bfloat16)) == 8          # 16 bytes
    assert ra(torch.zeros(4, 8, 16, 128, dtype=torch.float32)) == 4
    # size-1 dims: their (odd) strides never move a row; the blocks' 80 bytes apart
    assert ra(torch.zeros(400, dtype=torch.uint8).as_strided((4, 1, 1, 72), (80, 7, 3, 1))) == 16
    assert ra(torch.zeros(1, 1, 1, 23, dtype=torch.uint8)) == 16                # one row: the pointer's alignment
    with pytest.raises(ValueError, match="element sizes"):
        ra(torch.zeros(2, 2, 2, 8, dtype=torch.uint8), torch.zeros(2, 2, 2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="cap_bytes=12"):
        ra(torch.zeros(2, 2, 2, 8), cap_bytes=12)


def test_launch_config_invariants() -> None:
    for group, head_dim, max_q, bs, f32, nbytes in itertools.product(
            (1, 2, 3, 4, 6, 8, 16, 32), (1, 64, 80, 96, 128, 256), (0, 1, 2, 7, 64, 4096), (8, 16, 32, 48),
            (False, True), (1, 2, 4)):
        c = launch_config(group, head_dim, max_q, bs, f32, nbytes)
        assert c.block_m >= max(8 if c.key_rows else 16, c.block_q * group) and c.block_q >= 1
        for v in (c.block_m, c.tile_n, c.d_pad):
            assert v >= (8 if v is c.block_m and c.key_rows else 16) and v & (v - 1) == 0
        assert not c.key_rows or (nbytes == 1 and c.block_m <= 16 and not f32 and c.d_pad <= 128)
        assert c.d_pad >= head_dim
        assert c.tile_in_block == (bs % c.tile_n == 0)
        assert c.num_warps in (1, 2, 4, 8) and c.num_stages in (3, 5)
    assert launch_config(8, 128, 1, 16, False).block_q == 2       # decode: 16 rows = 2 tokens x 8 heads
    assert launch_config(1, 128, 512, 16, False).block_q == 64    # prefill: 64 tokens per tile
    assert launch_config(1, 128, 512, 32, False).tile_n == 32
    assert not launch_config(1, 128, 1, 8, False).tile_in_block
    # the engine's decode launches at Llama-3.1-8B shapes (module docstring of the kernel; tests/helpers/sm90.py)
    fp8 = launch_config(4, 128, 1, 16, False, cache_bytes=1)
    assert (fp8.block_m, fp8.tile_n, fp8.num_warps, fp8.num_stages, fp8.tile_in_block, fp8.key_rows) \
        == (8, 64, 1, 5, False, True)
    bf16 = launch_config(4, 128, 1, 16, False, cache_bytes=2)
    assert (bf16.tile_n, bf16.num_warps, bf16.num_stages, bf16.tile_in_block) == (16, 1, 5, True)
    # float32 queries at head_dim 65 .. 128 take 8 warps (on 4 their tiles spill); a 16-bit query's float32
    # products (a cache of another dtype) keep 4, and every 16-bit query's launch is the same with either default
    for head_dim, max_q, nbytes in itertools.product((64, 80, 128, 256), (1, 512), (1, 2, 4)):
        f32q = launch_config(4, head_dim, max_q, 16, True, nbytes, query_bytes=4)
        half = launch_config(4, head_dim, max_q, 16, True, nbytes, query_bytes=2)
        assert (f32q.num_warps, half.num_warps) == ((8 if head_dim in (80, 128) else 4), 4), (head_dim, max_q)
        assert replace(f32q, num_warps=4) == half
        assert launch_config(4, head_dim, max_q, 16, False, nbytes) == launch_config(
            4, head_dim, max_q, 16, False, nbytes, query_bytes=2)


def test_split_heuristic() -> None:
    # few programs, long context: split up to 4 programs per SM, >= 256 keys per split
    assert choose_num_kv_splits(num_programs=16, max_query_len=1, max_keys=8192, compute_units=132) == 32
    assert choose_num_kv_splits(num_programs=16, max_query_len=1, max_keys=1024, compute_units=132) == 4
    assert choose_num_kv_splits(num_programs=256, max_query_len=1, max_keys=4096, compute_units=132) == 3
    assert choose_num_kv_splits(num_programs=1, max_query_len=1, max_keys=10 ** 6, compute_units=132) \
        == MAX_KV_SPLITS
    # enough programs already, a prefill-sized batch, a short context, a CPU: no split
    assert choose_num_kv_splits(num_programs=528, max_query_len=1, max_keys=8192, compute_units=132) == 1
    assert choose_num_kv_splits(num_programs=16, max_query_len=512, max_keys=8192, compute_units=132) == 1
    assert choose_num_kv_splits(num_programs=16, max_query_len=1, max_keys=200, compute_units=132) == 1
    assert choose_num_kv_splits(num_programs=16, max_query_len=1, max_keys=8192, compute_units=1) == 1


def test_split_rule_counts_real_programs() -> None:
    """32 decode rows at 4k context, 8 KV heads, on 132 SMs: the grid has 32 // 2 + 32 = 48 query tiles (16 of them
    return at once), the real programs are 32 x 8 = 256, so 3 splits reach 4 x 132 (the grid's 384 would give 2)."""
    from tests.helpers.sm90 import llama_attention_launches
    launches = llama_attention_launches("fp8_e4m3", "decode", compute_units=132)
    assert launches[0].grid == (48, 8, 3)
    assert launches[0].kwargs["NUM_SPLITS"] == 3 and len(launches) == 2     # the attention kernel and the merge


def test_mixed_batch_launches_decode_rows_apart() -> None:
    """A batch with a prefill chunk and decode rows launches the kernel twice over the same arguments: decode tiles
    (16 rows, 64 FP8 keys as the products' rows, 1 warp) for the sequences of <= 16 // group = 4 new tokens,
    prefill tiles (64 rows = 16 tokens x 4 heads, 4 warps) for the others; each grid covers the whole batch (the
    host reads no lengths). A batch without decode rows (``min_query_len`` > 4: a pure prefill) makes only the
    prefill launch, the same kernel; one without prefill rows only the decode one. The interpreter tests' mixed
    batches run both launches."""
    from tests.helpers.sm90 import llama_attention_launches
    decode, prefill = llama_attention_launches("fp8_e4m3", "mixed")      # 31 decode rows, one 2048-token chunk
    assert (decode.kwargs["Q_LEN_MIN"], decode.kwargs["Q_LEN_MAX"]) == (0, 4)
    assert (decode.kwargs["BLOCK_M"], decode.kwargs["TILE_N"], decode.kwargs["num_warps"]) == (16, 64, 1)
    assert decode.kwargs["KEY_ROWS"] and not prefill.kwargs["KEY_ROWS"]
    assert decode.grid == (2079 // 4 + 32, 8, 1) and decode.args == prefill.args
    assert prefill.kwargs["Q_LEN_MIN"] == 5 and (prefill.kwargs["BLOCK_M"], prefill.kwargs["num_warps"]) == (64, 4)
    assert prefill.grid == (2079 // 16 + 32, 8, 1)                       # 16 tokens x 4 heads per tile
    only, = llama_attention_launches("fp8_e4m3", "prefill")              # one 2048-token chunk: no decode launch
    assert only.kwargs == prefill.kwargs and only.grid == (2048 // 16 + 1, 8, 1)
    decode_only = llama_attention_launches("fp8_e4m3", "decode")          # 32 rows at 4k: tiles and a split merge
    assert [x.kernel for x in decode_only] == [triton_attention._paged_attention_kernel,
                                                triton_attention._merge_splits_kernel]
    assert decode_only[0].kwargs["Q_LEN_MAX"] > 2 ** 30 and decode_only[0].kwargs["BLOCK_M"] == 8


def test_group_formats_launch_with_every_register() -> None:
    """The group formats' attention launches (fp4_e2m1, int4_per_group32: decode and prefill tiles) let ptxas use
    all 255 registers (``maxnreg``: at its own cap of 168 their 4-warp decode spills with Triton 3.7.1 and 3.9); the
    other formats' launches leave the choice to ptxas."""
    from tests.helpers.sm90 import llama_attention_launches
    for kv in ("fp4_e2m1", "fp8_e4m3", "int8", "bfloat16"):
        attention = [x for x in llama_attention_launches(kv, "mixed") if "Q_LEN_MIN" in x.kwargs]
        assert len(attention) == 2
        assert [x.kwargs.get("maxnreg") for x in attention] == [255 if kv == "fp4_e2m1" else None] * 2, kv
    variant = triton_attention.KernelVariant(torch.bfloat16, torch.uint8, kernel_format(INT4_G32), False,
                                             triton_attention.SCALES_NONE, False, False, 4, 128, 16, 1)
    assert variant.config.options == {"num_warps": 4, "num_stages": 5, "maxnreg": 255}


@pytest.mark.parametrize(("batch", "attention_launches"), [
    (Batch((19, 12), (19, 40)), 1),                # prefill only: a fresh prompt and a chunk over cached context
    (Batch((1, 12, 0), (37, 40, 5)), 2),           # a decode row beside the chunk (and an empty row)
    (Batch((1, 1), (37, 16)), 1),                  # decode only
], ids=["prefill", "mixed", "decode"])
def test_the_backend_makes_no_launch_without_rows(batch: Batch, attention_launches: int,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the engine's triton backend (lengths from the metadata), counted at the launcher: a batch gets a
    decode-tiled launch only if it has decode rows (<= 16 // group = 8 new tokens) and a prefill launch only if it
    has longer runs; the output is the reference's all the same."""
    if not INTERPRETED:
        pytest.skip("CPU tensors need the interpreter")
    from kv8.attention.triton import TritonBackend
    from kv8.kernels.triton.launch import Launch

    p = _build("fp8_e4m3", torch.bfloat16, batch=batch, seed=3)
    ran: list[Launch] = []
    run = Launch.run

    def counted(launch: Launch) -> None:
        ran.append(launch)
        run(launch)

    monkeypatch.setattr(Launch, "run", counted)
    t = p.num_tokens
    g = torch.Generator().manual_seed(4)
    key, value = (torch.randn(t, 2, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    out = TritonBackend(CPU).forward(p.query[:t], key, value, p.cache, 0, p.meta, p.scale)
    attention = [x for x in ran if x.kernel is triton_attention._paged_attention_kernel]
    assert len(attention) == attention_launches, [x.kwargs["BLOCK_M"] for x in attention]
    assert [x.kernel for x in ran].count(triton_store._store_kv_kernel) == 1
    ref = paged_attention_reference(p.query[:t], p.cache, 0, p.meta, p.scale)
    torch.testing.assert_close(out.float(), ref.float(), **_tolerance(p))


def _valid_kwargs() -> dict:
    p = _build("fp8_e4m3", torch.float32, batch=Batch((1, 2), (3, 20)), seed=12)
    k_cache, v_cache = p.cache.layer(0)
    ks, vs = p.cache.layer_scales(0)  # type: ignore[misc]
    m = p.meta
    return dict(query=p.query, k_cache=k_cache, v_cache=v_cache, out=torch.empty_like(p.query),
                query_start_loc=m.query_start_loc, seq_lens=m.seq_lens, block_tables=m.block_tables,
                max_query_len=2, max_seq_len=20, scale=0.125, sliding_window=None, fp8=E4M3, k_scale=ks, v_scale=vs)


def _bad_cases() -> list[tuple[str, dict, str]]:
    f32 = torch.float32
    q = torch.zeros(3 + PAD_ROWS, 4, 64)
    cache16 = torch.zeros(8, 2, 16, 64, dtype=torch.bfloat16)
    int4_scales = {"k_scale": None, "v_scale": None, "k_token_scales": torch.ones(8, 2, 16),
                   "v_token_scales": torch.ones(8, 2, 16)}
    return [
        ("query dtype", {"query": q.to(torch.int32)}, "query must be"),
        ("out dtype", {"out": q.to(torch.bfloat16)}, "out must match"),
        ("float cache with fp8", {"k_cache": cache16, "v_cache": cache16}, "k_cache.dtype"),
        ("fp8 cache without fp8", {"fp8": None, "k_scale": None, "v_scale": None}, "k_cache.dtype"),
        ("GQA ratio", {"query": torch.zeros(5, 3, 64), "out": torch.zeros(5, 3, 64)}, "multiple of"),
        ("head_dim mismatch", {"query": torch.zeros(5, 4, 32), "out": torch.zeros(5, 4, 32)}, "head_dim"),
        ("query_start_loc length", {"query_start_loc": torch.tensor([0, 1])}, "B \\+ 1"),
        ("index dtype", {"seq_lens": torch.tensor([3.0, 20.0])}, "seq_lens must be"),
        ("table ndim", {"block_tables": torch.zeros(2, dtype=torch.int64)}, "block_tables must be"),
        ("no scales", {"k_scale": None, "v_scale": None}, "exactly one kind"),
        ("one scale", {"v_scale": None}, "pairs"),
        ("both kinds", {"k_token_scales": torch.ones(8, 2, 16)}, "exactly one kind"),
        ("scale shape", {"k_scale": torch.ones(3, 1)}, "does not broadcast"),
        ("token scale shape", {"k_scale": None, "v_scale": None, "k_token_scales": torch.ones(2, 2, 16),
                               "v_token_scales": torch.ones(2, 2, 16)}, "k_token_scales must be"),
        ("splits", {"num_kv_splits": 0}, "num_kv_splits"),
        ("too many splits", {"num_kv_splits": MAX_KV_SPLITS + 1}, "num_kv_splits"),
        ("window", {"sliding_window": 0}, "sliding_window"),
        ("max_query_len", {"max_query_len": -1}, "max_query_len"),
        ("min_query_len", {"min_query_len": 3}, r"min_query_len=3 must be an int in \[0, 2\]"),
        ("scale", {"scale": float("nan")}, "scale="),
        ("format layout", {"fp8": FP8Format(
            name="fp8_e5m2fnuz", exponent_bits=5, mantissa_bits=2, exponent_bias=16, max_finite=57344.0,
            min_subnormal=2.0 ** -17, torch_dtype=torch.float8_e5m2fnuz, has_negative_zero=False, has_inf=False,
            nan_codes=(0x80,), nan_code=0x80)}, r"fp8 format 'fp8_e5m2fnuz': 5 exponent bits with exponent_bias=16"),
        ("not a format", {"fp8": SimpleNamespace(name="fp8_e3m4")}, r"fp8=.* is not an FP8 format"),
        ("head_dim too large", {"query": torch.zeros(5, 4, 320), "out": torch.zeros(5, 4, 320),
                                "k_cache": torch.zeros(8, 2, 16, 320, dtype=torch.uint8),
                                "v_cache": torch.zeros(8, 2, 16, 320, dtype=torch.uint8)},
         r"head_dim=320 .*1 \.\. 256"),
        ("query strided", {"query": torch.zeros(5, 4, 128)[:, :, ::2]}, "contiguous last dim"),
        ("table device", {"block_tables": torch.zeros(2, 2, dtype=torch.int64, device="meta")}, "block_tables is on"),
        ("window bool", {"sliding_window": True}, "sliding_window=True"),
        ("seq_lens strided", {"seq_lens": torch.tensor([3, 0, 20, 0])[::2]}, "seq_lens must be contiguous"),
        ("fp32 scale for 16-bit cache", {"k_cache": cache16.to(f32), "v_cache": cache16.to(f32), "fp8": None},
         "16/32-bit cache"),
        ("int8 with a uint8 cache", {"fp8": INT8}, r"k_cache.dtype=torch.uint8 but fp8='int8' needs torch.int8"),
        ("int8 with static scales", {"fp8": INT8, "k_cache": torch.zeros(8, 2, 16, 64, dtype=torch.int8),
                                     "v_cache": torch.zeros(8, 2, 16, 64, dtype=torch.int8)},
         r"int8 cache needs its dynamic k_token_scales and v_token_scales .* \(got static ones\)"),
        ("int8 layout", {"fp8": SimpleNamespace(name="int8", bits=8, max_finite=128.0)},
         r"integer format 'int8': bits=8, max_finite=128.0"),
        ("int4 row of D bytes", {"fp8": INT4, **int4_scales},
         r"cache row width=64 != 32, the bytes of query head_dim=64 in two codes per byte"),
        ("int4_g32 with scales", {"fp8": INT4_G32, **int4_scales,
                                  "k_cache": torch.zeros(8, 2, 16, 36, dtype=torch.uint8),
                                  "v_cache": torch.zeros(8, 2, 16, 36, dtype=torch.uint8)},
         r"an int4_g32 cache keeps a scale per group of 32 values in each row; it takes no k_scale"),
        ("int4_g32 head_dim 48", {"fp8": INT4_G32, "k_scale": None, "v_scale": None,
                                  "query": torch.zeros(5, 4, 48), "out": torch.zeros(5, 4, 48),
                                  "k_cache": torch.zeros(8, 2, 16, 27, dtype=torch.uint8),
                                  "v_cache": torch.zeros(8, 2, 16, 27, dtype=torch.uint8)},
         r"an int4_g32 cache has a scale per group of 32 values: it needs a head_dim that is a multiple of 32"),
        ("fp4 with scales", {"fp8": FP4_E2M1, **int4_scales,
                             "k_cache": torch.zeros(8, 2, 16, 36, dtype=torch.uint8),
                             "v_cache": torch.zeros(8, 2, 16, 36, dtype=torch.uint8)},
         r"an e2m1 cache keeps a scale per group of 16 values in each row; it takes no k_scale"),
        ("fp4 row width", {"fp8": FP4_E2M1, "k_scale": None, "v_scale": None},
         r"cache row width=64 != 36, the bytes of query head_dim=64 in two codes per byte and 1 per group of 16's "
         r"scale"),
        ("fp4 odd head_dim", {"fp8": FP4_E2M1, "k_scale": None, "v_scale": None, "query": torch.zeros(5, 4, 63),
                              "out": torch.zeros(5, 4, 63), "k_cache": torch.zeros(8, 2, 16, 35, dtype=torch.uint8),
                              "v_cache": torch.zeros(8, 2, 16, 35, dtype=torch.uint8)},
         r"an e2m1 cache packs two codes per byte: it needs an even head_dim, got 63"),
        ("int4 odd head_dim", {"fp8": INT4, **int4_scales, "query": torch.zeros(5, 4, 63),
                               "out": torch.zeros(5, 4, 63), "k_cache": torch.zeros(8, 2, 16, 31, dtype=torch.uint8),
                               "v_cache": torch.zeros(8, 2, 16, 31, dtype=torch.uint8)},
         r"an int4 cache packs two codes per byte: it needs an even head_dim, got 63"),
    ]


@pytest.mark.parametrize("what,change,message", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_arguments_raise_value_error(what: str, change: dict, message: str) -> None:
    kwargs = _valid_kwargs()
    kwargs.update(change)
    kwargs = on_device(kwargs)
    query, k_cache, v_cache, out = (kwargs.pop(n) for n in ("query", "k_cache", "v_cache", "out"))
    with pytest.raises(ValueError, match=message):
        unified_attention(query, k_cache, v_cache, out, **kwargs)


def test_valid_kwargs_run() -> None:
    """The base of the bad-argument cases is itself valid (so each case fails for its own reason)."""
    kwargs = on_device(_valid_kwargs())
    query, k_cache, v_cache, out = (kwargs.pop(n) for n in ("query", "k_cache", "v_cache", "out"))
    unified_attention(query, k_cache, v_cache, out, **kwargs)
    assert not out[:3].isnan().any()


# ---- compiled for an H100 without one ------------------------------------------------------------------------------

# Run in a fresh interpreter without TRITON_INTERPRET (this module's kernels are interpreted): compile the attention
# kernel's variants and the split merge for sm_90 with Triton's own compiler, assemble the PTX with the wheel's
# ptxas, and report registers, spills and the FP8 conversions used. argv[1]: JSON list of variants.
_COMPILE_SCRIPT = r"""
import json, os, re, subprocess, sys, tempfile
os.environ.pop("TRITON_INTERPRET", None)
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kv8.kernels.triton import attention as A
from kv8.kernels.triton.formats import kernel_format
from kv8.quant.formats import FP8_FORMATS, INT4, INT8
from kv8.quant.int4_group import INT4_G32

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32, "u8": torch.uint8, "i8": torch.int8}
PTR = {torch.bfloat16: "*bf16", torch.float16: "*fp16", torch.float32: "*fp32", torch.uint8: "*u8", torch.int8: "*i8"}
# the ptxas Triton itself runs for sm_90 (Triton 3.9 emits PTX 9.4, which only its newer bundled ptxas reads)
from triton.backends.nvidia.compiler import get_ptxas
ptxas = get_ptxas(90).path
target = GPUTarget("cuda", 90, 32)


def signature(fn, const, ptr_types):
    sig = {}
    for name in fn.arg_names:
        if name in const:
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = ptr_types.get(name, "*fp32")
        else:
            sig[name] = "fp32" if name == "qk_scale" else "i32"
    return sig


# what Triton's JIT specialises at the wrappers' launches when head_dim % 16 == 0 (every variant here): pointers
# and the q/out/cache strides divisible by 16 (so K/V tiles load in 16-byte vectors)
ALIGNED = {"stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb", "stride_kh", "stride_kt", "stride_vb",
           "stride_vh", "stride_vt"}


def aligned(fn, sig):
    return {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names)
            if sig[name] != "constexpr" and (name.endswith("_ptr") or name in ALIGNED)}


def assemble(kernel):
    info = {"cvt_fp8": sorted(set(re.findall(r"cvt\.[a-z0-9.]*e[45]m[23][a-z0-9.]*", kernel.asm["ptx"])))}
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(kernel.asm["ptx"])
    log = subprocess.run([ptxas, "-arch=sm_90a", "-v", f.name, "-o", os.devnull], capture_output=True, text=True)
    os.unlink(f.name)
    assert log.returncode == 0, log.stderr
    info["registers"] = int(re.search(r"Used (\d+) registers", log.stderr).group(1))
    info["spill_bytes"] = sum(int(x) for x in re.findall(r"(\d+) bytes spill", log.stderr))
    return info


results = []
for v in json.loads(sys.argv[1]):
    splits = v.pop("splits")
    v["query_dtype"], v["cache_dtype"] = DTYPES[v["query_dtype"]], DTYPES[v["cache_dtype"]]
    v["fp8"] = None if v["fp8"] is None else kernel_format({**FP8_FORMATS, "int8": INT8, "int4": INT4,
                                                           "int4_g32": INT4_G32}[v["fp8"]])
    variant = A.KernelVariant(**v)
    const = variant.constexprs(splits)
    q_ptr = PTR[variant.query_dtype]
    ptrs = {"out_ptr": q_ptr, "q_ptr": q_ptr, "k_ptr": PTR[variant.cache_dtype], "v_ptr": PTR[variant.cache_dtype],
            "qsl_ptr": "*i32", "seq_lens_ptr": "*i32", "table_ptr": "*i32"}
    fn = A._paged_attention_kernel
    sig = signature(fn, const, ptrs)
    kernel = triton.compile(ASTSource(fn, sig, const, aligned(fn, sig)), target=target,
                            options=variant.config.options)
    info = assemble(kernel)
    if splits > 1:
        merge = A._merge_splits_kernel
        mconst = dict(HEAD_DIM=variant.head_dim, D_PAD=variant.config.d_pad, NUM_SPLITS=splits,
                      SPLITS_PAD=max(2, triton.next_power_of_2(splits)))
        mk = triton.compile(ASTSource(merge, signature(merge, mconst, {"out_ptr": q_ptr, "qsl_ptr": "*i32"}), mconst),
                            target=target, options={"num_warps": 4})
        info["merge"] = assemble(mk)
    results.append(info)
print(json.dumps(results))
"""


def _variant(query: str = "bf16", kv: str = "fp8_e4m3", native: bool = True, scales: int = 1,
             k_channel: bool = False, window: bool = False, group: int = 4, head_dim: int = 128, block_size: int = 16,
             max_query_len: int = 1, splits: int = 1) -> dict:
    """A KernelVariant's fields (JSON: dtypes by short name); ``kv`` an FP8 format's name, "int8" or "int4"
    (dynamic scales whatever ``scales`` says) or a cache dtype."""
    fp8 = kv in FP8_FORMATS
    if kv in ("int8", "int4", "int4_g32"):
        scales = triton_attention.SCALES_NONE if kv == "int4_g32" else triton_attention.SCALES_DYNAMIC
        return dict(_variant(query, "fp8_e4m3", False, scales, k_channel, window, group, head_dim, block_size,
                             max_query_len, splits), cache_dtype="i8" if kv == "int8" else "u8", fp8=kv)
    return dict(query_dtype=query, cache_dtype="u8" if fp8 else kv, fp8=kv if fp8 else None,
                native_fp8=native and fp8, scales=scales if fp8 else triton_attention.SCALES_NONE,
                k_channel_scale=k_channel, sliding_window=window, group=group, head_dim=head_dim,
                block_size=block_size, max_query_len=max_query_len, splits=splits)


# what the engine launches on an H100 most (decode and prefill over E4M3 with bf16 queries), and the corners: the
# largest tiles, head_dim 256 and 96, float32 products, per-key table gathers, the exact bit decode, split-K
_SM90_VARIANTS = {
    "decode-bf16-e4m3-native": _variant(),
    "prefill-bf16-e4m3-native-channel": _variant(k_channel=True, max_query_len=512),
    "prefill-fp16-e5m2-dynamic-window-d96": _variant(query="fp16", kv="fp8_e5m2", scales=2, window=True,
                                                      head_dim=96, max_query_len=512),
    "split-bf16-fnuz-bits-d256": _variant(kv="fp8_e4m3fnuz", native=False, group=8, head_dim=256, splits=8),
    "prefill-bf16-e4m3-d256-bs32": _variant(group=1, head_dim=256, max_query_len=512, block_size=32),
    "prefill-bf16-cache-bf16": _variant(kv="bf16", max_query_len=512),
    "prefill-fp32-cache-fp32": _variant(query="fp32", kv="fp32", max_query_len=512),
    "decode-bs8-gather": _variant(block_size=8),
    "decode-bf16-e4m3-dynamic-window": _variant(scales=2, window=True),
    "decode-fp16-e5m2-native-channel": _variant(query="fp16", kv="fp8_e5m2", k_channel=True),
    "prefill-gqa8-d64-split3": _variant(group=8, head_dim=64, max_query_len=512, splits=3),
    "decode-bf16-int8-split3": _variant(kv="int8", splits=3),
    "prefill-fp16-int8-window": _variant(query="fp16", kv="int8", window=True, max_query_len=512),
    "decode-bf16-int4-split3": _variant(kv="int4", splits=3),
    "prefill-bf16-int4-window": _variant(kv="int4", window=True, max_query_len=512),
    "decode-bf16-int4g32-split3": _variant(kv="int4_g32", splits=3),
    "prefill-fp16-int4g32-d96": _variant(query="fp16", kv="int4_g32", head_dim=96, max_query_len=512),
}


def test_kernels_compile_for_sm90_without_spills(tmp_path: Path) -> None:
    """The kernels as compiled for an H100 (Triton's compiler, the wheel's ptxas; no GPU needed): what the
    interpreter cannot check -- the compiled constexpr branches, tl.dot shapes and dtypes, the native FP8
    conversions (used exactly where asked for), and registers: every variant fits sm_90's 255 per thread without
    spilling (launch_config's tile sizes). The variants take the cache strides as divisible by 16, which rows of a
    group format need not be (int4_per_group32's and fp4_e2m1's 72 bytes at head_dim 128): fp4_e2m1's kernels are
    compiled as the wrappers launch them in tests/kernels/test_triton_compiled.py."""
    pytest.importorskip("triton.backends.nvidia")
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("TRITON_INTERPRET", None)
    variants = list(_SM90_VARIANTS.values())
    run = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT, json.dumps(variants)], env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    results = json.loads(run.stdout.strip().splitlines()[-1])
    for (name, v), info in zip(_SM90_VARIANTS.items(), results):
        assert info["spill_bytes"] == 0 and info["registers"] <= 255, (name, info)
        assert bool(info["cvt_fp8"]) == v["native_fp8"], (name, info)      # the bit path converts no FP8
        if v["splits"] > 1:
            assert info["merge"]["spill_bytes"] == 0, (name, info)


# ---- a sample of the full sweep ----------------------------------------------------------------------------------

_SWEEP_KV = FLOAT_CACHES + FP8_CACHES + (INT8_CACHE, INT4_CACHE, FP4_CACHE)
_SWEEP_SHAPES = ((64, 4), (128, 8), (96, 2), (256, 1))                   # (head_dim, group)
_SWEEP_WINDOWS = ((None, 1), (None, 5), (13, 1), (29, 3))               # (sliding_window, num_kv_splits)
_SWEEP_QUERIES = (torch.float32, torch.bfloat16, torch.float16)
if os.environ.get("KV8_TRITON_FULL_SWEEP") == "1":                      # every combination
    _SWEEP = list(itertools.product(_SWEEP_KV, _SWEEP_SHAPES, _SWEEP_WINDOWS, _SWEEP_QUERIES))
else:
    # two cases per cache dtype: the twelve (shape, window) pairs off the diagonal, so each shape and each window /
    # split pair comes up three times, each query dtype four; and two each for int8, int4 and fp4_e2m1
    _f32, _bf16, _f16 = _SWEEP_QUERIES
    _SWEEP = [(kv, _SWEEP_SHAPES[s], _SWEEP_WINDOWS[w], q) for kv, s, w, q in (
        ("bfloat16", 0, 1, _bf16), ("bfloat16", 2, 3, _f32),
        ("float16", 1, 0, _f16), ("float16", 3, 2, _bf16),
        ("float32", 0, 2, _f32), ("float32", 1, 3, _f16),
        ("fp8_e4m3", 2, 0, _bf16), ("fp8_e4m3", 3, 1, _f16),
        ("fp8_e4m3fnuz", 0, 3, _f32), ("fp8_e4m3fnuz", 2, 1, _bf16),
        ("fp8_e5m2", 1, 2, _f16), ("fp8_e5m2", 3, 0, _f32),
        (INT8_CACHE, 1, 1, _bf16), (INT8_CACHE, 0, 2, _f16),
        (INT4_CACHE, 2, 3, _bf16), (INT4_CACHE, 3, 0, _f32),
        (FP4_CACHE, 0, 3, _bf16), (FP4_CACHE, 2, 2, _f16),
    )]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv,shape,window_splits,q_dtype", _SWEEP,
                         ids=lambda v: str(v).replace("torch.", "").replace(" ", ""))
def test_sweep(kv: str, shape: tuple[int, int], window_splits: tuple[int | None, int], q_dtype: torch.dtype,
               device: str) -> None:
    (head_dim, group), (window, splits) = shape, window_splits
    batch = Batch((1, 7, 21, 0, 1, 2, 1), (130, 40, 21, 7, 1, 90, 48))
    scales = "dynamic" if kv == "fp8_e5m2" else "channel" if kv == "fp8_e4m3fnuz" else "head"
    p = _build(kv, q_dtype, head_dim=head_dim, kv_heads=2, group=group, batch=batch, window=window,
               scales=scales, seed=13 + head_dim + group)
    _check(p, _run(p, device, num_kv_splits=splits))


def test_compiled_kernels_refuse_4_bit_codes_above_head_dim_128(monkeypatch: pytest.MonkeyPatch) -> None:
    """Compiled (not interpreted), a 4-bit side above :data:`COMPILED_PACKED_MAX_HEAD_DIM` is refused before any
    launch, naming the side, its format and the head_dim; int8 and FP8 sides, and head_dim 128, pass the check."""
    from kv8.kernels.triton.formats import check_compiled_packed_head_dim

    int8, g32, fp8 = kernel_format(INT8), kernel_format(INT4_G32), kernel_format(E4M3)
    check_compiled_packed_head_dim((g32, g32), 128)
    check_compiled_packed_head_dim((int8, fp8), 256)
    check_compiled_packed_head_dim((None, None), 256)
    with pytest.raises(ValueError, match=r"V's int4_g32 codes at head_dim=256: the compiled Triton attention"):
        check_compiled_packed_head_dim((int8, g32), 256)
    with pytest.raises(ValueError, match=r"K's int4 codes at head_dim=160"):
        check_compiled_packed_head_dim((kernel_format(INT4), None), 160)
    # the wrapper makes the check before its device check: compiled, CPU tensors reach it too
    monkeypatch.setattr(triton_interpreter, "INTERPRETED", False)
    p = _build(INT4G_CACHE, torch.bfloat16, head_dim=256, kv_heads=1, group=1, block_size=32, seed=3)
    with pytest.raises(ValueError, match=r"unified_attention: K's int4_g32 codes at head_dim=256"):
        _run(p, "cpu")
