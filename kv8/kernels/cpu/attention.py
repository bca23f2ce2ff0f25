"""The attention library: fused CPU paged attention and quantize-on-store, a C++ kernel built on first use,
called through ctypes (the ``cpu_fused`` backend, :class:`kv8.attention.cpu_fused.FusedCPUBackend`, calls it).

Why this shape: PyTorch's float8 conversions run at ~1 GB/s on this CPU, so dequantize-then-attend is slower
than a bf16 cache; the dequant has to live inside the attention loop. numba is not installed and
``torch.compile`` takes tens of seconds to start and cannot express the bit-level decode, so the kernels are
plain C++ (``csrc/attention/attention.cpp`` and the parts it includes; intrinsics, OpenMP, a C ABI, no torch
headers), compiled with the system ``g++`` once (about 11 s; ``scripts/setup.sh`` does it) and cached
(:mod:`kv8.kernels.cpu.build`: one build per source and included headers, compiler and CPU, atomic publication). The
library links ``libgomp.so.1`` by soname, so in a torch process it shares torch's OpenMP runtime and thread pool.

Interface: each entry point takes pointers to argument structs (``csrc/attention/abi.h``) mirrored here with
``ctypes.Structure``; the library exports their layout, its dtype codes and its error messages, and
:class:`KernelLibrary` reads them at load (a layout mismatch is :class:`KernelUnavailable`), so no number of the
C side is copied here. A layer's struct (cache pointers, scales) is built once per (cache, layer) and reused.

On a CPU with AVX-512 BF16 + VBMI the kernel decodes FP8 straight to bf16 with in-register byte tables and
multiplies with ``vdpbf16ps`` (exact products, fp32 accumulation); elsewhere, and for fp16/fp32 caches, it
runs an fp32 path that decodes FP8 exactly (the AVX2 kernel: E4M3 codes through fp16 with F16C, the power of two
that leaves out carried by the query and the softmax weights; the generic kernel: on bits). Details and precision:
see ``attention.cpp``. Numerics versus
:func:`kv8.attention.reference.paged_attention_reference`: q and the softmax weights are carried as bf16
hi + lo (about 16 significant bits; q exactly when it is bf16; the weights in bf16 alone when the output is
bf16), products are exact and accumulated in fp32.

The store is bit-exact with :meth:`kv8.cache.paged_cache.PagedKVCache.store` for every finite and infinite
input (FP8: ``saturate(rne(x / scale))``, the NaN rule of :meth:`kv8.quant.formats.FP8Format.encode`).

A K/V pair (``kv_cache_dtype="KFORMAT/VFORMAT"``, e.g. ``"k8v4"``): the layer's struct names the keys' format
(``kv_dtype``) and the values' (``v_kv_dtype``) and each side's per-token scales where that side keeps them; the
store encodes each side by its own format, and attention reads each by its own (``csrc/attention/attention.cpp``
says which kernel serves which pair).
"""

from __future__ import annotations

import ctypes
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from kv8.kernels.cpu.abi import NativeLibrary, code_table
from kv8.kernels.cpu.build import KernelUnavailable, build_shared_library
from kv8.validators import check_int

if TYPE_CHECKING:   # annotations only: kv8.kernels sits below the attention and cache packages
    from kv8.attention.metadata import AttentionMetadata
    from kv8.cache.paged_cache import PagedKVCache

__all__ = [
    "KernelLibrary",
    "KernelTesting",
    "KernelUnavailable",
    "load_kernels",
    "paged_attention_fused",
    "store_kv_fused",
]

SOURCE = Path(__file__).parent / "csrc" / "attention" / "attention.cpp"

# ------------------------------------------------------------------------------------------------
# The argument structs (csrc/attention/abi.h), checked against the library's layout at load (kv8.kernels.cpu.abi).
# ------------------------------------------------------------------------------------------------

_P = ctypes.c_void_p
_I32 = ctypes.c_int32
_I64 = ctypes.c_int64


