"""Key scaling (:mod:`kv8.quant.key_scaling`): the codec scales keys and queries exactly inversely (GQA groups
included), the engine gives a 32-bit cache's outputs on every path with factors far from 1, a quantized cache's
score error drops where the queries ignore a channel the keys fill, the factors come from the calibration
statistics, and what cannot use them refuses the file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kv8 import LLM
from kv8.cache.codec import K, KVCodec
from kv8.cache.config import CacheConfig
from kv8.cache.scale_sources import engine_key_scaling
from kv8.entrypoints.cli import main
from kv8.quant.formats import resolve_kv_cache_dtype
from kv8.quant.key_offsets import KeyOffsets
from kv8.quant.key_scaling import KeyScaling, key_scales_from_moments
from kv8.quant.rotation import hadamard
from kv8.quant.scale_files import write_kv8_scales_json
from kv8.quant.scales import KVScales, ModelScaleInfo
from kv8.tools.kv_stats import KeyMeanCollector
from tests.helpers.engine import tokens_and_logprobs
from tests.helpers.scales import model_scale_info
from tests.helpers.tiny_models import make_tiny_model

PROMPTS = ["the quick brown fox jumps over the lazy dog and then the dog sleeps in the sun",
           "London is the capital of England and Paris is the capital of France"]
F32 = resolve_kv_cache_dtype("float32", torch.float32)


def _factors(model: ModelScaleInfo, seed: int = 0, spread: float = 3.0) -> torch.Tensor:
    """Factors between e^-spread and e^spread (up to ~20x either way), different per layer, head and channel."""
    g = torch.Generator().manual_seed(seed)
    return torch.exp(spread * (2 * torch.rand(model.num_layers, model.num_kv_heads, model.head_dim, generator=g) - 1))


def _scaled_file(path: Path, model: ModelScaleInfo, s: torch.Tensor, c: torch.Tensor | None = None) -> str:
    c = torch.zeros_like(s) if c is None else c
    write_kv8_scales_json(path, KVScales.default(model.num_layers), model, KeyOffsets(c, "test"),
                          KeyScaling(s, "test"))
    return str(path)


def _llm(path: str, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "4MiB")
    return LLM(path, dtype="float32", max_model_len=256, **kw)


def _run(llm: LLM) -> tuple[list[list[int]], torch.Tensor]:
    return tokens_and_logprobs(llm, PROMPTS)


# ---- the codec ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_codec_scales_keys_and_divides_each_gqa_groups_queries(rotation: str) -> None:
    info = ModelScaleInfo("llama", 3, 2, 8)
    c, s = torch.randn(3, 2, 8), _factors(info)
    codec = KVCodec.build(F32, 8, rotation=rotation, key_offsets=KeyOffsets(c, "test"),
                          key_scaling=KeyScaling(s, "test"))
    r = hadamard(8) if rotation == "hadamard" else torch.eye(8)
    k, q = torch.randn(5, 2, 8), torch.randn(5, 6, 8)          # 3 query heads per KV head
    stored, queries = codec.keys_to_stored(k, 1), codec.queries_to_stored(q, 1)
    torch.testing.assert_close(stored, ((k - c[1]) * s[1]) @ r)
    torch.testing.assert_close(queries, (q / s[1].repeat_interleave(3, dim=0)) @ r)
    # every score is the centered one: q . (k - c), query head h reading KV head h // 3
    scores = torch.einsum("thd,shd->hts", queries, stored.repeat_interleave(3, dim=1))
    exact = torch.einsum("thd,shd->hts", q, (k - c[1]).repeat_interleave(3, dim=1))
    torch.testing.assert_close(scores, exact, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(codec.keys_from_stored(stored, 1), k, rtol=1e-4, atol=1e-4)
    assert "key scaling on (test)" in codec.describe()
    plain = KVCodec.build(F32, 8, rotation=rotation, key_offsets=KeyOffsets(c, "test"))
    assert torch.equal(plain.queries_to_stored(q, 1), plain.to_stored_basis(q, K))


def test_codec_refuses_factors_it_cannot_apply() -> None:
    c, s = KeyOffsets(torch.zeros(2, 1, 8), "test"), KeyScaling(torch.ones(2, 1, 8), "test")
    with pytest.raises(ValueError, match="comes only with key offsets"):
        KVCodec.build(F32, 8, key_scaling=s)
    with pytest.raises(ValueError, match=r"k_channel_scale from test has shape \[2, 1, 8\], k_offset \[2, 2, 8\]"):
        KVCodec.build(F32, 8, key_offsets=KeyOffsets(torch.zeros(2, 2, 8), "test"), key_scaling=s)
    fp8 = resolve_kv_cache_dtype("fp8_e4m3", torch.float32)
    with pytest.raises(ValueError, match="a static-scale FP8 cache cannot scale keys"):
        KVCodec.build(fp8, 8, scales=KVScales.default(2), key_offsets=c, key_scaling=s)
    assert KVCodec.build(fp8, 8, scale_mode="dynamic", key_offsets=c, key_scaling=s).key_scaling is s


def test_factors_move_rounding_out_of_a_channel_the_queries_ignore() -> None:
    """Centered keys N(0, 1) with one channel of spread 20 that the queries (N(0, 1) elsewhere) barely read -- what
    Gemma's keys do (docs/accuracy.md): with the calibrated factors the int4-per-group-32 scores' error drops, with
    and without the rotation."""
    g = torch.Generator().manual_seed(0)
    t, h, d = 256, 1, 64
    k = torch.randn(t, h, d, generator=g)
    k[..., 5] *= 20.0
    q = torch.randn(64, h, d, generator=g)
    q[..., 5] *= 0.01
    s = key_scales_from_moments(q.pow(2).mean(0, keepdim=True), k.pow(2).mean(0, keepdim=True))
    assert float(s[0, 0, 5]) < 0.1 < float(s[0, 0].exp().mean().log())   # the loud, ignored channel shrinks
    kv_dtype = resolve_kv_cache_dtype("int4_per_group32", torch.float32)
    offsets = KeyOffsets(torch.zeros(1, h, d), "test")
    for rotation in ("none", "hadamard"):
        errors = []
        for scaling in (None, KeyScaling(s, "test")):
            codec = KVCodec.build(kv_dtype, d, rotation=rotation, key_offsets=offsets, key_scaling=scaling)
            back, _ = codec.round_trip(codec.keys_to_stored(k, 0), 0, 0)
            qs = codec.queries_to_stored(q, 0)
            err = torch.einsum("qhd,thd->hqt", qs, back) - torch.einsum("qhd,thd->hqt", q, k)
            errors.append(float(err.pow(2).mean()))
        assert errors[1] < 0.5 * errors[0], (rotation, errors)


def test_factors_from_the_collectors_moments() -> None:
    """KeyMeanCollector pools each KV head's query heads and centers the keys' second moment by their mean."""
    g = torch.Generator().manual_seed(0)
    col = KeyMeanCollector(2, 2, 4, queries=True)
    keys = [torch.randn(7, 2, 4, generator=g) * 3 + 5 for _ in range(2)]
    queries = [torch.randn(7, 6, 4, generator=g) for _ in range(2)]
    for k, q in zip(keys, queries):
        col.observe(1, k, q)
        col.observe(0, k[:3], q[:3])
    k, q = torch.cat(keys).double(), torch.cat(queries).double()
    q2 = q.view(-1, 2, 3, 4).pow(2).mean(dim=(0, 2))
    k2 = (k - k.mean(0)).pow(2).mean(0)
    want = (q2 / k2) ** 0.25
    want = want / want.log().mean(-1, keepdim=True).exp()
    got = col.scaling("test").s
    torch.testing.assert_close(got[1], want.float(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got.log().mean(-1), torch.zeros(2, 2), atol=1e-5, rtol=0)   # geometric mean 1
    with pytest.raises(ValueError, match="key scaling needs query statistics"):
        KeyMeanCollector(1, 1, 4).scaling("test")


def test_dead_channels_get_finite_factors() -> None:
    q2, k2 = torch.ones(1, 1, 4), torch.tensor([[[1.0, 0.0, 1.0, 1.0]]])
    s = key_scales_from_moments(q2, k2)
    assert bool((torch.isfinite(s) & (s > 0)).all()) and float(s[0, 0, 1]) > float(s[0, 0, 0])
    s = key_scales_from_moments(torch.zeros(1, 1, 4), torch.zeros(1, 1, 4))
    torch.testing.assert_close(s, torch.ones(1, 1, 4))


# ---- the engine: exact with a 32-bit cache -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("ks_qwen2")), "qwen2")


@pytest.mark.parametrize("backend,rotation", [("reference", "none"), ("reference", "hadamard"),
                                              ("cpu_fused", "hadamard"), ("triton", "none")])
def test_scaling_is_exact_with_a_float32_cache_on_every_path(qwen2: str, tmp_path: Path, backend: str,
                                                            rotation: str) -> None:
    """Factors up to ~20x either way, chunked prefill (8 tokens a step), prefix-cache hits (blocks of 4), GQA: the
    outputs equal the plain engine's within float32 rounding."""
    info = model_scale_info(qwen2)
    path = _scaled_file(tmp_path / "scaled.json", info, _factors(info), 0.5 * torch.randn(
        info.num_layers, info.num_kv_heads, info.head_dim))
    kw = dict(kv_cache_dtype="float32", attention_backend=backend, max_num_batched_tokens=8, block_size=4,
              kv_cache_rotation=rotation)
    ref_tokens, ref_lps = _run(_llm(qwen2, **kw))
    llm = _llm(qwen2, quantization_param_path=path, **kw)
    assert llm.engine.cache.codec.key_scaling is not None
    tokens, lps = _run(llm)
    assert llm.engine.stats().prefix_cache_hit_rate > 0
    assert tokens == ref_tokens
    torch.testing.assert_close(lps, ref_lps, atol=2e-4, rtol=1e-4)


