"""Rotary position embedding (rotate-half, Hugging Face layout) applied to a packed q/k/v projection.

One :class:`RotaryEmbedding` per model, shared by its attention layers. Per forward:

    rope = rotary_emb.angles(positions, dtype)     # once: cos/sin of the positions [T]
    q, k, v = rotary_emb(qkv, rope)                 # per layer: split qkv, rotate q and k

``qkv [T, (Hq + 2 Hkv) * D]`` is ``[q | k | v]`` (:class:`kv8.layers.linear.QKVLinear`); the outputs are
``q [T, Hq, D]``, ``k [T, Hkv, D]`` (rotated) and ``v [T, Hkv, D]``, all contiguous. Angles are computed in
float32 as Hugging Face computes them (inverse frequencies with linear, llama3 or longrope scaling from
:class:`kv8.config.RopeScaling`), so positions rotate identically. Partial rotary (``rotary_dim < D``, Phi-4-mini's
``partial_rotary_factor``): only the first ``rotary_dim`` dims of each head rotate (rotate-half within them), the
rest pass through.

LongRoPE (``longrope``, Phi-3's "SuRoPE"): two sets of inverse frequencies, ``1 / (short_factor[i] *
theta^(2i/R))`` and the same with ``long_factor``, and cos/sin multiplied by ``attention_factor``. kv8's rule:
**each token uses the long factors exactly when its own position is >= original_max_position_embeddings**
(i.e. when the sequence up to and including it is longer than the original context). The choice depends only
on the token's position -- not on the batch, the chunking of a prefill, or the other sequences -- so a
token's K is rotated the same way whenever it is computed (a prefix-cache hit or a recompute after preemption
stores what a fresh prefill would), and the cache never needs re-rotating.
Transformers decides once per forward from the largest position (long for every token when ``max(position) + 1
> original_max_position_embeddings``); vLLM once per batch (long for every token when any position in the
batch is beyond it, so one sequence's choice depends on the others). kv8 and transformers agree whenever a
forward's positions are all below the original context, and on every decode step (one token per forward) --
hence with transformers' own generation from a prompt no longer than the original context. The remaining
difference: a prompt longer than the original context, prefilled in one forward, gets the long factors at
*all* its positions in transformers but the short factors below ``original_max_position_embeddings`` in kv8;
the rotations of its later positions agree, but they attend to keys rotated differently, so the logits differ
at every position. kv8 computes what transformers computes when it prefills the first
``original_max_position_embeddings`` tokens and then continues one token per forward.

The torch path is the reference (:func:`rope_reference`); the packed_bf16 path runs
:meth:`DenseKernels.rope_qkv`, which splits and rotates in one pass and equals the reference exactly (full
rotary only: a partial-rotary model rotates in torch on either backend).
:class:`RopeAngles` holds cos/sin in the layout of the path that made them; the model only passes it on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from kv8.config import RopeScaling
from kv8.layers.dense_backend import DenseBackend

__all__ = ["RopeAngles", "RotaryEmbedding", "apply_rope", "rope_inv_freq", "rope_reference"]


def rope_inv_freq(rotary_dim: int, rope_theta: float, rope_scaling: RopeScaling | None,
                  long: bool = False) -> torch.Tensor:
    """Inverse frequencies ``[R / 2]`` (float32, CPU) of ``R = rotary_dim`` (the head dim, or the rotated part
    of it), with the rope scaling applied; ``long`` picks longrope's long factors (else its short ones)."""
    d = rotary_dim
    # float32 throughout, as Hugging Face computes it, so positions rotate identically.
    base = rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d)
    rs = rope_scaling
    if rs is not None and rs.rope_type == "longrope":
        rs.check_rotary_dim(d)
        factors = torch.tensor(rs.long_factor if long else rs.short_factor, dtype=torch.float32, device="cpu")
        return (1.0 / (factors * base)).float()
    inv = 1.0 / base
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
    reads: ``[T, 1, R]`` in the model dtype (torch path) or ``[T, R/2]`` float32 (packed_bf16 path), ``R`` the
    rotary dim (the head dim unless partial); longrope's attention factor already applied."""

    cos: torch.Tensor
    sin: torch.Tensor


