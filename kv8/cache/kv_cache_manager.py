"""Request-level view of the block pool: block tables, prefix hits, all-or-nothing allocation.

Block table and slot arithmetic (block_size = 4 in this sketch)::

    request tokens   t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9
    block table      [   7       ,    2        ,   9   ]      (block ids in the pool)
    slot of t5       = block_table[5 // 4] * 4 + 5 % 4 = 2 * 4 + 1 = 9

Prefix caching: full blocks are identified by a chain hash ``h_i = H(h_{i-1}, tokens of block i)``, so a
block's hash names the whole prefix up to its end. A new request walks its chain through the pool's map and
takes a reference on each hit; hits stop at the first miss. At most ``num_tokens - 1`` tokens can come from
the cache (the last token must be computed to produce logits), in whole blocks. Because cached blocks are
read back exactly as stored (FP8 codes included), output with prefix caching equals output without it.
"""

from __future__ import annotations

import hashlib
from array import array

from kv8.cache.block_pool import BlockPool
from kv8.config import ceil_div
from kv8.engine.request import Request

_ROOT_HASH = b"kv8-root"


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    """Chain hash of one full block (collision resistant: 128-bit BLAKE2b over the parent hash and tokens)."""
    h = hashlib.blake2b(parent or _ROOT_HASH, digest_size=16)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_blocks: dict[str, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        """Extend ``request.block_hashes`` to cover the full blocks among its first ``num_tokens`` tokens."""
        bs = self.block_size
        hashes = request.block_hashes
        for i in range(len(hashes), num_tokens // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, request.all_token_ids[i * bs:(i + 1) * bs]))

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Cached blocks that hold a prefix of ``request`` (no reference taken), and how many tokens they cover."""
        if not self.enable_prefix_caching or request.wants_prompt_logprobs:
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        self._update_hashes(request, max_hit_blocks * self.block_size)
        hits = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        self.pool.num_queries += max_hit_blocks
        self.pool.num_hits += len(hits)
        return hits, len(hits) * self.block_size

    def blocks_needed(self, request: Request, num_new_tokens: int, computed_blocks: list[int]) -> int:
        """Free blocks that :meth:`allocate_slots` would take for this request (new blocks plus free hits)."""
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        have = len(self.req_blocks.get(request.request_id, [])) + len(computed_blocks)
        new = max(ceil_div(num_computed + num_new_tokens, self.block_size) - have, 0)
        return new + sum(self.pool.blocks[b].ref_cnt == 0 for b in computed_blocks)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> list[int] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones; all or nothing.

        ``computed_blocks`` (from :meth:`get_computed_blocks`, only for a request with no blocks yet) are
        appended first with a reference taken. Returns the newly allocated block ids, or ``None`` (and changes
        nothing) when the pool cannot supply them.
        """
        blocks = self.req_blocks.setdefault(request.request_id, [])
        computed_blocks = computed_blocks or []
        if computed_blocks and blocks:
            raise RuntimeError("computed blocks can only be added to a request without blocks")
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        needed = ceil_div(num_computed + num_new_tokens, self.block_size) - len(blocks) - len(computed_blocks)
        # Hits on free cached blocks take them out of the free queue, so they count against the free blocks.
        num_free_hits = sum(self.pool.blocks[b].ref_cnt == 0 for b in computed_blocks)
        if needed > self.pool.num_free_blocks - num_free_hits:
            if not blocks:
                del self.req_blocks[request.request_id]
            return None
        self.pool.touch(computed_blocks)
        blocks.extend(computed_blocks)
        new = self.pool.get_new_blocks(max(needed, 0))
        blocks.extend(new)
        return new

    def cache_computed_blocks(self, request: Request) -> None:
        """Publish the request's full blocks whose K/V is now written (call after a step)."""
        if not self.enable_prefix_caching:
            return
        num_full = min(request.num_computed_tokens, request.num_tokens) // self.block_size
        self._update_hashes(request, num_full * self.block_size)
        blocks = self.req_blocks.get(request.request_id, [])
        for i in range(min(num_full, len(blocks))):
            self.pool.cache_block(blocks[i], request.block_hashes[i])

    def free(self, request: Request) -> None:
        """Release every block of ``request`` (tail first, so the tail is evicted first)."""
        blocks = self.req_blocks.pop(request.request_id, [])
        self.pool.free_blocks(blocks[::-1])

    def prefix_cache_hit_rate(self) -> float:
        return self.pool.num_hits / self.pool.num_queries if self.pool.num_queries else 0.0

    def check_integrity(self) -> None:
        """Pool invariants, plus: each block's ref count equals the number of requests holding it."""
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for blocks in self.req_blocks.values():
            for b in blocks:
                refs[b] = refs.get(b, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} but held {refs.get(block.block_id, 0)} times")
