"""Keys and values stored in different formats (``kv_cache_dtype="KFORMAT/VFORMAT"``, alias ``k8v4``): the names,
each side's bytes equal to the one-format codec of its format (so every single-format oracle covers the pair), the
cache's tensors and sizes, the options' checks, and the engine on tiny models (the fused CPU attention gives the
reference attention's tokens across chunked prefill, prefix caching and preemption; a plan; sliding windows).
Transformers with each side rounded by its own format is the oracle of tests/models/test_model_vs_hf.py; the fused CPU
and Triton kernels' pair paths are tested in tests/kernels, TP=2 in tests/distributed."""

from __future__ import annotations

import json

import pytest
import torch

from kv8 import SamplingParams
from kv8.cache.budget import KVBudget
from kv8.cache.codec import K, KVCodec, V
from kv8.cache.config import CacheConfig
from kv8.cache.paged_cache import CacheShape, PagedKVCache
from kv8.cache.plan import KVSpec
from kv8.quant.formats import (
    kv_cache_dtype_name,
    resolve_kv_cache_dtype,
    resolve_kv_cache_dtypes,
    split_kv_cache_dtype,
)
from kv8.quant.key_offsets import KeyOffsets
from kv8.quant.scales import KVScales
from tests.helpers.engine import (
    PROMPTS,
    assert_greedy_match,
    assert_tokens_on_every_engine_path,
    check_all_blocks_free,
    make_llm,
)

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
F32 = torch.float32
#: pairs over every kind of side: integer codes with token scales, group scales in the row, FP8, 16/32-bit
PAIRS = ["int8/int4_g32", "int8/int4", "fp8/int4_per_group32", "bfloat16/int8", "int4_g32/int8", "fp8_e5m2/fp4",
         "float32/fp8_e4m3"]


def _fmt(name: str):
    return resolve_kv_cache_dtype(name, F32)


def test_pair_names_resolve_each_side_and_collapse_when_equal() -> None:
    assert split_kv_cache_dtype("k8v4") == ("int8_per_token_head", "int4_per_group32")
    assert split_kv_cache_dtype("int8") is None and split_kv_cache_dtype("int8/int4") == ("int8", "int4")
    k, v = resolve_kv_cache_dtypes("k8v4", torch.bfloat16)
    assert (k.name, v.name) == ("int8_per_token_head", "int4_per_group32")
    assert kv_cache_dtype_name(k, v) == "int8_per_token_head/int4_per_group32"
    assert resolve_kv_cache_dtypes("int8/int8_per_token_head", F32) == (k, k)
    assert kv_cache_dtype_name(k, k) == "int8_per_token_head"
    assert resolve_kv_cache_dtypes("auto", torch.bfloat16)[1].name == "bfloat16"
    for bad, message in (("int8/", "a K/V pair is written KFORMAT/VFORMAT"),
                         ("auto/int8", "a K/V pair is written KFORMAT/VFORMAT"),
                         ("fp8/int3", "kv_cache_dtype='fp8/int3', its V format: kv_cache_dtype='int3' is not"),
                         ("a/b/c", "'a/b/c': a K/V pair")):
        with pytest.raises(ValueError, match=message):
            resolve_kv_cache_dtypes(bad, F32)


@pytest.mark.parametrize("pair", PAIRS)
@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_each_side_stores_the_bytes_of_its_own_format(pair: str, rotation: str) -> None:
    """Encode, decode and round trip of each side are bit for bit those of a one-format codec of that side's format
    (FP8 and int sides with dynamic scales), and the cache's tensors have each side's width and dtype."""
    k_fmt, v_fmt = resolve_kv_cache_dtypes(pair, F32)
    codec = KVCodec.build(k_fmt, 64, rotation=rotation, v_dtype=v_fmt)
    assert codec.is_pair and codec.name == f"{k_fmt.name}/{v_fmt.name}" and codec.scales is None
    gen = torch.Generator().manual_seed(3)
    shape = CacheShape(2, 4, 2, 8, 64)
    cache = PagedKVCache(shape, codec)
    slots = torch.randperm(32, generator=gen)
    key, value = (torch.randn(32, 2, 64, generator=gen) * 3 for _ in range(2))
    cache.store(1, key, value, slots)
    for which, fmt, x in ((K, k_fmt, key), (V, v_fmt, value)):
        one = KVCodec.build(fmt, 64, rotation=rotation,
                            scale_mode="dynamic" if fmt.is_quantized and not fmt.group_scales else "static")
        assert codec.dtype_of(which) == fmt and codec.dynamic_of(which) == one.dynamic
        want, want_ts = one.encode(x, 1, which)
        got, got_ts = codec.encode(x, 1, which)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        assert (got_ts is None) == (want_ts is None) and (got_ts is None or torch.equal(got_ts, want_ts))
        codes = cache.k_data if which == K else cache.v_data
        assert codes.dtype == fmt.storage_dtype and codes.shape == (2, 4, 2, 8, fmt.stored_width(64))
        scales = cache.k_token_scales if which == K else cache.v_token_scales
        assert (scales is None) == (want_ts is None)
        back = codec.round_trip(x, 1, which)
        assert torch.equal(back[0], one.round_trip(x, 1, which)[0]) and back[1] == one.round_trip(x, 1, which)[1]
    k, v = cache.gather(1, torch.arange(4), 32, F32)
    for which, got in ((K, k), (V, v)):
        x = key if which == K else value
        want = codec.round_trip(x, 1, which)[0]
        assert torch.equal(got[slots], want)
    token_bytes = KVSpec.of(k_fmt, rotation, "static", v_fmt).token_bytes(64, 2)
    assert cache.nbytes == token_bytes * 2 * 4 * 8                    # layers x blocks x block size


