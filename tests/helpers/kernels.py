"""kv8's native kernels in tests: a library's AMX or AVX-512 path chosen for a test (the kernel, layer and FP8
weight tests' fixtures), the attention library's test cases and item-kernel checks (the fused attention and
sliding-window tests, the empty-batch and thread tests), and the dense library loaded once, with an engine run on a
chosen dense backend (the layers and the model tests)."""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kv8.attention.metadata import AttentionMetadata
from kv8.cache.codec import KVCodec
from kv8.cache.paged_cache import CacheShape, PagedKVCache
from kv8.engine.args import EngineArgs
from kv8.engine.engine import LLMEngine
from kv8.kernels.cpu import attention as kernels
from kv8.kernels.cpu.attention import load_kernels
from kv8.kernels.cpu.build import KernelUnavailable, cpu_flags
from kv8.kernels.cpu.dense import DenseKernels, load_dense_kernels
from kv8.observer import EngineObserver
from kv8.quant.formats import KVCacheDtype, resolve_kv_cache_dtype
from kv8.quant.scales import KVScales, ScaleGranularity
from kv8.sampling_params import SamplingParams

FP8 = ["fp8_e4m3", "fp8_e4m3fnuz", "fp8_e5m2"]
INT8 = "int8_per_token_head"   # int8 codes, a scale per token and head (always dynamic)
INT4 = "int4_per_token_head"   # int4 codes, two per byte, a scale per token and head (always dynamic)
FP4 = "fp4_e2m1"               # E2M1 codes, two per byte, an E4M3 scale per 16 values in the row
I4G = "int4_per_group32"       # int4 codes, two per byte, a float16 scale per 32 values in the row (head_dim % 32 == 0)
#: the formats whose prefill items the tile kernel reads through tiles decoded to bf16 (csrc/attention/item_staged.h;
#: on AMX tiles where the library has them, as a bf16 cache's; int4_per_group32 with bf16 compute only)
STAGED = [INT8, INT4, FP4, I4G]

# A ragged batch mixing decode and chunked prefill over cached prefixes; lengths at / across block edges.
QUERY_LENS = [1, 1, 1, 5, 16, 17, 1]
SEQ_LENS = [1, 16, 33, 21, 48, 17, 130]
#: the fused attention's tolerance against the reference, by output dtype: |out - ref| <= TOL * (1 + max|ref|)
#: (tests/kernels/test_fused_attention.py says why)
TOL = {torch.float32: 5e-5, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}


# ---- either library's two paths (AMX tiles, AVX-512) ------------------------------------------------------------
@contextlib.contextmanager
def amx_path(lib: Any, path: str) -> Iterator[str]:
    """Runs the body with a kernel library's ``amx`` flag set for ``path`` ("amx": AMX tiles; any other name: the
    AVX-512 path), restored afterwards; an "amx" path is skipped where the library has no AMX tiles (this CPU,
    build or OS). For the fixtures that run a test on each of a library's two paths."""
    if path == "amx" and not lib.amx:
        pytest.skip("this CPU, build or OS gives no AMX-BF16 tiles")
    chosen = lib.amx
    lib.amx = path == "amx"
    try:
        yield path
    finally:
        lib.amx = chosen


# ---- the GGUF int8 kernel's paths (avx2, vnni256, vnni512) --------------------------------------------------------
@contextlib.contextmanager
def gguf_path(lib: DenseKernels, path: str) -> Iterator[DenseKernels]:
    """Runs the body with the dense library's GGUF kernel on ``path`` (:attr:`DenseKernels.gguf_path`), restored
    afterwards; skipped where the build has no such path (this CPU or compiler)."""
    if path not in lib.gguf_paths:
        pytest.skip(f"this build's GGUF kernel has no {path} path (it has: {list(lib.gguf_paths) or 'none'})")
    chosen = lib.gguf_path
    lib.gguf_path = path
    try:
        yield lib
    finally:
        lib.gguf_path = chosen


# ---- the attention library --------------------------------------------------------------------------------------
def cpu_has_fast_path() -> bool:
    """AVX-512 F/BW/VL + VBMI + BF16: what the fast path needs (this project's machine has them)."""
    flags = set(cpu_flags().split())
    return {"avx512f", "avx512bw", "avx512vl", "avx512vbmi", "avx512_bf16"} <= flags


