"""The ``cpu_fused`` attention backend: kv8's C++ attention library (:mod:`kv8.kernels.cpu.attention`) stores the new
K/V (quantize-on-store) and attends over the paged cache."""

from __future__ import annotations

import torch

from kv8.attention.metadata import AttentionMetadata
from kv8.cache.paged_cache import PagedKVCache
from kv8.kernels.cpu.attention import load_kernels

__all__ = ["FusedCPUBackend"]


class FusedCPUBackend:
    """Store with the C++ quantize-on-store kernel, then attend with the fused paged-attention kernel.

    Construction builds/loads the kernels and raises :class:`kv8.kernels.cpu.build.KernelUnavailable` (with the reason)
    if it can't. ``forward`` calls the library's trusted entries: the engine validated shapes and dtypes at its
    boundary, and the per-layer checks run once, when a layer's arguments are built.
    """

    name = "cpu_fused"

    def __init__(self) -> None:
        self.lib = load_kernels()
        # the work is always split for the threads the engine started with, so that an engine whose thread
        # count kv8.engine.threads lowers under load computes the same bits
        self.plan_threads = torch.get_num_threads()
        #: (K format, V format) -> how far ahead the decode kernels stream that cache (``stream_tiles``; a cache not
        #: listed: the build's default). Speed only: the same bits at any distance. The engine sets it from this
        #: machine's plan (:func:`kv8.attention.tuning.tuned_stream_tiles`).
        self.stream_tiles: dict[tuple[str, str], int] = {}

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cache: PagedKVCache,
                layer: int, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        self.lib.store(key, value, cache, layer, meta.slot_mapping)
        return self.lib.attention(query, cache, layer, meta, scale, plan_threads=self.plan_threads,
                                  stream_tiles=self.stream_tiles.get((cache.k_dtype.name, cache.v_dtype.name), 0))
