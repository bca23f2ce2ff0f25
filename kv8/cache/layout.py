"""Where each layer's K/V lives: KV cache groups, pools and slots (the hybrid layout).

Layers differ in what they keep: a full-attention layer keeps every token of a sequence, a sliding-window
layer only its last ``window`` tokens (older blocks can be freed and reused), and each layer has a storage
*spec* (format, rotation, scales: :class:`kv8.cache.plan.KVPlan`; a plan from ``kv_cache_plan``, or
``kv_cache_dtype_skip_layers`` keeping layers in the compute dtype). The layout sees a spec as its index only.
Layers that agree on both form a *kind*. A request has one block table per *group*; the blocks come from a
*pool*::

    pool      the layers of one spec: one tensor [num_slots, 2, num_blocks, H, bs, W] (W: stored width) and
              one free list
    group     up to num_slots layers of one kind; a block id in its table names the same block index in
              every slot, slot s holding layer group.layers[s]
    kind      (window, spec): its layers are cut into groups of num_slots layers

Within a pool every kind is cut into groups of the same size, ``num_slots`` = the fewest layers any kind of
the pool has (vLLM's hybrid KV cache manager does the same), so one block id is the same number of bytes
whatever group holds it and all groups of a pool share its free blocks: memory freed by a sliding-window
group is reused by a full-attention group and vice versa. A kind whose layer count is not a multiple of
``num_slots`` leaves the last slots of its last group unused.

Example, Gemma-3-270M (18 layers, every 6th global, window 512): kinds full (3 layers) and sliding (15);
``num_slots = 3``; groups ``full[5, 11, 17]`` and five sliding groups of 3 layers. At 8k context a sequence
holds 512 blocks of the full group and at most ``ceil(512 / 16) + 1 = 33`` of each sliding group.

Pools: layers of one spec share a pool; pools come in ascending spec index (spec 0, the ``kv_cache_dtype`` one,
first; a spec no layer uses has no pool), each with its own blocks and its own codec. The memory budget is split
in proportion to what one ``max_model_len`` sequence needs in each (:meth:`kv8.cache.budget.KVBudget.split`).
Example: a plan with layer 0 in bfloat16, layer 1 in int4 + Hadamard and the rest in FP8 has three pools, FP8
(spec 0) first.

Invariants: every model layer is in exactly one group; the groups of a pool have ``len(layers) <=
pool.num_slots``; a layer's (pool, slot) is unique; a pool's layers share one spec and no two pools have the
same spec.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints (blocks that hold ``a`` tokens of ``b`` per block)."""
    return -(-a // b)

@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one block table per request. ``sliding_window`` None: full attention."""

    group_id: int
    pool: int
    layers: tuple[int, ...]        # slot s holds layers[s]
    sliding_window: int | None     # what its layers attend to
    frees_out_of_window: bool = True   # False (disable_hybrid_kv_cache_manager): keeps every block

    @property
    def kept_window(self) -> int | None:
        """The window whose blocks the group keeps (None: every block)."""
        return self.sliding_window if self.frees_out_of_window else None

    def max_blocks(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """The most blocks one sequence of ``num_tokens`` tokens holds in this group at once, computed in chunks of
        at most ``chunk`` tokens (a sliding group frees blocks before the window of a chunk's first token)."""
        full = ceil_div(num_tokens, block_size)
        if self.kept_window is None:
            return full
        return min(full, ceil_div(self.kept_window - 1 + chunk, block_size) + 1)


@dataclass(frozen=True)
class KVPoolSpec:
    """One physical pool: ``num_slots`` layer slots per block, its layers stored in spec ``spec`` (an index into
    the plan's specs, :class:`kv8.cache.plan.KVPlan`)."""

    pool_id: int
    num_slots: int
    spec: int
    layers: tuple[int, ...]         # the model layers it holds, ascending


@dataclass(frozen=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroup, ...]
    pools: tuple[KVPoolSpec, ...]
    layer_group: tuple[int, ...]    # model layer -> group id
    layer_slot: tuple[int, ...]     # model layer -> slot in its pool

    @property
    def num_layers(self) -> int:
        return len(self.layer_group)

    @property
    def has_sliding_window(self) -> bool:
        return any(g.sliding_window is not None for g in self.groups)

    def pool_groups(self, pool: int) -> tuple[KVCacheGroup, ...]:
        return tuple(g for g in self.groups if g.pool == pool)

    def blocks_per_sequence(self, pool: int, num_tokens: int, block_size: int, chunk: int) -> int:
        """Blocks of ``pool`` one sequence of ``num_tokens`` tokens needs at most (:meth:`KVCacheGroup.max_blocks`)."""
        return sum(g.max_blocks(num_tokens, block_size, chunk) for g in self.pool_groups(pool))

    @staticmethod
    def build(layer_windows: Sequence[int | None], layer_spec: Sequence[int] = (), hybrid: bool = True
              ) -> KVCacheLayout:
        """The layout for per-layer windows and storage specs (``layer_spec[i]``: the index of layer i's spec,
        :attr:`kv8.cache.plan.KVPlan.layer_spec`; empty: every layer in spec 0). ``hybrid=False``: sliding-window
        groups keep every block (vLLM's ``disable_hybrid_kv_cache_manager``)."""
        n = len(layer_windows)
        specs = tuple(layer_spec) or (0,) * n
        if len(specs) != n or n == 0 or min(specs) < 0:
            raise ValueError(f"{len(specs)} layer specs (indices >= 0) for {n} layers")
        groups: list[KVCacheGroup] = []
        pools: list[KVPoolSpec] = []
        layer_group, layer_slot = [0] * n, [0] * n
        for spec in sorted(set(specs)):   # spec 0 (kv_cache_dtype's) first
            layers = [i for i in range(n) if specs[i] == spec]
            windows = sorted({layer_windows[i] for i in layers}, key=lambda w: (w is not None, w or 0))
            kinds = [[i for i in layers if layer_windows[i] == w] for w in windows]
            num_slots = min(len(k) for k in kinds)
            pool_id = len(pools)
            pools.append(KVPoolSpec(pool_id, num_slots, spec, tuple(layers)))
            for w, kind in zip(windows, kinds):
                for start in range(0, len(kind), num_slots):
                    members = tuple(kind[start:start + num_slots])
                    for slot, layer in enumerate(members):
                        layer_group[layer], layer_slot[layer] = len(groups), slot
                    groups.append(KVCacheGroup(len(groups), pool_id, members, w, hybrid))
        return KVCacheLayout(tuple(groups), tuple(pools), tuple(layer_group), tuple(layer_slot))

    def describe(self, spec_names: Sequence[str] = ()) -> str:
        """One line per pool: its spec (``spec_names[spec]``, else its index), groups and kinds."""
        parts = []
        for p in self.pools:
            gs = self.pool_groups(p.pool_id)
            kinds: dict[int | None, int] = {}
            for g in gs:
                kinds[g.sliding_window] = kinds.get(g.sliding_window, 0) + 1
            what = ", ".join(f"{c} {'full' if w is None else f'window-{w}'}" for w, c in kinds.items())
            name = spec_names[p.spec] if p.spec < len(spec_names) else f"spec {p.spec}"
            parts.append(f"{name} pool: {len(gs)} groups of "
                         f"{p.num_slots} layers ({what})")
        return "; ".join(parts)


__all__ = ["KVCacheGroup", "KVCacheLayout", "KVPoolSpec", "ceil_div"]
