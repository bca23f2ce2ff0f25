"""The hybrid KV cache layout and the manager's sliding-window groups: grouping, freeing, prefix hits."""

from __future__ import annotations

import pytest
import torch

from kv8.cache.kv_cache_manager import NULL_BLOCK, KVCacheManager
from kv8.cache.layout import KVCacheLayout
from kv8.engine.request import Request
from kv8.sampling_params import SamplingParams

GEMMA_270M_WINDOWS = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]


def req(rid: str, tokens: list[int], **params) -> Request:
    return Request(request_id=rid, prompt_token_ids=tokens, sampling_params=SamplingParams(**params),
                   generator=torch.Generator(), max_tokens=10_000, eos_token_ids=frozenset())


def test_gemma_layout_groups_layers_in_threes_sharing_one_pool():
    layout = KVCacheLayout.build(GEMMA_270M_WINDOWS)
    assert len(layout.pools) == 1 and layout.pools[0].num_slots == 3
    assert [(g.layers, g.sliding_window) for g in layout.groups] == [
        ((5, 11, 17), None), ((0, 1, 2), 512), ((3, 4, 6), 512), ((7, 8, 9), 512), ((10, 12, 13), 512),
        ((14, 15, 16), 512)]
    # every layer in exactly one (group, slot)
    assert sorted((g, s) for g, s in zip(layout.layer_group, layout.layer_slot)) == sorted(
        (g.group_id, s) for g in layout.groups for s in range(len(g.layers)))
    # 8k context: the full group holds 512 blocks, each sliding group at most ceil(512 / 16) + 1 in decode
    assert layout.blocks_per_sequence(0, 8192, 16, chunk=1) == 512 + 5 * 33
    assert KVCacheLayout.build(GEMMA_270M_WINDOWS, hybrid=False).blocks_per_sequence(0, 8192, 16, 1) == 6 * 512


def test_layouts_of_uniform_models_and_skipped_layers():
    llama = KVCacheLayout.build([None] * 4)
    assert [(g.layers, g.sliding_window) for g in llama.groups] == [((0, 1, 2, 3), None)]
    mistral = KVCacheLayout.build([64] * 4)
    assert [(g.layers, g.sliding_window) for g in mistral.groups] == [((0, 1, 2, 3), 64)]
    # 7 sliding + 2 full: groups of 2 slots, the last sliding group has one layer (one slot unused)
    odd = KVCacheLayout.build([8, 8, 8, None, 8, 8, 8, None, 8])
    assert [g.layers for g in odd.groups] == [(3, 7), (0, 1), (2, 4), (5, 6), (8,)]
    skip = KVCacheLayout.build(GEMMA_270M_WINDOWS, [int(w is not None) for w in GEMMA_270M_WINDOWS])
    assert [(p.spec, p.layers, p.num_slots) for p in skip.pools] == [
        (0, (5, 11, 17), 3), (1, tuple(i for i in range(18) if (i + 1) % 6), 15)]
    assert [(g.pool, g.sliding_window) for g in skip.groups] == [(0, None), (1, 512)]


def _decode(kv: KVCacheManager, r: Request, steps: int) -> None:
    for _ in range(steps):
        assert kv.allocate_slots(r, 1)
        r.num_computed_tokens += 1
        kv.cache_computed_blocks(r)
        r.append_output_token(7)


