"""Sliding-window models end to end: out-of-window blocks are freed, and greedy output does not depend on
batching, prefix caching, preemption or the freeing itself, in every KV dtype; kv_cache_dtype_skip_layers.

Models: ``mistral_swa`` (every layer windowed, window 11) and ``qwen2_swa`` (layer 0 full, layer 1 window 7) from
tests/helpers/tiny_models.py; prompts of 20-40 tokens and 20 new tokens, so windows slide during prefill and decode.
Logits of both against transformers are checked in tests/models/test_model_vs_hf.py.
"""

from __future__ import annotations

import pytest

from kv8 import SamplingParams
from tests.helpers.engine import KV_CONFIGS, PROMPTS, assert_greedy_match, check_all_blocks_free, make_llm, tokens_of

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
GREEDY_LP = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)  # for near-ties
PROMPTS = PROMPTS[:4]
KVS = ["float32", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "fp8_e4m3+dynamic", "fp8_e4m3+hadamard", "int8",
       "fp4_e2m1"]
MODELS = ["mistral_swa", "qwen2_swa"]


def alone_outputs(path: str, kv: str) -> list:
    """Greedy completions (with logprobs) of each prompt run alone, prefix caching off, every block kept."""
    llm = make_llm(path, **KV_CONFIGS[kv], enable_prefix_caching=False, disable_hybrid_kv_cache_manager=True)
    return [llm.generate(p, GREEDY_LP)[0].outputs[0] for p in PROMPTS]


def completions(outputs) -> list:
    return [o.outputs[0] for o in outputs]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("kv", [pytest.param(kv, marks=pytest.mark.slow) if "+" in kv else kv for kv in KVS])
def test_freeing_batching_prefix_caching_and_preemption_give_identical_tokens(tiny_models, model, kv):
    """Identical greedy tokens, up to a near-tie that batching's float rounding may swap (assert_greedy_match)."""
    expected = alone_outputs(tiny_models[model], kv)
    # continuous batching with chunked prefill, out-of-window blocks freed
    llm = make_llm(tiny_models[model], **KV_CONFIGS[kv], enable_prefix_caching=False, max_num_batched_tokens=16,
                   block_size=4)
    assert_greedy_match(completions(llm.generate(PROMPTS, GREEDY_LP)), expected)
    check_all_blocks_free(llm)
    # prefix caching: the second pass hits cached blocks (only the window's blocks are needed)
    llm = make_llm(tiny_models[model], **KV_CONFIGS[kv], enable_prefix_caching=True, block_size=4)
    first, again = llm.generate(PROMPTS, GREEDY_LP), llm.generate(PROMPTS, GREEDY_LP)
    assert_greedy_match(completions(first), expected)
    assert_greedy_match(completions(again), expected)
    assert any(o.num_cached_tokens > 0 for o in again)
    check_all_blocks_free(llm)
    # A tiny cache, prefix caching on. qwen2_swa: one sequence of 72 tokens needs 25 blocks (18 of the full layer,
    # 7 of the sliding one), four growing sequences far more than 30: preemption is certain. mistral_swa: a
    # sequence needs at most 8 (its window and a chunk of 16) and does not grow in decode, so the admission
    # watermark alone keeps 12 blocks enough, without preempting.
    llm = make_llm(tiny_models[model], **KV_CONFIGS[kv], enable_prefix_caching=True, block_size=4,
                   num_kv_blocks=12 if model == "mistral_swa" else 30, max_model_len=72, max_num_batched_tokens=16)
    assert_greedy_match(completions(llm.generate(PROMPTS, GREEDY_LP)), expected)
    assert (llm.engine.scheduler.num_preemptions > 0) == (model == "qwen2_swa")
    check_all_blocks_free(llm)


