"""Fused CPU paged attention and quantize-on-store: a C++ kernel built on first use, called through ctypes.

Why this shape: PyTorch's float8 conversions run at ~1 GB/s on this CPU, so dequantize-then-attend is slower
than a bf16 cache; the dequant has to live inside the attention loop. numba is not installed and
``torch.compile`` takes tens of seconds to start and cannot express the bit-level decode, so the kernels are
plain C++ (``cpu_kernels.cpp``, intrinsics, OpenMP, a C ABI, no torch headers), compiled with the system
``g++`` once (about 11 s; ``scripts/setup.sh`` does it) and cached (:mod:`kv8.native`: one build per
source and included headers, compiler and CPU, atomic publication). The library links ``libgomp.so.1`` by soname, so in a torch process it shares
torch's OpenMP runtime and thread pool.

On a CPU with AVX-512 BF16 + VBMI the kernel decodes FP8 straight to bf16 with in-register byte tables and
multiplies with ``vdpbf16ps`` (exact products, fp32 accumulation); elsewhere, and for fp16/fp32 caches, it
runs an fp32 path that decodes FP8 on bits. Details and precision: see ``cpu_kernels.cpp``. Numerics versus
:func:`kv8.attention.reference.paged_attention_reference`: q and the softmax weights are carried as bf16
hi + lo (about 16 significant bits; q exactly when it is bf16; the weights in bf16 alone when the output is
bf16), products are exact and accumulated in fp32.

The store is bit-exact with :meth:`kv8.cache.paged_cache.PagedKVCache.store` for every finite and infinite
input (FP8: ``saturate(rne(x / scale))``, the NaN rule of :meth:`kv8.quant.formats.FP8Format.encode`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import weakref
from pathlib import Path

import torch

from kv8.attention.metadata import AttentionMetadata
from kv8.cache.paged_cache import PagedKVCache
from kv8.native import KernelUnavailable, build_shared_library

logger = logging.getLogger("kv8")

__all__ = [
    "FusedCPUBackend",
    "KernelLibrary",
    "KernelUnavailable",
    "KV_DTYPE_CODES",
    "load_kernels",
    "paged_attention_fused",
    "store_kv_fused",
]

SOURCE = Path(__file__).with_name("cpu_kernels.cpp")

KV_DTYPE_CODES: dict[str, int] = {
    "fp8_e4m3": 0, "fp8_e4m3fnuz": 1, "fp8_e5m2": 2, "bfloat16": 3, "float16": 4, "float32": 5,
}
_COMPUTE_CODES: dict[torch.dtype, int] = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}
_ERRORS: dict[int, str] = {
    1: "a block table entry is not a valid block id (>= num_blocks or negative)",
    2: "block_tables is too narrow for seq_lens",
    3: "query_start_loc / seq_lens are inconsistent (need 0 <= query_len <= seq_len, query_start_loc[-1] == T)",
    4: "slot_mapping holds a slot outside the cache",
    5: "invalid kernel arguments",
    6: "out of memory in the kernel",
}


def _build(march: str) -> Path:
    """Compile (or find the cached) attention library for ``-march=march``; returns its path."""
    return build_shared_library(SOURCE, march)


_P = ctypes.c_void_p
_I = ctypes.c_int
_L = ctypes.c_int64
_F = ctypes.c_float


class KernelLibrary:
    """The loaded kernels. Build with :func:`load_kernels`."""

    def __init__(self, path: Path, march: str) -> None:
        try:
            lib = ctypes.CDLL(str(path))
        except OSError as exc:
            raise KernelUnavailable(f"cannot load {path}: {exc}") from exc
        self.path = path
        self.march = march
        lib.kv8_has_fast_path.argtypes = []
        lib.kv8_has_fast_path.restype = _I
        lib.kv8_attention_path.argtypes = [_I, _I, _I]
        lib.kv8_attention_path.restype = _I
        lib.kv8_decode_item_path.argtypes = [_I, _I, _I, _I, _I]
        lib.kv8_decode_item_path.restype = _I
        lib.kv8_paged_attention.argtypes = [
            _P, _I, _P, _L, _I, _I, _I,          # q, q_dtype, out, T, Hq, Hkv, D
            _P, _P, _I, _L, _I,                  # k_cache, v_cache, kv, num_blocks, bs
            _P, _L, _L, _P, _L, _L,              # k_scale, strides, v_scale, strides
            _P, _P,                              # k / v token scales (dynamic) or NULL
            _I, _P, _P, _P, _L,                  # B, qsl, seq_lens, block_tables, bt_stride
            _F, _I, _L,                          # sm_scale, nthreads, partition_size
        ]
        lib.kv8_paged_attention.restype = _I
        lib.kv8_store_kv.argtypes = [
            _P, _P, _I, _L, _I, _I, _P,          # key, value, in_dtype, T, H, D, slots
            _P, _P, _I, _L, _I,                  # k_cache, v_cache, kv, num_blocks, bs
            _P, _L, _L, _P, _L, _L,              # k_scale, strides, v_scale, strides
            _P, _P, _I,                          # k / v token scales (dynamic) or NULL, nthreads
        ]
        lib.kv8_store_kv.restype = _I
        lib.kv8_decode_fp8.argtypes = [_I, _I, _P, _L, _P]
        lib.kv8_decode_fp8.restype = _I
        self._lib = lib
        self.has_fast_path = bool(lib.kv8_has_fast_path())

    def attention_path(self, kv_dtype: str, compute_dtype: torch.dtype, head_dim: int) -> str:
        """"fast" (AVX-512 BF16) or "generic" (fp32) for these parameters."""
        fast = self._lib.kv8_attention_path(KV_DTYPE_CODES[kv_dtype], _COMPUTE_CODES[compute_dtype], head_dim)
        return "fast" if fast else "generic"

    def uses_decode_kernel(self, kv_dtype: str, compute_dtype: torch.dtype, head_dim: int, block_size: int,
                           rows: int) -> bool:
        """Whether items of ``rows`` rows (query heads per KV head x query tokens of one sequence) take the
        fast path's decode-item kernel (K/V read in place, softmax per 64 tokens): bf16 compute, an FP8 or
        bf16 cache, head_dim 64 / 128 / 256, blocks of a multiple of 16 tokens, at most 4 rows."""
        return bool(self._lib.kv8_decode_item_path(KV_DTYPE_CODES[kv_dtype], _COMPUTE_CODES[compute_dtype],
                                                   head_dim, block_size, rows))

    def decode_fp8(self, fmt: str, codes: torch.Tensor, path: str) -> torch.Tensor:
        """Decode uint8 ``codes`` with the kernel's bit decoder (``path="bits"``) or bf16 tables (``"tables"``)."""
        if fmt not in ("fp8_e4m3", "fp8_e4m3fnuz", "fp8_e5m2"):
            raise ValueError(f"fmt={fmt!r} is not an FP8 format; choose fp8_e4m3, fp8_e4m3fnuz or fp8_e5m2")
        if path not in ("bits", "tables"):
            raise ValueError(f"path={path!r}; choose 'bits' or 'tables'")
        codes = codes.contiguous()
        if codes.dtype != torch.uint8:
            raise ValueError(f"codes must be uint8, got {codes.dtype}")
        out = torch.empty(codes.shape, dtype=torch.float32)
        rc = self._lib.kv8_decode_fp8(KV_DTYPE_CODES[fmt], 0 if path == "bits" else 1, codes.data_ptr(),
                                      codes.numel(), out.data_ptr())
        if rc != 0:
            raise ValueError(f"decode path {path!r} is not available in this build (march={self.march})")
        return out

    def attention(self, query: torch.Tensor, out: torch.Tensor, cache: PagedKVCache, layer: int,
                  meta: AttentionMetadata, scale: float, partition_size: int = 0) -> None:
        tables = meta.block_tables
        rc = self._lib.kv8_paged_attention(
            query.data_ptr(), _COMPUTE_CODES[query.dtype], out.data_ptr(), query.shape[0], query.shape[1],
            cache.shape.num_kv_heads, cache.shape.head_dim, *_layer_args(cache, layer),
            meta.num_seqs, meta.query_start_loc.data_ptr(), meta.seq_lens.data_ptr(), tables.data_ptr(),
            tables.shape[1], scale, torch.get_num_threads(), partition_size)
        if rc != 0:
            raise ValueError(f"paged attention (layer {layer}): {_ERRORS.get(rc, f'error {rc}')}")

    def store(self, key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache, layer: int,
              slot_mapping: torch.Tensor) -> None:
        rc = self._lib.kv8_store_kv(
            key.data_ptr(), value.data_ptr(), _COMPUTE_CODES[key.dtype], key.shape[0], key.shape[1], key.shape[2],
            slot_mapping.data_ptr(), *_layer_args(cache, layer), torch.get_num_threads())
        if rc != 0:
            raise ValueError(f"store (layer {layer}): {_ERRORS.get(rc, f'error {rc}')}")


