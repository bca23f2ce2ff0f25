"""Key offsets aligned to the first position's key (``kv8 calibrate --key-centering --align-first-key FORMAT``).

Why. Most queries of a model put much of their attention on the first token of the context, whatever it is (the
"attention sink"). Its score is large, so the rounding error of its stored key moves every output of a query. With
key centering (:mod:`kv8.quant.key_offsets`) the sink is hit hardest: the offset ``c`` is the *mean* key, and the
first position's key lies far from it (SmolLM2-135M: ``|k_0 - c|`` about 11-17 in most layers, against 4-9 for
``|k_0|``), so a 4-bit code stores it with a large absolute error.

What. In many heads the first position's key is the same for every text (it passes through no RoPE rotation and
its hidden state forgets the token after the first layers: SmolLM2-135M, from layer 3 on, varies by 1% of its norm
between texts). For such a head the offset can be moved by a small amount so that the first key, as the cache
stores it, is a value the format represents exactly::

    m  = mean first-position key of the calibration windows (model basis)
    x  = ((m - c) * s) R                 what the cache stores for it (key scaling ``s``, rotation ``R``)
    y  = decode(encode(x)), repeated until it no longer changes (a fixed point of the format's round trip)
    c' = m - (y R) / s                   so that ((m - c') * s) R = y

Centering by ``c'`` instead of ``c`` is still exact for attention (any offset is: it shifts all of a query's
scores alike); every other key moves by the constant ``c - c'`` (a fraction of the first key's rounding error, small
beside the keys' spread), while the first key's stored error falls to its variation between texts. This module
chooses per (layer, KV head) by measurement: the offset is moved where the first keys of the calibration windows,
stored with ``c'``, have a mean squared error at most :data:`GAIN` times that with ``c``; elsewhere ``c`` stays.

The alignment is made for one cache format and rotation (its grid); a file aligned for one format still centers
keys exactly for any other, where the first key merely gains nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kv8.cache.codec import K, KVCodec
from kv8.quant.formats import KVCacheDtype
from kv8.quant.key_offsets import KeyOffsets
from kv8.quant.key_scaling import KeyScaling

__all__ = ["GAIN", "FirstKeyAlignment", "FirstKeyCollector", "align_to_first_key", "check_alignable"]

#: a head's offset moves only where the first keys' mean squared stored error falls at least this much (x this)
GAIN = 0.25
_FIXED_POINT_STEPS = 8


class FirstKeyCollector:
    """The keys at position 0 of every calibration window, per layer (model basis, float32):
    :meth:`kv8.observer.EngineObserver.on_first_keys` feeds :meth:`observe`."""

    def __init__(self, num_layers: int) -> None:
        self.keys: list[list[torch.Tensor]] = [[] for _ in range(num_layers)]

    def observe(self, layer: int, keys: torch.Tensor) -> None:
        """Record first-position keys ``[N, H, D]`` of ``layer``."""
        self.keys[layer].append(keys.detach().float().cpu())

    def stacked(self) -> torch.Tensor:
        """``[N, L, H, D]``: every window's first key in every layer; ValueError when the layers saw different
        numbers of windows or none."""
        counts = {sum(int(k.shape[0]) for k in ks) for ks in self.keys}
        if len(counts) != 1 or 0 in counts:
            raise ValueError(f"first-position keys: every layer must see the same windows, got counts {counts}")
        return torch.stack([torch.cat(ks) for ks in self.keys], dim=1)


@dataclass(frozen=True)
class FirstKeyAlignment:
    """The aligned offsets and what the choice measured, per (layer, KV head): ``error_before`` / ``error_after``,
    the mean squared stored error of the calibration windows' first keys (``first_keys``) with the mean offset and
    with the aligned one (the stored basis), and ``aligned``, where the offset moved."""

    offsets: KeyOffsets
    first_keys: torch.Tensor     # [N, L, H, D] float32, the model's basis
    error_before: torch.Tensor   # [L, H] float32
    error_after: torch.Tensor    # [L, H] float32
    aligned: torch.Tensor        # [L, H] bool

    def summary(self) -> str:
        """One line: how many heads moved and the first keys' error over all heads before and after."""
        n, total = int(self.aligned.sum()), self.aligned.numel()
        before = float(self.error_before.mean())
        after = float(torch.where(self.aligned, self.error_after, self.error_before).mean())
        return (f"first-position key aligned in {n} of {total} (layer, KV head) pairs; its mean squared stored error "
                f"{before:.3g} -> {after:.3g}")


