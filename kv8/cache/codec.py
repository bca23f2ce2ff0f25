"""The KV codec: the one place that decides what the KV cache stores for a key or value vector.

A codec is a storage format plus how values are scaled and in which basis they are stored::

    stored  = encode(x R / s)          x: one K or V vector of a KV head, [D]
    read    = decode(stored) * s       (in the stored basis; attention works there, see below)

* format (:class:`kv8.quant.formats.KVCacheDtype`): FP8 (E4M3, E4M3FNUZ, E5M2: ``saturate(rne(.))`` to raw
  ``uint8`` codes), int8 / int4 (``clamp(rne(.), -max, max)``, max 127 / 7, to ``int8`` codes or two 4-bit codes
  per ``uint8``; always with dynamic scales), the group-scaled formats -- FP4 E2M1 (two codes per byte and an E4M3
  scale per group of 16 values in the same row, :mod:`kv8.quant.fp4`) and int4 per group of 32 (a float16 scale
  per 32 values, :mod:`kv8.quant.int4_group`): their scales are neither static nor per token, ``s`` is per group --
  or a 16/32-bit float (a plain cast, ``s = 1``);
* scales ``s``: *static* -- per layer, for K and V separately, per tensor, KV head or channel
  (:class:`kv8.quant.scales.KVScales`, FP8 only) -- or *dynamic* -- one float32 per token and KV head,
  ``amax(|x|) / format max`` (1.0 for an all-zero or non-finite vector), computed at store time and kept beside
  the codes (FP8 with ``kv_cache_scale_mode="dynamic"``; int8 always);
* key offsets ``c`` (key centering, :mod:`kv8.quant.key_offsets`): keys are stored as ``(k - c) R`` instead of
  ``k R``, with ``c`` calibrated per (layer, KV head, channel) in the model's basis; exact for attention (every
  score of a query moves by the same ``-q.c``) and applied in one place, :meth:`KVCodec.keys_to_stored`, which the
  attention layer calls before any backend stores the keys. Values are never centered;
* key scaling ``s`` (:mod:`kv8.quant.key_scaling`, only beside key offsets): keys are stored as ``((k - c) * s) R``
  and queries used as ``(q / s) R`` (``s`` per layer, KV head and channel, the queries of a KV head's group divided
  by its factors); exact for attention (``s`` cancels in every product), applied in
  :meth:`KVCodec.keys_to_stored` and :meth:`KVCodec.queries_to_stored`;
* K and V apart (``v_dtype``): keys in one format, values in another (``kv_cache_dtype="int8/int4_g32"``, or
  ``"k8v4"``); each side is encoded, decoded and sized by its own format. In a pair every FP8 or integer side keeps
  dynamic per-token scales (a pair takes no static scales), a group-scaled side its group scales, a 16/32-bit side
  none; the basis, key offsets and key scaling are the layer's, as for one format;
* basis ``R``: identity, or the orthonormal per-head Hadamard matrix (:mod:`kv8.quant.rotation`), for keys and
  values apart (``rotation="none/hadamard"``: keys as they are, values rotated). Queries are rotated as the keys
  are, and the attention output is rotated back as the values were (``R`` is its own inverse), so attention over
  the stored basis equals attention over the original one in exact arithmetic and nothing stored is ever
  un-rotated.

Everything that writes, reads or measures stored K/V goes through a codec: the reference store and gather
(:class:`kv8.cache.paged_cache.PagedKVCache`), the fused kernels (their per-layer scale arguments come from
:meth:`KVCodec.layer_scales`; their encode is tested bit-exact against :meth:`KVCodec.encode`), the attention
layer (:meth:`KVCodec.to_stored_basis`, :meth:`KVCodec.keys_to_stored`, :meth:`KVCodec.queries_to_stored`),
calibration statistics (:attr:`KVCodec.rotation`, the keys' basis, for the key envelope)
and ``kv8 eval``'s round-trip error (:meth:`KVCodec.round_trip`).

Invariants (the options are checked by :class:`kv8.cache.config.CacheConfig` when the engine is built, the scales'
fit and basis by :func:`kv8.cache.scale_sources.resolve_kv_scales`, and that scales are present or absent as the
mode needs by :meth:`KVCodec.build`): dynamic scales and static scales exclude each other; static scales need an
FP8 format, dynamic ones an FP8 or integer format, and int8 / int4 are always dynamic; the group-scaled formats have
neither (their group scales are part of each stored row) and need whole rows of their groups (``int4_per_group32``:
a head_dim that is a multiple of 32); an FP8 codec in static mode
always has scales (1.0 when none were given); a rotation needs a power-of-two ``head_dim``; static scales describe
the codec's basis (1.0 fits every basis).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from kv8.quant.formats import KVCacheDtype, dequantize, kv_cache_dtype_name, pack_int4, quantize, unpack_int4
from kv8.quant.fp4 import FP4GroupFormat
from kv8.quant.int4_group import Int4GroupFormat
from kv8.quant.key_offsets import KeyOffsets
from kv8.quant.key_scaling import KeyScaling
from kv8.quant.rotation import ROTATIONS, hadamard, rotate, rotation_name, rotation_sides
from kv8.quant.scales import KVScales

SCALE_MODES = ("static", "dynamic")
DYNAMIC_SCALE_BYTES = 4  # one float32 scale per (token, KV head), for K and for V

K, V = 0, 1  # index of keys / values in every (K, V) pair
GROUP_FORMATS = (FP4GroupFormat, Int4GroupFormat)   # the classes of kv8.quant.formats.GroupFormat (isinstance)


@dataclass(frozen=True, eq=False)
class KVCodec:
    """Format + scales + basis of the stored K/V. Build with :meth:`build`."""

    kv_dtype: KVCacheDtype                  # the keys' format, and the values' unless v_dtype says otherwise
    head_dim: int
    scales: KVScales | None = None          # static scales (FP8, static mode, one format); None otherwise
    # per-token, per-head scales stored beside the codes of some side (int8: always; in a pair: FP8 and int sides)
    dynamic: bool = False
    rotation_name: str = "none"             # canonical kv_cache_rotation ("none", "hadamard", "none/hadamard", ...)
    rotation: torch.Tensor | None = None    # the keys' basis: [D, D] orthonormal, float32; None = identity
    # the static scales' (k [L, H|1, D|1], v) on the codec's device (scales stay on the CPU: KVScales)
    device_scales: tuple[torch.Tensor, torch.Tensor] | None = None
    key_offsets: KeyOffsets | None = None   # key centering (every layer, this rank's KV heads); None = off
    # the key offsets [L, H, D] float32 on the codec's device, in the model's basis (subtracted before R)
    device_key_offsets: torch.Tensor | None = None
    key_scaling: KeyScaling | None = None   # key scaling (only with key offsets); None = off
    # the key factors [L, H, D] float32 on the codec's device, in the model's basis (applied before R)
    device_key_scaling: torch.Tensor | None = None
    v_dtype: KVCacheDtype | None = None     # the values' format when it differs from kv_dtype (a K/V pair)
    v_rotation: torch.Tensor | None = None  # the values' basis ([D, D] or None, as :attr:`rotation`)

    @staticmethod
    def build(kv_dtype: KVCacheDtype, head_dim: int, *, scale_mode: str = "static", rotation: str = "none",
              scales: KVScales | None = None, key_offsets: KeyOffsets | None = None,
              key_scaling: KeyScaling | None = None, v_dtype: KVCacheDtype | None = None) -> KVCodec:
        """A codec for options already validated by :class:`kv8.cache.config.CacheConfig` (``scale_mode`` in
        :data:`SCALE_MODES`, ``rotation`` one of :data:`ROTATIONS` or a K/V pair of them, dynamic scales only with a
        quantized format, a power-of-two ``head_dim`` for a rotation). ``scales`` are the static scales (dropped for a
        16/32-bit format: there is nothing to scale); an FP8 format in static mode needs them -- 1.0 comes from
        :meth:`KVScales.default`, never invented here. An int8 format is dynamic whatever ``scale_mode`` says (its
        scales are per token and head by definition) and takes no static scales. ``key_offsets`` (``[L, H, D]`` with
        this codec's ``head_dim``; any format) turn key centering on; ``key_scaling`` (the same shape, only with
        ``key_offsets``) key scaling. ``v_dtype`` (other than ``kv_dtype``) stores the values in their own format: a K/V
        pair, whose FP8 and int sides keep dynamic scales whatever ``scale_mode`` says, and which takes no static
        ``scales``."""
        if v_dtype is not None and v_dtype == kv_dtype:
            v_dtype = None
        for side in (kv_dtype,) if v_dtype is None else (kv_dtype, v_dtype):
            if side.group is not None:
                side.group.check_head_dim(head_dim, side.name)
            elif side.bits_per_value == 4 and head_dim % 2:
                raise ValueError(f"kv_cache_dtype={side.name!r} packs two values per byte: it needs an even "
                                 f"head_dim, not {head_dim}")
        if v_dtype is not None:
            return KVCodec._build_pair(kv_dtype, v_dtype, head_dim, rotation, scales, key_offsets, key_scaling)
        if scale_mode not in SCALE_MODES:
            raise ValueError(f"scale_mode={scale_mode!r}: allowed are {', '.join(SCALE_MODES)}")
        k_rotation, v_rotation = rotation_sides(rotation, "rotation")
        if kv_dtype.group_scales and (scale_mode == "dynamic" or scales is not None):
            raise ValueError(f"kv_cache_dtype={kv_dtype.name!r} stores a scale per group of values in each row; it "
                             "takes neither dynamic per-token scales nor static scales")
        dynamic = scale_mode == "dynamic" or kv_dtype.per_token_scales
        if dynamic and not kv_dtype.is_quantized:
            raise ValueError(f"dynamic scales need a quantized format (FP8 or int8), not {kv_dtype.name}")
        if dynamic and scales is not None:
            what = (f"kv_cache_dtype={kv_dtype.name!r}" if kv_dtype.per_token_scales
                    else "kv_cache_scale_mode='dynamic'")
            raise ValueError(f"{what} computes scales per token; static scales ({scales.source}) cannot be "
                             "combined with it")
        if kv_dtype.is_fp8 and not dynamic and scales is None:
            raise ValueError("an FP8 KV cache in static scale mode needs scales (KVScales.default gives 1.0)")
        if key_offsets is not None and int(key_offsets.k.shape[2]) != head_dim:
            raise ValueError(f"k_offset from {key_offsets.source} has head_dim {int(key_offsets.k.shape[2])}, the "
                             f"cache {head_dim}")
        if key_scaling is not None:
            if key_offsets is None:
                raise ValueError(f"k_channel_scale from {key_scaling.source} comes only with key offsets "
                                 "(k_offset); kv8 calibrate --key-scaling needs --key-centering")
            if list(key_scaling.s.shape) != list(key_offsets.k.shape):
                raise ValueError(f"k_channel_scale from {key_scaling.source} has shape {list(key_scaling.s.shape)}, "
                                 f"k_offset {list(key_offsets.k.shape)}; they must be equal")
            if kv_dtype.is_fp8 and not dynamic:
                raise ValueError(f"k_channel_scale from {key_scaling.source}: a static-scale FP8 cache cannot scale "
                                 "keys (the file's static scales describe unscaled keys); use "
                                 "kv_cache_scale_mode='dynamic' or another cache format")
        scales = scales if kv_dtype.is_fp8 else None
        return KVCodec(kv_dtype, head_dim, scales, dynamic, rotation_name(k_rotation, v_rotation),
                       hadamard(head_dim) if k_rotation == "hadamard" else None,
                       None if scales is None else (scales.k, scales.v), key_offsets,
                       None if key_offsets is None else key_offsets.k, key_scaling,
                       None if key_scaling is None else key_scaling.s,
                       v_rotation=hadamard(head_dim) if v_rotation == "hadamard" else None)

    @staticmethod
    def _build_pair(k_dtype: KVCacheDtype, v_dtype: KVCacheDtype, head_dim: int, rotation: str,
                    scales: KVScales | None, key_offsets: KeyOffsets | None,
                    key_scaling: KeyScaling | None) -> KVCodec:
        """:meth:`build` of a K/V pair (two different formats)."""
        name = kv_cache_dtype_name(k_dtype, v_dtype)
        rotation_sides(rotation, "rotation")
        if scales is not None:
            raise ValueError(f"kv_cache_dtype={name!r} keeps a scale per token and head on its FP8 and int sides; "
                             f"static scales ({scales.source}) cannot be combined with a K/V pair")
        # the offsets' and factors' own checks are the one-format codec's (no static scales here)
        checked = KVCodec.build(k_dtype, head_dim, scale_mode="dynamic" if k_dtype.is_fp8 else "static",
                                rotation=rotation, key_offsets=key_offsets, key_scaling=key_scaling)
        return replace(checked, dynamic=k_dtype.token_scalable or v_dtype.token_scalable, v_dtype=v_dtype)

    def to(self, device: torch.device | str) -> KVCodec:
        """The same codec with its tensors (static scales, rotation) on ``device``: what encodes and decodes
        tensors there. ``scales`` (:class:`KVScales`) stays on the CPU."""
        moved = None if self.device_scales is None else (self.device_scales[0].to(device),
                                                          self.device_scales[1].to(device))
        rotation = None if self.rotation is None else self.rotation.to(device)
        v_rotation = None if self.v_rotation is None else self.v_rotation.to(device)
        offsets = None if self.device_key_offsets is None else self.device_key_offsets.to(device)
        factors = None if self.device_key_scaling is None else self.device_key_scaling.to(device)
        return replace(self, rotation=rotation, v_rotation=v_rotation, device_scales=moved,
                       device_key_offsets=offsets, device_key_scaling=factors)

    # ---- sides ----------------------------------------------------------------------------------------------
    @property
    def k_dtype(self) -> KVCacheDtype:
        """The keys' format (:attr:`kv_dtype`)."""
        return self.kv_dtype

    @property
    def values_dtype(self) -> KVCacheDtype:
        """The values' format: :attr:`v_dtype` in a K/V pair, else :attr:`kv_dtype`."""
        return self.kv_dtype if self.v_dtype is None else self.v_dtype

    @property
    def is_pair(self) -> bool:
        """Keys and values are stored in different formats."""
        return self.v_dtype is not None

    @property
    def name(self) -> str:
        """The cache format's canonical name: the format's, or ``"K/V"`` for a pair."""
        return kv_cache_dtype_name(self.kv_dtype, self.values_dtype)

    def dtype_of(self, which: int) -> KVCacheDtype:
        """The format of :data:`K` or :data:`V`."""
        return self.kv_dtype if which == K else self.values_dtype

    def dynamic_of(self, which: int) -> bool:
        """Whether :data:`K` or :data:`V` keeps a scale per token and head beside its codes."""
        return self.dynamic and self.dtype_of(which).token_scalable

    def packed_of(self, which: int) -> bool:
        """Two integer codes per stored byte on that side (int4 per token and head; the group-scaled rows are
        :attr:`KVCacheDtype.group`'s own)."""
        codes = self.dtype_of(which).int_codes
        return codes is not None and codes.bits == 4

    @property
    def packed(self) -> bool:
        """:meth:`packed_of` the keys (of both sides, for one format)."""
        return self.packed_of(K)

    # ---- sizes ----------------------------------------------------------------------------------------------
    @staticmethod
    def bytes_per_head(kv_dtype: KVCacheDtype, head_dim: int, dynamic: bool) -> int:
        """Bytes one token's K (or V) of one KV head occupies: its stored row (codes; FP4: and its group scales,
        ``ceil(head_dim / 16)`` bytes; int4_per_group32: ``2 head_dim / 32`` bytes), plus its scale with dynamic
        scales (``dynamic``, and always for int8 / int4 per token and head: ``4 / head_dim`` overhead, 6.25% at
        head_dim 64; never for a 16/32-bit side, nor for a group-scaled one)."""
        scaled = dynamic and kv_dtype.token_scalable or kv_dtype.per_token_scales
        return (kv_dtype.stored_width(head_dim) * kv_dtype.bytes_per_element
                + (DYNAMIC_SCALE_BYTES if scaled else 0))

    # ---- basis ----------------------------------------------------------------------------------------------
    def basis(self, which: int) -> torch.Tensor | None:
        """The rotation of :data:`K` (queries share it) or :data:`V` (the attention output shares it); None for
        the identity."""
        return self.rotation if which == K else self.v_rotation

    def to_stored_basis(self, x: torch.Tensor, which: int) -> torch.Tensor:
        """``x R`` over the last dim, ``R`` the basis of :data:`K` or :data:`V` (identity without a rotation); also
        undoes it, since ``R R = I``: the values' basis turns the attention output back."""
        matrix = self.basis(which)
        return x if matrix is None else rotate(x, matrix)

    def keys_to_stored(self, key: torch.Tensor, layer: int) -> torch.Tensor:
        """New keys ``[T, H, D]`` of ``layer`` (post-RoPE, the model's basis) -> what the cache is asked to store,
        ``((k - c[layer]) * s[layer]) R`` in the keys' dtype: the one place keys are centered and scaled (one
        rounding to the keys' dtype, after the subtraction, the scaling and the rotation in float32). Without key
        offsets, :meth:`to_stored_basis` of :data:`K`."""
        if self.device_key_offsets is None:
            return self.to_stored_basis(key, K)
        x = key.float() - self.device_key_offsets[layer]            # [T, H, D] - [H, D]
        if self.device_key_scaling is not None:
            x = x * self.device_key_scaling[layer]
        if self.rotation is not None:
            x = x @ self.rotation
        return x.to(key.dtype)

    def queries_to_stored(self, query: torch.Tensor, layer: int) -> torch.Tensor:
        """Queries ``[T, Hq, D]`` of ``layer`` (post-RoPE, the model's basis; ``Hq`` a multiple of the codec's KV
        heads, each KV head's group of query heads consecutive) -> what attends over the stored keys,
        ``(q / s[layer]) R`` in the queries' dtype: the one place queries are scaled. Without key scaling,
        :meth:`to_stored_basis` of :data:`K`."""
        if self.device_key_scaling is None:
            return self.to_stored_basis(query, K)
        s = self.device_key_scaling[layer]                          # [Hkv, D]
        x = query.float() / s.repeat_interleave(query.shape[-2] // s.shape[0], dim=0)   # [T, Hq, D]
        if self.rotation is not None:
            x = x @ self.rotation
        return x.to(query.dtype)

    def keys_from_stored(self, stored: torch.Tensor, layer: int) -> torch.Tensor:
        """The inverse of :meth:`keys_to_stored` in float32: stored keys ``[T, H, D]`` -> ``stored R / s + c``, the
        keys in the model's basis (what ``kv8 eval`` measures a key's error against)."""
        x = self.to_stored_basis(stored.float(), K)                 # R is its own inverse
        if self.device_key_scaling is not None:
            x = x / self.device_key_scaling[layer]
        if self.device_key_offsets is not None:
            x = x + self.device_key_offsets[layer]
        return x

    # ---- scales ---------------------------------------------------------------------------------------------
    def layer_scales(self, layer: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Static ``(k_scale, v_scale)`` of one layer, float32 broadcastable to ``[H, D]``, on the codec's device;
        None without."""
        if self.scales is None or self.device_scales is None:
            return None
        self.scales.layer(layer)   # validates the index
        return self.device_scales[0][layer], self.device_scales[1][layer]

    def token_scales(self, x: torch.Tensor, which: int = K) -> torch.Tensor:
        """Dynamic scales ``[T, H]`` float32 of ``which``'s values ``[T, H, D]``: ``amax / format max``, 1.0 where
        that is zero or not finite."""
        fmt = self.dtype_of(which).codes
        assert fmt is not None, "dynamic scales exist only for quantized (FP8, int8) codecs"
        amax = x.float().abs().amax(dim=-1)
        # a tensor divisor: a true float32 division on every device (CUDA turns `/ python_float` into a multiply
        # by the rounded reciprocal, which differs in the last bit for about half the values)
        s = amax / torch.tensor(fmt.max_finite, dtype=torch.float32, device=amax.device)
        return torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))

    # ---- bytes ----------------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, layer: int, which: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Values ``[T, H, D]`` (already in the stored basis) of ``which`` (:data:`K` or :data:`V`) in ``layer``
        -> ``(stored [T, H, W], token scales [T, H] or None)``; ``W = kv_dtype.stored_width(D)`` (``D / 2``
        bytes for int4: two codes per byte, :func:`kv8.quant.formats.pack_int4`); ``which``'s format."""
        kv_dtype = self.dtype_of(which)
        fmt = kv_dtype.codes
        if fmt is None:
            return x.to(kv_dtype.storage_dtype), None
        if isinstance(fmt, GROUP_FORMATS):
            return fmt.encode(x), None
        if self.dynamic_of(which):
            ts = self.token_scales(x, which)
            codes = quantize(x, ts.unsqueeze(-1), fmt)
            return (pack_int4(codes) if self.packed_of(which) else codes), ts
        scales = self.layer_scales(layer)
        assert scales is not None
        return quantize(x, scales[which], fmt), None

    def decode(self, stored: torch.Tensor, layer: int, which: int, dtype: torch.dtype,
               token_scales: torch.Tensor | None = None) -> torch.Tensor:
        """What :meth:`encode` stored ``[T, H, W]`` -> values ``[T, H, D]`` in ``dtype`` (stored basis).
        ``token_scales`` ``[T, H]`` are the stored dynamic scales (required where :meth:`dynamic_of`)."""
        fmt = self.dtype_of(which).codes
        if fmt is None:
            return stored.to(dtype)
        if isinstance(fmt, GROUP_FORMATS):
            return fmt.decode(stored, self.head_dim, dtype)
        if self.dynamic_of(which):
            assert token_scales is not None, "a dynamic codec decodes with the stored token scales"
            codes = unpack_int4(stored) if self.packed_of(which) else stored
            return dequantize(codes, token_scales.unsqueeze(-1), fmt, dtype=dtype)
        scales = self.layer_scales(layer)
        assert scales is not None
        return dequantize(stored, scales[which], fmt, dtype=dtype)

    def round_trip(self, x: torch.Tensor, layer: int, which: int) -> tuple[torch.Tensor, int]:
        """``(read-back float32 [T, H, D], number of values clipped)`` for values ``[T, H, D]`` in the stored
        basis: what attention reads for ``x`` and how many of its values lay beyond the format's range
        (``|x| / s > fmt.clip_limit``: the FP8 format's max, or int8's 127.5; 0 for a 16/32-bit cache)."""
        stored, ts = self.encode(x, layer, which)
        back = self.decode(stored, layer, which, torch.float32, ts)
        fmt = self.dtype_of(which).codes
        if fmt is None:
            return back, 0
        if isinstance(fmt, GROUP_FORMATS):
            return back, fmt.clipped(x, stored)
        scale = ts.unsqueeze(-1) if ts is not None else self.layer_scales(layer)[which]  # type: ignore[index]
        return back, int(((x.float() / scale).abs() > fmt.clip_limit).sum())

    def describe(self) -> str:
        """One line for logs: the scales' source and the basis."""
        if self.v_dtype is not None:
            sides = [f"{w} {self._side_scales(self.dtype_of(i))}" for i, w in ((K, "K"), (V, "V"))]
            return self._describe_rest("; ".join(sides))
        scales = ("dynamic per token and head" if self.dynamic else
                  f"{self.kv_dtype.group.scale_name} per group of {self.kv_dtype.group.group_size}"
                  if self.kv_dtype.group is not None else
                  self.scales.source if self.scales is not None else "none (not quantized)")
        return self._describe_rest(f"scales: {scales}")

    @staticmethod
    def _side_scales(fmt: KVCacheDtype) -> str:
        """A pair side's scales in words."""
        if fmt.group is not None:
            return f"{fmt.name} ({fmt.group.scale_name} per group of {fmt.group.group_size})"
        return f"{fmt.name} ({'dynamic per token and head' if fmt.is_quantized else 'not quantized'})"

    def _describe_rest(self, scales: str) -> str:
        """``scales``, then the rotation and the key offsets and factors."""
        centering = "" if self.key_offsets is None else f"; key centering on ({self.key_offsets.source})"
        if self.key_scaling is not None:
            centering += f"; key scaling on ({self.key_scaling.source})"
        return f"{scales}; rotation {self.rotation_name}{centering}"


__all__ = ["DYNAMIC_SCALE_BYTES", "K", "KVCodec", "ROTATIONS", "SCALE_MODES", "V"]