def test_k8v4_sizes_and_description() -> None:
    """k8v4 at head_dim 64: int8 keys (64 bytes + a 4-byte scale) and int4_per_group32 values (32 code bytes + two
    float16 scales): 104 bytes per KV head and token against fp8's 128 and int8's 136."""
    spec = KVSpec.of(*resolve_kv_cache_dtypes("k8v4", F32)[:1], "none", "static", _fmt("int4_g32"))
    assert spec.name == "int8_per_token_head/int4_per_group32" and spec.dynamic and not spec.static_fp8
    assert spec.token_bytes(64, 1) == 68 + 36
    assert KVSpec.of(_fmt("fp8"), v_dtype=_fmt("fp8")) == KVSpec.of(_fmt("fp8"))     # one format, one spec
    assert KVSpec.of(_fmt("bfloat16"), v_dtype=_fmt("int4_g32")).token_bytes(64, 1) == 128 + 36
    codec = KVCodec.build(_fmt("int8"), 64, rotation="hadamard", v_dtype=_fmt("int4_g32"))
    assert codec.describe() == ("K int8_per_token_head (dynamic per token and head); V int4_per_group32 (float16 per "
                                "group of 32); rotation hadamard")
    budget = KVBudget.build(_cache("k8v4"), [None] * 3, head_dim=64, kv_heads=2, max_model_len=256,
                            max_num_batched_tokens=256)
    assert budget.token_bytes == (2 * 104,)                        # per layer: 2 KV heads


def _cache(kv: str, **kw) -> CacheConfig:
    return CacheConfig(kv_dtype=resolve_kv_cache_dtypes(kv, torch.bfloat16)[0], kv_cache_dtype=kv, **kw)


def test_options_of_a_pair() -> None:
    cache = _cache("k8v4")
    assert cache.is_pair and cache.v_dtype.name == "int4_per_group32" and cache.dynamic_scales
    assert cache.default_spec.v_dtype == cache.v_dtype
    assert not _cache("int8/int8").is_pair and _cache("int8/int8").default_spec == _cache("int8").default_spec
    assert not _cache("bfloat16/int4_g32").dynamic_scales
    assert _cache("fp8/int4", kv_cache_scale_mode="dynamic").dynamic_scales
    assert _cache("bfloat16/int8", kv_cache_dtype_skip_layers=(1,)).kv_cache_dtype_skip_layers == (1,)
    with pytest.raises(ValueError, match="kv_cache_scale_mode='dynamic' applies to FP8 formats, but kv_cache_dtype="
                                         "'k8v4' .* has no FP8 side"):
        _cache("k8v4", kv_cache_scale_mode="dynamic")
    with pytest.raises(ValueError, match="quantization_param_path='s.json' has no key offsets"):
        _cache("fp8/int4", quantization_param_path="s.json")
    with pytest.raises(ValueError, match="quantizes neither side"):
        _cache("bfloat16/float32", kv_cache_dtype_skip_layers=(0,))
    with pytest.raises(ValueError, match="kv_dtype='fp8_e4m3' is not the keys' format of kv_cache_dtype='k8v4'"):
        CacheConfig(kv_dtype=_fmt("fp8"), kv_cache_dtype="k8v4")


def test_codec_of_a_pair_refuses_static_scales_and_checks_each_sides_head_dim() -> None:
    with pytest.raises(ValueError, match="static scales .* cannot be combined with a K/V pair"):
        KVCodec.build(_fmt("fp8"), 64, scales=KVScales.default(2), v_dtype=_fmt("int8"))
    with pytest.raises(ValueError, match="int4_per_group32.*multiple of 32"):
        KVCodec.build(_fmt("int8"), 48, v_dtype=_fmt("int4_g32"))
    with pytest.raises(ValueError, match="int4_per_token_head' packs two values per byte"):
        KVCodec.build(_fmt("int4"), 33, v_dtype=_fmt("bfloat16"))
    offsets = KeyOffsets(torch.zeros(2, 2, 64), "test")
    centered = KVCodec.build(_fmt("int8"), 64, key_offsets=offsets, v_dtype=_fmt("int4_g32"))
    assert centered.key_offsets is offsets and centered.values_dtype.name == "int4_per_group32"


