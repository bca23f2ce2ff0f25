"""The scheduler (:mod:`kv8.engine.scheduler`) over a real KV cache manager: admission keeps a free block for each
running request's growth. Its stop rules, block tables and ``Scheduler.update`` are tested with the engine's other
model-free parts in test_engine_parts.py."""

from __future__ import annotations

import torch

from kv8.cache.kv_cache_manager import KVCacheManager
from kv8.engine.request import Request
from kv8.sampling_params import SamplingParams


def req(rid: str, tokens: list[int], **params) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(**params),
                   generator=torch.Generator(), max_tokens=16, eos_token_ids=frozenset())


def test_scheduler_keeps_a_free_block_per_running_request_before_admitting():
    from kv8.engine.config import SchedulerConfig
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