def check_alignable(kv_dtype: KVCacheDtype) -> None:
    """ValueError unless ``kv_dtype`` stores a key with no scale chosen before the offsets: its scales are in each
    row (``int4_per_group32``, ``fp4_e2m1``) or per token (``int8``, ``int4``). A static-scale FP8 cache's scales
    are calibrated after the offsets (on the centered keys) and a 16/32-bit cache has nothing to align to."""
    if not (kv_dtype.group_scales or kv_dtype.per_token_scales):
        raise ValueError(f"--align-first-key {kv_dtype.name}: the first key can be aligned to a format whose scales "
                         "are in each row or per token (int8, int4, int4_per_group32, fp4_e2m1), not to "
                         f"{kv_dtype.name}")


def _stored_error(codec: KVCodec, keys: torch.Tensor, layer: int) -> torch.Tensor:
    """Mean squared round-trip error ``[H]`` of keys ``[N, H, D]`` (model basis) stored by ``codec`` in ``layer``."""
    x = codec.keys_to_stored(keys, layer)
    back, _ = codec.round_trip(x, layer, K)
    return (back - x).pow(2).mean(dim=(0, 2))


def _fixed_point(codec: KVCodec, x: torch.Tensor, layer: int) -> torch.Tensor:
    """The round trip applied to ``x [1, H, D]`` until it returns its input (at most a few steps; the last
    value otherwise, which the caller's measurement then judges)."""
    y, _ = codec.round_trip(x, layer, K)
    for _ in range(_FIXED_POINT_STEPS):
        z, _ = codec.round_trip(y, layer, K)
        if torch.equal(z, y):
            break
        y = z
    return y


def align_to_first_key(offsets: KeyOffsets, scaling: KeyScaling | None, first_keys: torch.Tensor,
                       kv_dtype: KVCacheDtype, rotation: str) -> FirstKeyAlignment:
    """Offsets aligned to the first keys ``[N, L, H, D]`` (model basis) for a ``kv_dtype`` cache with ``rotation``
    (the module docstring): per (layer, KV head), ``c'`` where it cuts the first keys' stored error by
    :data:`GAIN` or more, else ``c``. ``scaling`` are the key factors the file carries (None: no key scaling)."""
    check_alignable(kv_dtype)
    num_layers, heads, head_dim = (int(n) for n in offsets.k.shape)
    if first_keys.ndim != 4 or list(first_keys.shape[1:]) != [num_layers, heads, head_dim] or not first_keys.shape[0]:
        raise ValueError(f"first keys must be [N >= 1, {num_layers}, {heads}, {head_dim}], got "
                         f"{list(first_keys.shape)}")
    keys = first_keys.float()

    def codec(c: torch.Tensor) -> KVCodec:
        return KVCodec.build(kv_dtype, head_dim, rotation=rotation, key_offsets=KeyOffsets(c, offsets.source),
                             key_scaling=scaling)

    mean_codec = codec(offsets.k)
    target = offsets.k.clone()
    for layer in range(num_layers):
        m = keys[:, layer].mean(dim=0, keepdim=True)                        # [1, H, D]
        y = _fixed_point(mean_codec, mean_codec.keys_to_stored(m, layer), layer)
        # keys_from_stored(y) = y R / s + c, so c' = m - y R / s = m - (keys_from_stored(y) - c)
        target[layer] = (m - (mean_codec.keys_from_stored(y, layer) - offsets.k[layer]))[0]
    aligned_codec = codec(target)
    before = torch.stack([_stored_error(mean_codec, keys[:, layer], layer) for layer in range(num_layers)])
    after = torch.stack([_stored_error(aligned_codec, keys[:, layer], layer) for layer in range(num_layers)])
    moved = after <= GAIN * before
    chosen = torch.where(moved.unsqueeze(-1), target, offsets.k)
    source = (f"{offsets.source}; aligned to the first position's key for {kv_dtype.name}"
              + (f" + {rotation}" if rotation != "none" else "") + f" in {int(moved.sum())} of {moved.numel()} heads")
    return FirstKeyAlignment(KeyOffsets(chosen, source), keys, before, after, moved)