# Per cache and layer: (k_cache, v_cache, kv dtype code, num_blocks, block_size, k_scale, k_head_stride,
# k_dim_stride, v_scale, v_head_stride, v_dim_stride, k_token_scales, v_token_scales) -- the argument run the
# C entry points share. Memoized (building views costs ~10 us a call, 2 calls per layer per step) and keyed by
# the tensors' identity and data pointers, so a replaced tensor is never read through a stale pointer.
_LAYER_ARGS: weakref.WeakKeyDictionary[PagedKVCache, tuple[tuple[int, ...], dict[int, tuple[int, ...]]]] = \
    weakref.WeakKeyDictionary()


def _layer_args(cache: PagedKVCache, layer: int) -> tuple[int, ...]:
    scales, token_scales = cache.scales, getattr(cache, "token_scales", None)
    key = (cache.data.data_ptr(), id(scales), 0 if token_scales is None else token_scales.data_ptr())
    entry = _LAYER_ARGS.get(cache)
    if entry is None or entry[0] != key:
        entry = (key, {})
        _LAYER_ARGS[cache] = entry
    args = entry[1].get(layer)
    if args is None:
        args = entry[1][layer] = _compute_layer_args(cache, layer)
    return args


def _compute_layer_args(cache: PagedKVCache, layer: int) -> tuple[int, ...]:
    shape = cache.shape
    if not cache.data.is_contiguous():
        raise ValueError("cache.data must be contiguous")
    k_cache, v_cache = cache.layer(layer)
    args = [k_cache.data_ptr(), v_cache.data_ptr(), KV_DTYPE_CODES[cache.kv_dtype.name], shape.num_blocks,
            shape.block_size]
    scales = cache.layer_scales(layer)
    for s in scales if scales is not None else ():
        if s.dtype != torch.float32 or s.ndim != 2 or s.shape[0] not in (1, shape.num_kv_heads) \
                or s.shape[1] not in (1, shape.head_dim):
            raise ValueError(f"layer {layer} KV scale has dtype {s.dtype} and shape {list(s.shape)}; need float32 "
                             f"[1 or {shape.num_kv_heads}, 1 or {shape.head_dim}]")
        args += [s.data_ptr(), s.stride(0) if s.shape[0] > 1 else 0, s.stride(1) if s.shape[1] > 1 else 0]
    if scales is None:
        args += [0] * 6
    ts = getattr(cache, "token_scales", None)
    if ts is None:
        args += [0, 0]
    else:
        if ts.dtype != torch.float32 or not ts.is_contiguous():
            raise ValueError(f"cache.token_scales must be contiguous float32, got {ts.dtype}")
        args += [ts[layer, 0].data_ptr(), ts[layer, 1].data_ptr()]
    return tuple(args)