@pytest.mark.parametrize("model", MODELS)
def test_sliding_groups_hold_at_most_the_window_in_decode(tiny_models, model):
    llm = make_llm(tiny_models[model], kv_cache_dtype="fp8", block_size=4, max_num_batched_tokens=16)
    engine, kv = llm.engine, llm.engine.kv_manager
    engine.add_request(PROMPTS[2], SamplingParams(temperature=0.0, max_tokens=80, ignore_eos=True), "r")
    worst = {g.group_id: 0 for g in kv.groups}
    while engine.has_unfinished_requests():
        engine.step()
        req = engine.scheduler.running[0] if engine.scheduler.running else None
        if req is None or req.num_output_tokens < 2:   # prefill chunks may hold window + chunk
            continue
        for g in kv.groups:
            worst[g.group_id] = max(worst[g.group_id], kv.num_held_blocks("r", g.group_id))
    for g in kv.groups:
        if g.sliding_window is not None:
            assert 0 < worst[g.group_id] <= -(-g.sliding_window // 4) + 1, (g, worst)
        else:
            assert worst[g.group_id] > 20   # a full group keeps every block (~100 tokens / 4)
    check_all_blocks_free(llm)


def test_skip_layers_keep_named_layers_in_the_compute_dtype(tiny_models):
    path = tiny_models["qwen2_swa"]
    auto = make_llm(path, enable_prefix_caching=False)
    expected = tokens_of(auto.generate(PROMPTS, GREEDY))
    # every layer skipped: an "FP8" cache that stores nothing in FP8 gives the 32-bit cache's tokens exactly
    all_skipped = make_llm(path, kv_cache_dtype="fp8", kv_cache_dtype_skip_layers="0,1", enable_prefix_caching=False)
    assert tokens_of(all_skipped.generate(PROMPTS, GREEDY)) == expected
    # the sliding layer in float32, the full one in FP8: two pools, each layer where it belongs
    llm = make_llm(path, kv_cache_dtype="fp8", kv_cache_dtype_skip_layers=["sliding_window"])
    caches = llm.engine.caches
    assert [c.kv_dtype.name for c in caches] == ["fp8_e4m3", "float32"]
    assert [sorted(c.slots) for c in caches] == [[0], [1]]
    outs = llm.generate(PROMPTS, GREEDY)
    assert all(len(t) == 20 for t in tokens_of(outs))
    check_all_blocks_free(llm)
    with pytest.raises(ValueError, match="kv_cache_dtype_skip_layers has layer 5, but the model has 2 layers"):
        make_llm(path, kv_cache_dtype="fp8", kv_cache_dtype_skip_layers="5")
    with pytest.raises(ValueError, match="'sliding_window', but this model has no sliding attention layers"):
        make_llm(tiny_models["llama"], kv_cache_dtype="fp8", kv_cache_dtype_skip_layers="sliding_window")
    with pytest.raises(ValueError, match="kv_cache_dtype_skip_layers entry 'everything' must be"):
        make_llm(path, kv_cache_dtype="fp8", kv_cache_dtype_skip_layers="everything")
    with pytest.raises(ValueError, match="kv_cache_dtype='auto' .the float32 compute dtype. is not an FP8 format"):
        make_llm(path, kv_cache_dtype_skip_layers="0")


def test_info_reports_capacity_with_and_without_freeing(tiny_models, capsys):
    from kv8.entrypoints.cli import main

    # mistral_swa: 2 layers of window 11, 2 KV heads x head_dim 16, context 512; 1 MiB in blocks of 16 tokens
    assert main(["info", tiny_models["mistral_swa"], "--kv-cache-memory", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert "2 sliding window (11 tokens)" in out and "sequences of L = 512 tokens" in out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines()
            if line.startswith(("bfloat16", "fp8", "int", "fp4"))}
    # per layer: K and V, heads, bytes (the integer caches: codes plus a float32 scale per token and head)
    per_token = {"bfloat16": 2 * 2 * 16 * 2, "fp8_e4m3": 2 * 2 * 16, "int8_per_token_head": 2 * 2 * (16 + 4),
                 "int4_per_token_head": 2 * 2 * (8 + 4), "fp4_e2m1": 2 * 2 * (8 + 1)}   # FP4: an E4M3 scale per 16
    for name, b in per_token.items():
        full_b, window_b, keep_all, seqs, seqs_freed = map(int, rows[name][:5])
        assert (full_b, window_b) == (0, 2 * b)
        assert keep_all == (1 << 20) // (2 * b * 16) * 16
        assert seqs == (1 << 20) // (2 * b * 16) // 32                 # 32 blocks of 16 per layer at L = 512
        assert seqs_freed == (1 << 20) // (2 * b * 16) // 2             # the window needs 2 blocks per layer
    assert rows["fp8_e4m3"][5:] == ["2.00", "32.00"]   # x bf16 (both freed), x bf16 keeping every block
    assert "int4_per_group32" not in rows   # head_dim 16 holds no group of 32