def test_scaling_is_exact_with_sliding_windows(tmp_path: Path) -> None:
    """Gemma 3's local layers (window 16) and the global one, one KV head for several query heads."""
    gemma3 = make_tiny_model(str(tmp_path / "gemma3"), "gemma3")
    info = model_scale_info(gemma3)
    path = _scaled_file(tmp_path / "scaled.json", info, _factors(info))
    kw = dict(kv_cache_dtype="float32", max_num_batched_tokens=8, block_size=4)
    ref_tokens, ref_lps = _run(_llm(gemma3, **kw))
    tokens, lps = _run(_llm(gemma3, quantization_param_path=path, **kw))
    assert tokens == ref_tokens
    torch.testing.assert_close(lps, ref_lps, atol=2e-4, rtol=1e-4)


# ---- options: which caches may scale -----------------------------------------------------------------------------
def test_a_static_fp8_cache_refuses_a_file_with_factors(qwen2: str, tmp_path: Path) -> None:
    info = model_scale_info(qwen2)
    path = _scaled_file(tmp_path / "scaled.json", info, _factors(info))
    with pytest.raises(ValueError, match=r"has key scaling's factors \(k_channel_scale\).*static-scale FP8"):
        _llm(qwen2, kv_cache_dtype="fp8_e4m3", quantization_param_path=path)
    llm = _llm(qwen2, kv_cache_dtype="fp8_e4m3", kv_cache_scale_mode="dynamic", quantization_param_path=path)
    assert llm.engine.cache.codec.key_scaling is not None
    assert CacheConfig(kv_dtype=resolve_kv_cache_dtype("int4_per_group32", torch.float32),
                       kv_cache_dtype="int4_per_group32", quantization_param_path=path).key_scaling


