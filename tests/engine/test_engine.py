"""End-to-end engine behaviour on a tiny random model, in every KV dtype.

Greedy output must not depend on how requests are batched, on prefix caching, or on preemption; after
every test all blocks are back in the pool.
"""

from __future__ import annotations

import pytest

from kv8 import SamplingParams
from tests.helpers.engine import KV_CONFIGS, PROMPTS, assert_greedy_match, check_all_blocks_free, make_llm, tokens_of
from tests.helpers.tiny_models import POISONED_TOKEN

KV_DTYPES = list(KV_CONFIGS)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_assert_greedy_match_allows_only_a_near_tie():
    from kv8.outputs import CompletionOutput, Logprob

    def out(tokens: list[int], lps: list[dict[int, float]]) -> CompletionOutput:
        return CompletionOutput(0, "", tokens, None, [{t: Logprob(x) for t, x in d.items()} for d in lps])

    same = {5: -0.1, 6: -3.0}
    tie = {7: -1.0, 8: -1.01}
    assert_greedy_match([out([5, 7, 1], [same, tie, {1: 0.0}])], [out([5, 8, 2], [same, tie, {2: 0.0}])])
    clear = {7: -0.2, 8: -2.0}
    with pytest.raises(AssertionError, match="no near-tie"):
        assert_greedy_match([out([5, 7], [same, clear])], [out([5, 8], [same, clear])])
    with pytest.raises(AssertionError):   # a token the other run does not list
        assert_greedy_match([out([5, 9], [same, {9: -1.0, 7: -1.0}])], [out([5, 8], [same, tie])])


@pytest.fixture(scope="module")
def reference_tokens(tiny_models):
    """Greedy tokens of each prompt run alone, float32 compute, per KV dtype, prefix caching off."""
    out = {}
    for kv in KV_DTYPES:
        llm = make_llm(tiny_models["llama_gqa"], **KV_CONFIGS[kv], enable_prefix_caching=False)
        out[kv] = [llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS]
        check_all_blocks_free(llm)
    return out


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_continuous_batching_equals_one_at_a_time(tiny_models, reference_tokens, kv):
    llm = make_llm(tiny_models["llama_gqa"], **KV_CONFIGS[kv], enable_prefix_caching=False,
                   max_num_batched_tokens=24, max_num_seqs=4)   # chunked prefill + staggered admission
    outs = llm.generate(PROMPTS, GREEDY)
    assert tokens_of(outs) == reference_tokens[kv]
    check_all_blocks_free(llm)


@pytest.mark.parametrize("kv", KV_DTYPES)
def test_prefix_caching_gives_identical_tokens(tiny_models, reference_tokens, kv):
    llm = make_llm(tiny_models["llama_gqa"], **KV_CONFIGS[kv], enable_prefix_caching=True, block_size=4)
    first = llm.generate(PROMPTS, GREEDY)
    again = llm.generate(PROMPTS, GREEDY)          # every prompt now hits cached blocks
    assert tokens_of(first) == reference_tokens[kv]
    assert tokens_of(again) == reference_tokens[kv]
    assert any(o.num_cached_tokens > 0 for o in again)
    assert llm.engine.kv_manager.prefix_cache_hit_rate() > 0
    check_all_blocks_free(llm)


@pytest.mark.parametrize("kv", KV_DTYPES)
@pytest.mark.parametrize("prefix_caching", [False, True])
def test_preemption_under_tiny_cache_gives_identical_tokens(tiny_models, reference_tokens, kv, prefix_caching):
    # 16 blocks of 4 tokens = 64 token slots for six sequences of ~30 tokens: preemption is certain.
    llm = make_llm(tiny_models["llama_gqa"], **KV_CONFIGS[kv], enable_prefix_caching=prefix_caching,
                   block_size=4, num_kv_blocks=16, max_model_len=64)
    outs = llm.generate(PROMPTS, GREEDY)
    assert llm.engine.scheduler.num_preemptions > 0
    assert tokens_of(outs) == reference_tokens[kv]
    check_all_blocks_free(llm)