def make_cache(shape: CacheShape, kv: KVCacheDtype, scales: KVScales | None, dynamic: bool = False) -> PagedKVCache:
    """A cache whose codec stores ``kv`` with static ``scales`` (or dynamic scales)."""
    codec = KVCodec.build(kv, shape.head_dim, scale_mode="dynamic" if dynamic else "static",
                          scales=scales if kv.is_fp8 else None)
    return PagedKVCache(shape, codec)


def make_scales(kv_name: str, gran: str, layers: int, heads: int, dim: int,
                gen: torch.Generator) -> KVScales | None:
    """Random static scales of granularity ``gran`` for an FP8 ``kv_name``; None for other dtypes or dynamic."""
    if kv_name not in FP8 or gran == "dynamic":
        return None
    shape = {"tensor": (layers, 1, 1), "head": (layers, heads, 1), "channel": (layers, heads, dim)}[gran]
    k = 0.004 + 0.03 * torch.rand(shape, generator=gen)
    v = 0.004 + 0.03 * torch.rand(shape, generator=gen)
    return KVScales(k=k, v=v, granularity=ScaleGranularity(gran), source="test", made_for=None)


def random_kv(n: int, heads: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    """Values over a wide dynamic range, so FP8 codes include subnormals, saturation and both signs."""
    mag = torch.exp2(torch.empty(n, heads, dim).uniform_(-14.0, 4.0, generator=gen))
    return torch.randn(n, heads, dim, generator=gen) * mag * 0.5 + torch.randn(n, heads, dim, generator=gen)


def stored(cache: PagedKVCache, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Raw K and V contents (and dynamic token scales) at ``slots``, as integers for bitwise comparison."""
    bs = cache.shape.block_size
    blocks, offsets = slots // bs, slots % bs
    out = []
    for codes in (cache.k_data, cache.v_data):
        raw = codes.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[codes.element_size()])
        out.append(raw[layer][blocks, :, offsets])
    out += [ts[layer][blocks, :, offsets].view(torch.int32)
            for ts in (cache.k_token_scales, cache.v_token_scales) if ts is not None]
    return tuple(out)


def fill_codes(cache: PagedKVCache, value: float) -> None:
    """Every code (or 16/32-bit value) of the cache's K and V tensors set to ``value``."""
    for codes in (cache.k_data, cache.v_data):
        codes.fill_(value)


def scattered_tables(seq_lens: list[int], bs: int, gen: torch.Generator, *,
                     block0_unused: bool = False) -> tuple[list[list[int]], int]:
    """Block tables for sequences of ``seq_lens`` tokens in a random order of ``num_blocks`` (3 more than they
    need; with ``block0_unused`` block 0 is in no table) -> ``(tables, num_blocks)``."""
    counts = [math.ceil(s / bs) for s in seq_lens]
    num_blocks = sum(counts) + 3
    perm = ((torch.randperm(num_blocks - 1, generator=gen) + 1) if block0_unused else
            torch.randperm(num_blocks, generator=gen)).tolist()
    tables, i = [], 0
    for n in counts:
        tables.append(perm[i:i + n])
        i += n
    return tables, num_blocks


def make_case(kv_name: str, gran: str, q_dtype: torch.dtype, *, group: int = 3, dim: int = 64, bs: int = 16,
              heads: int = 2, query_lens: list[int] | None = None, seq_lens: list[int] | None = None,
              seed: int = 0, poison: bool = False) -> tuple[PagedKVCache, AttentionMetadata, torch.Tensor]:
    """A 2-layer cache whose layer 1 holds every context token (stored by the reference), metadata for the
    new tokens, and queries [T, heads * group, dim]. ``poison``: every slot (and dynamic scale) that holds no
    context token is NaN, so a kernel that reads past a sequence's last token returns NaN."""
    query_lens = QUERY_LENS if query_lens is None else query_lens
    seq_lens = SEQ_LENS if seq_lens is None else seq_lens
    gen = torch.Generator().manual_seed(seed)
    kv = resolve_kv_cache_dtype(kv_name, torch.bfloat16)
    tables, num_blocks = scattered_tables(seq_lens, bs, gen)
    cache = make_cache(CacheShape(2, num_blocks, heads, bs, dim), kv, make_scales(kv_name, gran, 2, heads, dim, gen),
                       gran == "dynamic")
    everything = AttentionMetadata.build(list(seq_lens), list(seq_lens), tables, bs)
    if poison:
        if kv_name in FP8:
            fill_codes(cache, 0x80 if kv_name == "fp8_e4m3fnuz" else 0x7F)  # the formats' NaN codes
        elif kv_name in (INT8, INT4):
            fill_codes(cache, 127)   # no NaN code: the NaN token scales below poison it
        elif kv_name in (FP4, I4G):
            fill_codes(cache, 0xFF)  # the group scales' bytes read as E4M3's / float16's NaN
        else:
            fill_codes(cache, float("nan"))
        for ts in (cache.k_token_scales, cache.v_token_scales):
            if ts is not None:
                ts.fill_(float("nan"))
    total = sum(seq_lens)
    dtype = q_dtype if kv.is_quantized else kv.storage_dtype
    cache.store(1, random_kv(total, heads, dim, gen).to(dtype), random_kv(total, heads, dim, gen).to(dtype),
                everything.slot_mapping)
    meta = AttentionMetadata.build(list(query_lens), list(seq_lens), tables, bs)
    q = torch.randn(sum(query_lens), heads * group, dim, generator=gen).to(q_dtype)
    return cache, meta, q


def make_pair_cache(shape: CacheShape, k_name: str, v_name: str) -> PagedKVCache:
    """A cache whose keys are stored in ``k_name`` and values in ``v_name`` (a K/V pair: per-token scales on its FP8
    and integer sides, group scales in a group-scaled side's rows, none on a 16/32-bit side)."""
    k, v = (resolve_kv_cache_dtype(name, torch.bfloat16) for name in (k_name, v_name))
    return PagedKVCache(shape, KVCodec.build(k, shape.head_dim, v_dtype=v))


def make_pair_case(k_name: str, v_name: str, q_dtype: torch.dtype, *, group: int = 3, dim: int = 64, bs: int = 16,
                   heads: int = 2, query_lens: list[int] | None = None, seq_lens: list[int] | None = None,
                   seed: int = 0) -> tuple[PagedKVCache, AttentionMetadata, torch.Tensor]:
    """:func:`make_case` for a K/V pair (:func:`make_pair_cache`): K stored in ``k_name``, V in ``v_name``, by the
    reference store."""
    query_lens = QUERY_LENS if query_lens is None else query_lens
    seq_lens = SEQ_LENS if seq_lens is None else seq_lens
    gen = torch.Generator().manual_seed(seed)
    tables, num_blocks = scattered_tables(seq_lens, bs, gen)
    cache = make_pair_cache(CacheShape(2, num_blocks, heads, bs, dim), k_name, v_name)
    everything = AttentionMetadata.build(list(seq_lens), list(seq_lens), tables, bs)
    total = sum(seq_lens)
    cache.store(1, random_kv(total, heads, dim, gen).to(q_dtype), random_kv(total, heads, dim, gen).to(q_dtype),
                everything.slot_mapping)
    meta = AttentionMetadata.build(list(query_lens), list(seq_lens), tables, bs)
    q = torch.randn(sum(query_lens), heads * group, dim, generator=gen).to(q_dtype)
    return cache, meta, q


def load_or_skip(march: str = "native") -> kernels.KernelLibrary:
    """The kernels for ``march``; the test is skipped (with the reason) where they cannot be built."""
    try:
        return load_kernels(march)
    except KernelUnavailable as exc:
        pytest.skip(f"fused CPU kernels unavailable: {exc}")


def portable_path(lib: kernels.KernelLibrary, dim: int, kv_name: str | None = None) -> str:
    """The item kernel of a library without the AVX-512 BF16 path (or of a format / head dim it does not take):
    "avx2" where the build has the AVX2 kernel and head_dim is a multiple of 8 (up to 1024), else "generic" (always
    for the group-scaled FP4 and int4_per_group32)."""
    return "avx2" if lib.has_avx2_path and dim % 8 == 0 and dim <= 1024 and kv_name not in (FP4, I4G) else "generic"


def prefill_kernel(lib: kernels.KernelLibrary, kv_name: str, gran: str, q_dtype: torch.dtype, dim: int,
                   bs: int = 16) -> str:
    """The item kernel of a 48-row prefill item, asserted to be the expected one: :func:`portable_path` without the
    fast path (or for int4_per_group32 with fp16 / fp32 compute); "amx" where the library multiplies with AMX tiles
    and the item qualifies (bf16 compute, K scales not per channel, head_dim a multiple of 64 up to 256; the
    :data:`STAGED` formats too, on their staged tiles); else "prefill" (head_dim <= 128) or "tile"."""
    got = kernels.KernelTesting(lib).item_kernel(kv_name, q_dtype, dim, bs, 48, k_per_channel=gran == "channel")
    if not lib.has_fast_path or (kv_name == I4G and q_dtype != torch.bfloat16):
        expected = portable_path(lib, dim, kv_name)
    elif lib.amx and q_dtype == torch.bfloat16 and gran != "channel" and dim % 64 == 0 and dim <= 256:
        expected = "amx"
    else:
        expected = "prefill" if dim <= 128 else "tile"
    assert got == expected, (got, expected)
    return got


def decode_kernel(lib: kernels.KernelLibrary, kv_name: str, gran: str, dim: int, bs: int, rows: int) -> str:
    """The item kernel of a decode-sized item (bf16 compute, <= 4 rows, head_dim 64 / 128 / 256, blocks of a
    multiple of 16 tokens), asserted to be the expected one: :func:`portable_path` without the fast path;
    "amx_decode" where the library multiplies with AMX tiles, the K scales are not per channel and the cache is
    not 4-bit coded (int4 / int4_per_group32 / FP4 run the AVX-512 decode kernel only); else "decode"."""
    got = kernels.KernelTesting(lib).item_kernel(kv_name, torch.bfloat16, dim, bs, rows,
                                                 k_per_channel=gran == "channel")
    if not lib.has_fast_path:
        expected = portable_path(lib, dim, kv_name)
    else:
        expected = ("amx_decode" if lib.amx and gran != "channel" and kv_name not in (INT4, I4G, FP4)
                    else "decode")
    assert got == expected, (got, expected)
    return got


# ---- the dense library ------------------------------------------------------------------------------------------
@functools.cache
def dense_kernels_or_reason() -> tuple[DenseKernels | None, str]:
    """kv8's dense kernels and "", or None and why they cannot be loaded here (tried once per process)."""
    try:
        return load_dense_kernels(), ""
    except KernelUnavailable as exc:
        return None, str(exc)


def dense_build_or_skip(march: str) -> DenseKernels:
    """The dense kernels built for ``march``: "native" (the engine's build) or "x86-64-v3" (the AVX2 path, so that a
    CPU whose native build takes the AVX-512 path tests the AVX2 one too); the test is skipped, with the reason, where
    that build cannot run here or is the native one again."""
    native, why = dense_kernels_or_reason()
    if march == "native":
        if native is None:
            pytest.skip(f"kv8's dense kernels are unavailable: {why}")
        return native
    if not {"avx2", "fma", "f16c"} <= set(cpu_flags().split()):
        pytest.skip("this CPU lacks AVX2 + FMA + F16C: no AVX2 path to test")
    if native is not None and native.isa == "avx2":
        pytest.skip("the native build is the AVX2 path: tested as 'native'")
    try:
        return load_dense_kernels(march)
    except KernelUnavailable as exc:
        pytest.skip(f"kv8's dense kernels for {march} are unavailable: {exc}")


def prefill_logits(model: str, dense_backend: str, prompt: list[int], **kw: object) -> tuple[torch.Tensor, list[int]]:
    """The logits of every prompt position and 4 greedy tokens of an engine in bf16 on ``dense_backend``."""
    rows: list[torch.Tensor] = []

    class Rows(EngineObserver):
        def on_prompt_logits(self, request_id: str, start: int, logits: torch.Tensor) -> None:
            rows.append(logits)

    engine = LLMEngine(EngineArgs(model=model, dtype="bfloat16", dense_backend=dense_backend, num_kv_blocks=16,
                                  max_model_len=128, kv_cache_dtype="fp8_e4m3", **kw), Rows())  # type: ignore[arg-type]
    assert engine.dense_backend == dense_backend
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    return torch.cat(rows), tokens