_LOADED: dict[str, KernelLibrary] = {}
_FAILED: dict[str, KernelUnavailable] = {}


def load_kernels(march: str = "native") -> KernelLibrary:
    """Build (first use) and load the kernels for ``-march=march``; raises :class:`KernelUnavailable`.

    The result, success or failure, is remembered per ``march`` for the life of the process, so a missing
    compiler costs one attempt, not one per call.
    """
    if not isinstance(march, str) or not march or any(c.isspace() for c in march):
        raise ValueError(f"march={march!r} must be a non-empty -march value without spaces")
    if march in _FAILED:
        raise _FAILED[march]
    if march not in _LOADED:
        try:
            _LOADED[march] = KernelLibrary(_build(march), march)
        except KernelUnavailable as exc:
            _FAILED[march] = exc
            raise
    return _LOADED[march]


def _check_common(name: str, x: torch.Tensor, cache: PagedKVCache) -> None:
    if x.dtype not in _COMPUTE_CODES:
        raise ValueError(f"{name} dtype {x.dtype} is not supported; use bfloat16, float16 or float32")
    if x.ndim != 3 or x.shape[2] != cache.shape.head_dim:
        raise ValueError(f"{name} shape {list(x.shape)} must be [T, H, head_dim={cache.shape.head_dim}]")
    if x.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {x.device}")


