"""Rotary position embedding (rotate-half, Hugging Face layout) applied to a packed q/k/v projection.

One :class:`RotaryEmbedding` per model, shared by its attention layers. Per forward:

    rope = rotary_emb.angles(positions, dtype)     # once: cos/sin of the positions [T]
    q, k, v = rotary_emb(qkv, rope)                 # per layer: split qkv, rotate q and k

``qkv [T, (Hq + 2 Hkv) * D]`` is ``[q | k | v]`` (:class:`kv8.layers.linear.QKVLinear`); the outputs are
``q [T, Hq, D]``, ``k [T, Hkv, D]`` (rotated) and ``v [T, Hkv, D]``, all contiguous. Angles are computed in
float32 as Hugging Face computes them (inverse frequencies with linear or llama3 scaling from
:class:`kv8.config.RopeScaling`), so positions rotate identically.

The torch path is the reference (:func:`rope_reference`); the packed_bf16 path runs
:meth:`DenseKernels.rope_qkv`, which splits and rotates in one pass and equals the reference exactly.
:class:`RopeAngles` holds cos/sin in the layout of the path that made them; the model only passes it on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from kv8.config import RopeScaling
from kv8.layers.dense_kernels import DenseBackend

__all__ = ["RopeAngles", "RotaryEmbedding", "apply_rope", "rope_inv_freq", "rope_reference"]


def rope_inv_freq(head_dim: int, rope_theta: float, rope_scaling: RopeScaling | None) -> torch.Tensor:
    """Inverse frequencies ``[D / 2]`` (float32, CPU), with the rope scaling applied."""
    d = head_dim
    # float32 throughout, as Hugging Face computes it, so positions rotate identically.
    inv = 1.0 / (rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
    rs = rope_scaling
    if rs is not None and rs.rope_type == "linear":
        inv = inv / rs.factor
    elif rs is not None and rs.rope_type == "llama3":
        low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
        high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
        wavelen = 2 * math.pi / inv
        smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
            rs.high_freq_factor - rs.low_freq_factor)
        scaled = torch.where(wavelen > low_wavelen, inv / rs.factor, inv)
        mid = (wavelen <= low_wavelen) & (wavelen >= high_wavelen)
        inv = torch.where(mid, (1 - smooth) * inv / rs.factor + smooth * inv, scaled)
    return inv.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of x ``[T, H, D]``; cos/sin ``[T, 1, D]`` (both halves) in x's dtype."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _split_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int,
                 head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t = qkv.shape[0]
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    return (q.reshape(t, num_heads, head_dim), k.reshape(t, num_kv_heads, head_dim),
            v.reshape(t, num_kv_heads, head_dim))


def rope_reference(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int,
                   head_dim: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated q, k and v from packed ``qkv [T, (Hq + 2 Hkv) D]``; cos/sin ``[T, D/2]`` float32, in plain torch."""
    q, k, v = _split_heads(qkv, num_heads, num_kv_heads, head_dim)
    c = torch.cat((cos, cos), dim=-1).unsqueeze(1).to(qkv.dtype)
    s = torch.cat((sin, sin), dim=-1).unsqueeze(1).to(qkv.dtype)
    return apply_rope(q, c, s), apply_rope(k, c, s), v.contiguous()


@dataclass(frozen=True)
class RopeAngles:
    """cos and sin of one forward's positions, in the layout the :class:`RotaryEmbedding` that made them
    reads: ``[T, 1, D]`` in the model dtype (torch path) or ``[T, D/2]`` float32 (packed_bf16 path)."""

    cos: torch.Tensor
    sin: torch.Tensor


class RotaryEmbedding(nn.Module):
    """RoPE for attention with ``num_heads`` query heads and ``num_kv_heads`` KV heads of ``head_dim``.
    Buffer ``inv_freq [D/2]`` float32 (not in checkpoints)."""

    inv_freq: torch.Tensor

    def __init__(self, head_dim: int, num_heads: int, num_kv_heads: int, rope_theta: float,
                 rope_scaling: RopeScaling | None, backend: DenseBackend) -> None:
        super().__init__()
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        self.kernels = backend.kernels
        # On the CPU even while the model is built on the meta device: computed here, never loaded.
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, rope_theta, rope_scaling), persistent=False)

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeAngles:
        """cos/sin of positions ``[T]`` for a model computing in ``dtype`` (angles in float32)."""
        freqs = positions.float().unsqueeze(1) * self.inv_freq.unsqueeze(0)     # [T, D/2]
        if self.kernels is not None:
            return RopeAngles(freqs.cos(), freqs.sin())
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)                     # [T, 1, D]
        return RopeAngles(emb.cos().to(dtype), emb.sin().to(dtype))

    def forward(self, qkv: torch.Tensor, rope: RopeAngles) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D])`` from ``qkv [T, (Hq + 2 Hkv) D]``; q and k rotated."""
        if self.kernels is not None:
            return self.kernels.rope_qkv(qkv, rope.cos, rope.sin, self.num_heads, self.num_kv_heads, self.head_dim)
        q, k, v = _split_heads(qkv, self.num_heads, self.num_kv_heads, self.head_dim)
        return apply_rope(q, rope.cos, rope.sin), apply_rope(k, rope.cos, rope.sin), v.contiguous()

    def rotate(self, q: torch.Tensor, k: torch.Tensor, rope: RopeAngles) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE of q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` already split (for models that transform q and k
        between the projection and RoPE, e.g. QK-norm), in plain torch for either angle layout."""
        cos, sin = rope.cos, rope.sin
        if cos.dim() == 2:   # [T, D/2] float32 (the packed_bf16 layout) -> [T, 1, D] in q's dtype
            cos = torch.cat((cos, cos), dim=-1).unsqueeze(1).to(q.dtype)
            sin = torch.cat((sin, sin), dim=-1).unsqueeze(1).to(q.dtype)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``qkv [T, (Hq + 2 Hkv) D]`` -> views q ``[T, Hq, D]``, k and v ``[T, Hkv, D]`` (not rotated)."""
        return _split_heads(qkv, self.num_heads, self.num_kv_heads, self.head_dim)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, heads={self.num_heads}, kv_heads={self.num_kv_heads}, "
                f"kernels={self.kernels is not None}")