class LayerArgs(ctypes.Structure):
    """``kv8_layer``: one (cache, layer), built once and reused every step (see :meth:`KernelLibrary.layer_args`)."""

    _fields_ = [
        ("k_cache", _P), ("v_cache", _P), ("num_blocks", _I64),
        ("kv_dtype", _I32), ("v_kv_dtype", _I32), ("num_kv_heads", _I32), ("block_size", _I32), ("head_dim", _I32),
        ("k_scale", _P), ("k_scale_head_stride", _I64), ("k_scale_dim_stride", _I64),
        ("v_scale", _P), ("v_scale_head_stride", _I64), ("v_scale_dim_stride", _I64),
        ("k_token_scales", _P), ("v_token_scales", _P),
    ]


class AttentionCall(ctypes.Structure):
    """``kv8_attention_call``: the query batch of one attention call."""

    _fields_ = [
        ("q", _P), ("out", _P), ("num_tokens", _I64), ("num_q_heads", _I32), ("q_dtype", _I32),
        ("query_start_loc", _P), ("seq_lens", _P), ("block_tables", _P), ("block_table_stride", _I64),
        ("num_seqs", _I32), ("num_threads", _I32), ("plan_threads", _I32), ("sm_scale", ctypes.c_float),
        ("partition_size", _I64),
        ("sliding_window", _I64),  # AttentionMetadata.sliding_window, 0 for None (full causal attention)
        ("use_amx", _I32),  # KernelLibrary.amx
        ("stream_tiles", _I32),  # KernelLibrary.attention's stream_tiles: speed only (kv8.attention.tuning)
    ]


class StoreCall(ctypes.Structure):
    """``kv8_store_call``: the new K/V rows of one quantize-on-store call."""

    _fields_ = [
        ("key", _P), ("value", _P), ("slot_mapping", _P), ("num_tokens", _I64), ("in_dtype", _I32),
        ("num_threads", _I32),
    ]


def _build(march: str) -> Path:
    """Compile (or find the cached) attention library for ``-march=march``; returns its path."""
    return build_shared_library(SOURCE, march)


# ------------------------------------------------------------------------------------------------
# The library
# ------------------------------------------------------------------------------------------------

