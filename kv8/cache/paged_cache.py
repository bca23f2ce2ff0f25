"""The KV cache tensors and quantize-on-store.

Layout, one tensor for the whole model (``H`` = KV heads, ``D`` = head dim, ``bs`` = block size)::

    data: [num_layers, 2 (K, V), num_blocks, H, bs, D]   dtype = storage dtype (uint8 codes for FP8)

so one (layer, K|V, block, head) is a contiguous ``bs x D`` tile -- what a paged-attention kernel streams.
A token's slot is ``block_id * bs + offset``; token ``t`` of a sequence lives at
``block_table[t // bs] * bs + t % bs``.

FP8 convention (vLLM's kernels): ``stored = saturate(rne(x / scale))``, ``read = stored * scale`` with the
per-layer K and V scales of :class:`kv8.quant.scales.KVScales` (shape broadcastable to ``[H, D]``).
16/32-bit caches store the value cast to the cache dtype and have no scales.

Dynamic scales (``dynamic_scales=True``, FP8 only): each stored token also gets one float32 scale per KV head
for K and for V, ``amax(|x|) / format max`` over the head's ``D`` values (1.0 for an all-zero vector), kept
beside its codes in ``token_scales: [num_layers, 2, num_blocks, H, bs]``. A slot's codes and scale are
written together and read together, so prefix caching and preemption read back exactly what was stored.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kv8.quant.formats import KVCacheDtype, dequantize, quantize
from kv8.quant.scales import KVScales


@dataclass(frozen=True)
class CacheShape:
    num_layers: int
    num_blocks: int
    num_kv_heads: int
    block_size: int
    head_dim: int


class PagedKVCache:
    """Owns the cache tensor; knows how to store new K/V into slots and how to read blocks back."""

    def __init__(self, shape: CacheShape, kv_dtype: KVCacheDtype, scales: KVScales | None,
                 dynamic_scales: bool = False) -> None:
        if dynamic_scales and (not kv_dtype.is_fp8 or scales is not None):
            raise ValueError("dynamic scales need an FP8 cache and no static scales")
        if kv_dtype.is_fp8 and scales is None and not dynamic_scales:
            raise ValueError("an FP8 KV cache needs scales (KVScales.default gives 1.0) or dynamic scales")
        if scales is not None and scales.num_layers != shape.num_layers:
            raise ValueError(f"KV scales have {scales.num_layers} layers, the model has {shape.num_layers}")
        self.shape = shape
        self.kv_dtype = kv_dtype
        self.scales = scales if kv_dtype.is_fp8 else None
        # empty, not zeros: pages are mapped lazily, so an unused budget costs neither time nor resident
        # memory. Slots are always written before they are read (a slot beyond a sequence's length is never
        # used in its attention), so the initial contents do not matter.
        self.data = torch.empty(shape.num_layers, 2, shape.num_blocks, shape.num_kv_heads, shape.block_size,
                                shape.head_dim, dtype=kv_dtype.storage_dtype)
        self.token_scales: torch.Tensor | None = None
        if dynamic_scales:
            self.token_scales = torch.empty(shape.num_layers, 2, shape.num_blocks, shape.num_kv_heads,
                                            shape.block_size, dtype=torch.float32)

    @property
    def dynamic_scales(self) -> bool:
        return self.token_scales is not None

    @property
    def nbytes(self) -> int:
        extra = 0 if self.token_scales is None else self.token_scales.numel() * 4
        return self.data.numel() * self.data.element_size() + extra

    def dynamic_scale(self, x: torch.Tensor) -> torch.Tensor:
        """Per-token, per-head scales ``[T, H]`` for values ``[T, H, D]``: ``amax / format max`` (1.0 if zero)."""
        assert self.kv_dtype.fp8 is not None
        s = x.float().abs().amax(dim=-1) / self.kv_dtype.fp8.max_finite
        return torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K cache, V cache) of one layer, each ``[num_blocks, H, bs, D]``."""
        return self.data[layer, 0], self.data[layer, 1]

    def layer_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_scale, v_scale) broadcastable to ``[H, D]``, or None for a 16/32-bit cache."""
        return None if self.scales is None else self.scales.layer(layer)

    def layer_token_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(K, V) per-token scales of one layer, each ``[num_blocks, H, bs]`` float32, or None (static scales)."""
        return None if self.token_scales is None else (self.token_scales[layer, 0], self.token_scales[layer, 1])

    def encode(self, x: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        """Values ``[..., H, D]`` -> what the cache stores."""
        if self.kv_dtype.fp8 is None:
            return x.to(self.kv_dtype.storage_dtype)
        return quantize(x, scale, self.kv_dtype.fp8)

    def decode(self, stored: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        """What the cache stores -> values in ``dtype``."""
        if self.kv_dtype.fp8 is None:
            return stored.to(dtype)
        return dequantize(stored, scale, self.kv_dtype.fp8, dtype=dtype)

    def store(self, layer: int, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Write new tokens. key/value: ``[T, H, D]``; slot_mapping: ``[T]`` int64 slots."""
        k_cache, v_cache = self.layer(layer)
        scales = self.layer_scales(layer)
        k_scale, v_scale = scales if scales is not None else (None, None)
        bs = self.shape.block_size
        blocks, offsets = slot_mapping // bs, slot_mapping % bs
        if self.token_scales is not None:
            k_s, v_s = self.dynamic_scale(key), self.dynamic_scale(value)          # [T, H]
            self.token_scales[layer, 0][blocks, :, offsets] = k_s
            self.token_scales[layer, 1][blocks, :, offsets] = v_s
            k_scale, v_scale = k_s.unsqueeze(-1), v_s.unsqueeze(-1)                 # [T, H, 1]
        # Advanced indices around a slice: the indexed view is [T, H, D], matching key/value.
        k_cache[blocks, :, offsets] = self.encode(key, k_scale)
        v_cache[blocks, :, offsets] = self.encode(value, v_scale)

    def gather(self, layer: int, block_table: torch.Tensor, num_tokens: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Read the first ``num_tokens`` tokens of one sequence, dequantized: (K, V) each ``[num_tokens, H, D]``."""
        k_cache, v_cache = self.layer(layer)
        nb = -(-num_tokens // self.shape.block_size)
        idx = block_table[:nb]
        scales = self.layer_scales(layer)
        k_scale, v_scale = scales if scales is not None else (None, None)
        out = []
        for kv, (cache, scale) in enumerate(((k_cache, k_scale), (v_cache, v_scale))):
            blocks = cache[idx]                                  # [nb, H, bs, D]
            tokens = blocks.transpose(1, 2).reshape(-1, self.shape.num_kv_heads, self.shape.head_dim)
            if self.token_scales is not None:
                ts = self.token_scales[layer, kv][idx]           # [nb, H, bs]
                scale = ts.transpose(1, 2).reshape(-1, self.shape.num_kv_heads)[:num_tokens].unsqueeze(-1)
            out.append(self.decode(tokens[:num_tokens], scale, dtype))  # [num_tokens, H, D]
        return out[0], out[1]
