"""Orthogonal rotation of K and V before they are stored (an FP8 accuracy option).

A per-head orthonormal Hadamard matrix ``R`` (``D x D``, Sylvester construction scaled by ``1/sqrt(D)``) is
symmetric and its own inverse (``R @ R = I``). Storing ``k R`` and ``v R`` instead of ``k`` and ``v`` leaves
attention unchanged in exact arithmetic when q is rotated too and the output is rotated back::

    (q R) . (k R) = q . k              scores:  rotate q, read the rotated keys as stored
    sum_j p_j (v_j R) = (sum_j p_j v_j) R    output:  multiply by R again to undo it

while spreading a few large channels (post-RoPE keys have them) over all channels, so one scale fits every
channel better and less is lost to FP8 rounding. Nothing stored ever needs un-rotating, so prefix caching,
preemption and every kernel work unchanged.

Keys and values may be rotated apart (``kv_cache_rotation="none/hadamard"``: keys as they are, values rotated):
the two identities above are independent, the first needs only q and k in one basis, the second only v and the
output. Where rotating keys hurts (Gemma-3's keys keep a large channel the queries ignore, docs/accuracy.md) the
values can still be rotated.
"""

from __future__ import annotations

import functools

import torch

ROTATIONS = ("none", "hadamard")  # one side's rotation: none, or the per-head Hadamard matrix below
ROTATION_HELP = "none, hadamard, or keys/values apart such as none/hadamard"


def rotation_sides(value: object, field: str = "kv_cache_rotation") -> tuple[str, str]:
    """``(keys' rotation, values' rotation)`` of a ``kv_cache_rotation`` value: one of :data:`ROTATIONS` for both
    sides, or ``"K/V"`` with each side one of them (the spelling of a K/V pair of ``kv_cache_dtype``). Anything
    else raises ValueError naming ``field``, the value and what is allowed."""
    parts = value.split("/") if isinstance(value, str) else []
    if len(parts) == 1 and parts[0] in ROTATIONS:
        return parts[0], parts[0]
    if len(parts) == 2 and all(p in ROTATIONS for p in parts):
        return parts[0], parts[1]
    raise ValueError(f"{field}={value!r} is not supported; choose {ROTATION_HELP} (each side one of: "
                     f"{', '.join(ROTATIONS)})")


def rotation_name(k: str, v: str) -> str:
    """The canonical ``kv_cache_rotation`` of sides ``k`` and ``v``: one name where they agree, else ``"K/V"``."""
    return k if k == v else f"{k}/{v}"


def canonical_rotation(value: object, field: str = "kv_cache_rotation") -> str:
    """``value`` checked (:func:`rotation_sides`) and spelled canonically (``"hadamard/hadamard"`` ->
    ``"hadamard"``)."""
    return rotation_name(*rotation_sides(value, field))


def is_rotated(value: str) -> bool:
    """Some side of a (valid) ``kv_cache_rotation`` is rotated."""
    return any(side != "none" for side in rotation_sides(value))


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