def test_seeded_sampling_is_reproducible_regardless_of_batch(tiny_llama):
    llm = make_llm(tiny_llama)
    p = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate(PROMPTS[1], p)[0].outputs[0].token_ids
    others = SamplingParams(temperature=1.2, max_tokens=7, ignore_eos=True)
    batch = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], [others, p, others])
    assert batch[1].outputs[0].token_ids == alone
    other_seed = llm.generate(PROMPTS[1], SamplingParams(temperature=1.0, top_p=0.9, seed=99, max_tokens=10,
                                                         ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone
    check_all_blocks_free(llm)


def test_n_samples_stop_and_lengths(tiny_llama):
    llm = make_llm(tiny_llama)
    out = llm.generate(PROMPTS[0], SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1   # seeds seed+i differ
    # stop_token_ids: stop at the first greedy token.
    first = llm.generate(PROMPTS[1], GREEDY)[0].outputs[0]
    stopped = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12,
                                                      stop_token_ids=[first.token_ids[2]]))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == first.token_ids[2]
    assert stopped.token_ids == first.token_ids[:first.token_ids.index(first.token_ids[2]) + 1]
    # the stop token is in token_ids but adds no text, unless include_stop_str_in_output (vLLM's rule)
    tok = llm.get_tokenizer()
    assert stopped.text == tok.decode(stopped.token_ids[:-1])
    kept = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, include_stop_str_in_output=True,
                                                   stop_token_ids=[first.token_ids[2]]))[0].outputs[0]
    assert kept.token_ids == stopped.token_ids and kept.text == tok.decode(kept.token_ids)
    # EOS (forced by logit_bias after min_tokens) with skip_special_tokens=False: not in the text either
    eos = tok.eos_token_id
    for skip in (True, False):
        ended = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, min_tokens=2,
                                                        logit_bias={eos: 100.0}, skip_special_tokens=skip))[0]
        c = ended.outputs[0]
        assert c.finish_reason == "stop" and c.stop_reason is None and c.token_ids[-1] == eos
        assert len(c.token_ids) == 3 and c.text == tok.decode(c.token_ids[:-1]) and tok.eos_token not in c.text
    # stop string: text is cut before it, finish_reason stop.
    full = first.text
    stop = full[len(full) // 2:len(full) // 2 + 2]
    if stop and stop.strip():
        s_out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                        stop=[stop]))[0].outputs[0]
        assert s_out.finish_reason == "stop" and s_out.stop_reason == stop
        assert s_out.text == full[:full.index(stop)]
    check_all_blocks_free(llm)


def test_min_tokens_bans_stop_tokens_end_to_end(tiny_llama):
    """min_tokens masks the tokens that would stop the request in the sampled logits (they come out of the
    model in inference mode, so the mask must be applied there too) and the engine keeps serving after."""
    llm = make_llm(tiny_llama)
    first = llm.generate(PROMPTS[1], GREEDY)[0].outputs[0]
    stop_id = first.token_ids[0]
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=6, min_tokens=3,
                                                  stop_token_ids=[stop_id]))[0].outputs[0]
    assert stop_id not in out.token_ids[:3] and len(out.token_ids) >= 3
    sampled = llm.generate(PROMPTS[1], SamplingParams(temperature=1.0, seed=3, max_tokens=4, min_tokens=4))
    assert len(sampled[0].outputs[0].token_ids) == 4
    assert llm.generate(PROMPTS[1], GREEDY)[0].outputs[0].token_ids == first.token_ids
    check_all_blocks_free(llm)


def test_non_finite_logits_fail_that_request_alone(tiny_llama, nan_llama):
    """A NaN in one token's embedding makes the logits of every prompt holding that token NaN: those requests
    finish with finish_reason "error" and a message, the others in the same batch are unchanged, every block
    returns to the pool and the engine goes on serving."""
    clean_prompt, nan_prompt = [3, 4, 5, 6, 8, 9], [3, 4, POISONED_TOKEN, 6, 8, 9]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    expected = make_llm(tiny_llama).generate([clean_prompt], params)[0].outputs[0].token_ids
    llm = make_llm(nan_llama)
    failed, ok = llm.generate([nan_prompt, clean_prompt], params)
    assert failed.finished and failed.outputs[0].finish_reason == "error"
    assert "non-finite logits" in failed.outputs[0].error and failed.outputs[0].token_ids == []
    assert ok.outputs[0].finish_reason == "length" and ok.outputs[0].token_ids == expected
    check_all_blocks_free(llm)
    assert llm.generate([clean_prompt], params)[0].outputs[0].token_ids == expected


