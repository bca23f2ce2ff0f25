"""The pool of KV cache blocks: reference counts, the free blocks and the prefix-cache hash map.

A block is a fixed run of ``block_size`` token slots in every layer's K and V cache. The pool knows nothing
about requests; :mod:`kv8.cache.kv_cache_manager` maps requests to blocks.

Free blocks are kept in two places. *Empty* ones (no hash: nothing in them can be reused) wait in a min-heap of
block ids; free *cached* ones wait in an LRU queue, least recently freed first. :meth:`BlockPool.get_new_blocks`
takes empty blocks first, lowest id first, and evicts cached blocks only when no empty block is left (as
SGLang's radix cache uses free slots before it evicts). Why: a cached prefix survives as long as there is room
without it, and requests' blocks stay together at the low end of the cache: a prompt's blocks taken in one call
are one contiguous run wherever the pool has one, whatever order earlier requests freed theirs, and the decode
attention kernels read a sequence's blocks fastest as one run (docs/benchmarks.md, "Empty blocks first, lowest
id first").

Invariants (checked by :meth:`BlockPool.check_integrity`):

* every block is either *in use* (``ref_cnt > 0``) or free (``ref_cnt == 0``), never both; a free block is in
  the empty heap if it has no hash, else in the LRU queue;
* the LRU queue is ordered for eviction: the front is evicted first (least recently freed);
* a block with a hash is *cached*: its K/V slots hold exactly the tokens the hash names, fully written.
  A cached block may be free (reusable by a later hit, evictable) or in use (shared, read-only);
* ``cached[h] == b`` iff ``blocks[b].block_hash == h``.

A block handed out by :meth:`get_new_blocks` has no hash until the manager caches it, after its slots were
written, so a prefix hit never reads a block that is still being filled.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks={num_blocks} must be >= 1")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._empty: list[int] = list(range(num_blocks))   # a min-heap of free blocks without a hash
        self._evictable: OrderedDict[int, None] = OrderedDict()   # free cached blocks, LRU first
        self.cached: dict[bytes, int] = {}
        # Prefix cache statistics, in blocks.
        self.num_queries = 0
        self.num_hits = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, cached or not)."""
        return len(self._empty) + len(self._evictable)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests (cached free blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_new_blocks(self, n: int) -> list[int]:
        """Take ``n`` free blocks: empty ones first, lowest id first, then cached ones from the front of the LRU
        queue (their cached contents are dropped); returned in ascending id order.

        The order returned is the order of addresses, so a request's blocks taken in one call lie at ascending
        addresses in every layer's cache. The decode attention kernels read a sequence's blocks in table order,
        and the hardware prefetchers stream ascending runs (docs/benchmarks.md, "Blocks in ascending order").
        The caller checks ``num_free_blocks`` first; asking for more raises ``RuntimeError`` (a bug).
        """
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks with only {self.num_free_blocks} free")
        empty = min(n, len(self._empty))
        out = [heapq.heappop(self._empty) for _ in range(empty)]
        for _ in range(n - empty):
            block_id, _ = self._evictable.popitem(last=False)
            block = self.blocks[block_id]
            assert block.block_hash is not None, f"block {block_id} in the LRU queue without a hash"
            del self.cached[block.block_hash]
            block.block_hash = None
            out.append(block_id)
        for block_id in out:
            self.blocks[block_id].ref_cnt = 1
        out.sort()
        return out

    def lookup(self, block_hash: bytes) -> int | None:
        """The cached block holding ``block_hash``, or None."""
        return self.cached.get(block_hash)

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks found by a prefix hit (removing free ones from the LRU queue)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._evictable[block_id]
            block.ref_cnt += 1

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; a block reaching zero becomes free: a cached one joins the tail
        of the LRU queue, an empty one the heap (without prefix caching every block is empty once free).

        Callers pass a request's blocks in *reverse* order so that the tail of a sequence (least likely to be
        shared by another prompt) is evicted before its head.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block_id} freed with ref_cnt={block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if not self.enable_prefix_caching and block.block_hash is not None:
                    del self.cached[block.block_hash]
                    block.block_hash = None
                if block.block_hash is None:
                    heapq.heappush(self._empty, block_id)
                else:
                    self._evictable[block_id] = None

    def cache_block(self, block_id: int, block_hash: bytes) -> None:
        """Mark a fully written, in-use block as holding ``block_hash``.

        If another block already holds that hash (two requests computed the same prefix at once), the
        existing entry is kept and this block stays uncached; both are correct copies.
        """
        block = self.blocks[block_id]
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block_id

    def check_integrity(self) -> None:
        """Raise ``AssertionError`` if an invariant of the module docstring is broken."""
        empty = set(self._empty)
        assert len(empty) == len(self._empty), "a block is in the empty heap twice"
        for block in self.blocks:
            in_empty, in_lru = block.block_id in empty, block.block_id in self._evictable
            assert block.ref_cnt >= 0, f"block {block.block_id} ref_cnt {block.ref_cnt}"
            assert not (in_empty and in_lru), f"block {block.block_id} is in the heap and the LRU queue"
            assert (in_empty or in_lru) == (block.ref_cnt == 0), \
                f"block {block.block_id} ref_cnt {block.ref_cnt} free {in_empty or in_lru}"
            if in_empty or in_lru:
                assert in_lru == (block.block_hash is not None), \
                    f"free block {block.block_id} with hash {block.block_hash!r} in the {'LRU' if in_lru else 'heap'}"
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) == block.block_id, f"block {block.block_id} hash map"
        assert len(self.cached) == sum(b.block_hash is not None for b in self.blocks)
