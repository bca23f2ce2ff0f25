"""The attention layer every model uses: new q/k/v in, attention over the paged cache out.

A model computes q, k and v (projections, norms, RoPE: its own math) and calls
:class:`PagedAttention` with an :class:`AttentionContext`, the per-forward state passed explicitly down the
model. The layer moves q/k/v into the basis the KV codec stores
(:meth:`kv8.cache.codec.KVCodec.to_stored_basis`; keys centered and scaled first when the codec has key offsets
and factors, :meth:`kv8.cache.codec.KVCodec.keys_to_stored`, queries divided by the factors,
:meth:`kv8.cache.codec.KVCodec.queries_to_stored`), shows the new K/V to an observer if there is one, lets the
attention backend store them and attend, and moves the output back (from the values' basis, which may differ from
the keys': ``kv_cache_rotation="none/hadamard"``). Models never see how K/V are stored.

Under tensor parallelism a layer sees its rank's heads only (``num_heads`` / ``num_kv_heads`` are local counts,
:mod:`kv8.distributed.shard`) and the rank's cache holds those KV heads; attention is per head, so nothing
else changes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kv8.attention.backend import AttentionBackend
from kv8.attention.metadata import AttentionMetadata
from kv8.cache.codec import V
from kv8.cache.paged_cache import PagedKVCache
from kv8.observer import EngineObserver


@dataclass(frozen=True)
class AttentionContext:
    """Per-forward state: the cache, the batch layout, the backend that stores and attends, an observer.

    With one KV cache group (every layer reads the same block tables) ``cache`` and ``meta`` serve every
    layer. A hybrid layout (:mod:`kv8.cache.layout`: sliding-window groups, skipped layers) gives
    ``per_layer[l] = (cache of layer l's pool, metadata of layer l's group)``; the metadata carries the group's
    block tables, slots and sliding window.
    """

    cache: PagedKVCache
    meta: AttentionMetadata
    backend: AttentionBackend
    observer: EngineObserver | None = None
    per_layer: tuple[tuple[PagedKVCache, AttentionMetadata], ...] = ()

    def for_layer(self, layer: int) -> tuple[PagedKVCache, AttentionMetadata]:
        return self.per_layer[layer] if self.per_layer else (self.cache, self.meta)


class PagedAttention(nn.Module):
    """Attention of one layer over the paged KV cache. No parameters.

    ``forward(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D], ctx) -> [T, Hq * D]`` in q's dtype (``Hq``, ``Hkv``:
    this rank's heads).
    Invariant: the new K/V of the whole batch are stored before any query attends (the backend's contract),
    so every query reads the bytes as stored, whatever the batching, chunking or prefix caching.
    """

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: AttentionContext) -> torch.Tensor:
        cache, meta = ctx.for_layer(self.layer_idx)
        codec = cache.codec
        if ctx.observer is not None:
            ctx.observer.on_attention_inputs(self.layer_idx, q, k, v, codec)
            first = meta.first_position_rows()
            if first:
                ctx.observer.on_first_keys(self.layer_idx, k[first])
        # keys centered and scaled (with key offsets and factors) and rotated here, before any backend stores them,
        # queries divided by the same factors: every key attention reads, fresh or cached, went through this line
        q, k = codec.queries_to_stored(q, self.layer_idx), codec.keys_to_stored(k, self.layer_idx)
        v = codec.to_stored_basis(v, V)
        if ctx.observer is not None:
            ctx.observer.on_kv_store(self.layer_idx, k, v, codec)
        out = ctx.backend.forward(q, k, v, cache, self.layer_idx, meta, self.scale)   # [T, Hq, D]
        out = codec.to_stored_basis(out, V)  # back from the values' basis (R is its own inverse)
        return out.reshape(out.shape[0], self.num_heads * self.head_dim)

    def extra_repr(self) -> str:
        return f"layer={self.layer_idx}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, head_dim={self.head_dim}"


__all__ = ["AttentionContext", "PagedAttention"]
