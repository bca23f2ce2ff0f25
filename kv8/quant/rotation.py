"""Orthogonal rotation of K and V before they are stored (an FP8 accuracy option).

A per-head orthonormal Hadamard matrix ``R`` (``D x D``, Sylvester construction scaled by ``1/sqrt(D)``) is
symmetric and its own inverse (``R @ R = I``). Storing ``k R`` and ``v R`` instead of ``k`` and ``v`` leaves
attention unchanged in exact arithmetic when q is rotated too and the output is rotated back::

    (q R) . (k R) = q . k              scores:  rotate q, read the rotated keys as stored
    sum_j p_j (v_j R) = (sum_j p_j v_j) R    output:  multiply by R again to undo it

while spreading a few large channels (post-RoPE keys have them) over all channels, so one scale fits every
channel better and less is lost to FP8 rounding. Nothing stored ever needs un-rotating, so prefix caching,
preemption and every kernel work unchanged.
"""

from __future__ import annotations

import functools

import torch

ROTATIONS = ("none", "hadamard")  # kv_cache_rotation: no rotation, or the per-head Hadamard matrix below


@functools.lru_cache(maxsize=8)
def hadamard(dim: int) -> torch.Tensor:
    """The ``dim x dim`` orthonormal Sylvester-Hadamard matrix (float32). ``dim`` must be a power of two."""
    if dim < 1 or dim & (dim - 1):
        raise ValueError(f"a Hadamard rotation needs a power-of-two head_dim, got {dim}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < dim:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h / dim ** 0.5).float()


def rotate(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """``x @ matrix`` over the last dim, computed in float32 and returned in x's dtype."""
    return (x.float() @ matrix).to(x.dtype)
