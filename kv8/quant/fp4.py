"""FP4 E2M1 codes with an E4M3 scale per group of 16 values: what ``kv_cache_dtype="fp4_e2m1"`` stores.

E2M1 (OCP MX FP4): a sign bit and 3 magnitude bits, no infinities, no NaN. Code ``S << 3 | m`` has the value
``(-1)^S * GRID[m]``, ``GRID = (0, 0.5, 1, 1.5, 2, 3, 4, 6)`` (``m`` = 1 is the only subnormal; 8 is -0.0).

One row of ``D`` values (one token of one KV head; ``D`` even) is stored as ``D / 2 + G`` bytes,
``G = ceil(D / 16)``::

    [ codes: D / 2 bytes, channel 2j in the low nibble of byte j, 2j + 1 in the high | G E4M3 scale codes ]

Group ``g`` is channels ``16 g .. 16 g + 15`` (the last group is shorter when ``D % 16 != 0``). Encoding, in
float32, NVFP4's rule (a group's largest magnitude maps to 6) without its tensor scale:

* ``s_g = e4m3(clamp(amax_g / 6, 2^-9, 448))`` rounded to nearest even (E4M3's smallest subnormal to its largest
  finite value, so every group has a positive finite scale); ``s_g = 1.0`` when ``amax_g`` is zero or not finite
  (as int4's per-token scale);
* ``code = e2m1(x / s_g)``: round to the nearest grid value, ties to the even code, saturating at ``±6``
  (``±inf`` included), NaN -> +0, the sign kept for values that round to zero (``-0.0``: code 8).

Decoding is ``GRID[m] * s_g`` (exact in float32). With ``D % 16 == 0`` a value costs 4 + 8 / 16 = 4.5 bits.

No tensor scale: NVFP4 multiplies every group scale by a float32 per-tensor scale so that the group scales stay
in E4M3's range; on SmolLM2's and Gemma-3-270M's keys and values a per-layer or even a per-(token, head) float32
scale measured no better than none (``scripts/kv4_error.py``, docs/accuracy.md), so kv8 stores none: values
beyond ``6 * 448 = 2688`` saturate, and groups whose largest value is below ``6 * 2^-6`` get a subnormal (less
precise) scale, whose rounding (at most ``2^-10``) moves a value by at most ``6 * 2^-10``, below ``2^-7``.

Invariants: a group's scale is a positive finite E4M3 value; ``decode(encode(x))`` is within half a grid step of
every finite value whose group is finite and within range (``|x| <= 2688``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["E2M1_GRID", "FP4_E2M1", "FP4GroupFormat", "pack_nibbles", "unpack_nibbles"]

#: the magnitudes of E2M1 codes 0..7
E2M1_GRID: tuple[float, ...] = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E4M3_MAX = 448.0
_E4M3_MIN_SUBNORMAL = 2.0 ** -9
_SCALE_DTYPE = torch.float8_e4m3fn   # the group scales' codes: E4M3 (bias 7, no infinities, NaN S.1111.111)
_SIGN = 8


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """4-bit codes ``uint8 [..., D]`` (0..15, D even) -> ``uint8 [..., D / 2]``: channel ``2j`` in the low nibble
    of byte ``j``, ``2j + 1`` in its high nibble (int4's order, :func:`kv8.quant.formats.pack_int4`)."""
    if codes.dtype != torch.uint8 or codes.shape[-1] % 2:
        raise ValueError(f"pack_nibbles: codes must be uint8 with an even last dim, got {codes.dtype} "
                         f"{tuple(codes.shape)}")
    return (codes[..., 0::2] & 0xF) | ((codes[..., 1::2] & 0xF) << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_nibbles`: ``uint8 [..., D / 2]`` -> ``uint8 [..., D]`` in 0..15."""
    if packed.dtype != torch.uint8:
        raise ValueError(f"unpack_nibbles: packed codes must be uint8, got {packed.dtype}")
    return torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)


@dataclass(frozen=True)
class FP4GroupFormat:
    """E2M1 codes with an E4M3 scale per ``group_size`` values along the last dim (the module docstring).

    Invariant: ``group_size`` is 16 (the only size kv8 stores; the field names it where sizes are computed).
    """

    name: str = "e2m1"
    group_size: int = 16

    def __post_init__(self) -> None:
        if self.group_size != 16:
            raise ValueError(f"FP4GroupFormat.group_size={self.group_size!r}: kv8 stores groups of 16")

    @property
    def max_finite(self) -> float:
        """The largest code's magnitude, 6.0: what a group's scale maps its largest magnitude to."""
        return E2M1_GRID[-1]

    @property
    def clip_limit(self) -> float:
        """Magnitudes (after scaling) beyond this count as clipped: 7.0, the midpoint between 6 and the 8 a wider
        exponent would give (a group's own largest value lands at most ``6 * (1 + 2^-4)`` after its scale's
        rounding, so only saturated or non-finite groups clip)."""
        return 7.0

    @property
    def storage_dtype(self) -> torch.dtype:
        """The dtype of the stored rows: ``uint8`` (packed codes, then the scale codes)."""
        return torch.uint8

    @property
    def grid(self) -> tuple[float, ...]:
        """The magnitudes of codes 0..7 (:data:`E2M1_GRID`): what a code's 3 low bits select."""
        return E2M1_GRID

    @property
    def scale_name(self) -> str:
        """What each group's scale is, for messages: ``E4M3``."""
        return "E4M3"

    @property
    def scale_dtype(self) -> torch.dtype:
        """The torch dtype whose codes the group scales are: ``float8_e4m3fn`` (:meth:`encode_scale` casts to it,
        :meth:`decode_scale` views it)."""
        return _SCALE_DTYPE

    @property
    def head_dim_multiple(self) -> int:
        """``head_dim`` must be a multiple of this: 2 (two codes per byte; the last group may be shorter)."""
        return 2

    def check_head_dim(self, head_dim: int, kv_cache_dtype: str) -> None:
        """Raise ValueError naming ``kv_cache_dtype`` unless ``head_dim`` is positive and even."""
        if head_dim <= 0 or head_dim % 2:
            raise ValueError(f"kv_cache_dtype={kv_cache_dtype!r} packs two values per byte: it needs an even "
                             f"head_dim, not {head_dim}")

    def groups(self, head_dim: int) -> int:
        """Groups of one row: ``ceil(head_dim / 16)``."""
        return -(-head_dim // self.group_size)

    def row_bytes(self, head_dim: int) -> int:
        """Bytes of one stored row: ``head_dim / 2`` of codes and one per group."""
        return head_dim // 2 + self.groups(head_dim)

    # ---- the two code formats -------------------------------------------------------------------------------
    @staticmethod
    def encode_e2m1(x: torch.Tensor) -> torch.Tensor:
        """Values already divided by their scale (any float dtype) -> ``uint8`` E2M1 codes 0..15, same shape."""
        xf = x.to(torch.float32)
        mags = torch.nan_to_num(xf.abs(), nan=0.0)
        m = torch.zeros(xf.shape, dtype=torch.uint8, device=xf.device)
        for i in range(len(E2M1_GRID) - 1):   # the midpoint between codes i and i + 1: a tie goes to the even code
            mid = (E2M1_GRID[i] + E2M1_GRID[i + 1]) / 2
            m += (mags > mid) if i % 2 == 0 else (mags >= mid)
        sign = torch.signbit(xf) & ~torch.isnan(xf)
        return m | (sign.to(torch.uint8) << 3)

    @staticmethod
    def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
        """``uint8`` E2M1 codes 0..15 -> float32 values (exact), same shape."""
        table = torch.tensor(E2M1_GRID + tuple(-v for v in E2M1_GRID), dtype=torch.float32, device=codes.device)
        return torch.take(table, codes.long())

    @staticmethod
    def encode_scale(scale: torch.Tensor) -> torch.Tensor:
        """Positive float32 scales -> E4M3 codes (round to nearest even, clamped to ``[2^-9, 448]``)."""
        return scale.clamp(_E4M3_MIN_SUBNORMAL, _E4M3_MAX).to(_SCALE_DTYPE).view(torch.uint8)

    @staticmethod
    def decode_scale(codes: torch.Tensor) -> torch.Tensor:
        """E4M3 scale codes -> float32 (exact)."""
        return codes.view(_SCALE_DTYPE).to(torch.float32)

    # ---- rows -----------------------------------------------------------------------------------------------
    def _padded(self, x: torch.Tensor) -> torch.Tensor:
        """``[..., D]`` -> ``[..., G, 16]``, zeros after the last value."""
        d = x.shape[-1]
        pad = self.groups(d) * self.group_size - d
        if pad:
            x = torch.nn.functional.pad(x, (0, pad))
        return x.reshape(*x.shape[:-1], -1, self.group_size)

    def group_scales(self, x: torch.Tensor) -> torch.Tensor:
        """The E4M3 scale codes ``uint8 [..., G]`` of values ``[..., D]``."""
        amax = self._padded(x.to(torch.float32)).abs().amax(dim=-1)
        s = amax / torch.tensor(self.max_finite, dtype=torch.float32, device=amax.device)
        s = torch.where(torch.isfinite(s) & (s > 0), s, torch.ones_like(s))
        return self.encode_scale(s)

    def scaled(self, x: torch.Tensor, scale_codes: torch.Tensor) -> torch.Tensor:
        """``float32(x) / s_g`` for each value's group, ``[..., D]``: what :meth:`encode_e2m1` rounds."""
        d = x.shape[-1]
        s = self.decode_scale(scale_codes).unsqueeze(-1)
        return (self._padded(x.to(torch.float32)) / s).flatten(-2)[..., :d]

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Values ``[..., D]`` (any float dtype, D even) -> stored rows ``uint8 [..., D / 2 + G]``."""
        if not isinstance(x, torch.Tensor) or not x.dtype.is_floating_point:
            raise ValueError(f"FP4GroupFormat.encode: x must be a floating-point tensor, got "
                             f"{x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
        if x.ndim == 0 or x.shape[-1] % 2:
            raise ValueError(f"FP4GroupFormat.encode: the last dim packs two codes per byte and must be even, got "
                             f"shape {tuple(x.shape)}")
        scales = self.group_scales(x)
        return torch.cat((pack_nibbles(self.encode_e2m1(self.scaled(x, scales))), scales), dim=-1)

    def split(self, stored: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stored rows ``[..., D / 2 + G]`` -> (E2M1 codes ``uint8 [..., D]``, scale codes ``uint8 [..., G]``)."""
        if stored.dtype != torch.uint8 or stored.shape[-1] != self.row_bytes(head_dim):
            raise ValueError(f"FP4GroupFormat: stored rows must be uint8 [..., {self.row_bytes(head_dim)}] for "
                             f"head_dim {head_dim}, got {stored.dtype} {tuple(stored.shape)}")
        return unpack_nibbles(stored[..., :head_dim // 2]), stored[..., head_dim // 2:]

    def decode(self, stored: torch.Tensor, head_dim: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Stored rows -> values ``[..., head_dim]`` in ``dtype`` (multiplied in float32, then cast)."""
        codes, scale_codes = self.split(stored, head_dim)
        values = self._padded(self.decode_e2m1(codes)) * self.decode_scale(scale_codes).unsqueeze(-1)
        return values.flatten(-2)[..., :head_dim].to(dtype)

    def clipped(self, x: torch.Tensor, stored: torch.Tensor) -> int:
        """How many of values ``x [..., D]`` lay beyond the range (``|x| / s_g > clip_limit``) of ``stored``."""
        _, scale_codes = self.split(stored, x.shape[-1])
        return int((self.scaled(x, scale_codes).abs() > self.clip_limit).sum())


FP4_E2M1 = FP4GroupFormat()
