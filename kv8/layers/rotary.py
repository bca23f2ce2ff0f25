"""Rotary position embedding (rotate-half, Hugging Face layout) applied to a packed q/k/v projection.

One :class:`RotaryEmbedding` per model, shared by its attention layers. Per forward:

    rope = rotary_emb.angles(positions, dtype)     # once: cos/sin of the positions [T]
    q, k, v = rotary_emb(qkv, rope)                 # per layer: split qkv, rotate q and k

``qkv [T, (Hq + 2 Hkv) * D]`` is ``[q | k | v]`` (:class:`kv8.layers.linear.QKVLinear`); the outputs are
``q [T, Hq, D]``, ``k [T, Hkv, D]`` (rotated) and ``v [T, Hkv, D]``, all contiguous. Angles are computed in
float32 as Hugging Face computes them (inverse frequencies with linear, llama3 or longrope scaling from
:class:`kv8.models.config.RopeScaling`), so positions rotate identically. Partial rotary (``rotary_dim < D``,
Phi-4-mini's ``partial_rotary_factor``): only the first ``rotary_dim`` dims of each head rotate (rotate-half within
them), the rest pass through.

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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kv8.layers.dense_backend import DenseBackend
from kv8.validators import cfg_float, cfg_int, is_number

__all__ = ["RopeAngles", "RotaryEmbedding", "apply_rope", "rope_inv_freq", "rope_reference"]


@dataclass(frozen=True)
class RopeScaling:
    """RoPE scaling from the config's ``rope_scaling`` (or transformers 5's ``rope_parameters``).

    Supported: ``linear`` and ``llama3`` (scaled inverse frequencies), and ``longrope`` (Phi-3's LongRoPE, also
    spelled ``su``): ``short_factor`` and ``long_factor`` divide the inverse frequencies, one factor per
    rotary frequency, and cos/sin are multiplied by ``attention_factor``. Which positions use the long factors
    is :class:`kv8.layers.rotary.RotaryEmbedding`'s rule (positions ``>= original_max_position_embeddings``).

    Invariants for ``longrope``: ``short_factor`` and ``long_factor`` are non-empty, of equal length, positive
    and finite (their length is checked against the rotary dim by :meth:`check_rotary_dim`, which needs the
    model); ``attention_factor`` is finite and > 0.
    """

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()
    attention_factor: float = 1.0

    @staticmethod
    def from_hf_config(cfg: Mapping[str, Any]) -> RopeScaling | None:
        """The scaling of a whole Hugging Face config: its ``rope_scaling``, else its ``rope_parameters``
        (transformers 5 writes the scaling there, with ``rope_type`` ``default`` when there is none). For
        ``longrope`` the top-level ``original_max_position_embeddings`` and ``max_position_embeddings`` (Phi-3
        keeps them there) fill in what the dict lacks."""
        d = cfg.get("rope_scaling") or cfg.get("rope_parameters")
        if d is not None and not isinstance(d, Mapping):
            raise ValueError(f"model config rope_scaling={d!r} must be a JSON object")
        return RopeScaling.from_dict(d, cfg)

    @staticmethod
    def from_dict(d: Mapping[str, Any] | None, cfg: Mapping[str, Any] | None = None) -> RopeScaling | None:
        """``d`` is the ``rope_scaling`` dict; ``cfg`` the whole config (read by ``longrope`` only)."""
        if not d:
            return None
        rope_type = d.get("rope_type", d.get("type"))
        if rope_type in (None, "default"):
            return None
        if rope_type == "su":   # Phi-3's early name for longrope (transformers renames it too)
            rope_type = "longrope"
        if rope_type == "longrope":
            return RopeScaling._longrope(d, cfg or {})
        if rope_type not in ("linear", "llama3"):
            raise ValueError(f"rope_scaling type {rope_type!r} is not supported; kv8 supports: linear, llama3, "
                             "longrope")
        if d.get("factor") is None:
            raise ValueError(f"model config rope_scaling ({rope_type}) is missing the key 'factor'")
        factor = cfg_float(d, "factor", 1.0)
        if not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"model config rope_scaling factor={factor!r} must be a finite number > 0")
        return RopeScaling(
            rope_type=rope_type,
            factor=factor,
            low_freq_factor=cfg_float(d, "low_freq_factor", 1.0),
            high_freq_factor=cfg_float(d, "high_freq_factor", 4.0),
            original_max_position_embeddings=cfg_int(d, "original_max_position_embeddings", 8192),
        )

    @staticmethod
    def _longrope(d: Mapping[str, Any], cfg: Mapping[str, Any]) -> RopeScaling:
        lists: dict[str, tuple[float, ...]] = {}
        for key in ("short_factor", "long_factor"):
            value = d.get(key)
            if not isinstance(value, (list, tuple)) or not value or not all(is_number(x) for x in value):
                raise ValueError(f"model config rope_scaling (longrope) {key}={value!r} must be a non-empty list "
                                 "of numbers")
            bad = [x for x in value if not math.isfinite(x) or x <= 0]
            if bad:
                raise ValueError(f"model config rope_scaling (longrope) {key} has {bad[0]!r}; every factor must be "
                                 "a finite number > 0")
            lists[key] = tuple(float(x) for x in value)
        if len(lists["short_factor"]) != len(lists["long_factor"]):
            raise ValueError(f"model config rope_scaling (longrope) has {len(lists['short_factor'])} short_factor "
                             f"and {len(lists['long_factor'])} long_factor entries; they must be equally long")
        original_key = "original_max_position_embeddings"
        source = d if d.get(original_key) is not None else cfg
        if source.get(original_key) is None:
            raise ValueError(f"model config rope_scaling (longrope) needs {original_key} (in rope_scaling or at the "
                             "top level of the config)")
        original = cfg_int(source, original_key)
        if original < 2:
            raise ValueError(f"model config {original_key}={original} must be an int >= 2")
        if d.get("factor") is not None:
            factor = cfg_float(d, "factor", 1.0)
        else:   # Phi-3: the ratio of the extended to the original context
            factor = cfg_int(cfg, "max_position_embeddings", original) / original
        if not math.isfinite(factor) or factor <= 0:
            raise ValueError(f"model config rope_scaling (longrope) factor={factor!r} must be a finite number > 0")
        if d.get("attention_factor") is not None:
            attention_factor = cfg_float(d, "attention_factor", 1.0)
        else:   # LongRoPE's default: sqrt(1 + ln(factor) / ln(original)), 1.0 without extension
            attention_factor = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
        if not math.isfinite(attention_factor) or attention_factor <= 0:
            raise ValueError(f"model config rope_scaling (longrope) attention_factor={attention_factor!r} must be a "
                             "finite number > 0")
        return RopeScaling(rope_type="longrope", factor=factor, original_max_position_embeddings=original,
                           short_factor=lists["short_factor"], long_factor=lists["long_factor"],
                           attention_factor=attention_factor)

    def check_rotary_dim(self, rotary_dim: int) -> None:
        """``ValueError`` unless the per-frequency factors (longrope) fit ``rotary_dim`` (rotary_dim / 2 each)."""
        if self.rope_type == "longrope" and len(self.short_factor) != rotary_dim // 2:
            raise ValueError(f"model config rope_scaling (longrope) short_factor and long_factor have "
                             f"{len(self.short_factor)} entries; this model rotates {rotary_dim} dims per head and "
                             f"needs {rotary_dim // 2} (rotary dim / 2)")


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
