"""The KV codec: the one place that decides what the KV cache stores for a key or value vector.

A codec is a storage format plus how values are scaled and in which basis they are stored::

    stored  = encode(x R / s)          x: one K or V vector of a KV head, [D]
    read    = decode(stored) * s       (in the stored basis; attention works there, see below)

* format (:class:`kv8.quant.formats.KVCacheDtype`): FP8 (E4M3, E4M3FNUZ, E5M2: ``saturate(rne(.))`` to raw
  ``uint8`` codes) or a 16/32-bit float (a plain cast, ``s = 1``);
* scales ``s``: *static* -- per layer, for K and V separately, per tensor, KV head or channel
  (:class:`kv8.quant.scales.KVScales`) -- or *dynamic* -- one float32 per token and KV head, ``amax(|x|) /
  format max`` (1.0 for an all-zero or non-finite vector), computed at store time and kept beside the codes;
* basis ``R``: identity, or the orthonormal per-head Hadamard matrix (:mod:`kv8.quant.rotation`). Queries are
  rotated the same way and the attention output is rotated back (``R`` is its own inverse), so attention over
  the stored basis equals attention over the original one in exact arithmetic and nothing stored is ever
  un-rotated.

Everything that writes, reads or measures stored K/V goes through a codec: the reference store and gather
(:class:`kv8.cache.paged_cache.PagedKVCache`), the fused kernels (their per-layer scale arguments come from
:meth:`KVCodec.layer_scales`; their encode is tested bit-exact against :meth:`KVCodec.encode`), the attention
layer (:meth:`KVCodec.to_stored_basis`), calibration statistics (:attr:`KVCodec.rotation` for the key envelope)
and ``kv8 eval``'s round-trip error (:meth:`KVCodec.round_trip`).

Invariants (the options are checked by :class:`kv8.cache.config.CacheConfig` when the engine is built, the scales'
fit and basis by :func:`kv8.cache.scale_sources.resolve_kv_scales`, and that scales are present or absent as the
mode needs by :meth:`KVCodec.build`): dynamic scales and static scales exclude each other and both need an FP8
format; an FP8 codec in static mode always has scales (1.0 when none were given); a rotation needs a power-of-two
``head_dim``; static scales describe the codec's basis (1.0 fits every basis).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kv8.quant.formats import KVCacheDtype, dequantize, quantize
from kv8.quant.rotation import ROTATIONS, hadamard, rotate
from kv8.quant.scales import KVScales

SCALE_MODES = ("static", "dynamic")
DYNAMIC_SCALE_BYTES = 4  # one float32 scale per (token, KV head), for K and for V

K, V = 0, 1  # index of keys / values in every (K, V) pair


@dataclass(frozen=True, eq=False)
class KVCodec:
    """Format + scales + basis of the stored K/V. Build with :meth:`build`."""

    kv_dtype: KVCacheDtype
    head_dim: int
    scales: KVScales | None = None          # static scales (FP8, static mode); None otherwise
    dynamic: bool = False                   # per-token, per-head scales stored beside the codes
    rotation_name: str = "none"
    rotation: torch.Tensor | None = None    # [D, D] orthonormal, float32; None = identity

    @staticmethod
    def build(kv_dtype: KVCacheDtype, head_dim: int, *, scale_mode: str = "static", rotation: str = "none",
              scales: KVScales | None = None) -> KVCodec:
        """A codec for options already validated by :class:`kv8.cache.config.CacheConfig` (``scale_mode`` in
        :data:`SCALE_MODES`, ``rotation`` in :data:`ROTATIONS`, dynamic scales only with FP8, a power-of-two
        ``head_dim`` for a rotation). ``scales`` are the static scales (dropped for a 16/32-bit format: there is
        nothing to scale); an FP8 format in static mode needs them -- 1.0 comes from :meth:`KVScales.default`,
        never invented here."""
        if scale_mode not in SCALE_MODES or rotation not in ROTATIONS:
            raise ValueError(f"scale_mode={scale_mode!r} / rotation={rotation!r}: allowed are "
                             f"{', '.join(SCALE_MODES)} / {', '.join(ROTATIONS)}")
        dynamic = scale_mode == "dynamic"
        if dynamic and not kv_dtype.is_fp8:
            raise ValueError(f"dynamic scales need an FP8 format, not {kv_dtype.name}")
        if dynamic and scales is not None:
            raise ValueError(f"kv_cache_scale_mode='dynamic' computes scales per token; static scales "
                             f"({scales.source}) cannot be combined with it")
        if kv_dtype.is_fp8 and not dynamic and scales is None:
            raise ValueError("an FP8 KV cache in static scale mode needs scales (KVScales.default gives 1.0)")
        matrix = hadamard(head_dim) if rotation == "hadamard" else None
        return KVCodec(kv_dtype, head_dim, scales if kv_dtype.is_fp8 else None, dynamic, rotation, matrix)

    # ---- sizes ----------------------------------------------------------------------------------------------
    @staticmethod
    def bytes_per_head(kv_dtype: KVCacheDtype, head_dim: int, dynamic: bool) -> int:
        """Bytes one token's K (or V) of one KV head occupies: its codes, plus its scale with dynamic scales
        (``4 / head_dim`` overhead: 6.25% at head_dim 64)."""
        return head_dim * kv_dtype.bytes_per_element + (DYNAMIC_SCALE_BYTES if dynamic else 0)

    # ---- basis ----------------------------------------------------------------------------------------------
    def to_stored_basis(self, x: torch.Tensor) -> torch.Tensor:
        """``x R`` over the last dim (identity without a rotation); also undoes it, since ``R R = I``."""
        return x if self.rotation is None else rotate(x, self.rotation)

    # ---- scales ---------------------------------------------------------------------------------------------
    def layer_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Static ``(k_scale, v_scale)`` of one layer, float32 broadcastable to ``[H, D]``; None without."""
        return None if self.scales is None else self.scales.layer(layer)

    def token_scales(self, x: torch.Tensor) -> torch.Tensor:
        """Dynamic scales ``[T, H]`` float32 of values ``[T, H, D]``: ``amax / format max``, 1.0 where that is
        zero or not finite."""
        fmt = self.kv_dtype.fp8
        assert fmt is not None, "dynamic scales exist only for FP8 codecs"
        amax = x.float().abs().amax(dim=-1)
        # a tensor divisor: a true float32 division on every device (CUDA turns `/ python_float` into a multiply
        # by the rounded reciprocal, which differs in the last bit for about half the values)
        s = amax / torch.tensor(fmt.max_finite, dtype=torch.float32, device=amax.device)
        return torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))

    # ---- bytes ----------------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, layer: int, which: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Values ``[T, H, D]`` (already in the stored basis) of ``which`` (:data:`K` or :data:`V`) in ``layer``
        -> ``(stored [T, H, D], token scales [T, H] or None)``."""
        fmt = self.kv_dtype.fp8
        if fmt is None:
            return x.to(self.kv_dtype.storage_dtype), None
        if self.dynamic:
            ts = self.token_scales(x)
            return quantize(x, ts.unsqueeze(-1), fmt), ts
        assert self.scales is not None
        return quantize(x, self.scales.layer(layer)[which], fmt), None

    def decode(self, stored: torch.Tensor, layer: int, which: int, dtype: torch.dtype,
               token_scales: torch.Tensor | None = None) -> torch.Tensor:
        """What :meth:`encode` stored ``[T, H, D]`` -> values in ``dtype`` (stored basis). ``token_scales``
        ``[T, H]`` are the stored dynamic scales (required in dynamic mode)."""
        fmt = self.kv_dtype.fp8
        if fmt is None:
            return stored.to(dtype)
        if self.dynamic:
            assert token_scales is not None, "a dynamic codec decodes with the stored token scales"
            return dequantize(stored, token_scales.unsqueeze(-1), fmt, dtype=dtype)
        assert self.scales is not None
        return dequantize(stored, self.scales.layer(layer)[which], fmt, dtype=dtype)

    def round_trip(self, x: torch.Tensor, layer: int, which: int) -> tuple[torch.Tensor, int]:
        """``(read-back float32 [T, H, D], number of values clipped)`` for values ``[T, H, D]`` in the stored
        basis: what attention reads for ``x`` and how many of its values lay beyond the format's range
        (``|x| / s > format max``; 0 for a 16/32-bit cache)."""
        stored, ts = self.encode(x, layer, which)
        back = self.decode(stored, layer, which, torch.float32, ts)
        fmt = self.kv_dtype.fp8
        if fmt is None:
            return back, 0
        scale = ts.unsqueeze(-1) if ts is not None else self.scales.layer(layer)[which]  # type: ignore[union-attr]
        return back, int(((x.float() / scale).abs() > fmt.max_finite).sum())

    def describe(self) -> str:
        """One line for logs: the scales' source and the basis."""
        scales = ("dynamic per token and head" if self.dynamic else
                  self.scales.source if self.scales is not None else "none (not fp8)")
        return f"scales: {scales}; rotation {self.rotation_name}"


__all__ = ["DYNAMIC_SCALE_BYTES", "K", "KVCodec", "ROTATIONS", "SCALE_MODES", "V"]