@pytest.mark.parametrize("window,bs", [(8, 4), (6, 4), (5, 2), (16, 16), (3, 8)])
def test_sliding_groups_hold_only_their_window(window, bs):
    layout = KVCacheLayout.build([window, None, window, window])  # groups: full (1), sliding (1, 1, 1)
    kv = KVCacheManager(layout, [200], bs, enable_prefix_caching=True)
    r = req("a", list(range(23)))
    assert kv.allocate_slots(r, 23)
    r.num_computed_tokens = 23
    kv.cache_computed_blocks(r)
    r.append_output_token(5)
    _decode(kv, r, 40)
    limit = -(-window // bs) + 1
    for g in layout.groups:
        held = kv.num_held_blocks("a", g.group_id)
        table = kv.block_ids("a")[g.group_id]
        if g.sliding_window is None:
            assert held == len(table) == -(-r.num_tokens // bs)
        else:
            assert held <= limit, (g, held, limit)
            # what is held is exactly the blocks the window of the last allocated token reaches (blocks are
            # freed when the next allocation starts)
            first = max(r.num_computed_tokens - 1 - window + 1, 0) // bs
            assert all(b == NULL_BLOCK for b in table[:first]) and NULL_BLOCK not in table[first:]
    kv.check_integrity()
    kv.free(r)
    kv.check_integrity()
    assert kv.num_free_blocks == 200


def test_sliding_window_prefix_hits_need_only_the_window_blocks():
    bs, window = 4, 6
    layout = KVCacheLayout.build([window, window])
    kv = KVCacheManager(layout, [64], bs, enable_prefix_caching=True)
    prompt = list(range(100, 130))           # 30 tokens, 7 full blocks
    a = req("a", prompt)
    assert kv.allocate_slots(a, 30)
    a.num_computed_tokens = 30
    kv.cache_computed_blocks(a)
    kv.free(a)                                # cached, free, in the queue
    # The same prompt hits 7 blocks (28 tokens; the last token is always computed), but only the window of
    # token 28 (positions 23..28: blocks 5, 6) is needed: the rest of the table stays NULL, nothing is touched.
    b = req("b", prompt)
    hits, n = kv.get_computed_blocks(b)
    assert n == 28 and all(h[:5] == [NULL_BLOCK] * 5 and NULL_BLOCK not in h[5:] and len(h) == 7 for h in hits)
    free_before = kv.num_free_blocks
    assert kv.allocate_slots(b, 2, hits)
    assert all(t[:5] == (NULL_BLOCK,) * 5 for t in kv.block_ids("b"))
    assert free_before - kv.num_free_blocks == 2 + 1   # one group (both layers): 2 hit blocks + 1 new one
    kv.check_integrity()
    kv.free(b)
    assert kv.num_free_blocks == 64


def _hit_after_dropping(sliding_block_index: int) -> tuple[list[list[int]], int]:
    """Prefill 20 tokens (bs 2, window 4, one full and one sliding layer), drop one cached block of the sliding
    group, and look up the same prompt."""
    kv = KVCacheManager(KVCacheLayout.build([None, 4]), [64], 2, enable_prefix_caching=True)
    prompt = list(range(20))
    a = req("a", prompt)
    assert kv.allocate_slots(a, 20)
    a.num_computed_tokens = 20
    kv.cache_computed_blocks(a)
    block = kv.pools[0].blocks[kv.block_ids("a")[1][sliding_block_index]]
    del kv.pools[0].cached[block.block_hash]
    block.block_hash = None
    out = kv.get_computed_blocks(req("b", prompt))
    kv.free(a)
    kv.check_integrity()
    return out


def test_a_hit_stops_before_a_missing_window_block():
    # A hit of n tokens needs sliding blocks (n - 3) // 2 .. n / 2 - 1. The longest (n = 18: blocks 7, 8)
    # misses block 8, so the hit ends before it: n = 16 (blocks 6, 7), and the full group serves 8 blocks.
    hits, n = _hit_after_dropping(8)
    assert n == 16 and len(hits[0]) == 8
    assert hits[1][:6] == [NULL_BLOCK] * 6 and NULL_BLOCK not in hits[1][6:] and len(hits[1]) == 8
    # Block 6 missing does not matter to n = 18: its window starts at block 7.
    hits, n = _hit_after_dropping(6)
    assert n == 18 and hits[1][:7] == [NULL_BLOCK] * 7 and NULL_BLOCK not in hits[1][7:]


def test_a_pool_per_spec_in_spec_order_each_cut_by_its_own_kinds():
    """Four specs over Gemma-3-270M's 18 layers (spec 2 unused): one pool per used spec, ascending; within each
    pool its kinds cut into groups of the pool's fewest layers of a kind; every layer in one (pool, slot)."""
    specs = [0] * 18
    specs[0], specs[1] = 1, 3                      # a sliding layer each
    specs[5], specs[6], specs[7], specs[11] = 3, 3, 3, 3   # full 5 and 11, sliding 6 and 7
    layout = KVCacheLayout.build(GEMMA_270M_WINDOWS, specs)
    assert [(p.pool_id, p.spec, p.layers, p.num_slots) for p in layout.pools] == [
        (0, 0, (2, 3, 4, 8, 9, 10, 12, 13, 14, 15, 16, 17), 1), (1, 1, (0,), 1), (2, 3, (1, 5, 6, 7, 11), 2)]
    assert [(g.pool, g.layers, g.sliding_window) for g in layout.pool_groups(2)] == [
        (2, (5, 11), None), (2, (1, 6), 512), (2, (7,), 512)]
    assert [g.layers for g in layout.pool_groups(0)][:2] == [(17,), (2,)]   # full attention first, one slot each
    placed = {(layout.groups[layout.layer_group[i]].pool, layout.layer_slot[i], layout.layer_group[i])
              for i in range(18)}
    assert len(placed) == 18 and sorted(i for g in layout.groups for i in g.layers) == list(range(18))
    for p in layout.pools:
        assert all(len(g.layers) <= p.num_slots for g in layout.pool_groups(p.pool_id))
        assert {i for g in layout.pool_groups(p.pool_id) for i in g.layers} == set(p.layers)
        assert all(specs[i] == p.spec for i in p.layers)
    assert layout.describe(["fp8", "bf16", "unused", "int4"]).split("; ")[1] == "bf16 pool: 1 groups of 1 layers " \
        "(1 window-512)"
    with pytest.raises(ValueError, match="3 layer specs"):
        KVCacheLayout.build([None] * 4, [0, 0, 1])