def store_kv_fused(lib: KernelLibrary, cache: PagedKVCache, layer: int, key: torch.Tensor, value: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Quantize-on-store of ``key``/``value`` ``[T, H_kv, D]`` into ``slot_mapping`` (``[T]`` int64)."""
    _check_common("key", key, cache)
    if value.shape != key.shape or value.dtype != key.dtype:
        raise ValueError(f"value {list(value.shape)} {value.dtype} must match key {list(key.shape)} {key.dtype}")
    if key.shape[1] != cache.shape.num_kv_heads:
        raise ValueError(f"key has {key.shape[1]} heads, the cache {cache.shape.num_kv_heads}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be int64 of shape [{key.shape[0]}], got {slot_mapping.dtype} "
                         f"{list(slot_mapping.shape)}")
    if not 0 <= layer < cache.shape.num_layers:
        raise ValueError(f"layer={layer} is outside [0, {cache.shape.num_layers})")
    lib.store(key.contiguous(), value.contiguous(), cache, layer, slot_mapping.contiguous())


def paged_attention_fused(lib: KernelLibrary, query: torch.Tensor, cache: PagedKVCache, layer: int,
                          meta: AttentionMetadata, scale: float, partition_size: int = 0) -> torch.Tensor:
    """query ``[T, Hq, D]`` -> output ``[T, Hq, D]`` (query's dtype) over the stored context.

    Same contract as :func:`kv8.attention.reference.paged_attention_reference`. ``partition_size`` (tokens,
    rounded up to 16) forces a context split (0: automatic, negative: never).
    """
    _check_common("query", query, cache)
    if query.shape[1] % cache.shape.num_kv_heads != 0:
        raise ValueError(f"query heads {query.shape[1]} must be a multiple of KV heads {cache.shape.num_kv_heads}")
    if not 0 <= layer < cache.shape.num_layers:
        raise ValueError(f"layer={layer} is outside [0, {cache.shape.num_layers})")
    for name in ("query_start_loc", "seq_lens", "block_tables"):
        t = getattr(meta, name)
        if t.dtype != torch.int64 or not t.is_contiguous():
            raise ValueError(f"meta.{name} must be a contiguous int64 tensor, got {t.dtype}")
    if meta.query_start_loc.shape[0] != meta.num_seqs + 1 or meta.block_tables.shape[0] != meta.num_seqs:
        raise ValueError(f"meta has {meta.num_seqs} sequences but query_start_loc {list(meta.query_start_loc.shape)}"
                         f" and block_tables {list(meta.block_tables.shape)}")
    query = query.contiguous()
    out = torch.empty_like(query)
    lib.attention(query, out, cache, layer, meta, float(scale), partition_size)
    return out


class FusedCPUBackend:
    """Store with the C++ quantize-on-store kernel, then attend with the fused paged-attention kernel.

    Construction builds/loads the kernels and raises :class:`KernelUnavailable` (with the reason) if it can't.
    """

    name = "cpu_fused"

    def __init__(self) -> None:
        self.lib = load_kernels()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache,
                layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        store_kv_fused(self.lib, cache, layer, key, value, meta.slot_mapping)
        return paged_attention_fused(self.lib, query, cache, layer, meta, scale)
