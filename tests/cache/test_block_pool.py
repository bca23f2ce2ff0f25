"""Block pool and KV cache manager: exact block ids, reference counts, prefix hits, empty blocks before
evictions and LRU eviction order."""

from __future__ import annotations

import pytest
import torch

from kv8.cache.block_pool import BlockPool
from kv8.cache.kv_cache_manager import KVCacheManager, hash_block
from kv8.engine.request import Request
from kv8.sampling_params import SamplingParams


def req(rid: str, tokens: list[int], **params) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(**params),
                   generator=torch.Generator(), max_tokens=16, eos_token_ids=frozenset())


def test_pool_hands_out_empty_blocks_lowest_first():
    pool = BlockPool(6, enable_prefix_caching=True)
    assert pool.get_new_blocks(3) == [0, 1, 2]
    assert pool.get_new_blocks(2) == [3, 4]
    pool.free_blocks([4, 1])          # empty blocks: they join the heap, whatever the order they are freed in
    assert pool.get_new_blocks(2) == [1, 4]      # the lowest free ids (not 5, which was free all along)
    pool.free_blocks([4, 1])
    assert pool.get_new_blocks(3) == [1, 4, 5]   # in ascending (address) order
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)
    with pytest.raises(RuntimeError):
        pool.free_blocks([5, 5])      # double free
    pool.check_integrity()


def test_blocks_freed_in_reverse_come_back_as_one_ascending_run():
    """Without prefix caching every freed block is empty: after a batch of requests frees its blocks (each
    request tail first), the next request's blocks are the lowest ids, a contiguous ascending run."""
    kv = KVCacheManager.full_attention(num_blocks=16, block_size=4, enable_prefix_caching=False)
    reqs = [req(r, list(range(20))) for r in "abc"]
    for r in reqs:
        assert kv.allocate_slots(r, 20)
    assert [kv.block_ids(r.request_id)[0] for r in reqs] == [(0, 1, 2, 3, 4), (5, 6, 7, 8, 9), (10, 11, 12, 13, 14)]
    for r in (reqs[1], reqs[0], reqs[2]):
        kv.free(r)
    d = req("d", list(range(28)))
    assert kv.allocate_slots(d, 28) and kv.block_ids("d") == ((0, 1, 2, 3, 4, 5, 6),)
    kv.check_integrity()


def test_empty_blocks_are_used_before_a_cached_block_is_evicted():
    """A cached prefix freed before some empty blocks stays cached while empty blocks are left (an LRU over all
    free blocks would evict it first, being least recently freed)."""
    kv = KVCacheManager.full_attention(num_blocks=5, block_size=2, enable_prefix_caching=True)
    pool = kv.pools[0]
    a = req("a", [1, 2, 3, 4])
    assert kv.allocate_slots(a, 4) and kv.block_ids("a") == ((0, 1),)
    a.num_computed_tokens = 4
    kv.cache_computed_blocks(a)                                   # blocks 0, 1 full -> cached
    kv.free(a)
    e = req("e", [9] * 5)
    assert kv.allocate_slots(e, 5) and kv.block_ids("e") == ((2, 3, 4),)
    kv.free(e)                                                    # never computed: its blocks are empty
    assert sorted(pool._empty) == [2, 3, 4] and list(pool._evictable) == [1, 0]
    f = req("f", [8] * 3)
    assert kv.allocate_slots(f, 3) and kv.block_ids("f") == ((2, 3),)
    assert set(pool.cached.values()) == {0, 1}                    # nothing evicted while empty blocks were left
    assert kv.get_computed_blocks(req("g", [1, 2, 3, 4, 5])) == ([[0, 1]], 4)
    h = req("h", [7] * 5)
    assert kv.allocate_slots(h, 5) and kv.block_ids("h") == ((0, 1, 4),)   # then the cached ones, LRU first
    assert pool.cached == {}
    kv.free(f)
    kv.free(h)
    kv.check_integrity()


def test_manager_allocates_all_or_nothing():
    kv = KVCacheManager.full_attention(num_blocks=4, block_size=4, enable_prefix_caching=False)
    a = req("a", list(range(10)))
    assert kv.allocate_slots(a, 10) and kv.block_ids("a") == ((0, 1, 2),)   # ceil(10 / 4) blocks
    a.num_computed_tokens = 10
    assert kv.allocate_slots(a, 2) and kv.block_ids("a") == ((0, 1, 2),)    # tokens 10, 11 fit in block 2
    b = req("b", list(range(8)))
    assert not kv.allocate_slots(b, 8)                           # needs 2, only 1 free: nothing changes
    assert kv.num_free_blocks == 1 and "b" not in kv.req_blocks
    kv.free(a)
    assert kv.num_free_blocks == 4
    kv.check_integrity()