def test_factors_are_cut_to_each_tensor_parallel_ranks_kv_heads(tmp_path: Path) -> None:
    info = ModelScaleInfo("llama", 2, 4, 8)
    s = _factors(info)
    path = _scaled_file(tmp_path / "s.json", info, s)
    cache = CacheConfig(kv_dtype=resolve_kv_cache_dtype("int8", torch.float32), kv_cache_dtype="int8",
                        quantization_param_path=path)
    for rank in range(2):
        got = engine_key_scaling(cache, info, (2 * rank, 2))
        assert got is not None and torch.equal(got.s, s[:, 2 * rank:2 * rank + 2])
    replicated = engine_key_scaling(cache, info, (3, 1))
    assert replicated is not None and torch.equal(replicated.s, s[:, 3:4])
    with pytest.raises(ValueError, match="KV heads 3..4 are not within the 4 heads of k_channel_scale"):
        KeyScaling(s, "test").heads(3, 2)


def test_info_and_the_startup_line_say_key_scaling_is_on(qwen2: str, tmp_path: Path,
                                                         capsys: pytest.CaptureFixture[str],
                                                         caplog: pytest.LogCaptureFixture) -> None:
    info = model_scale_info(qwen2)
    path = _scaled_file(tmp_path / "s.json", info, _factors(info))
    assert main(["info", qwen2, "--kv-cache-memory", "1MiB", "--quantization-param-path", path]) == 0
    assert "key scaling on: centered keys times its factors" in capsys.readouterr().out
    with caplog.at_level("INFO", logger="kv8"):
        _llm(qwen2, kv_cache_dtype="int4", quantization_param_path=path)
    assert any(f"key scaling on (quantization_param_path {path})" in r.getMessage() for r in caplog.records)
