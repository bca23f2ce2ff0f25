"""Block pool and KV cache manager: exact block ids, reference counts, prefix hits and LRU eviction order."""

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


def test_pool_hands_out_blocks_in_order_and_frees_to_the_tail():
    pool = BlockPool(6, enable_prefix_caching=True)
    assert pool.get_new_blocks(3) == [0, 1, 2]
    assert pool.get_new_blocks(2) == [3, 4]
    pool.free_blocks([4, 1])          # 4 then 1 join the tail of the free queue (after 5)
    assert pool.get_new_blocks(3) == [1, 4, 5]   # the queue's first three, in ascending (address) order
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)
    with pytest.raises(RuntimeError):
        pool.free_blocks([5, 5])      # double free
    pool.check_integrity()


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
    kv.free(a)                                                    # freed tail first: queue 3, 2, 1, 0
    assert list(kv.pools[0]._free) == [3, 2, 1, 0]
    # A hit on a free cached block takes it out of the free queue (it counts against the free blocks).
    b = req("b", [1, 2, 3, 4, 9])
    hits, n = kv.get_computed_blocks(b)
    assert (hits, n) == ([[0, 1]], 4)
    assert kv.allocate_slots(b, 1, hits) and kv.block_ids("b") == ((0, 1, 3),)
    assert list(kv.pools[0]._free) == [2]
    kv.free(b)
    assert list(kv.pools[0]._free) == [2, 3, 1, 0]
    # New blocks evict from the front: 2 (uncached), then 3, then 1 (cached: its hash is dropped); 0 stays cached.
    # The blocks taken in one call come back in ascending id (address) order.
    c = req("c", [7] * 5)
    assert kv.allocate_slots(c, 5) and kv.block_ids("c") == ((1, 2, 3),)
    assert set(kv.pools[0].cached.values()) == {0}
    assert list(kv.pools[0]._free) == [0]
    kv.free(c)
    kv.check_integrity()


def test_chain_hash_names_the_whole_prefix():
    h1 = hash_block(None, [1, 2])
    assert hash_block(h1, [3, 4]) != hash_block(hash_block(None, [9, 9]), [3, 4])
    assert hash_block(None, [1, 2]) == h1 and len(h1) == 16


def test_scheduler_keeps_a_free_block_per_running_request_before_admitting():
    from kv8.config import SchedulerConfig
    from kv8.engine.scheduler import Scheduler

    kv = KVCacheManager.full_attention(num_blocks=5, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=20), kv)
    a, b = req("a", list(range(8))), req("b", list(range(50, 62)))
    assert kv.blocks_needed(a, 8) == [2] and kv.blocks_needed(b, 12) == [3]
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    # a takes 2 blocks; b needs 3 and 3 free blocks remain, but one is kept for a's growth: b waits.
    assert [c.request.request_id for c in out.chunks] == ["a"] and list(sched.waiting) == [b]
    assert kv.num_free_blocks == 3
    sched.finish(a, a.status)
    assert [c.request.request_id for c in sched.schedule().chunks] == ["b"]
    sched.finish(b, b.status)
    kv.check_integrity()