@pytest.mark.parametrize("params", [SamplingParams(temperature=0, max_tokens=5),
                                    SamplingParams(temperature=0.8, seed=1, max_tokens=5, logprobs=2,
                                                   prompt_logprobs=1)],
                         ids=["greedy", "random+logprobs"])
def test_a_lone_request_with_non_finite_logits_fails_and_the_engine_goes_on(tiny_llama, nan_llama, params):
    """The same request alone in its step: every sampling row fails, so the sampler gets an empty batch. It must
    fail that request only (finish_reason "error"), and the engine must serve the next request as usual."""
    clean_prompt, nan_prompt = [3, 4, 5, 6, 8, 9], [3, 4, POISONED_TOKEN, 6, 8, 9]
    expected = make_llm(tiny_llama).generate([clean_prompt], params)[0].outputs[0].token_ids
    llm = make_llm(nan_llama)
    failed = llm.generate([nan_prompt], params)[0].outputs[0]
    assert failed.finish_reason == "error" and "non-finite logits" in failed.error and failed.token_ids == []
    check_all_blocks_free(llm)
    assert llm.generate([clean_prompt], params)[0].outputs[0].token_ids == expected
    check_all_blocks_free(llm)


def test_logprobs_and_prompt_logprobs(tiny_llama):
    llm = make_llm(tiny_llama, max_num_batched_tokens=8)   # prompt logprobs across chunks
    out = llm.generate(PROMPTS[2], SamplingParams(temperature=0, max_tokens=4, logprobs=3, prompt_logprobs=2,
                                                  ignore_eos=True))[0]
    comp = out.outputs[0]
    assert len(comp.logprobs) == 4
    for tok, pos in zip(comp.token_ids, comp.logprobs):
        assert tok in pos and pos[tok].rank == 1          # greedy picks the top token
        assert len(pos) == 3
        vals = sorted((lp.logprob for lp in pos.values()), reverse=True)
        assert all(v <= 0 for v in vals)
    assert abs(comp.cumulative_logprob - sum(p[t].logprob for t, p in zip(comp.token_ids, comp.logprobs))) < 1e-5
    plp = out.prompt_logprobs
    assert len(plp) == len(out.prompt_token_ids) and plp[0] is None
    for tok, pos in zip(out.prompt_token_ids[1:], plp[1:]):
        assert tok in pos and len(pos) >= 2
    check_all_blocks_free(llm)


def test_one_token_prompt_has_prompt_logprobs_none(tiny_llama):
    out = make_llm(tiny_llama).generate([[5]], SamplingParams(max_tokens=2, prompt_logprobs=1))[0]
    assert out.prompt_logprobs == [None]


def test_prompt_logprobs_equal_decode_logprobs(tiny_llama):
    """Scoring a sequence as a prompt gives the logprobs it got while being generated."""
    llm = make_llm(tiny_llama)
    gen = llm.generate(PROMPTS[1], SamplingParams(temperature=0, max_tokens=5, logprobs=0, ignore_eos=True))[0]
    ids = gen.prompt_token_ids + gen.outputs[0].token_ids
    scored = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0].prompt_logprobs
    n = len(gen.prompt_token_ids)
    for i, tok in enumerate(gen.outputs[0].token_ids):
        assert abs(scored[n + i][tok].logprob - gen.outputs[0].logprobs[i][tok].logprob) < 1e-4
    check_all_blocks_free(llm)


def test_chat_uses_the_template(tiny_llama):
    llm = make_llm(tiny_llama)
    out = llm.chat([{"role": "user", "content": "hello"}], GREEDY)[0]
    tok = llm.get_tokenizer()
    assert tok.decode(out.prompt_token_ids) == "<s>user: hello</s><s>assistant:"
    check_all_blocks_free(llm)


