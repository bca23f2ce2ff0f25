"""The ``triton`` attention backend, the GPU path: quantize-on-store and one paged-attention kernel family for the
whole mixed batch (:mod:`kv8.kernels.triton`), reading FP8, int8 or int4 codes (per token and head, or per group
of 32) or FP4 E2M1 codes (an E4M3 scale per group of 16) in place.

It runs on CUDA tensors, and on CPU tensors in Triton's interpreter (``TRITON_INTERPRET=1`` before
:mod:`kv8.kernels.triton` is imported), where the tests check it against the reference backend. Triton is
imported when the backend is built, never by the CPU path.

Per layer the arguments come from the cache: its K/V views (:meth:`PagedKVCache.layer`), each side's code format
(FP8, int8, int4, int4_per_group32 or fp4_e2m1; None for a 16/32-bit side: a plain cast; ``fp8`` K's and ``v_fp8``
V's, which differ in a K/V pair such as ``kv_cache_dtype="k8v4"``), its static scales on the cache's device
(:meth:`PagedKVCache.layer_scales`; one format only) or each side's dynamic per-token scales
(:meth:`PagedKVCache.layer_token_scales`: in a pair one side may have none).
"""

from __future__ import annotations

import torch

from kv8.attention.metadata import AttentionMetadata
from kv8.cache.paged_cache import PagedKVCache
from kv8.platform import Platform

__all__ = ["TritonBackend"]


class TritonBackend:
    """Store with :func:`kv8.kernels.triton.store.store_kv`, then attend with
    :func:`kv8.kernels.triton.attention.unified_attention` for ``platform`` (the engine's; None: this process's
    device, :meth:`Platform.resolve` of ``auto``, once). Construction imports Triton (``ImportError`` if it is
    missing: :class:`kv8.engine.config.EngineConfig` says so first)."""

    name = "triton"

    def __init__(self, platform: Platform | None = None) -> None:
        from kv8.kernels.triton.attention import unified_attention
        from kv8.kernels.triton.store import store_kv

        self._store = store_kv
        self._attend = unified_attention
        self.platform = platform if platform is not None else Platform.resolve("auto")

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache,
                layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        k_cache, v_cache = cache.layer(layer)
        # each side's FP8, int8, int4, int4_per_group32 or fp4_e2m1 code format; None for a 16/32-bit side (V's is
        # K's object for a single-format cache, v_dtype being k_dtype: the kernels derive it once)
        fp8, v_fp8 = cache.k_dtype.codes, cache.v_dtype.codes
        static = cache.layer_scales(layer)
        dynamic = cache.layer_token_scales(layer)
        k_scale, v_scale = static if static is not None else (None, None)
        k_ts, v_ts = dynamic if dynamic is not None else (None, None)
        self._store(key, value, k_cache, v_cache, meta.slot_mapping, fp8=fp8, v_fp8=v_fp8, k_scale=k_scale,
                    v_scale=v_scale, k_token_scales=k_ts, v_token_scales=v_ts)
        out = torch.empty_like(query)
        if meta.num_seqs == 0:
            return out
        # the shortest run of new tokens of the sequences that have any: a batch without decode rows makes no
        # launch for them
        min_query_len = min((n for n in meta.query_lens_list if n > 0), default=0)
        return self._attend(query, k_cache, v_cache, out, query_start_loc=meta.query_start_loc,
                            seq_lens=meta.seq_lens, block_tables=meta.block_tables,
                            max_query_len=max(meta.query_lens_list), min_query_len=min_query_len,
                            max_seq_len=max(meta.seq_lens_list),
                            scale=scale, sliding_window=meta.sliding_window, fp8=fp8, v_fp8=v_fp8, k_scale=k_scale,
                            v_scale=v_scale, k_token_scales=k_ts, v_token_scales=v_ts, platform=self.platform)