class KernelLibrary(NativeLibrary):
    """The loaded kernels (build with :func:`load_kernels`).

    Production interface, used by :class:`kv8.attention.cpu_fused.FusedCPUBackend`: :meth:`store` and
    :meth:`attention`. They trust their arguments (the engine validated options and shapes at its boundary): tensors
    on the CPU, contiguous int64 metadata, shapes matching the cache. The C side still checks what memory safety
    needs (block ids, slots, lengths, table width) and a failure raises ``ValueError`` naming it.
    :func:`store_kv_fused` and :func:`paged_attention_fused` are the validated entries for direct use;
    :class:`KernelTesting` holds what only tests use.
    """

    STRUCTS = (("kv8_layer", LayerArgs), ("kv8_attention_call", AttentionCall), ("kv8_store_call", StoreCall))

    def __init__(self, path: Path, march: str) -> None:
        super().__init__(path)
        self.march = march
        self._bind_structs("kv8_paged_attention", LayerArgs, AttentionCall)
        self._bind_structs("kv8_store_kv", LayerArgs, StoreCall)
        self.has_fast_path = bool(self._bind("kv8_has_fast_path", [])())
        #: Whether the AVX2 item kernel is compiled in (AVX2 + FMA + F16C targets: x86-64-v3 and later).
        self.has_avx2_path = bool(self._bind("kv8_has_avx2_path", [])())
        #: Whether prefill items (head_dim a multiple of 64 up to 256) and decode items (the decode kernel's)
        #: multiply with AMX tiles, both with bf16 compute and no per-channel K scales. True where the build, the
        #: CPU and the OS allow it; setting it False takes the AVX-512 paths (tests do, to run both). The two
        #: paths sum in different orders: keep one choice for the life of an engine, so a row's result never
        #: depends on when it is computed.
        self.amx = bool(self._bind("kv8_attention_amx_available", [])())
        #: The decode kernels' stream distance (:meth:`attention`'s ``stream_tiles``) where a call passes 0, and the
        #: largest a call may pass.
        self.default_stream_tiles = int(self._bind("kv8_default_stream_tiles", [])())
        self.max_stream_tiles = int(self._bind("kv8_max_stream_tiles", [])())
        #: KV dtype name (``KVCacheDtype.name``) -> the library's code, and torch dtype -> compute code.
        self.kv_dtype_codes: dict[str, int] = code_table(self._lib.kv8_kv_dtype_name)
        self.compute_codes: dict[torch.dtype, int] = {
            getattr(torch, name): code for name, code in code_table(self._lib.kv8_compute_dtype_name).items()}
        # Per cache: (key, {layer: (LayerArgs, tensors it points into)}); see layer_args.
        self._layers: weakref.WeakKeyDictionary[PagedKVCache, tuple[tuple, dict[int, tuple]]] = \
            weakref.WeakKeyDictionary()

    def attention(self, query: torch.Tensor, cache: PagedKVCache, layer: int, meta: AttentionMetadata,
                  scale: float, partition_size: int = 0, plan_threads: int | None = None,
                  stream_tiles: int = 0) -> torch.Tensor:
        """query ``[T, Hq, D]`` -> output ``[T, Hq, D]`` (query's dtype) over the stored context; trusted
        arguments (see the class docstring). ``partition_size``: see :func:`paged_attention_fused`;
        ``plan_threads``: the thread count the work is split for (default: the threads it runs on), the only
        thread count the result depends on; ``stream_tiles``: how many tiles of 16 tokens ahead the decode kernels
        stream K and V into L2 (1 .. :attr:`max_stream_tiles`; 0: :attr:`default_stream_tiles`), speed only -- the
        result is the same bits at every distance (:mod:`kv8.attention.tuning` chooses it per machine)."""
        query = query.contiguous()
        out = torch.empty_like(query)
        tables = meta.block_tables
        threads = torch.get_num_threads()
        call = AttentionCall(query.data_ptr(), out.data_ptr(), query.shape[0], query.shape[1],
                             self.compute_codes[query.dtype], meta.query_start_loc.data_ptr(),
                             meta.seq_lens.data_ptr(), tables.data_ptr(), tables.shape[1], meta.num_seqs,
                             threads, plan_threads or threads, scale, partition_size, meta.sliding_window or 0,
                             int(self.amx), stream_tiles)
        self.invoke(self._lib.kv8_paged_attention, f"paged attention (layer {layer})", self.layer_args(cache, layer),
                    call)
        return out

    def store(self, key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache, layer: int,
              slot_mapping: torch.Tensor) -> None:
        """Quantize-on-store of ``key``/``value`` ``[T, H_kv, D]`` into ``slot_mapping`` (``[T]`` int64);
        trusted arguments (see the class docstring)."""
        key, value = key.contiguous(), value.contiguous()
        call = StoreCall(key.data_ptr(), value.data_ptr(), slot_mapping.data_ptr(), key.shape[0],
                         self.compute_codes[key.dtype], torch.get_num_threads())
        self.invoke(self._lib.kv8_store_kv, f"store (layer {layer})", self.layer_args(cache, layer), call)

    def layer_args(self, cache: PagedKVCache, layer: int) -> LayerArgs:
        """The ``kv8_layer`` of ``cache``'s layer ``layer``, built on first use and reused.

        Memoized (building it costs ~10 us, 2 calls per layer per step) under a key of the cache tensor's data
        pointers (codes and token scales) and shape and the cache's codec (frozen: format, scales, basis), so a
        replaced tensor or codec is never read through a stale pointer. The entry holds the
        scale tensors it points into, so they live as long as the pointers.
        """
        key = (tuple(t.data_ptr() for t in cache.tensors), cache.shape, id(cache.codec))
        entry = self._layers.get(cache)
        if entry is None or entry[0] != key:
            entry = (key, {})
            self._layers[cache] = entry
        built = entry[1].get(layer)
        if built is None:
            built = entry[1][layer] = self._build_layer_args(cache, layer)
        return built[0]

    def _build_layer_args(self, cache: PagedKVCache, layer: int) -> tuple[LayerArgs, tuple]:
        """(LayerArgs, the tensors it points into, and the codec of the key). Validates the layer once."""
        shape = cache.shape
        if not 0 <= layer < shape.num_layers:
            raise ValueError(f"layer={layer} is outside [0, {shape.num_layers})")
        if not all(t.is_contiguous() for t in cache.tensors):
            raise ValueError("the cache's tensors must be contiguous")
        k_cache, v_cache = cache.layer(layer)   # K rows in the keys' format, V rows in the values' (a K/V pair)
        args = LayerArgs(k_cache=k_cache.data_ptr(), v_cache=v_cache.data_ptr(), num_blocks=shape.num_blocks,
                         kv_dtype=self.kv_dtype_codes[cache.k_dtype.name],
                         v_kv_dtype=self.kv_dtype_codes[cache.v_dtype.name], num_kv_heads=shape.num_kv_heads,
                         block_size=shape.block_size, head_dim=shape.head_dim)
        scales = cache.layer_scales(layer)
        for prefix, s in zip(("k", "v"), scales if scales is not None else ()):
            if s.dtype != torch.float32 or s.ndim != 2 or s.shape[0] not in (1, shape.num_kv_heads) \
                    or s.shape[1] not in (1, shape.head_dim):
                raise ValueError(f"layer {layer} {prefix.upper()} scale has dtype {s.dtype} and shape "
                                 f"{list(s.shape)}; need float32 [1 or {shape.num_kv_heads}, 1 or {shape.head_dim}]")
            setattr(args, f"{prefix}_scale", s.data_ptr())
            setattr(args, f"{prefix}_scale_head_stride", s.stride(0) if s.shape[0] > 1 else 0)
            setattr(args, f"{prefix}_scale_dim_stride", s.stride(1) if s.shape[1] > 1 else 0)
        token_scales = cache.layer_token_scales(layer)
        if token_scales is not None:   # per side: a K/V pair keeps them on its FP8 and int sides only
            for prefix, ts in zip(("k", "v"), token_scales):
                if ts is None:
                    continue
                if ts.dtype != torch.float32 or not ts.is_contiguous() \
                        or tuple(ts.shape) != (shape.num_blocks, shape.num_kv_heads, shape.block_size):
                    raise ValueError(f"layer {layer} {prefix.upper()} token scales must be contiguous float32 "
                                     f"[{shape.num_blocks}, {shape.num_kv_heads}, {shape.block_size}], got "
                                     f"{ts.dtype} {list(ts.shape)}")
                setattr(args, f"{prefix}_token_scales", ts.data_ptr())
        return args, (scales, token_scales, cache.codec)