def test_fp8_cache_holds_twice_the_tokens_of_bf16(tiny_llama):
    caps = {}
    for kv in ("bfloat16", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz"):
        llm = make_llm(tiny_llama, kv_cache_dtype=kv, kv_cache_memory="4MiB")
        caps[kv] = llm.engine.kv_manager.num_blocks
        assert llm.engine.cache.nbytes <= 4 * 1024 * 1024
    assert caps["fp8_e4m3"] == caps["fp8_e5m2"] == caps["fp8_e4m3fnuz"] == 2 * caps["bfloat16"]
    # Dynamic scales cost one float32 per token, head and K/V: 4 / head_dim (16 here) = 25% on this tiny model.
    dyn = make_llm(tiny_llama, kv_cache_dtype="fp8", kv_cache_scale_mode="dynamic", kv_cache_memory="4MiB")
    per_token = dyn.engine.config.kv_budget().bytes_per_token
    assert per_token == 2 * 2 * 4 * (16 + 4)
    assert dyn.engine.kv_manager.num_blocks == (4 * 1024 * 1024) // (per_token * 16)
    assert dyn.engine.cache.nbytes <= 4 * 1024 * 1024


def test_bad_inputs_raise_clear_errors(tiny_llama):
    with pytest.raises(ValueError, match=r"stop_token_ids contains \[10000000\], not token ids in \[0, "):
        make_llm(tiny_llama).generate([[3, 4]], SamplingParams(stop_token_ids=[10000000], min_tokens=1))
    with pytest.raises(ValueError, match="kv_cache_dtype='fp9'.*fp8_e4m3"):
        make_llm(tiny_llama, kv_cache_dtype="fp9")
    with pytest.raises(TypeError, match="unknown option.*swap_space"):
        make_llm(tiny_llama, swap_space=4)   # a vLLM option kv8 does not have
    with pytest.raises(ValueError, match=r"gpu_memory_utilization=1.5 must be a finite number in \(0, 1\]"):
        make_llm(tiny_llama, gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="kv_cache_memory='lots'"):
        make_llm(tiny_llama, kv_cache_memory="lots")
    with pytest.raises(ValueError, match="fewer than max_model_len"):
        make_llm(tiny_llama, num_kv_blocks=2, max_model_len=256)
    with pytest.raises(ValueError, match="quantization_param_path.*not an FP8"):
        make_llm(tiny_llama, kv_cache_dtype="bfloat16", quantization_param_path="x.json")
    with pytest.raises(ValueError, match="max_num_seqs=0"):
        make_llm(tiny_llama, max_num_seqs=0)
    with pytest.raises(ValueError, match="kv_cache_scale_mode='dynamic' needs an FP8 cache"):
        make_llm(tiny_llama, kv_cache_scale_mode="dynamic")
    with pytest.raises(ValueError, match="kv_cache_scale_mode='per-token'.*static, dynamic"):
        make_llm(tiny_llama, kv_cache_dtype="fp8", kv_cache_scale_mode="per-token")
    with pytest.raises(ValueError, match="kv_cache_rotation='random'.*none, hadamard"):
        make_llm(tiny_llama, kv_cache_rotation="random")
    with pytest.raises(ValueError, match="cannot be combined with quantization_param_path"):
        make_llm(tiny_llama, kv_cache_dtype="fp8", kv_cache_scale_mode="dynamic", quantization_param_path="x")
    llm = make_llm(tiny_llama, max_model_len=32)
    with pytest.raises(ValueError, match="prompt has .* tokens; with max_model_len=32"):
        llm.generate("word " * 40, GREEDY)
    with pytest.raises(ValueError, match="prompt is empty"):
        llm.generate("", GREEDY)
    with pytest.raises(ValueError, match="not token ids"):
        llm.generate([[1, 2, 10**6]], GREEDY)
    with pytest.raises(ValueError, match=r"logprobs must be <= the vocabulary size \d+, got 100000"):
        llm.generate(PROMPTS[1], SamplingParams(logprobs=100000))
    with pytest.raises(ValueError, match=r"prompt_logprobs must be <= the vocabulary size"):
        llm.generate(PROMPTS[1], SamplingParams(prompt_logprobs=100000))
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        llm.generate(PROMPTS[:3], [GREEDY, GREEDY])
    # The engine still serves after rejected requests, and nothing leaked.
    assert llm.generate(PROMPTS[1], GREEDY)[0].outputs[0].token_ids
    check_all_blocks_free(llm)


def test_abort_frees_blocks(tiny_llama):
    llm = make_llm(tiny_llama)
    eng = llm.engine
    eng.add_request(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True), request_id="a")
    eng.add_request(PROMPTS[1], SamplingParams(n=2, max_tokens=50, ignore_eos=True), request_id="b")
    eng.step()
    eng.step()
    assert eng.kv_manager.req_blocks
    assert eng.abort_request("a") and eng.abort_request("b")
    assert not eng.abort_request("a")
    check_all_blocks_free(llm)