def test_engine_with_a_pair_keeps_its_tokens_across_chunks_prefix_hits_and_preemption(d32_models) -> None:
    path = d32_models["llama_gqa"]
    alone = make_llm(path, kv_cache_dtype="k8v4", attention_backend="reference", enable_prefix_caching=False)
    assert alone.engine.caches[0].codec.name == "int8_per_token_head/int4_per_group32"
    expected = [alone.generate(p, GREEDY)[0].outputs[0] for p in PROMPTS]
    one_format = make_llm(path, kv_cache_dtype="int8", attention_backend="reference", enable_prefix_caching=False)
    int8_values = one_format.generate(PROMPTS[0], GREEDY)[0].outputs[0]
    assert int8_values.logprobs != expected[0].logprobs            # the values' format is used
    assert_tokens_on_every_engine_path(path, expected, GREEDY, kv_cache_dtype="int8/int4_g32",
                                       attention_backend="cpu_fused")


def test_a_plan_naming_a_pair_gives_the_tokens_of_the_same_formats_set_by_hand(d32_models, tmp_path) -> None:
    """Layer 1 stored as k8v4 by a plan (layer 0 in fp8) and the plan naming every layer: the tokens of the
    same formats given by kv_cache_dtype, and a sliding-window model frees its blocks with a pair."""
    path = d32_models["llama_gqa"]
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"kv8_kv_plan": 1, "layers": {"0": {"kv_cache_dtype": "k8v4"},
                                                              "1": {"kv_cache_dtype": "int8/int4_per_group32"}}}))
    by_plan = make_llm(path, kv_cache_dtype="fp8", kv_cache_plan=str(plan), attention_backend="reference")
    assert [s.name for s in by_plan.engine.config.kv_plan().used()] == ["int8_per_token_head/int4_per_group32"]
    by_hand = make_llm(path, kv_cache_dtype="k8v4", attention_backend="reference")
    assert_greedy_match([o.outputs[0] for o in by_plan.generate(PROMPTS, GREEDY)],
                        [o.outputs[0] for o in by_hand.generate(PROMPTS, GREEDY)])
    mixed = tmp_path / "mixed.json"
    mixed.write_text(json.dumps({"kv8_kv_plan": 1, "layers": {"1": {"kv_cache_dtype": "k8v4"}}}))
    llm = make_llm(path, kv_cache_dtype="fp8", kv_cache_plan=str(mixed), attention_backend="reference")
    assert [(s.name, s.dynamic) for s in llm.engine.config.kv_plan().specs] == [
        ("fp8_e4m3", False), ("int8_per_token_head/int4_per_group32", True)]
    assert [(c.k_data.dtype, c.v_data.shape[-1]) for c in llm.engine.caches] == [(torch.uint8, 32),
                                                                                  (torch.int8, 16 + 2)]
    llm.generate(PROMPTS, GREEDY)
    check_all_blocks_free(llm)
    swa = d32_models["mistral_swa"]
    alone = make_llm(swa, kv_cache_dtype="k8v4", enable_prefix_caching=False, attention_backend="reference",
                     disable_hybrid_kv_cache_manager=True)
    expected = [alone.generate(p, GREEDY)[0].outputs[0] for p in PROMPTS[:4]]
    freeing = make_llm(swa, kv_cache_dtype="k8v4", attention_backend="reference", enable_prefix_caching=True,
                       block_size=4, max_num_batched_tokens=16)
    assert_greedy_match([o.outputs[0] for o in freeing.generate(PROMPTS[:4], GREEDY)], expected)
    check_all_blocks_free(freeing)


def test_info_lists_k8v4_with_each_sides_bytes(tiny_models, capsys) -> None:
    from kv8.entrypoints.cli import main

    assert main(["info", tiny_models["qwen3"], "--kv-cache-memory", "1MiB"]) == 0   # 2 layers, 2 KV heads x 32
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()
            if line.startswith(("k8v4", "int8_per_token_head", "int4_per_group32"))}
    assert int(rows["k8v4"][0]) == 2 * 2 * ((32 + 4) + (16 + 2))       # layers x heads x (int8 K + int4_g32 V)
    assert int(rows["k8v4"][0]) * 2 == int(rows["int8_per_token_head"][0]) + int(rows["int4_per_group32"][0])
