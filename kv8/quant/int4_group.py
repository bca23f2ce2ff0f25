"""int4 codes with a float16 scale per group of 32 values: what ``kv_cache_dtype="int4_per_group32"`` stores.

One row of ``D`` values (one token of one KV head; ``D`` a multiple of 32) is stored as ``D / 2 + 2 G`` bytes,
``G = D / 32``::

    [ codes: D / 2 bytes, channel 2j in the low nibble of byte j, 2j + 1 in the high | G float16 scales ]

Group ``g`` is channels ``32 g .. 32 g + 31``; scale ``g`` is bytes ``D / 2 + 2 g`` (low) and ``D / 2 + 2 g + 1``
(high), the float16's little-endian bits. Encoding, in float32:

* ``s_g = float16(clamp(amax_g / 7, 2^-24, 65504))`` rounded to nearest even (float16's smallest subnormal to its
  largest finite value, so every group has a positive finite scale); ``s_g = 1.0`` when ``amax_g / 7`` is zero or
  not finite (a NaN or an infinity in the group; as int4's per-token scale);
* ``code = clamp(round_half_even(x / s_g), -7, 7)``: symmetric (-8 is never written), ``±inf`` saturate to
  ``±7``, NaN -> 0 (:class:`kv8.quant.formats.IntFormat`'s rule); each code a two's complement nibble.

Decoding is ``code * s_g`` (exact in float32: a 4-bit integer times a float16). A value costs 4 + 16 / 32 = 4.5 bits,
the bytes of ``fp4_e2m1``; ``scripts/kv4_error.py`` measured this layout's attention-output error 9% (SmolLM2) /
21% (Gemma-3-270M) below int4 with a scale per (token, KV head) (docs/accuracy.md).

Not llama.cpp's ``q4_0`` (also 32 values and a float16 scale): q4_0 maps the signed value of largest magnitude to
-8 (``d = max / -8``, codes -8..7, rounding ``(int)(x / d + 8.5)``); this format is symmetric, ``amax / 7`` with
round half to even, so the two disagree on most rows and the name is not aliased to it.

Invariants: a group's scale is a positive finite float16; ``decode(encode(x))`` is within half a scale of every
finite value whose group is finite and whose scale is normal and unclamped (``amax_g / 7`` in
``[2^-14, 65504]``), plus the scale's own rounding on the group's largest values (``|x| <= 7 s_g`` up to float16's
half ulp).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kv8.quant.fp4 import pack_nibbles, unpack_nibbles

__all__ = ["INT4_G32", "Int4GroupFormat"]

_F16_MAX = 65504.0
_F16_MIN_SUBNORMAL = 2.0 ** -24


@dataclass(frozen=True)
class Int4GroupFormat:
    """Symmetric int4 codes with a float16 scale per ``group_size`` values along the last dim (the module docstring).

    Invariant: ``group_size`` is 32 and ``head_dim`` a multiple of it (checked by :meth:`check_head_dim`, which the
    codec and the engine's options call).
    """

    name: str = "int4_g32"
    group_size: int = 32

    def __post_init__(self) -> None:
        if self.group_size != 32:
            raise ValueError(f"Int4GroupFormat.group_size={self.group_size!r}: kv8 stores groups of 32")

    @property
    def max_finite(self) -> float:
        """The largest code, 7.0: what a group's scale maps its largest magnitude to."""
        return 7.0

    @property
    def clip_limit(self) -> float:
        """Magnitudes (after scaling) beyond this count as clipped: 7.5, past which rounding would have given a
        larger code than the clamp allows (a group's own largest value lands at most float16's half ulp above 7)."""
        return 7.5

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype of the stored rows: ``uint8`` (packed codes, then the scales' bytes)."""
        return torch.uint8

    @property
    def scale_name(self) -> str:
        """What each group's scale is, for messages: ``float16``."""
        return "float16"

    @property
    def head_dim_multiple(self) -> int:
        """``head_dim`` must be a multiple of this: 32 (whole groups only)."""
        return self.group_size

    def check_head_dim(self, head_dim: int, kv_cache_dtype: str) -> None:
        """Raise ValueError naming ``kv_cache_dtype`` unless ``head_dim`` is a positive multiple of 32."""
        if head_dim <= 0 or head_dim % self.group_size:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} stores a float16 scale per group of "
                             f"{self.group_size} values: it needs a head_dim that is a multiple of "
                             f"{self.group_size}, not head_dim={head_dim} (use int4_per_token_head or fp4_e2m1, "
                             "which take any even head_dim)")

    def groups(self, head_dim: int) -> int:
        """Groups of one row: ``head_dim / 32``."""
        return head_dim // self.group_size

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one stored row: ``head_dim / 2`` of codes and two per group."""
        return head_dim // 2 + 2 * self.groups(head_dim)

    # ---- codes and scales -----------------------------------------------------------------------------------
    @staticmethod
    def encode_int4(x: torch.Tensor) -> torch.Tensor:
        """Values already divided by their scale (any float dtype) -> ``int8`` codes in -7..7, same shape:
        ``clamp(round_half_even(float32(x)), -7, 7)``, NaN -> 0."""
        xf = torch.nan_to_num(x.to(torch.float32), nan=0.0, posinf=7.0, neginf=-7.0)
        return torch.round(xf.clamp(-7.0, 7.0)).to(torch.int8)

    @staticmethod
    def encode_scale(scale: torch.Tensor) -> torch.Tensor:
        """Positive float32 scales -> float16 (round to nearest even, clamped to ``[2^-24, 65504]``)."""
        return scale.clamp(_F16_MIN_SUBNORMAL, _F16_MAX).to(torch.float16)

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., D]`` -> ``[..., G, 32]``."""
        return x.reshape(*x.shape[:-1], -1, self.group_size)

    def group_scales(self, x: torch.Tensor) -> torch.Tensor:
        """The float16 scales ``[..., G]`` of values ``[..., D]``."""
        amax = self._grouped(x.to(torch.float32)).abs().amax(dim=-1)
        # a tensor divisor: a true float32 division on every device (as KVCodec.token_scales)
        s = amax / torch.tensor(self.max_finite, dtype=torch.float32, device=amax.device)
        s = torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))
        return self.encode_scale(s)

    def scaled(self, x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """``float32(x) / s_g`` for each value's group, ``[..., D]``: what :meth:`encode_int4` rounds."""
        s = scales.to(torch.float32).unsqueeze(-1)
        return (self._grouped(x.to(torch.float32)) / s).flatten(-2)

    # ---- rows -----------------------------------------------------------------------------------------------
    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Values ``[..., D]`` (any float dtype, D a multiple of 32) -> stored rows ``uint8 [..., D / 2 + 2 G]``."""
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            raise ValueError(f"Int4GroupFormat.encode: x must be a floating-point tensor, got "
                             f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.ndim == 0 or x.shape[-1] == 0 or x.shape[-1] % self.group_size:
            raise ValueError(f"Int4GroupFormat.encode: the last dim holds whole groups of {self.group_size} values "
                             f"and must be a multiple of {self.group_size}, got shape {tuple(x.shape)}")
        scales = self.group_scales(x)
        codes = self.encode_int4(self.scaled(x, scales)).to(torch.uint8) & 0xF
        scale_bytes = scales.contiguous().view(torch.uint8)          # [..., 2 G]: each float16's bytes, low first
        return torch.cat((pack_nibbles(codes), scale_bytes), dim=-1)

    def split(self, stored: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored rows ``[..., D / 2 + 2 G]`` -> (int4 codes ``int8 [..., D]`` in -8..7, scales
        ``float16 [..., G]``)."""
        if stored.dtype != torch.uint8 or head_dim % self.group_size or stored.shape[-1] != self.row_bytes(head_dim):
            raise ValueError(f"Int4GroupFormat: stored rows must be uint8 [..., {self.row_bytes(head_dim)}] for "
                             f"head_dim {head_dim} (a multiple of {self.group_size}), got {stored.dtype} "
                             f"{tuple(stored.shape)}")
        nibbles = unpack_nibbles(stored[..., :head_dim // 2]).to(torch.int16)
        codes = ((nibbles ^ 8) - 8).to(torch.int8)
        scales = stored[..., head_dim // 2:].contiguous().view(torch.float16)
        return codes, scales

    def decode(self, stored: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Stored rows -> values ``[..., head_dim]`` in ``dtype`` (multiplied in float32, then cast)."""
        codes, scales = self.split(stored, head_dim)
        values = self._grouped(codes.to(torch.float32)) * scales.to(torch.float32).unsqueeze(-1)
        return values.flatten(-2).to(dtype)

    def clipped(self, x: torch.Tensor, stored: torch.Tensor) -> int:
        """How many of values ``x [..., D]`` lay beyond the range (``|x| / s_g > clip_limit``) of ``stored``."""
        _, scales = self.split(stored, x.shape[-1])
        return int((self.scaled(x, scales).abs() > self.clip_limit).sum())


INT4_G32 = Int4GroupFormat()
