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


def _seven_decoding_and_one_waiting(max_tokens: int):
    """A pool of 40 blocks of 4 tokens; 7 requests of 16 prompt tokens and ``max_tokens`` new ones prefilled (4 blocks
    each) with one token sampled, and an eighth such prompt waiting. Returns (scheduler, pool, running, waiting
    one) before the next schedule, in which each decode takes one more block (35 of 40 used, 5 free for the
    prompt's 4)."""
    from kv8.engine.config import SchedulerConfig
    from kv8.engine.scheduler import Scheduler

    kv = KVCacheManager.full_attention(num_blocks=40, block_size=4, enable_prefix_caching=False)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=16 + max_tokens), kv)

    def make(rid: str, first: int) -> Request:
        return Request(request_id=rid, prompt_token_ids=list(range(first, first + 16)),
                       sampling_params=SamplingParams(max_tokens=max_tokens), generator=torch.Generator(),
                       max_tokens=max_tokens, eos_token_ids=frozenset())

    running = [make(f"r{i}", 100 * i) for i in range(7)]
    for r in running:
        sched.add(r)
    assert len(sched.schedule().chunks) == 7
    for r in running:
        r.num_computed_tokens = 16
        r.append_output_token(1)
    last = make("last", 900)
    sched.add(last)
    return sched, kv, running, last


def test_a_request_near_its_last_token_reserves_only_the_blocks_it_can_fill():
    """Growth is kept back only up to a request's last possible token (prompt + max_tokens): in a pool sized for
    exactly the requests' final lengths, a running request with few tokens left must not keep the next prompt
    waiting (with a flat 64-token reserve per request, 8 prompts of 1,024 tokens with 32 new each ran 7 + 1)."""
    sched, kv, running, last = _seven_decoding_and_one_waiting(max_tokens=4)
    # the running requests can grow by 3 tokens each, all inside the blocks they hold: nothing to keep back (a flat
    # reserve of GROWTH_RESERVE_TOKENS per request, capped at a quarter of the pool, would keep 10 of the 5 free)
    out = sched.schedule()
    assert [c.request.request_id for c in out.chunks][-1] == "last" and not sched.waiting
    for r in running + [last]:
        sched.finish(r, r.status)
    kv.check_integrity()


def test_growth_is_still_kept_for_requests_with_many_tokens_left():
    """The same pool with requests that may still generate 64 tokens: the reserve keeps the last prompt waiting,
    as before (a request that will grow must not be preempted by one admitted into its room)."""
    sched, kv, running, last = _seven_decoding_and_one_waiting(max_tokens=64)
    out = sched.schedule()
    assert "last" not in [c.request.request_id for c in out.chunks] and list(sched.waiting) == [last]
    for r in running:
        sched.finish(r, r.status)
    kv.check_integrity()
