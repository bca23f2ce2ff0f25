"""Key centering: a calibrated offset ``c`` per (layer, KV head, channel) subtracted from every key before it is
stored (``kv8 calibrate --key-centering``; carried by kv8's scales file, :mod:`kv8.quant.scale_files`).

Why it is exact for attention. A query ``q`` scores every key ``k_j`` of its head; with centered keys::

    q . (k_j - c) = q . k_j - q . c          the same constant -q.c for every key of this query

and softmax is unchanged by adding one constant to all of a query's scores, so the attention output is the same
in exact arithmetic. What changes is what the cache rounds: keys often carry a large channel that is nearly the
same for every token (and that the queries barely read); a per-token or per-head scale is set by it, and every
other channel is stored with fewer levels. Removing the mean frees those levels.

Invariants the engine keeps (:meth:`kv8.cache.codec.KVCodec.keys_to_stored`, the one place keys are centered):

* ``c`` is subtracted from the keys *as stored*: after RoPE (a constant after RoPE is a constant for every
  position; before RoPE it would turn into a position-dependent term, which is not a shift of the scores), and
  before the Hadamard rotation and quantization (with a rotation ``R``: ``(k - c) R = kR - cR``).
* every key attention reads is centered the same way: every backend stores the new keys first and reads them
  back from the cache (:mod:`kv8.attention.backend`), so fresh, cached and prefix-cached keys alike are centered.
* values are not centered (attention outputs are not invariant to shifting values; the study found no gain).

It is *not* exact where a score passes through something other than a shift-invariant softmax: logit
soft-capping (``cap * tanh(s / cap)``, Gemma 2) or attention sinks (a fixed logit every score competes with). The
engine refuses key centering for such architectures (:attr:`kv8.models.config.ModelArchConfig.shift_invariant_scores`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["KeyOffsets"]


@dataclass(frozen=True, eq=False)
class KeyOffsets:
    """Per-layer key offsets ``k [num_layers, num_kv_heads, head_dim]`` (float32, CPU, finite), in the model's basis
    (post-RoPE, before any rotation), and where they came from.

    The tensor is a private copy of what was passed in; do not mutate it in place."""

    k: torch.Tensor
    source: str

    def __post_init__(self) -> None:
        if not isinstance(self.source, str) or not self.source:
            raise ValueError(f"KeyOffsets.source must be a non-empty string, got {self.source!r}")
        t = self.k
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"k_offset must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.float32 or t.device.type != "cpu":
            raise ValueError(f"k_offset must be a float32 CPU tensor, got {t.dtype} on {t.device}")
        if t.ndim != 3 or min(t.shape) < 1:
            raise ValueError(f"k_offset must have shape [num_layers, num_kv_heads, head_dim] (all >= 1), got "
                             f"{list(t.shape)}")
        bad = ~torch.isfinite(t)
        if bool(bad.any()):
            layer, head, chan = (int(x) for x in bad.nonzero()[0])
            value = float(t[layer, head, chan])
            raise ValueError(f"k_offset for layer {layer}, KV head {head}, channel {chan} is {value!r}; offsets must "
                             f"be finite ({self.source})")
        object.__setattr__(self, "k", t.detach().clone().contiguous())

    @property
    def num_layers(self) -> int:
        return int(self.k.shape[0])

    def check_fits(self, num_layers: int, num_kv_heads: int, head_dim: int) -> None:
        """ValueError naming ``k_offset`` unless its shape is exactly ``[num_layers, num_kv_heads, head_dim]``
        (offsets are per layer, KV head and channel: nothing broadcasts)."""
        want = [num_layers, num_kv_heads, head_dim]
        if list(self.k.shape) != want:
            raise ValueError(f"k_offset from {self.source} has shape {list(self.k.shape)}; the model needs "
                             f"[num_layers, num_kv_heads, head_dim] = {want}")

    def heads(self, first: int, count: int) -> KeyOffsets:
        """The offsets of KV heads ``first .. first + count - 1`` (what one tensor-parallel rank holds)."""
        h = int(self.k.shape[1])
        if not (0 <= first and count >= 1 and first + count <= h):
            raise ValueError(f"KV heads {first}..{first + count - 1} are not within the {h} heads of k_offset")
        if (first, count) == (0, h):
            return self
        return KeyOffsets(self.k[:, first:first + count], f"{self.source}, KV heads {first}..{first + count - 1}")