class KernelTesting:
    """The library's testing interface (``kv8_test_*`` exports): what only kv8's tests use, never production."""

    ITEM_KERNELS = ("generic", "tile", "decode", "prefill", "amx", "amx_decode", "avx2")

    def __init__(self, lib: KernelLibrary) -> None:
        self.lib = lib
        c = lib._lib
        c.kv8_test_item_kernel.argtypes = [ctypes.c_int] * 8
        c.kv8_test_item_kernel.restype = ctypes.c_int
        c.kv8_test_decode_fp8.argtypes = [ctypes.c_int, ctypes.c_int, _P, _I64, _P]
        c.kv8_test_decode_fp8.restype = ctypes.c_int
        c.kv8_test_softmax_weights.argtypes = [ctypes.c_int, _P, _I64, ctypes.c_float, _P]
        c.kv8_test_softmax_weights.restype = ctypes.c_int
        self._c = c

    def item_kernel(self, kv_dtype: str, compute_dtype: torch.dtype, head_dim: int, block_size: int = 16,
                    rows: int = 48, k_per_channel: bool = False, v_kv_dtype: str | None = None) -> str:
        """The item kernel that serves items of ``rows`` rows (query heads per KV head x query tokens of one
        sequence):

        * "generic": fp32, scalar (builds without AVX2, head dims not a multiple of 8; the FP4 and
          int4_per_group32 items the kernels below do not take);
        * "avx2": fp32 on AVX2 + FMA, head_dim a multiple of 8: every item of a build without the AVX-512 BF16
          path, and with it the items the kernels below do not take (fp16 / fp32 caches, int8 / int4 items of
          at most 4 rows the decode kernel does not serve, head dims not a multiple of 16);
        * "tile": AVX-512 BF16, any item (int8 / int4 / FP4 / int4_per_group32: items of more than 4 rows, their
          tiles decoded to bf16; int4_per_group32 with bf16 compute only);
        * "decode": AVX-512 BF16, decode-sized items (bf16 compute, an FP8, bf16, int8, int4, int4_per_group32 or FP4
          cache, head_dim 64 / 128 / 256, blocks of a multiple of 16 tokens, at most 4 rows);
        * "amx_decode": those items on AMX tiles, where :attr:`KernelLibrary.amx` and the K scales are not per
          channel (``k_per_channel``) and the cache is FP8, bf16 or int8;
        * "prefill": the tile kernel's loop for items of more than 4 rows and head_dim <= 128 (the formats above
          through tiles decoded to bf16 as well);
        * "amx": that loop on AMX tiles, where :attr:`KernelLibrary.amx` (bf16 compute, head_dim a multiple of
          64 up to 256, K scales not per channel; the integer and group-scaled formats and the pairs on their tiles
          decoded to bf16).

        ``kv_dtype`` is K's format, ``v_kv_dtype`` V's (default: K's). A pair whose sides are each int8, int4,
        FP4, int4_per_group32, FP8 or bf16: "decode" for the decode-sized items of int8 K with int4_per_group32 or
        int4 V, else "amx" / "prefill" / "tile" (every item, on tiles of both sides decoded to bf16; with an
        int4_per_group32 side bf16 compute only, else "generic"); a pair with an fp16 / fp32 side: "generic"."""
        codes = self.lib.kv_dtype_codes
        code = self._c.kv8_test_item_kernel(codes[kv_dtype], codes[v_kv_dtype or kv_dtype],
                                            self.lib.compute_codes[compute_dtype], head_dim, block_size, rows,
                                            int(self.lib.amx), int(k_per_channel))
        return self.ITEM_KERNELS[code]

    def decode_fp8(self, fmt: str, codes: torch.Tensor, path: str) -> torch.Tensor:
        """Decode uint8 ``codes`` with the kernel's bit decoder (``path="bits"``), bf16 tables (``"tables"``, the
        AVX-512 path) or the AVX2 kernel's 8-lane decoder (``"avx2"``)."""
        if fmt not in ("fp8_e4m3", "fp8_e4m3fnuz", "fp8_e5m2"):
            raise ValueError(f"fmt={fmt!r} is not an FP8 format; choose fp8_e4m3, fp8_e4m3fnuz or fp8_e5m2")
        paths = ("bits", "tables", "avx2")
        if path not in paths:
            raise ValueError(f"path={path!r}; choose one of {', '.join(map(repr, paths))}")
        codes = codes.contiguous()
        if codes.dtype != torch.uint8:
            raise ValueError(f"codes must be uint8, got {codes.dtype}")
        out = torch.empty(codes.shape, dtype=torch.float32)
        rc = self._c.kv8_test_decode_fp8(self.lib.kv_dtype_codes[fmt], paths.index(path), codes.data_ptr(),
                                         codes.numel(), out.data_ptr())
        if rc != 0:
            raise ValueError(f"decode path {path!r} is not available in this build (march={self.lib.march})")
        return out

    def softmax_weights(self, scores: torch.Tensor, ref: float, form: str) -> torch.Tensor:
        """e^(scores - ref) as the AVX-512 kernels compute softmax weights (float32 in and out): ``form="bf16"``
        for weights then rounded to bf16 (a degree-3 polynomial), ``"precise"`` for weights kept to 16 bits or
        in fp32 (degree 5). ValueError without the AVX-512 BF16 path."""
        forms = ("precise", "bf16")
        if form not in forms:
            raise ValueError(f"form={form!r}; choose one of {', '.join(map(repr, forms))}")
        if scores.dtype != torch.float32:
            raise ValueError(f"scores must be float32, got {scores.dtype}")
        scores = scores.contiguous()
        out = torch.empty_like(scores)
        if self._c.kv8_test_softmax_weights(forms.index(form), scores.data_ptr(), scores.numel(), ref,
                                            out.data_ptr()) != 0:
            raise ValueError(f"the softmax weights need the AVX-512 BF16 path (march={self.lib.march})")
        return out


