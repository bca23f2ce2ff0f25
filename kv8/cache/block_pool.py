"""The pool of KV cache blocks: reference counts, an LRU free queue and the prefix-cache hash map.

A block is a fixed run of ``block_size`` token slots in every layer's K and V cache. The pool knows nothing
about requests; :mod:`kv8.cache.kv_cache_manager` maps requests to blocks.

Invariants (checked by :meth:`BlockPool.check_integrity`):

* every block is either *in use* (``ref_cnt > 0``) or in the free queue (``ref_cnt == 0``), never both;
* the free queue is ordered for eviction: the front is evicted first (least recently freed);
* a block with a hash is *cached*: its K/V slots hold exactly the tokens the hash names, fully written.
  A cached block may be free (reusable by a later hit, evictable) or in use (shared, read-only);
* ``cached[h] == b`` iff ``blocks[b].block_hash == h``.

A block handed out by :meth:`get_new_blocks` has no hash until the manager caches it, after its slots were
written, so a prefix hit never reads a block that is still being filled.
"""

from __future__ import annotations

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
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.cached: dict[bytes, int] = {}
        # Prefix cache statistics, in blocks.
        self.num_queries = 0
        self.num_hits = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, cached or not)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use by requests (cached free blocks count as free)."""
        return 1.0 - len(self._free) / self.num_blocks

    def get_new_blocks(self, n: int) -> list[int]:
        """Take ``n`` blocks from the front of the free queue, evicting their cached contents; returned in
        ascending id order.

        Which blocks are taken is the queue's (eviction) order; the order they are returned in is the order of
        addresses, so a request's blocks taken in one call lie at ascending addresses in every layer's cache even
        when they were freed in reverse. The decode attention kernels read a sequence's blocks in table order,
        and the hardware prefetchers stream ascending runs (docs/benchmarks.md, "Blocks in ascending order").
        The caller checks ``num_free_blocks`` first; asking for more raises ``RuntimeError`` (a bug).
        """
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} blocks with only {len(self._free)} free")
        out = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block_id)
        out.sort()
        return out

    def lookup(self, block_hash: bytes) -> int | None:
        """The cached block holding ``block_hash``, or None."""
        return self.cached.get(block_hash)

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks found by a prefix hit (removing free ones from the queue)."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt == 0:
                del self._free[block_id]
            block.ref_cnt += 1

    def free_blocks(self, block_ids: list[int]) -> None:
        """Drop one reference from each block; blocks reaching zero join the tail of the free queue.

        Callers pass a request's blocks in *reverse* order so that the tail of a sequence (least likely to be
        shared by another prompt) is evicted before its head.
        """
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block_id} freed with ref_cnt={block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if not self.enable_prefix_caching:
                    block.block_hash = None
                self._free[block_id] = None

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
        for block in self.blocks:
            in_free = block.block_id in self._free
            assert block.ref_cnt >= 0, f"block {block.block_id} ref_cnt {block.ref_cnt}"
            assert in_free == (block.ref_cnt == 0), f"block {block.block_id} ref_cnt {block.ref_cnt} free {in_free}"
            if block.block_hash is not None:
                assert self.cached.get(block.block_hash) == block.block_id, f"block {block.block_id} hash map"
        assert len(self.cached) == sum(b.block_hash is not None for b in self.blocks)
