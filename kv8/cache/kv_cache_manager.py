"""Request-level view of the block pools: one block table per KV cache group, prefix hits, freeing
out-of-window blocks, all-or-nothing allocation.

Block table and slot arithmetic (block_size = 4 in this sketch)::

    request tokens   t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9
    block table      [   7       ,    2        ,   9   ]      (block ids in the group's pool)
    slot of t5       = block_table[5 // 4] * 4 + 5 % 4 = 2 * 4 + 1 = 9

A request has one table per group of :mod:`kv8.cache.layout` (one group for a model whose layers all attend
to the whole context). In a sliding-window group (window ``W``) the next token to compute, at position
``c = num_computed_tokens``, and every later one attend only to keys at positions ``> c - W``: blocks that end
at or before ``c - W + 1`` are never read again. :meth:`KVCacheManager.allocate_slots` frees them first (their
table entries become :data:`NULL_BLOCK`), so a sliding-window group holds at most ``ceil((W - 1 + n) / bs) + 1``
blocks while a chunk of ``n`` tokens is computed (``ceil(W / bs) + 1`` in decode).

Prefix caching: full blocks are identified by a chain hash ``h_i = H(h_{i-1}, tokens of block i)``, so a
block's hash names the whole prefix up to its end; each group caches its own blocks under (group, hash). A hit
of ``n`` blocks needs, in every full-attention group, blocks ``0 .. n-1`` cached, and in every sliding-window
group only the blocks the window of token ``n * bs`` reaches (the ones before are not needed and stay
:data:`NULL_BLOCK`); the longest ``n`` that every group can serve wins. At most ``num_tokens - 1`` tokens come
from the cache (the last token must be computed to produce logits). Because cached blocks are read back
exactly as stored (FP8 codes included), output with prefix caching equals output without it.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence
from typing import Protocol

from kv8.cache.block_pool import BlockPool
from kv8.cache.layout import KVCacheGroup, KVCacheLayout, ceil_div

_ROOT_HASH = b"kv8-root"
NULL_BLOCK = -1   # a table entry whose block was freed (out of the window) or never needed (prefix hit)


class CachedSequence(Protocol):
    """What the manager reads of a request (:class:`kv8.engine.request.Request` is one): its id, tokens, how
    many of them are computed, whether it scores its prompt, and the chain hashes of its full blocks, which the
    manager extends."""

    block_hashes: list[bytes]

    @property
    def request_id(self) -> str: ...
    @property
    def all_token_ids(self) -> list[int]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_computed_tokens(self) -> int: ...
    @property
    def wants_prompt_logprobs(self) -> bool: ...


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    """Chain hash of one full block (collision resistant: 128-bit BLAKE2b over the parent hash and tokens)."""
    h = hashlib.blake2b(parent or _ROOT_HASH, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def first_needed_block(num_computed: int, window: int | None, block_size: int) -> int:
    """Index of the first block that computing the tokens from position ``num_computed`` on can read."""
    if window is None:
        return 0
    return max(num_computed - window + 1, 0) // block_size


class KVCacheManager:
    """Block tables of every request, one per group; pools shared by the groups of :class:`KVCacheLayout`.

    ``num_blocks[p]`` is the size of pool ``p``. Invariants (see :meth:`check_integrity`): a block's
    reference count equals the number of (request, group) tables holding it; :data:`NULL_BLOCK` entries hold
    nothing; a table's entries before the window of its request's next token are :data:`NULL_BLOCK` after
    each allocation.
    """

    def __init__(self, layout: KVCacheLayout, num_blocks: Sequence[int], block_size: int,
                 enable_prefix_caching: bool) -> None:
        if len(num_blocks) != len(layout.pools):
            raise ValueError(f"{len(num_blocks)} pool sizes for {len(layout.pools)} pools")
        self.layout = layout
        self.groups: tuple[KVCacheGroup, ...] = layout.groups
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pools = [BlockPool(n, enable_prefix_caching) for n in num_blocks]
        self._windowed = any(g.kept_window is not None for g in self.groups)
        self.req_blocks: dict[str, list[list[int]]] = {}
        self._num_cached: dict[str, list[int]] = {}   # per request and group: blocks already published
        # Prefix cache statistics, in blocks.
        self.num_queries = 0
        self.num_hits = 0

    @staticmethod
    def full_attention(num_blocks: int, block_size: int, enable_prefix_caching: bool,
                       num_layers: int = 1) -> KVCacheManager:
        """A manager for a model whose layers all attend to the whole context (one group, one pool)."""
        return KVCacheManager(KVCacheLayout.build([None] * num_layers), [num_blocks], block_size,
                              enable_prefix_caching)

    # ---- views ------------------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return sum(p.num_free_blocks for p in self.pools)

    @property
    def num_blocks(self) -> int:
        return sum(p.num_blocks for p in self.pools)

    @property
    def usage(self) -> float:
        """Fraction of all blocks in use by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def block_ids(self, request_id: str) -> tuple[tuple[int, ...], ...]:
        """The request's table in each group (:data:`NULL_BLOCK` where a block was freed or not needed)."""
        tables = self.req_blocks.get(request_id)
        return tuple(tuple(t) for t in tables) if tables else tuple(() for _ in self.groups)

    def num_held_blocks(self, request_id: str, group: int) -> int:
        return sum(b != NULL_BLOCK for b in self.req_blocks.get(request_id, [[]] * len(self.groups))[group])

    # ---- prefix caching ---------------------------------------------------------------------------------------
    def _update_hashes(self, request: CachedSequence, num_tokens: int) -> None:
        """Extend ``request.block_hashes`` to cover the full blocks among its first ``num_tokens`` tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, request.all_token_ids[i * bs:(i + 1) * bs]))

    @staticmethod
    def _key(group: int, block_hash: bytes) -> bytes:
        return group.to_bytes(2, "little") + block_hash

    def get_computed_blocks(self, request: CachedSequence) -> tuple[list[list[int]], int]:
        """Cached blocks that hold a prefix of ``request`` (no reference taken), per group, and how many tokens
        they cover. Entries a sliding-window group does not need are :data:`NULL_BLOCK`."""
        empty: list[list[int]] = [[] for _ in self.groups]
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return empty, 0
        bs = self.block_size
        max_hit = (request.num_tokens - 1) // bs
        self._update_hashes(request, max_hit * bs)
        hashes = request.block_hashes[:max_hit]
        found: list[list[int | None]] = []
        n = max_hit
        for g in self.groups:
            lookup = self.pools[g.pool].lookup
            if g.kept_window is None:   # a full group serves its longest run of hits from the start
                ids: list[int | None] = []
                for h in hashes[:n]:
                    b = lookup(self._key(g.group_id, h))
                    if b is None:
                        break
                    ids.append(b)
                n = len(ids)
            else:
                ids = [lookup(self._key(g.group_id, h)) for h in hashes]
            found.append(ids)
        # Sliding groups: the longest n <= the full groups' hit whose window blocks are cached in every group
        # (lowering n for one group moves the window of the others, so repeat until no group lowers it).
        settled = False
        while not settled:
            settled = True
            for g, ids in zip(self.groups, found):
                if g.kept_window is None:
                    continue
                while n > 0 and any(b is None for b in ids[first_needed_block(n * bs, g.kept_window, bs):n]):
                    n = max(i for i in range(n) if ids[i] is None)   # a hit must end before the last miss
                    settled = False
        self.num_queries += max_hit
        self.num_hits += n
        if n == 0:
            return empty, 0
        out = []
        for g, ids in zip(self.groups, found):
            first = first_needed_block(n * bs, g.kept_window, bs)
            out.append([NULL_BLOCK] * first + [b if b is not None else NULL_BLOCK for b in ids[first:n]])
        return out, n * bs

    # ---- allocation -------------------------------------------------------------------------------------------
    def _free_out_of_window(self, request: CachedSequence, num_computed: int) -> None:
        tables = self.req_blocks.get(request.request_id)
        if not tables:
            return
        for g, table in zip(self.groups, tables):
            first = min(first_needed_block(num_computed, g.kept_window, self.block_size), len(table))
            dropped = [b for b in table[:first] if b != NULL_BLOCK]
            if dropped:
                table[:first] = [NULL_BLOCK] * first
                self.pools[g.pool].free_blocks(dropped[::-1])

    def _needed(self, request: CachedSequence, num_new_tokens: int, computed: list[list[int]]) -> list[int]:
        """Free blocks each pool must supply: new blocks, plus hits on free cached blocks (they leave the free
        queue). Assumes out-of-window blocks were freed."""
        tables = self.req_blocks.get(request.request_id)
        hit_tokens = max((len(c) for c in computed), default=0) * self.block_size
        total = ceil_div(request.num_computed_tokens + hit_tokens + num_new_tokens, self.block_size)
        per_pool = [0] * len(self.pools)
        for g in self.groups:
            have = len(tables[g.group_id]) if tables else 0
            hits = computed[g.group_id] if computed else []
            pool = self.pools[g.pool]
            per_pool[g.pool] += max(total - have - len(hits), 0) + sum(
                b != NULL_BLOCK and pool.blocks[b].ref_cnt == 0 for b in hits)
        return per_pool

    def blocks_needed(self, request: CachedSequence, num_new_tokens: int,
                      computed_blocks: list[list[int]] | None = None) -> list[int]:
        """Per pool, the free blocks :meth:`allocate_slots` would take to admit ``request`` (a waiting request:
        it holds no blocks) with ``computed_blocks`` from :meth:`get_computed_blocks`."""
        if self.req_blocks.get(request.request_id):
            raise RuntimeError(f"blocks_needed is for a request without blocks; {request.request_id!r} holds some")
        return self._needed(request, num_new_tokens, computed_blocks or [[] for _ in self.groups])

    def blocks_to_grow(self, request: CachedSequence, num_tokens: int) -> list[int]:
        """Per pool, the free blocks a request that holds blocks would take to hold ``num_tokens`` tokens after its
        computed ones (0 where its tables already cover them; no sliding-window freeing is assumed, so this never
        counts short)."""
        return self._needed(request, num_tokens, [[] for _ in self.groups])

    def allocate_slots(self, request: CachedSequence, num_new_tokens: int,
                       computed_blocks: list[list[int]] | None = None) -> bool:
        """Make room for ``num_new_tokens`` more tokens after the computed ones; all or nothing.

        First frees the request's blocks that fell out of its sliding windows. ``computed_blocks`` (from
        :meth:`get_computed_blocks`, only for a request with no blocks yet) start its tables, with a reference
        taken on each. Returns False (and allocates nothing) when a pool cannot supply the blocks.
        """
        computed = computed_blocks if computed_blocks is not None and any(computed_blocks) else None
        if computed is None and not self._windowed:
            # A decode step's common case: the tables already hold the new tokens' slots, and no group has a
            # window to free blocks from -- the full path below would find nothing to free or to take.
            tables = self.req_blocks.get(request.request_id)
            end = request.num_computed_tokens + num_new_tokens
            if tables and all(len(t) * self.block_size >= end for t in tables):
                return True
        if computed is not None and self.req_blocks.get(request.request_id):
            raise RuntimeError("computed blocks can only be added to a request without blocks")
        self._free_out_of_window(request, request.num_computed_tokens)
        needed = self._needed(request, num_new_tokens, computed or [[] for _ in self.groups])
        if any(n > pool.num_free_blocks for n, pool in zip(needed, self.pools)):
            return False
        tables = self.req_blocks.setdefault(request.request_id, [[] for _ in self.groups])
        self._num_cached.setdefault(request.request_id, [0] * len(self.groups))
        hit_tokens = 0
        if computed is not None:
            hit_tokens = len(computed[0]) * self.block_size
            for g, hits in zip(self.groups, computed):
                self.pools[g.pool].touch([b for b in hits if b != NULL_BLOCK])
                tables[g.group_id].extend(hits)
            self._num_cached[request.request_id] = [len(h) for h in computed]
        total = ceil_div(request.num_computed_tokens + hit_tokens + num_new_tokens, self.block_size)
        for g, table in zip(self.groups, tables):
            if total > len(table):
                table.extend(self.pools[g.pool].get_new_blocks(total - len(table)))
        return True

    def cache_computed_blocks(self, request: CachedSequence) -> None:
        """Publish the request's full blocks whose K/V is now written (call after a step)."""
        if not self.enable_prefix_caching:
            return
        tables = self.req_blocks.get(request.request_id)
        if not tables:
            return
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        self._update_hashes(request, num_full * self.block_size)
        done = self._num_cached[request.request_id]
        for g, table in zip(self.groups, tables):
            pool = self.pools[g.pool]
            for i in range(done[g.group_id], min(num_full, len(table))):
                if table[i] != NULL_BLOCK:
                    pool.cache_block(table[i], self._key(g.group_id, request.block_hashes[i]))
            done[g.group_id] = max(done[g.group_id], min(num_full, len(table)))

    def free(self, request: CachedSequence) -> None:
        """Release every block of ``request`` (tail first, so the tail is evicted first)."""
        tables = self.req_blocks.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        for g, table in zip(self.groups, tables or ()):
            self.pools[g.pool].free_blocks([b for b in table[::-1] if b != NULL_BLOCK])

    def prefix_cache_hit_rate(self) -> float:
        return self.num_hits / self.num_queries if self.num_queries else 0.0

    def check_integrity(self) -> None:
        """Pool invariants, plus: each block's ref count equals the number of tables holding it."""
        for pool in self.pools:
            pool.check_integrity()
        refs: list[dict[int, int]] = [{} for _ in self.pools]
        for tables in self.req_blocks.values():
            for g, table in zip(self.groups, tables):
                for b in table:
                    if b != NULL_BLOCK:
                        refs[g.pool][b] = refs[g.pool].get(b, 0) + 1
        for p, pool in enumerate(self.pools):
            for block in pool.blocks:
                held = refs[p].get(block.block_id, 0)
                assert block.ref_cnt == held, (
                    f"pool {p} block {block.block_id}: ref_cnt {block.ref_cnt} but held {held} times")