def test_prefix_hits_share_blocks_and_stop_short_of_the_last_token():
    kv = KVCacheManager.full_attention(num_blocks=8, block_size=4, enable_prefix_caching=True)
    prompt = list(range(100, 112))                                # exactly 3 full blocks
    a = req("a", prompt)
    assert kv.get_computed_blocks(a) == ([[]], 0)
    assert kv.allocate_slots(a, 12) and kv.block_ids("a") == ((0, 1, 2),)
    a.num_computed_tokens = 12
    kv.cache_computed_blocks(a)
    # Same prompt: only 2 blocks may hit -- the last token must be recomputed to produce logits.
    b = req("b", prompt)
    hits, n = kv.get_computed_blocks(b)
    assert (hits, n) == ([[0, 1]], 8)
    assert kv.allocate_slots(b, 4, hits)
    assert kv.block_ids("b") == ((0, 1, 3),)
    assert kv.pools[0].blocks[0].ref_cnt == 2 and kv.pools[0].blocks[2].ref_cnt == 1
    # A prompt diverging in block 1 hits only block 0; prompt_logprobs requests never take hits.
    c = req("c", prompt[:4] + [0] * 8)
    assert kv.get_computed_blocks(c) == ([[0]], 4)
    assert kv.get_computed_blocks(req("d", prompt, prompt_logprobs=1)) == ([[]], 0)
    kv.free(a)
    kv.free(b)
    kv.check_integrity()
    assert kv.num_free_blocks == 8


def test_lru_eviction_order_and_reuse_of_free_cached_blocks():
    kv = KVCacheManager.full_attention(num_blocks=4, block_size=2, enable_prefix_caching=True)
    a = req("a", [1, 2, 3, 4, 5])
    kv.allocate_slots(a, 5)                                       # blocks 0, 1, 2
    a.num_computed_tokens = 5
    kv.cache_computed_blocks(a)                                   # blocks 0, 1 full -> cached
    assert set(kv.pools[0].cached.values()) == {0, 1}
    kv.free(a)                                      # freed tail first: 2 is empty (heap), LRU queue 1, 0
    pool = kv.pools[0]
    assert sorted(pool._empty) == [2, 3] and list(pool._evictable) == [1, 0]
    # A hit on a free cached block takes it out of the LRU queue (it counts against the free blocks).
    b = req("b", [1, 2, 3, 4, 9])
    hits, n = kv.get_computed_blocks(b)
    assert (hits, n) == ([[0, 1]], 4)
    assert kv.allocate_slots(b, 1, hits) and kv.block_ids("b") == ((0, 1, 2),)   # the lowest empty block
    assert sorted(pool._empty) == [3] and list(pool._evictable) == []
    kv.free(b)
    assert sorted(pool._empty) == [2, 3] and list(pool._evictable) == [1, 0]
    # New blocks: the empty 2 and 3 first, then the LRU queue's front, 1 (its hash is dropped); 0 stays cached.
    # The blocks taken in one call come back in ascending id (address) order.
    c = req("c", [7] * 5)
    assert kv.allocate_slots(c, 5) and kv.block_ids("c") == ((1, 2, 3),)
    assert set(pool.cached.values()) == {0}
    assert list(pool._evictable) == [0] and pool._empty == []
    kv.free(c)
    kv.check_integrity()


def test_chain_hash_names_the_whole_prefix():
    h1 = hash_block(None, [1, 2])
    assert hash_block(h1, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])
    assert hash_block(None, [1, 2]) == h1 and len(h1) == 16


@pytest.mark.parametrize("window", [None, 6])
def test_decode_allocation_takes_a_block_only_at_a_block_edge(window: int | None) -> None:
    """A decode step's allocation of a request whose last block still has room takes nothing and frees nothing
    (the manager answers it without its full path where no group has a window); the step that crosses a block's
    end takes exactly one block; in a sliding-window layout the blocks the window left are freed at every step.
    All or nothing: a pool without a free block refuses the crossing step and changes nothing."""
    from kv8.cache.layout import KVCacheLayout

    kv = KVCacheManager(KVCacheLayout.build([window]), [4], block_size=4, enable_prefix_caching=False)
    r = req("a", list(range(5)))
    assert kv.allocate_slots(r, 5)
    held = kv.block_ids("a")
    assert held == ((0, 1),)
    r.num_computed_tokens = 5
    for pos in range(5, 16):   # one new token at a time, positions 5..15
        before = kv.num_free_blocks
        assert kv.allocate_slots(r, 1)
        table = kv.block_ids("a")[0]
        assert len(table) == pos // 4 + 1
        if window is None:
            assert table[:len(held[0])] == held[0] and before - kv.num_free_blocks == (pos % 4 == 0)
        else:   # blocks wholly before the window of position pos are freed
            first = max(pos - window + 1, 0) // 4
            assert all(b == -1 for b in table[:first]) and all(b != -1 for b in table[first:])
        held = kv.block_ids("a")
        r.num_computed_tokens = pos + 1
        kv.check_integrity()
    free = kv.num_free_blocks   # another request takes them: the next edge cannot be crossed
    assert kv.allocate_slots(req("b", list(range(4 * free))), 4 * free) and kv.num_free_blocks == 0
    assert not kv.allocate_slots(r, 1) and kv.block_ids("a") == held
    kv.check_integrity()
