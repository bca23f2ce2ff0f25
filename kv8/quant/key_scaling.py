"""Key scaling: a calibrated positive factor ``s`` per (layer, KV head, channel) that multiplies every centered key
before it is stored and divides every query that reads it (``kv8 calibrate --key-centering --key-scaling``; carried
by kv8's scales file beside the key offsets, :mod:`kv8.quant.scale_files`).

With key offsets ``c`` (:mod:`kv8.quant.key_offsets`) and the codec's rotation ``R`` (identity without one)::

    stored key  = ((k - c) * s) R          query used = (q / s) R
    (q / s) R . ((k - c) * s) R = q . (k - c)            (R orthonormal; s cancels channel by channel)

so attention is unchanged in exact arithmetic (every score is the centered score, itself a constant shift of
``q . k`` per query). What changes is where a 4-bit code's rounding error lands. A stored key's error is roughly
proportional to its size; channel ``i``'s error ``e_i`` reaches the score as ``(q_i / s_i) e_i``. Scaling a
channel up that the queries read strongly and the keys use weakly (and down where keys are large and queries small,
e.g. a channel the queries ignore) moves levels to where the scores feel them. Per KV head, the expected squared
score error is about ``sigma^2 * sum_i E[q_i^2] / s_i^2`` with ``sigma^2`` growing with the stored energy
``sum_i s_i^2 E[(k_i - c_i)^2]``; by Cauchy-Schwarz the product is smallest at::

    s_i = (E[q_i^2] / E[(k_i - c_i)^2]) ^ (1/4)          (QServe's SmoothAttention uses max|q|^a / max|k|^(1-a))

with the queries of the KV head's GQA group pooled; :func:`key_scales_from_moments` computes it and normalises each
head's factors to geometric mean 1 (only their ratios matter).

Invariants the engine keeps (:meth:`kv8.cache.codec.KVCodec.keys_to_stored` and
:meth:`kv8.cache.codec.KVCodec.queries_to_stored`, the one place each is scaled):

* ``s`` applies post-RoPE, after the key offsets and before the rotation (the rotation then spreads an already
  balanced vector), to every key the cache stores and every query that attends, fresh, cached or prefix-cached;
* it is exact for any score transform (``q . k`` itself is unchanged: soft-capping or sinks would not break it),
  but kv8 carries it only beside key offsets, in a file that turns key centering on;
* a static-scale FP8 cache refuses it: such a file's static scales were calibrated on unscaled keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KeyScaling", "key_scales_from_moments"]


@dataclass(frozen=True, eq=False)
class KeyScaling:
    """Per-layer key factors ``s [num_layers, num_kv_heads, head_dim]`` (float32, CPU, finite, > 0), in the model's
    basis (post-RoPE, before any rotation), and where they came from.

    The tensor is a private copy of what was passed in; do not mutate it in place."""

    s: torch.Tensor
    source: str

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"KeyScaling.source must be a non-empty string, got {self.source!r}")
        t = self.s
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"k_channel_scale must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"k_channel_scale must be a float32 CPU tensor, got {t.dtype} on {t.device}")
        if t.ndim != 3 or min(t.shape) < 1:
            raise ValueError(f"k_channel_scale must have shape [num_layers, num_kv_heads, head_dim] (all >= 1), "
                             f"got {list(t.shape)}")
        bad = ~(torch.isfinite(t) & (t > 0))
        if bool(bad.any()):
            layer, head, chan = (int(x) for x in bad.nonzero()[0])
            value = float(t[layer, head, chan])
            raise ValueError(f"k_channel_scale for layer {layer}, KV head {head}, channel {chan} is {value!r}; key "
                             f"scales must be finite and > 0 ({self.source})")
        object.__setattr__(self, "s", t.detach().clone().contiguous())

    @property
    def num_layers(self) -> int:
        return int(self.s.shape[0])

    def check_fits(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        """ValueError naming ``k_channel_scale`` unless its shape is exactly ``[num_layers, num_kv_heads,
        head_dim]`` (nothing broadcasts)."""
        want = [num_layers, num_kv_heads, head_dim]
        if list(self.s.shape) != want:
            raise ValueError(f"k_channel_scale from {self.source} has shape {list(self.s.shape)}; the model needs "
                             f"[num_layers, num_kv_heads, head_dim] = {want}")

    def heads(self, first: int, count: int) -> KeyScaling:
        """The factors of KV heads ``first .. first + count - 1`` (what one tensor-parallel rank holds)."""
        h = int(self.s.shape[1])
        if not (0 <= first and count >= 1 and first + count <= h):
            raise ValueError(f"KV heads {first}..{first + count - 1} are not within the {h} heads of "
                             "k_channel_scale")
        if (first, count) == (0, h):
            return self
        return KeyScaling(self.s[:, first:first + count], f"{self.source}, KV heads {first}..{first + count - 1}")


def key_scales_from_moments(query_sq: torch.Tensor, key_sq: torch.Tensor) -> torch.Tensor:
    """``s = (E[q^2] / E[k^2]) ^ (1/4)`` ``[L, H, D]`` float32 from the mean squared queries (the KV head's group
    pooled) and mean squared centered keys, both ``[L, H, D]``; each (layer, head)'s factors normalised to
    geometric mean 1. A channel with (almost) no energy in queries or keys is floored at 1e-6 of its head's mean
    energy, so every factor is finite and > 0 (its ratio to the head's others at most 1e6^(1/4) ~ 32 from it)."""
    if query_sq.shape != key_sq.shape or query_sq.ndim != 3:
        raise ValueError(f"query and key moments must both be [L, H, D], got {list(query_sq.shape)} and "
                         f"{list(key_sq.shape)}")
    q2, k2 = query_sq.double(), key_sq.double()
    q2 = q2.clamp_min(0) + 1e-6 * q2.mean(-1, keepdim=True).clamp_min(1e-30)
    k2 = k2.clamp_min(0) + 1e-6 * k2.mean(-1, keepdim=True).clamp_min(1e-30)
    s = (q2 / k2) ** 0.25
    s = s / s.log().mean(-1, keepdim=True).exp()
    return s.float()
