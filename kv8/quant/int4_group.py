"""int4 codes with a float16 scale per group of 32 values: what ``kv_cache_dtype="int4_per_group32"`` stores.

One row of ``D`` values (one token of one KV head; ``D`` a multiple of 32) is stored as ``D / 2 + 2 G`` bytes,
``G = D / 32``::

    [ codes: D / 2 bytes, channel 2j in the low nibble of byte j, 2j + 1 in the high | G float16 scales ]

Group ``g`` is channels ``32 g .. 32 g + 31``; scale ``g`` is bytes ``D / 2 + 2 g`` (low) and ``D / 2 + 2 g + 1``
(high), the float16's little-endian bits. Decoding is ``code * s_g`` with codes -8..7 (two's complement nibbles)
and ``s_g`` a float16 of either sign (exact in float32: a 4-bit integer times a float16). A value costs
4 + 16 / 32 = 4.5 bits, the bytes of ``fp4_e2m1`` and of llama.cpp's ``q4_0``.

Encoding chooses each group's scale by searching for the smallest squared error, in float32:

* ``quant(d) = clamp(round_half_even(x * r), -8, 7)`` with ``r = 1 / d`` rounded to float32 (one division per
  candidate, not per value), and ``err(d) = tsum((x - quant(d) * d)^2)`` (``quant(d) * d`` is exact), where ``tsum``
  is the sum of 32 values in one fixed order -- ``v[j] + v[j + 16]``, then the 16 sums' ``j`` and ``j + 8``, then
  4, 2, 1 (a pairwise tree, what a 16-lane register's halving reduction gives) -- so that every implementation
  (this module, the CPU store kernel, the Triton store) rounds the same sums and picks the same scale;
* the candidates, in order: for ``c = 7, 7.25, ..., 8.75`` and then the sign ``+``, ``-``:
  ``d = ±f16(clamp(amax / c, 2^-24, 65504))`` (``amax`` the group's largest ``|x|``; ``f16`` rounds to nearest
  even); the first candidate with the smallest ``err`` wins (``<``, so an earlier one keeps a tie);
* then one least-squares refit of the winner's codes ``q``: ``d' = f16(tsum(x q) / tsum(q q))`` (its magnitude
  clamped as above), taken when ``err(d') < err(d)``;
* a group with a NaN or an infinity, or all zeros, gets ``s_g = 1.0`` and codes
  ``clamp(round_half_even(x), -8, 7)`` with NaN -> 0, ``+inf`` -> 7, ``-inf`` -> -8.

The first candidate, ``d = f16(amax / 7)``, is the symmetric rule (codes -7..7, the largest magnitude mapped to 7),
so every group's squared error is at most that rule's; the others use the 16th level (-8) that the symmetric rule
leaves unused and clip a group's largest value where that lowers the error of the rest. On Gaussian groups the
search's mean squared error is 0.70x the symmetric rule's (0.0066 against 0.0094 of the variance); llama.cpp's
``q4_0`` maps the signed value of largest magnitude to -8 (``d = max / -8``) without a search (0.0074). The stored
rows read the same whichever scale was chosen: only the encoder searches.

Invariants: a group's scale is a nonzero finite float16; the codes are -8..7; a finite group's squared error is at
most that of ``d = f16(amax / 7)`` with codes ``clamp(round_half_even(x * (1 / d)), -7, 7)``.
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
    """int4 codes (-8..7) with a searched float16 scale per ``group_size`` values along the last dim (the module
    docstring).

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
        """7.0: the first candidate's divisor (``d = f16(amax / 7)``, the symmetric rule); the codes reach -8."""
        return 7.0

    @property
    def clip_limit(self) -> float:
        """Scaled values ``x / s_g`` above this, or below ``-clip_limit - 1``, count as clipped: 7.5 (past which
        rounding would give a code above 7; -8.5 below -8). A searched scale may clip a group's largest value on
        purpose, where that lowers the group's squared error."""
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
        """Values already divided by their scale (any float dtype) -> ``int8`` codes in -8..7, same shape:
        ``clamp(round_half_even(float32(x)), -8, 7)``, NaN -> 0, ``+inf`` -> 7, ``-inf`` -> -8."""
        xf = torch.nan_to_num(x.to(torch.float32), nan=0.0, posinf=7.0, neginf=-8.0)
        return torch.round(xf.clamp(-8.0, 7.0)).to(torch.int8)

    @staticmethod
    def encode_scale(scale: torch.Tensor) -> torch.Tensor:
        """Float32 scales -> float16 (round to nearest even), magnitudes clamped to ``[2^-24, 65504]`` (the sign
        kept; a zero becomes ``+2^-24``)."""
        mag = scale.abs().clamp(_F16_MIN_SUBNORMAL, _F16_MAX)
        return torch.where(scale < 0, -mag, mag).to(torch.float16)

    @staticmethod
    def tree_sum(v: torch.Tensor) -> torch.Tensor:
        """The sum over the last dim (a power of two, 32 here) in the module's fixed order: ``v[j] + v[j + n/2]``,
        halving until one value is left (float32 in, float32 out, every addition rounded once)."""
        while v.shape[-1] > 1:
            half = v.shape[-1] // 2
            v = v[..., :half] + v[..., half:]
        return v[..., 0]

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., D]`` -> ``[..., G, 32]``."""
        return x.reshape(*x.shape[:-1], -1, self.group_size)

    def _quantize(self, g: torch.Tensor, d: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes float32 ``[..., G, 32]``, squared error ``[..., G]``) of finite groups ``g`` with float32 scales
        ``d [..., G]`` (float16 values): ``quant(d)`` and ``err(d)`` of the module docstring."""
        dv = d.unsqueeze(-1)
        q = torch.round((g * (torch.ones_like(dv) / dv)).clamp(-8.0, 7.0))   # one true float32 division per group
        r = g - q * dv
        return q, self.tree_sum(r * r)

    def group_codes(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes ``int8 [..., D]`` in -8..7, float16 scales ``[..., G]``) of values ``[..., D]``: the search of
        the module docstring."""
        g = self._grouped(x.to(torch.float32))
        amax = g.abs().amax(dim=-1)
        ok = torch.isfinite(amax) & (amax > 0)                 # NaN propagates through amax
        gf = torch.where(ok.unsqueeze(-1), g, torch.zeros_like(g))
        amax = torch.where(ok, amax, torch.ones_like(amax))
        candidates: list[torch.Tensor] = []          # float32 scales [..., G], in the order the search tries them
        for k in range(8):
            # a tensor divisor: a true float32 division on every device (as KVCodec.token_scales)
            mag = self.encode_scale(amax / torch.tensor(7.0 + 0.25 * k, dtype=torch.float32, device=amax.device))
            candidates += [mag.to(torch.float32), (-mag).to(torch.float32)]
        best_d = candidates[0]
        best_q, best_e = self._quantize(gf, best_d)
        for d in candidates[1:]:
            q, e = self._quantize(gf, d)
            take = e < best_e
            best_q = torch.where(take.unsqueeze(-1), q, best_q)
            best_d = torch.where(take, d, best_d)
            best_e = torch.where(take, e, best_e)
        den = self.tree_sum(best_q * best_q)
        fit = self.tree_sum(gf * best_q) / torch.where(den > 0, den, torch.ones_like(den))
        fit_ok = (den > 0) & torch.isfinite(fit) & (fit != 0)
        d2 = self.encode_scale(torch.where(fit_ok, fit, best_d)).to(torch.float32)
        q2, e2 = self._quantize(gf, d2)
        take = fit_ok & (e2 < best_e)
        best_q = torch.where(take.unsqueeze(-1), q2, best_q)
        best_d = torch.where(take, d2, best_d)
        # groups with a NaN, an infinity or only zeros: scale 1.0, the values rounded as they are
        codes = torch.where(ok.unsqueeze(-1), best_q, self.encode_int4(g).to(torch.float32))
        scales = torch.where(ok, best_d, torch.ones_like(best_d)).to(torch.float16)
        return codes.to(torch.int8).flatten(-2), scales

    def scaled(self, x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """``float32(x) / s_g`` for each value's group, ``[..., D]``: what the codes round."""
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
        codes8, scales = self.group_codes(x)
        codes = codes8.to(torch.uint8) & 0xF
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
        """How many of values ``x [..., D]`` lay beyond the range of ``stored`` (``x / s_g`` above
        :attr:`clip_limit` or below ``-clip_limit - 1``)."""
        _, scales = self.split(stored, x.shape[-1])
        y = self.scaled(x, scales)
        return int(((y > self.clip_limit) | (y < -self.clip_limit - 1)).sum())


INT4_G32 = Int4GroupFormat()