_LOADED: dict[str, KernelLibrary] = {}
_FAILED: dict[str, str] = {}   # march -> the failure's message


def load_kernels(march: str = "native") -> KernelLibrary:
    """Build (first use) and load the kernels for ``-march=march``; raises :class:`KernelUnavailable`.

    The result, success or failure, is remembered per ``march`` for the life of the process, so a missing
    compiler costs one attempt, not one per call.
    """
    if not isinstance(march, str) or not march or any(c.isspace() for c in march):
        raise ValueError(f"march={march!r} must be a non-empty -march value without spaces")
    if march in _FAILED:   # a new exception each time: the remembered message keeps no caller's frames alive
        raise KernelUnavailable(_FAILED[march])
    if march not in _LOADED:
        try:
            _LOADED[march] = KernelLibrary(_build(march), march)
        except KernelUnavailable as exc:
            _FAILED[march] = str(exc)
            raise
    return _LOADED[march]


# ------------------------------------------------------------------------------------------------
# Validated entries (direct users, tests, benchmarks); the backend calls the library directly.
# ------------------------------------------------------------------------------------------------

def _check_common(lib: KernelLibrary, name: str, x: torch.Tensor, cache: PagedKVCache) -> None:
    if x.dtype not in lib.compute_codes:
        raise ValueError(f"{name} dtype {x.dtype} is not supported; use bfloat16, float16 or float32")
    if x.ndim != 3 or x.shape[2] != cache.shape.head_dim:
        raise ValueError(f"{name} shape {list(x.shape)} must be [T, H, head_dim={cache.shape.head_dim}]")
    if x.device.type != "cpu":
        raise ValueError(f"{name} must be on the CPU, got {x.device}")