def test_run_to_completion_returns_in_order_and_aborts_what_it_leaves(tiny_llama):
    """run_to_completion: the final outputs in the order asked, every output to the callback as it comes; a
    callback that raises (or an unknown id) leaves no request of the call in the engine."""
    llm = make_llm(tiny_llama)
    eng = llm.engine
    ids = [eng.add_request(PROMPTS[i], SamplingParams(max_tokens=3 + 2 * i, ignore_eos=True), request_id=f"r{i}")
           for i in range(3)]
    seen: list[tuple[str, int, bool]] = []
    outs = eng.run_to_completion(list(reversed(ids)),
                                 lambda o: seen.append((o.request_id, len(o.outputs[0].token_ids), o.finished)))
    assert [o.request_id for o in outs] == ["r2", "r1", "r0"]
    assert [len(o.outputs[0].token_ids) for o in outs] == [7, 5, 3]
    assert all(o.finished for o in outs) and seen[-1] == ("r2", 7, True)
    assert [n for rid, n, _ in seen if rid == "r0"] == [1, 2, 3]   # each step's output, in order
    with pytest.raises(ValueError, match="request ids not in flight: 'nope'"):
        eng.run_to_completion(["nope"])

    eng.add_request(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True), request_id="long")

    def fail(out):   # the callback raises at the first output
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        eng.run_to_completion(["long"], fail)
    assert not eng.has_unfinished_requests()
    check_all_blocks_free(llm)


def test_stats_report_the_steps_and_the_cache(tiny_llama):
    """EngineStats: prefilling until a prompt's first token, then decoding; the last step's prefill tokens and
    decode rows; the blocks in use and free."""
    llm = make_llm(tiny_llama)
    eng = llm.engine
    idle = eng.stats()
    assert (idle.num_running, idle.num_waiting, idle.num_prefilling, idle.last_step_prefill_tokens) == (0, 0, 0, 0)
    assert idle.num_free_blocks == idle.num_blocks and idle.kv_capacity_tokens == idle.num_blocks * idle.block_size
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    prompt = list(range(100, 130))   # 30 tokens
    eng.add_request(prompt, params, request_id="a")
    eng.add_request(prompt[:10], params, request_id="b")
    assert eng.stats().num_waiting == 2
    eng.step()
    s = eng.stats()
    assert s.num_running == 2 and s.num_prefilling == 0 and s.last_step_prefill_tokens == 40
    assert s.last_step_decode_tokens == 0 and s.num_free_blocks < s.num_blocks
    eng.step()
    s = eng.stats()
    assert (s.last_step_prefill_tokens, s.last_step_decode_tokens) == (0, 2)
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.stats().num_free_blocks == eng.stats().num_blocks and eng.stats().num_running == 0
    # a prompt longer than the step's token budget is prefilled in chunks: prefilling until its last chunk
    chunked = make_llm(tiny_llama, max_num_batched_tokens=16).engine
    chunked.add_request(prompt, params, request_id="c")
    chunked.step()
    s = chunked.stats()
    assert (s.num_running, s.num_prefilling, s.last_step_prefill_tokens) == (1, 1, 16)
    chunked.step()   # the last 14 prompt tokens, then its first token
    s = chunked.stats()
    assert (s.num_prefilling, s.last_step_prefill_tokens, s.last_step_decode_tokens) == (0, 14, 0)
