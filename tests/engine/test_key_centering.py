"""Key centering (:mod:`kv8.quant.key_offsets`) through the engine: exact with an unquantized cache on every path
(chunked prefill, prefix-cache hits, sliding windows, the fused CPU kernels), less error with a quantized cache on
keys with a large constant channel, refused where softmax is not shift invariant, shown by ``kv8 info``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kv8 import LLM
from kv8.cache.codec import K, KVCodec, V
from kv8.cache.config import CacheConfig
from kv8.cache.scale_sources import engine_key_offsets
from kv8.entrypoints.cli import main
from kv8.quant.formats import resolve_kv_cache_dtype
from kv8.quant.key_offsets import KeyOffsets
from kv8.quant.rotation import hadamard
from kv8.quant.scale_files import write_kv8_scales_json
from kv8.quant.scales import KVScales, ModelScaleInfo
from tests.helpers.engine import tokens_and_logprobs
from tests.helpers.scales import model_scale_info
from tests.helpers.tiny_models import make_tiny_model

PROMPTS = ["the quick brown fox jumps over the lazy dog and then the dog sleeps in the sun",
           "London is the capital of England and Paris is the capital of France"]


def _offsets_file(path: Path, model: ModelScaleInfo, offsets: torch.Tensor) -> str:
    """A kv8 scales file (scale 1.0) with key offsets ``offsets`` ``[L, H, D]``."""
    write_kv8_scales_json(path, KVScales.default(model.num_layers), model, KeyOffsets(offsets, "test"))
    return str(path)


def _large_offsets(model: ModelScaleInfo, seed: int = 0) -> torch.Tensor:
    """Offsets far from the keys' mean (a few channels at 40): centering by them moves every key a lot, so a
    path that forgot to center some keys would change the outputs visibly."""
    g = torch.Generator().manual_seed(seed)
    c = torch.randn(model.num_layers, model.num_kv_heads, model.head_dim, generator=g)
    c[..., 1] += 40.0
    return c


def _llm(path: str, **kw) -> LLM:
    kw.setdefault("kv_cache_memory", "4MiB")
    return LLM(path, dtype="float32", max_model_len=256, **kw)


def _run(llm: LLM) -> tuple[list[list[int]], torch.Tensor]:
    return tokens_and_logprobs(llm, PROMPTS)


# ---- the codec: the one place keys are centered ------------------------------------------------------------------
@pytest.mark.parametrize("rotation", ["none", "hadamard"])
def test_codec_centers_keys_before_the_rotation(rotation: str) -> None:
    c = torch.randn(3, 2, 8)
    codec = KVCodec.build(resolve_kv_cache_dtype("float32", torch.float32), 8, rotation=rotation,
                          key_offsets=KeyOffsets(c, "test"))
    k = torch.randn(5, 2, 8)
    r = hadamard(8) if rotation == "hadamard" else torch.eye(8)
    torch.testing.assert_close(codec.keys_to_stored(k, 1), (k - c[1]) @ r)
    # undoing the rotation and adding the offset gives the uncentered key back
    torch.testing.assert_close(codec.keys_from_stored(codec.keys_to_stored(k, 1), 1), k)
    assert "key centering on (test)" in codec.describe()
    plain = KVCodec.build(resolve_kv_cache_dtype("float32", torch.float32), 8, rotation=rotation)
    assert torch.equal(plain.keys_to_stored(k, 1), plain.to_stored_basis(k, K))
    torch.testing.assert_close(plain.keys_from_stored(plain.keys_to_stored(k, 1), 1), k)
    with pytest.raises(ValueError, match="k_offset .* head_dim 8, the cache 16"):
        KVCodec.build(resolve_kv_cache_dtype("float32", torch.float32), 16, key_offsets=KeyOffsets(c, "test"))


@pytest.mark.parametrize("dtype,rotation", [("int4", "none"), ("int4", "hadamard"), ("int8", "none"),
                                            ("int8", "hadamard"), ("fp4_e2m1", "none"),
                                            ("int4_per_group32", "none"), ("int4_per_group32", "hadamard")])
def test_a_constant_large_key_channel_costs_less_attention_error_when_centered(dtype: str, rotation: str) -> None:
    """Keys N(0, 1) with one channel near 30 (what Gemma's keys keep): quantized with evenly spaced integer levels
    per token and head (FP4: E2M1 levels per group of 16; int4_per_group32: per group of 32), the other channels lose
    their levels to it; centered by
    the mean, the attention output error drops (scores of one query shift by a constant, which softmax ignores).
    (FP8's levels are relative to each value, so a large channel costs the others little: dynamic E4M3 measured
    the same error either way.)"""
    g = torch.Generator().manual_seed(0)
    t, h, d = 256, 2, 64
    k = torch.randn(t, h, d, generator=g)
    k[..., 5] += 30.0 + 0.1 * torch.randn(t, h, generator=g)
    v = torch.randn(t, h, d, generator=g)
    q = torch.randn(16, h, d, generator=g) * 0.3
    c = k.mean(dim=0, keepdim=True)                                     # [1, H, D]
    kv_dtype = resolve_kv_cache_dtype(dtype, torch.float32)
    errors = []
    for offsets in (None, KeyOffsets(c, "test")):
        codec = KVCodec.build(kv_dtype, d, rotation=rotation, key_offsets=offsets,
                              scale_mode="dynamic" if kv_dtype.is_fp8 else "static")
        stored = codec.keys_to_stored(k, 0)
        back, _ = codec.round_trip(stored, 0, 0)
        vb, _ = codec.round_trip(codec.to_stored_basis(v, V), 0, V)
        qs = codec.to_stored_basis(q, K)

        def attend(keys: torch.Tensor, values: torch.Tensor, qq: torch.Tensor) -> torch.Tensor:
            p = torch.softmax(torch.einsum("qhd,thd->hqt", qq, keys) / d ** 0.5, dim=-1)
            return torch.einsum("hqt,thd->qhd", p, values)

        exact = attend(stored, codec.to_stored_basis(v, V), qs)
        got = attend(back, vb, qs)
        errors.append(float(((got - exact) ** 2).sum() / (exact ** 2).sum()))
    assert errors[1] < 0.9 * errors[0], errors


# ---- the engine: exact with an unquantized cache, on every path --------------------------------------------------
@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("kc_qwen2")), "qwen2")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("kc_gemma3")), "gemma3")


@pytest.mark.parametrize("backend", ["reference", "cpu_fused", "triton"])
def test_centering_is_exact_with_a_float32_cache_on_every_path(qwen2: str, tmp_path: Path, backend: str) -> None:
    """Chunked prefill (8 tokens a step), prefix-cache hits (blocks of 4), the reference, fused CPU and Triton
    (interpreted on the CPU) attention: with offsets of 40 on a channel, the outputs equal the uncentered engine's
    within float32 rounding."""
    info = model_scale_info(qwen2)
    path = _offsets_file(tmp_path / "offsets.json", info, _large_offsets(info))
    kw = dict(kv_cache_dtype="float32", attention_backend=backend, max_num_batched_tokens=8, block_size=4)
    ref_tokens, ref_lps = _run(_llm(qwen2, **kw))
    llm = _llm(qwen2, quantization_param_path=path, **kw)
    assert llm.engine.cache.codec.key_offsets is not None
    tokens, lps = _run(llm)
    assert llm.engine.stats().prefix_cache_hit_rate > 0
    assert tokens == ref_tokens
    torch.testing.assert_close(lps, ref_lps, atol=2e-4, rtol=1e-4)


def test_centering_is_exact_with_sliding_windows(gemma3: str, tmp_path: Path) -> None:
    """Gemma 3's local layers (window 16) and the global one, one KV head, chunked prefill."""
    info = model_scale_info(gemma3)
    path = _offsets_file(tmp_path / "offsets.json", info, _large_offsets(info))
    kw = dict(kv_cache_dtype="float32", max_num_batched_tokens=8, block_size=4)
    ref_tokens, ref_lps = _run(_llm(gemma3, **kw))
    tokens, lps = _run(_llm(gemma3, quantization_param_path=path, **kw))
    assert tokens == ref_tokens
    torch.testing.assert_close(lps, ref_lps, atol=2e-4, rtol=1e-4)


def test_centering_changes_a_bf16_cache_by_rounding_only(qwen2: str, tmp_path: Path) -> None:
    info = model_scale_info(qwen2)
    path = _offsets_file(tmp_path / "offsets.json", info, 0.5 * torch.randn(info.num_layers, info.num_kv_heads,
                                                                             info.head_dim))
    _, ref_lps = _run(_llm(qwen2, kv_cache_dtype="float32"))
    _, bf16 = _run(_llm(qwen2, kv_cache_dtype="bfloat16"))
    _, centered = _run(_llm(qwen2, kv_cache_dtype="bfloat16", quantization_param_path=path))
    rounding = float((bf16 - ref_lps).abs().max())
    assert float((centered - ref_lps).abs().max()) < max(4 * rounding, 1e-3)


# ---- the engine: a quantized cache --------------------------------------------------------------------------------
def _constant_channel_model(tmp_path_factory: pytest.TempPathFactory, **overrides) -> str:
    """The tiny Qwen2 (k_proj bias) with a k bias of 6 on the slowest-rotating RoPE pair of every KV head (channels
    D/2 - 1 and D - 1: over a few hundred positions they barely turn), so its keys keep a large near-constant
    channel, as Gemma-3-270M's do."""
    path = make_tiny_model(str(tmp_path_factory.mktemp("kc_const")), "qwen2", **overrides)
    weights = load_file(str(Path(path) / "model.safetensors"))
    info = model_scale_info(path)
    d = info.head_dim
    for layer in range(info.num_layers):
        bias = weights[f"model.layers.{layer}.self_attn.k_proj.bias"].view(info.num_kv_heads, d)
        bias[:, d // 2 - 1] = 6.0
        bias[:, d - 1] = 6.0
    save_file(weights, str(Path(path) / "model.safetensors"))
    return path


@pytest.fixture(scope="module")
def constant_channel(tmp_path_factory: pytest.TempPathFactory) -> str:
    """:func:`_constant_channel_model` at the tiny models' head_dim 16."""
    return _constant_channel_model(tmp_path_factory)


@pytest.fixture(scope="module")
def constant_channel_d32(tmp_path_factory: pytest.TempPathFactory) -> str:
    """:func:`_constant_channel_model` at head_dim 32 (int4_per_group32 stores whole groups of 32)."""
    return _constant_channel_model(tmp_path_factory, head_dim=32)


def _mean_keys(path: str, info: ModelScaleInfo) -> torch.Tensor:
    """The mean post-RoPE key of PROMPTS per layer, KV head and channel, from kv8 calibrate's collector."""
    from kv8.quant.formats import E4M3
    from kv8.quant.scales import ScaleGranularity
    from kv8.tools.calibrate import calibrate
    from kv8.tools.kv_stats import ScaleRecipe

    text = Path(path) / "calib.txt"
    text.write_text(" ".join(PROMPTS * 8))
    result = calibrate(path, [str(text)], ScaleRecipe(ScaleGranularity.TENSOR, "amax", E4M3), num_samples=2,
                       seq_len=32, dtype="float32", key_centering=True, show_progress=False)
    assert result.key_offsets is not None and list(result.key_offsets.k.shape) == [info.num_layers,
                                                                                     info.num_kv_heads,
                                                                                     info.head_dim]
    return result.key_offsets.k


@pytest.mark.parametrize("dtype,rotation", [("int4", "none"), ("int4", "hadamard"), ("int8", "none"),
                                            ("fp4_e2m1", "none"), ("int4_per_group32", "none")])
def test_calibrated_centering_lowers_a_quantized_caches_error(request: pytest.FixtureRequest, tmp_path: Path,
                                                             dtype: str, rotation: str) -> None:
    constant_channel = request.getfixturevalue("constant_channel_d32" if dtype == "int4_per_group32"
                                               else "constant_channel")
    info = model_scale_info(constant_channel)
    path = _offsets_file(tmp_path / "centered.json", info, _mean_keys(constant_channel, info))
    _, ref = _run(_llm(constant_channel, kv_cache_dtype="float32"))
    _, plain = _run(_llm(constant_channel, kv_cache_dtype=dtype, kv_cache_rotation=rotation))
    _, centered = _run(_llm(constant_channel, kv_cache_dtype=dtype, kv_cache_rotation=rotation,
                            quantization_param_path=path))
    err_plain, err_centered = float(((plain - ref) ** 2).mean()), float(((centered - ref) ** 2).mean())
    assert err_centered < err_plain, (err_centered, err_plain)


# ---- options: which files and models may center ------------------------------------------------------------------
def test_a_file_with_offsets_is_accepted_by_every_cache_format(qwen2: str, tmp_path: Path) -> None:
    info = model_scale_info(qwen2)
    with_offsets = _offsets_file(tmp_path / "c.json", info, torch.zeros(info.num_layers, info.num_kv_heads,
                                                                        info.head_dim))
    without = tmp_path / "s.json"
    write_kv8_scales_json(without, KVScales.default(info.num_layers), info)
    for dtype in ("int8", "int4", "fp4_e2m1", "int4_per_group32", "bfloat16"):
        kv = resolve_kv_cache_dtype(dtype, torch.float32)
        assert CacheConfig(kv_dtype=kv, kv_cache_dtype=dtype, quantization_param_path=with_offsets).key_centering
        with pytest.raises(ValueError, match="kv8 calibrate --key-centering"):
            CacheConfig(kv_dtype=kv, kv_cache_dtype=dtype, quantization_param_path=str(without))
    fp8 = resolve_kv_cache_dtype("fp8", torch.float32)
    assert CacheConfig(kv_dtype=fp8, kv_cache_scale_mode="dynamic", quantization_param_path=with_offsets).key_centering
    assert not CacheConfig(kv_dtype=fp8, quantization_param_path=str(without)).key_centering


def test_offsets_are_cut_to_each_tensor_parallel_ranks_kv_heads(tmp_path: Path) -> None:
    info = ModelScaleInfo("llama", 2, 4, 8)
    c = torch.arange(2 * 4 * 8, dtype=torch.float32).view(2, 4, 8)
    path = _offsets_file(tmp_path / "c.json", info, c)
    cache = CacheConfig(kv_dtype=resolve_kv_cache_dtype("int8", torch.float32), kv_cache_dtype="int8",
                        quantization_param_path=path)
    for rank in range(2):
        got = engine_key_offsets(cache, info, (2 * rank, 2))
        assert got is not None and torch.equal(got.k, c[:, 2 * rank:2 * rank + 2])
    whole = engine_key_offsets(cache, info)
    assert whole is not None and torch.equal(whole.k, c)
    replicated = engine_key_offsets(cache, info, (3, 1))   # a rank holding one (replicated) KV head
    assert replicated is not None and torch.equal(replicated.k, c[:, 3:4])


def test_soft_capping_refuses_key_centering(tmp_path: Path) -> None:
    path = make_tiny_model(str(tmp_path / "capped"), "llama", attn_logit_softcapping=30.0)
    info = model_scale_info(path)
    offsets = _offsets_file(tmp_path / "c.json", info, torch.zeros(info.num_layers, info.num_kv_heads,
                                                                    info.head_dim))
    with pytest.raises(ValueError, match=r"key offsets .* soft-caps its attention scores "
                                         r"\(attn_logit_softcapping=30\)"):
        _llm(path, kv_cache_dtype="int8", quantization_param_path=offsets)


def test_info_and_the_startup_line_say_key_centering_is_on(qwen2: str, tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    info = model_scale_info(qwen2)
    path = _offsets_file(tmp_path / "c.json", info, _large_offsets(info))
    assert main(["info", qwen2, "--kv-cache-memory", "1MiB", "--quantization-param-path", path]) == 0
    assert f"key centering on: keys minus the offsets of {path}" in capsys.readouterr().out
    with caplog.at_level("INFO", logger="kv8"):
        _llm(qwen2, kv_cache_dtype="int4", quantization_param_path=path)
    assert any(f"key centering on (quantization_param_path {path})" in r.getMessage() for r in caplog.records)