def store_kv_fused(lib: KernelLibrary, cache: PagedKVCache, layer: int, key: torch.Tensor, value: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Quantize-on-store of ``key``/``value`` ``[T, H_kv, D]`` into ``slot_mapping`` (``[T]`` int64), with
    every argument validated (``ValueError`` naming the bad one)."""
    _check_common(lib, "key", key, cache)
    if value.shape != key.shape or value.dtype != key.dtype:
        raise ValueError(f"value {list(value.shape)} {value.dtype} must match key {list(key.shape)} {key.dtype}")
    if key.shape[1] != cache.shape.num_kv_heads:
        raise ValueError(f"key has {key.shape[1]} heads, the cache {cache.shape.num_kv_heads}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (key.shape[0],):
        raise ValueError(f"slot_mapping must be int64 of shape [{key.shape[0]}], got {slot_mapping.dtype} "
                         f"{list(slot_mapping.shape)}")
    if not 0 <= layer < cache.shape.num_layers:
        raise ValueError(f"layer={layer} is outside [0, {cache.shape.num_layers})")
    lib.store(key, value, cache, layer, slot_mapping.contiguous())


def paged_attention_fused(lib: KernelLibrary, query: torch.Tensor, cache: PagedKVCache, layer: int,
                          meta: AttentionMetadata, scale: float, partition_size: int = 0,
                          plan_threads: int | None = None, stream_tiles: int = 0) -> torch.Tensor:
    """query ``[T, Hq, D]`` -> output ``[T, Hq, D]`` (query's dtype) over the stored context, with every argument
    validated (``ValueError`` naming the bad one).

    Same contract as :func:`kv8.attention.reference.paged_attention_reference`, sliding window included
    (``meta.sliding_window``: the kernels read neither the blocks wholly before a sequence's first window nor
    their block-table entries). ``partition_size`` (tokens, rounded up to 16) forces a split of each item's
    context range -- the window with one, else the whole causal context (0: automatic, negative: never).
    ``plan_threads`` (>= 1; default: the threads it runs on) is the thread count the work is split for: the
    result depends on it, not on how many threads run the call. ``stream_tiles`` (0 .. ``lib.max_stream_tiles``): see
    :meth:`KernelLibrary.attention`; speed only.
    """
    check_int("plan_threads", plan_threads, 1, optional=True)
    check_int("stream_tiles", stream_tiles, 0, lib.max_stream_tiles)
    _check_common(lib, "query", query, cache)
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
    return lib.attention(query, cache, layer, meta, float(scale), partition_size, plan_threads, stream_tiles)

