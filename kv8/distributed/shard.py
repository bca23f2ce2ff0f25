"""Which part of each sharded tensor a rank holds, and the group a model is being built for.

Megatron-style tensor parallelism over ``N`` ranks (rank ``r``):

* query heads: ``Hq / N`` consecutive heads, ``[r * Hq/N, (r+1) * Hq/N)``;
* KV heads: with ``Hkv >= N``, ``Hkv / N`` consecutive heads the same way; with ``Hkv < N`` (``N % Hkv ==
  0``) each KV head is replicated on ``N / Hkv`` consecutive ranks and rank ``r`` holds head ``r // (N /
  Hkv)`` (vLLM's rule). Either way a rank's query heads use only its own KV heads::

      Hq=8, Hkv=2, N=4:  rank     0     1     2     3
                         q heads  0-1   2-3   4-5   6-7
                         kv head  0     0     1     1

* MLP: ``I / N`` consecutive columns of gate and of up, the same rows of down.

Layers learn their group while the model is built: :func:`building_shard` (a context manager that does not
nest, around the meta-device build of the loader) makes :func:`shard_group` return it; outside it,
:func:`shard_group` is the single rank. A layer keeps the group it was built with (state passed down once,
read by nobody else).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kv8.distributed.group import SINGLE_RANK, TPGroup

__all__ = ["building_shard", "kv_head_shard", "local_head_counts", "shard_group", "split_evenly"]

_state = threading.local()


@contextmanager
def building_shard(tp: TPGroup) -> Iterator[None]:
    """Build layers for ``tp``'s rank inside this block (not nestable)."""
    if getattr(_state, "group", None) is not None:
        raise RuntimeError("building_shard blocks do not nest")
    _state.group = tp
    try:
        yield
    finally:
        _state.group = None


def shard_group() -> TPGroup:
    """The group of the model being built (the single rank outside :func:`building_shard`)."""
    group = getattr(_state, "group", None)
    return SINGLE_RANK if group is None else group


def split_evenly(n: int, tp: TPGroup) -> tuple[int, int]:
    """``(start, count)`` of rank ``tp.rank``'s share of ``n`` items (``n % tp.size == 0``, checked by the
    config)."""
    if n % tp.size:
        raise ValueError(f"{n} cannot be split evenly over {tp.size} tensor-parallel ranks")
    count = n // tp.size
    return tp.rank * count, count


def kv_head_shard(num_kv_heads: int, tp: TPGroup) -> tuple[int, int]:
    """``(first KV head, number of KV heads)`` rank ``tp.rank`` holds (replicated when ``num_kv_heads <
    tp.size``)."""
    if num_kv_heads >= tp.size:
        return split_evenly(num_kv_heads, tp)
    if tp.size % num_kv_heads:
        raise ValueError(f"{num_kv_heads} KV heads cannot be replicated evenly over {tp.size} tensor-parallel "
                         "ranks")
    return tp.rank // (tp.size // num_kv_heads), 1


def local_head_counts(num_heads: int, num_kv_heads: int, tp: TPGroup | None = None) -> tuple[int, int]:
    """``(query heads, KV heads)`` of one rank of ``tp`` (default: the group being built)."""
    tp = shard_group() if tp is None else tp
    return split_evenly(num_heads, tp)[1], kv_head_shard(num_kv_heads, tp)[1]