class RotaryEmbedding(nn.Module):
    """RoPE for attention with ``num_heads`` query heads and ``num_kv_heads`` KV heads of ``head_dim``, rotating
    the first ``rotary_dim`` dims of each head (default: all). Buffers ``inv_freq [R/2]`` float32 and, with
    longrope, ``inv_freq_long [R/2]`` (not in checkpoints); see the module docstring for which a token uses."""

    inv_freq: torch.Tensor
    inv_freq_long: torch.Tensor | None

    def __init__(self, head_dim: int, num_heads: int, num_kv_heads: int, rope_theta: float,
                 rope_scaling: RopeScaling | None, backend: DenseBackend, rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim, self.num_heads, self.num_kv_heads = head_dim, num_heads, num_kv_heads
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if not 2 <= self.rotary_dim <= head_dim or self.rotary_dim % 2:
            raise ValueError(f"rotary_dim={self.rotary_dim} must be even and in [2, head_dim={head_dim}]")
        # The fused kernel rotates whole heads; a partial-rotary model rotates in torch.
        self.kernels = backend.kernels if self.rotary_dim == head_dim else None
        lr = rope_scaling if rope_scaling is not None and rope_scaling.rope_type == "longrope" else None
        # positions >= long_from use inv_freq_long (longrope only)
        self.long_from = None if lr is None else lr.original_max_position_embeddings
        self.attention_factor = 1.0 if lr is None else lr.attention_factor
        # On the CPU even while the model is built on the meta device: computed here, never loaded.
        self.register_buffer("inv_freq", rope_inv_freq(self.rotary_dim, rope_theta, rope_scaling), persistent=False)
        self.register_buffer("inv_freq_long", rope_inv_freq(self.rotary_dim, rope_theta, rope_scaling, long=True)
                             if lr is not None else None, persistent=False)

    def angles(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeAngles:
        """cos/sin of positions ``[T]`` for a model computing in ``dtype`` (angles in float32)."""
        pos = positions.float().unsqueeze(1)                                     # [T, 1]
        freqs = pos * self.inv_freq.unsqueeze(0)                                 # [T, R/2]
        if self.inv_freq_long is not None and self.long_from is not None:   # longrope: per token, by position
            is_long = (positions >= self.long_from).unsqueeze(1)                 # [T, 1]
            freqs = torch.where(is_long, pos * self.inv_freq_long.unsqueeze(0), freqs)
        if self.kernels is not None:
            return RopeAngles(self._scaled(freqs.cos()), self._scaled(freqs.sin()))
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)                     # [T, 1, R]
        return RopeAngles(self._scaled(emb.cos()).to(dtype), self._scaled(emb.sin()).to(dtype))

    def _scaled(self, x: torch.Tensor) -> torch.Tensor:
        """cos or sin times the attention factor (longrope's), in float32 before any cast, as transformers."""
        return x if self.attention_factor == 1.0 else x * self.attention_factor

    def forward(self, qkv: torch.Tensor, rope: RopeAngles) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D])`` from ``qkv [T, (Hq + 2 Hkv) D]``; q and k rotated."""
        if self.kernels is not None:
            return self.kernels.rope_qkv(qkv, rope.cos, rope.sin, self.num_heads, self.num_kv_heads, self.head_dim)
        q, k, v = _split_heads(qkv, self.num_heads, self.num_kv_heads, self.head_dim)
        q, k = self.rotate(q, k, rope)
        return q, k, v.contiguous()

    def rotate(self, q: torch.Tensor, k: torch.Tensor, rope: RopeAngles) -> tuple[torch.Tensor, torch.Tensor]:
        """RoPE of q ``[T, Hq, D]`` and k ``[T, Hkv, D]`` already split (for models that transform q and k
        between the projection and RoPE, e.g. QK-norm), in plain torch for either angle layout; contiguous."""
        cos, sin = rope.cos, rope.sin
        if cos.dim() == 2:   # [T, R/2] float32 (the packed_bf16 layout) -> [T, 1, R] in q's dtype
            cos = torch.cat((cos, cos), dim=-1).unsqueeze(1).to(q.dtype)
            sin = torch.cat((sin, sin), dim=-1).unsqueeze(1).to(q.dtype)
        r = self.rotary_dim
        if r == self.head_dim:
            return apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        # partial rotary: [rotated first R dims | the rest as they are]
        return (torch.cat((apply_rope(q[..., :r], cos, sin), q[..., r:]), dim=-1),
                torch.cat((apply_rope(k[..., :r], cos, sin), k[..., r:]), dim=-1))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``qkv [T, (Hq + 2 Hkv) D]`` -> views q ``[T, Hq, D]``, k and v ``[T, Hkv, D]`` (not rotated)."""
        return _split_heads(qkv, self.num_heads, self.num_kv_heads, self.head_dim)

    def extra_repr(self) -> str:
        return (f"head_dim={self.head_dim}, rotary_dim={self.rotary_dim}, heads={self.num_heads}, "
                f"kv_heads={self.num_kv_heads}, long_from={self.long_from}, kernels={self.kernels is not None}")
