"""The KV cache tensors and quantize-on-store.

Layout, one tensor for the keys and one for the values of the layers the cache holds (``H`` = KV heads, ``D`` =
head dim, ``bs`` = block size)::

    k_data: [num_slots, num_blocks, H, bs, Wk]   dtype = the keys' storage dtype (uint8 codes for FP8)
    v_data: [num_slots, num_blocks, H, bs, Wv]   dtype = the values' storage dtype

``W`` is the side's ``KVCacheDtype.stored_width(D)``: ``D`` values, ``D / 2`` bytes for int4 (two codes each), the
codes and group scales of a group-scaled row. Keys and values have one format (the cache's ``kv_cache_dtype``) or
each its own (a K/V pair, :attr:`kv8.cache.codec.KVCodec.v_dtype`).

Model layer ``l`` lives in slot ``slots[l]``. Without a slot map every layer has its own slot (``num_slots =
num_layers``); a hybrid layout (:mod:`kv8.cache.layout`) puts several layers in one slot, each reached
through its own group's block table, so a block index means different tokens in different layers.

so one (layer, K|V, block, head) is a contiguous ``bs x D`` tile -- what a paged-attention kernel streams.
A token's slot is ``block_id * bs + offset``; token ``t`` of a sequence lives at
``block_table[t // bs] * bs + t % bs``.

What a slot holds is decided by the cache's :class:`kv8.cache.codec.KVCodec` (format, static or dynamic
scales, basis); this class owns only the tensors and where a token's bytes go. With dynamic scales, each
stored token also keeps one float32 scale per KV head beside the codes of each side that has them
(:meth:`KVCodec.dynamic_of`: both for one format, the FP8 and int sides of a pair)::

    k_token_scales, v_token_scales: [num_slots, num_blocks, H, bs]   float32 (or None: that side has none)

A slot's codes and scale are written together and read together, so prefix caching and preemption read back
exactly what was stored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from kv8.cache.codec import K, KVCodec, V
from kv8.quant.formats import KVCacheDtype
from kv8.quant.scales import KVScales


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_blocks: int
    num_kv_heads: int
    block_size: int
    head_dim: int


class PagedKVCache:
    """Owns the cache tensors; stores new K/V into slots and reads blocks back, both through its codec."""

    def __init__(self, shape: CacheShape, codec: KVCodec, slots: Mapping[int, int] | None = None,
                 device: torch.device | str = "cpu") -> None:
        """``shape.num_layers`` is the model's layer count; ``slots`` maps each layer this cache holds to its
        slot (None: every layer, slot = layer). Static scales are indexed by model layer. The tensors, and the
        codec's (:meth:`KVCodec.to`), live on ``device``."""
        self.shape = shape
        self.device = torch.device(device)
        self.codec = codec.to(self.device)
        self.slots: dict[int, int] = dict(slots) if slots is not None else {i: i for i in range(shape.num_layers)}
        if not self.slots or any(not 0 <= layer < shape.num_layers or s < 0 for layer, s in self.slots.items()):
            raise ValueError(f"slots {self.slots} must map layers in [0, {shape.num_layers}) to slots >= 0")
        num_slots = max(self.slots.values()) + 1
        # empty, not zeros: pages are mapped lazily, so an unused budget costs neither time nor resident
        # memory. Slots are always written before they are read (a slot beyond a sequence's length is never
        # used in its attention), so the initial contents do not matter. Ordinary pages, unlike the weights
        # (kv8.host_memory): the cache is first touched while serving, where a fresh 2 MiB page costs more.
        rows = (num_slots, shape.num_blocks, shape.num_kv_heads, shape.block_size)
        k_fmt, v_fmt = codec.dtype_of(K), codec.dtype_of(V)
        self.k_data = torch.empty(*rows, k_fmt.stored_width(shape.head_dim), dtype=k_fmt.storage_dtype,
                                  device=self.device)
        self.v_data = torch.empty(*rows, v_fmt.stored_width(shape.head_dim), dtype=v_fmt.storage_dtype,
                                  device=self.device)
        self.k_token_scales, self.v_token_scales = (
            torch.empty(*rows, dtype=torch.float32, device=self.device) if codec.dynamic_of(which) else None
            for which in (K, V))

    @property
    def kv_dtype(self) -> KVCacheDtype:
        """The keys' format (the cache's, for one format)."""
        return self.codec.kv_dtype

    @property
    def k_dtype(self) -> KVCacheDtype:
        return self.codec.kv_dtype

    @property
    def v_dtype(self) -> KVCacheDtype:
        """The values' format (:attr:`k_dtype` unless the cache is a K/V pair)."""
        return self.codec.values_dtype

    @property
    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor the cache holds: codes, then the token scales there are."""
        return tuple(t for t in (self.k_data, self.v_data, self.k_token_scales, self.v_token_scales)
                     if t is not None)

    @property
    def scales(self) -> KVScales | None:
        """The codec's static scales (None for a 16/32-bit cache or dynamic scales)."""
        return self.codec.scales

    @property
    def dynamic_scales(self) -> bool:
        return self.codec.dynamic

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K cache, V cache) of one layer, ``[num_blocks, H, bs, Wk]`` and ``[num_blocks, H, bs, Wv]`` (``W =
        stored_width(D)`` of each side's format)."""
        s = self.slots[layer]
        return self.k_data[s], self.v_data[s]

    def layer_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Static (k_scale, v_scale) broadcastable to ``[H, D]``, or None (16/32-bit cache, dynamic scales)."""
        return self.codec.layer_scales(layer)

    def layer_token_scales(self, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None] | None:
        """(K, V) per-token scales of one layer, each ``[num_blocks, H, bs]`` float32, or None where neither side
        has them (static scales, group scales, 16/32-bit). In a K/V pair one side may be None (its format keeps
        no per-token scales); with one format both are given or neither."""
        if self.k_token_scales is None and self.v_token_scales is None:
            return None
        s = self.slots[layer]
        return tuple(None if t is None else t[s] for t in (self.k_token_scales, self.v_token_scales))  # type: ignore[return-value]

    def store(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write new tokens (the reference store). key/value: ``[T, H, D]`` in the stored basis; slot_mapping:
        ``[T]`` int64 slots; a negative slot skips its token (the padding rows of :mod:`kv8.engine.cuda_graphs`),
        as in :func:`kv8.kernels.triton.store.store_kv`."""
        keep = slot_mapping >= 0
        if not bool(keep.all()):   # (-1 would index the cache's last slot)
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        bs, slot = self.shape.block_size, self.slots[layer]
        blocks, offsets = slot_mapping // bs, slot_mapping % bs
        for which, x in enumerate((key, value)):
            stored, ts = self.codec.encode(x, layer, which)
            # Advanced indices around a slice: the indexed view is [T, H, W], matching the stored rows.
            self._codes(which)[slot][blocks, :, offsets] = stored
            scales = self._scales(which)
            if ts is not None and scales is not None:
                scales[slot][blocks, :, offsets] = ts

    def gather(self, layer: int, block_table: torch.Tensor, num_tokens: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Read the first ``num_tokens`` tokens of one sequence, decoded: (K, V) each ``[num_tokens, H, D]``."""
        nb = -(-num_tokens // self.shape.block_size)
        idx = block_table[:nb]
        h, slot = self.shape.num_kv_heads, self.slots[layer]
        out = []
        for which in (K, V):
            codes = self._codes(which)
            blocks = codes[slot][idx]                                                 # [nb, H, bs, W]
            tokens = blocks.transpose(1, 2).reshape(-1, h, codes.shape[-1])[:num_tokens]   # [num_tokens, H, W]
            ts = None
            scales = self._scales(which)
            if scales is not None:
                ts = scales[slot][idx].transpose(1, 2).reshape(-1, h)[:num_tokens]
            out.append(self.codec.decode(tokens, layer, which, dtype, ts))
        return out[0], out[1]

    def _codes(self, which: int) -> torch.Tensor:
        return self.k_data if which == K else self.v_data

    def _scales(self, which: int) -> torch.Tensor | None:
        return self.k_token_scales if which == K else self.v_token_scales
