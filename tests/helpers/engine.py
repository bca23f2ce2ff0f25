"""For end-to-end engine tests on tiny models (the engine's and the sliding-window models'): KV cache forms, prompts,
an offline LLM, and what must hold after every run."""

from __future__ import annotations

import torch

from kv8 import LLM, SamplingParams

#: every KV cache form the engine tests cover: the options of each, by name
KV_CONFIGS = {
    "float32": dict(kv_cache_dtype="float32"),
    "bfloat16": dict(kv_cache_dtype="bfloat16"),
    "fp8_e4m3": dict(kv_cache_dtype="fp8_e4m3"),
    "fp8_e4m3fnuz": dict(kv_cache_dtype="fp8_e4m3fnuz"),
    "fp8_e5m2": dict(kv_cache_dtype="fp8_e5m2"),
    "fp8_e4m3+dynamic": dict(kv_cache_dtype="fp8_e4m3", kv_cache_scale_mode="dynamic"),
    "fp8_e4m3+hadamard": dict(kv_cache_dtype="fp8_e4m3", kv_cache_rotation="hadamard"),
    "fp8_e5m2+dynamic+hadamard": dict(kv_cache_dtype="fp8_e5m2", kv_cache_scale_mode="dynamic",
                                      kv_cache_rotation="hadamard"),
    "int8": dict(kv_cache_dtype="int8"),
    "int8_per_token_head+hadamard": dict(kv_cache_dtype="int8_per_token_head", kv_cache_rotation="hadamard"),
    "int4+hadamard": dict(kv_cache_dtype="int4", kv_cache_rotation="hadamard"),
    "fp4_e2m1": dict(kv_cache_dtype="fp4_e2m1"),
}
#: prompts of different lengths, two sharing a prefix (prefix caching has something to find)
PROMPTS = [
    "The quick brown fox jumps over the lazy dog. London is",
    "Paris is the capital of",
    "Once upon a time there was a little model that stored its cache in eight bits. It",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 100",
    "The quick brown fox jumps over the lazy dog. Berlin is the capital of Germany, and",
    "Punctuation",
]


def check_all_blocks_free(llm: LLM) -> None:
    """Every block is back in the pool and the engine has nothing left to run (its cache manager checked)."""
    kv = llm.engine.kv_manager
    kv.check_integrity()
    assert not kv.req_blocks, f"requests still hold blocks: {list(kv.req_blocks)}"
    assert kv.num_free_blocks == kv.num_blocks
    assert not llm.engine.scheduler.has_unfinished() and not llm.engine.has_unfinished_requests()


def make_llm(path: str, **kw) -> LLM:
    """An offline LLM for a tiny model: float32, 256 tokens of context, an 8 MiB cache unless ``kw`` says otherwise."""
    kw.setdefault("dtype", "float32")
    kw.setdefault("max_model_len", 256)
    if "num_kv_blocks" not in kw:
        kw.setdefault("kv_cache_memory", "8MiB")
    return LLM(model=path, **kw)


def tokens_of(outputs) -> list[list[int]]:
    """The token ids of each request's first completion."""
    return [o.outputs[0].token_ids for o in outputs]


#: how close (in nats) two tokens' logprobs must be for :func:`assert_greedy_match` to let them swap
NEAR_TIE = 0.05


def assert_greedy_match(got: list, expected: list, tol: float = NEAR_TIE) -> None:
    """Greedy completions (``CompletionOutput``, sampled with ``logprobs >= 2``) are equal, except that one may
    leave the other at a near-tie: at the first differing position each run must have both tokens among its
    logprobs, within ``tol`` nats of each other. Float rounding that differs between batch shapes can swap such
    a pair (an FP8 rounding boundary amplifies it); a wrong cache or mask diverges at a clear winner and fails.
    Tokens after a near-tie divergence are not compared (the contexts differ)."""
    assert len(got) == len(expected)
    for i, (g, e) in enumerate(zip(got, expected)):
        assert len(g.token_ids) == len(e.token_ids), f"sequence {i}: {g.token_ids} vs {e.token_ids}"
        j = next((k for k, (a, b) in enumerate(zip(g.token_ids, e.token_ids)) if a != b), None)
        if j is None:
            continue
        a, b = g.token_ids[j], e.token_ids[j]
        for name, run in (("got", g), ("expected", e)):
            lp = run.logprobs[j]
            assert a in lp and b in lp and abs(lp[a].logprob - lp[b].logprob) <= tol, (
                f"sequence {i} differs at token {j} ({a} vs {b}) and it is no near-tie in {name}: "
                f"{ {t: round(x.logprob, 5) for t, x in lp.items()} }")


def tokens_and_logprobs(llm: LLM, prompts: list[str]) -> tuple[list[list[int]], torch.Tensor]:
    """Greedy tokens (6 each) and prompt-token logprobs of ``prompts``, then the greedy tokens and their logprobs of a
    prompt extending the first (its blocks from the prefix cache: a request for prompt logprobs computes every token):
    what two engines that must compute the same attention are compared by."""
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=0, ignore_eos=True))
    lps = [pos[tid].logprob for o in outs if o.prompt_logprobs is not None
           for tid, pos in zip(o.prompt_token_ids[1:], o.prompt_logprobs[1:]) if pos is not None]
    outs += llm.generate([prompts[0] + " again and again"], SamplingParams(temperature=0, max_tokens=6, logprobs=1,
                                                                           ignore_eos=True))
    sampled = outs[-1].outputs[0]
    assert sampled.logprobs is not None
    lps += [pos[tid].logprob for tid, pos in zip(sampled.token_ids, sampled.logprobs)]
    return [list(o.outputs[0].token_ids) for o in outs], torch.tensor(lps)


#: the engine paths a cache format must give its tokens on: chunked prefill (16 tokens a step, blocks of 4),
#: prefix-cache hits, and preemption (24 blocks of 4 tokens for all of PROMPTS)
ENGINE_PATHS = (dict(enable_prefix_caching=False, max_num_batched_tokens=16, block_size=4),
                dict(enable_prefix_caching=True, block_size=4),
                dict(enable_prefix_caching=True, block_size=4, num_kv_blocks=24, max_model_len=64,
                     max_num_batched_tokens=16))


def assert_tokens_on_every_engine_path(path: str, expected: list, params: SamplingParams, **llm_kw) -> None:
    """PROMPTS through engines of ``llm_kw`` on each of :data:`ENGINE_PATHS` give ``expected`` (the outputs of
    one prompt at a time), the prefix cache hits on a second pass, the small cache preempts, and every block is
    free afterwards."""
    for kw in ENGINE_PATHS:
        llm = make_llm(path, **llm_kw, **kw)
        assert_greedy_match([o.outputs[0] for o in llm.generate(PROMPTS, params)], expected)
        if kw["enable_prefix_caching"] and "num_kv_blocks" not in kw:
            again = llm.generate(PROMPTS, params)
            assert_greedy_match([o.outputs[0] for o in again], expected)
            assert any(o.num_cached_tokens > 0 for o in again)
        if "num_kv_blocks" in kw:
            assert llm.engine.scheduler.num_preemptions > 0
        check_all_blocks_free(llm)
