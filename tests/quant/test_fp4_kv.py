"""The FP4 KV cache (``kv_cache_dtype="fp4_e2m1"``, aliases ``nvfp4`` / ``fp4``): E2M1 codes and E4M3 group scales
against ml_dtypes' ``float4_e2m1fn`` / ``float8_e4m3fn`` as the oracle (ties, saturation, zero / NaN / inf rows,
subnormal scales, head dims that are not a multiple of 16), the stored row (two codes per byte, then the scales),
the resolved dtype and its bytes, the codec and the options' checks, and which attention backends read it. The
engine's batching, prefix caching, preemption and sliding windows are in the engine tests (``KV_CONFIGS``), tensor
parallelism in tests/distributed/test_tensor_parallel.py, key centering in tests/engine/test_key_centering.py."""

from __future__ import annotations

import json
import math

import ml_dtypes
import numpy as np
import pytest
import torch

from kv8.cache.budget import KVBudget
from kv8.cache.codec import KVCodec
from kv8.cache.config import CacheConfig
from kv8.engine.args import EngineArgs
from kv8.loader.model import read_model_config
from kv8.quant.formats import KVCacheDtype, resolve_kv_cache_dtype
from kv8.quant.fp4 import E2M1_GRID, FP4_E2M1, FP4GroupFormat, pack_nibbles, unpack_nibbles
from kv8.quant.scales import KVScales

FP4_KV = resolve_kv_cache_dtype("fp4_e2m1", torch.bfloat16)


def e2m1_oracle(x: np.ndarray) -> np.ndarray:
    """ml_dtypes' E2M1 codes (round to nearest even, saturating) with NaN -> +0, as uint8 0..15."""
    return np.nan_to_num(x.astype(np.float32), nan=0.0).astype(ml_dtypes.float4_e2m1fn).view(np.uint8)


def row_oracle(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(E2M1 codes [..., D], E4M3 scale codes [..., G], decoded values float32 [..., D]) of rows ``x`` by the rule
    of :mod:`kv8.quant.fp4`, in numpy / ml_dtypes."""
    x = x.astype(np.float32)
    d = x.shape[-1]
    g = -(-d // 16)
    padded = np.zeros((*x.shape[:-1], g * 16), dtype=np.float32)
    padded[..., :d] = x
    groups = padded.reshape(*x.shape[:-1], g, 16)
    with np.errstate(invalid="ignore"):
        s = np.abs(groups).max(axis=-1) / np.float32(6)
    s = np.where(np.isfinite(s) & (s > 0), s, np.float32(1)).astype(np.float32)
    scale = np.clip(s, np.float32(2.0 ** -9), np.float32(448)).astype(ml_dtypes.float8_e4m3fn)
    sv = scale.astype(np.float32)[..., None]
    with np.errstate(invalid="ignore"):
        codes = e2m1_oracle(groups / sv)
    values = codes.view(ml_dtypes.float4_e2m1fn).astype(np.float32) * sv
    return (codes.reshape(*x.shape[:-1], -1)[..., :d], scale.view(np.uint8),
            values.reshape(*x.shape[:-1], -1)[..., :d])


def test_e2m1_codes_match_ml_dtypes_on_ties_specials_and_a_sweep() -> None:
    grid = np.array(E2M1_GRID, dtype=np.float32)
    mids = (grid[1:] + grid[:-1]) / 2                                          # every tie
    near = np.concatenate([np.nextafter(mids, np.float32(np.inf)), np.nextafter(mids, np.float32(-np.inf))])
    specials = np.array([0.0, -0.0, np.inf, -np.inf, 6.0, 7.0, 1e30, -1e30, 1e-40, -1e-40, 0.25, -0.25],
                        dtype=np.float32)
    sweep = np.random.default_rng(0).uniform(-9, 9, 100_000).astype(np.float32)
    for x in (mids, -mids, near, -near, specials, sweep, grid, -grid):
        got = FP4GroupFormat.encode_e2m1(torch.from_numpy(x)).numpy()
        np.testing.assert_array_equal(got, e2m1_oracle(x))
    assert FP4GroupFormat.encode_e2m1(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])).tolist() == \
        [0, 2, 2, 4, 4, 6, 6]                                                  # ties to the even code
    assert FP4GroupFormat.encode_e2m1(torch.tensor([math.nan, -math.nan])).tolist() == [0, 0]
    every = torch.arange(16, dtype=torch.uint8)
    np.testing.assert_array_equal(FP4GroupFormat.decode_e2m1(every).numpy(),
                                  every.numpy().view(ml_dtypes.float4_e2m1fn).astype(np.float32))


def test_two_codes_per_byte_low_nibble_first() -> None:
    codes = torch.arange(16, dtype=torch.uint8)
    assert pack_nibbles(codes).tolist() == [0x10, 0x32, 0x54, 0x76, 0x98, 0xBA, 0xDC, 0xFE]
    every = torch.cartesian_prod(codes, codes)                                   # all 256 pairs
    assert torch.equal(unpack_nibbles(pack_nibbles(every)), every)
    with pytest.raises(ValueError, match="even last dim"):
        pack_nibbles(torch.zeros(3, dtype=torch.uint8))
    with pytest.raises(ValueError, match="must be uint8"):
        unpack_nibbles(torch.zeros(2, dtype=torch.int8))


@pytest.mark.parametrize("head_dim", [64, 256, 6, 18, 40, 80])
def test_rows_match_the_oracle_codes_scales_and_values(head_dim: int) -> None:
    gen = torch.Generator().manual_seed(head_dim)
    x = torch.randn(30, 3, head_dim, generator=gen) * torch.exp(torch.randn(30, 3, 1, generator=gen) * 3)
    x[0, 0] = 0.0                                                                # an all-zero row
    x[0, 1] = 1e-5 * torch.randn(head_dim, generator=gen)                        # subnormal (clamped) scales
    x[0, 2] = 1e4 * torch.randn(head_dim, generator=gen)                         # beyond 6 * 448: saturates
    x[1, 0, :3] = torch.tensor([math.nan, math.inf, -2.6])                       # non-finite: scale 1.0
    x[1, 1, -1] = -math.inf
    x[2, 0, 1] = -0.0
    stored = FP4_E2M1.encode(x)
    g = -(-head_dim // 16)
    assert stored.dtype == torch.uint8 and stored.shape == (30, 3, head_dim // 2 + g)
    codes, scales = FP4_E2M1.split(stored, head_dim)
    want_codes, want_scales, want_values = row_oracle(x.numpy())
    np.testing.assert_array_equal(scales.numpy(), want_scales)
    np.testing.assert_array_equal(codes.numpy(), want_codes)
    assert torch.equal(stored[..., :head_dim // 2], pack_nibbles(codes))
    for dtype in (torch.float32, torch.bfloat16):
        back = FP4_E2M1.decode(stored, head_dim, dtype)
        assert back.dtype == dtype
        np.testing.assert_array_equal(back.float().numpy(), torch.from_numpy(want_values).to(dtype).float().numpy())
    back = FP4_E2M1.decode(stored, head_dim)
    assert int(back[0, 0].abs().max()) == 0
    assert float(FP4_E2M1.decode_scale(scales[0, 1]).min()) == 2.0 ** -9        # E4M3's smallest subnormal
    assert float(back[0, 2].abs().max()) == 6 * 448
    assert back[1, 0, :3].tolist() == [0.0, 6.0, -3.0] and float(back[1, 1, -1]) == -6.0
    finite = torch.isfinite(x).all(-1, keepdim=True) & (x.abs().amax(-1, keepdim=True) < 2688)
    step = FP4_E2M1.decode_scale(scales).repeat_interleave(16, -1)[..., :head_dim]   # the group's scale
    # within half the widest grid step (2 x scale, between 4 and 6) of every finite value saturated to +-6 x scale
    # (a group's largest value lands above 6 x scale where its scale rounded down, by up to half an E4M3 step, or,
    # for a subnormal scale, further)
    saturated = torch.minimum(x.abs(), 6 * step).copysign(x)
    assert bool(((back - saturated).abs() <= step * (1 + 1e-6)).where(finite, True).all())
    normal = finite & (FP4_E2M1.decode_scale(scales).amin(-1, keepdim=True) >= 2.0 ** -6)
    assert bool(((back - x).abs() <= 1.375 * step).where(normal, True).all())


def test_bad_inputs_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="floating-point"):
        FP4_E2M1.encode(torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="must be even"):
        FP4_E2M1.encode(torch.zeros(3, 7))
    with pytest.raises(ValueError, match=r"uint8 \[\.\.\., 36\] for head_dim 64"):
        FP4_E2M1.decode(torch.zeros(2, 32, dtype=torch.uint8), 64)
    with pytest.raises(ValueError, match="groups of 16"):
        FP4GroupFormat(group_size=32)


def test_names_resolve_to_one_dtype_with_group_scales_in_the_row() -> None:
    for name in ("fp4_e2m1", "nvfp4", "fp4"):
        assert resolve_kv_cache_dtype(name, torch.float32) == FP4_KV
    assert FP4_KV.name == "fp4_e2m1" and FP4_KV.storage_dtype == torch.uint8 and FP4_KV.group is FP4_E2M1
    assert FP4_KV.codes is FP4_E2M1 and FP4_KV.is_quantized and FP4_KV.group_scales
    assert not FP4_KV.per_token_scales and not FP4_KV.is_fp8 and FP4_KV.int_codes is None
    assert FP4_KV.bits_per_value == 4 and FP4_KV.bytes_per_element == 1
    assert FP4_KV.stored_width(64) == 32 + 4 and FP4_KV.stored_width(256) == 128 + 16
    assert FP4_KV.stored_width(40) == 20 + 3
    assert not resolve_kv_cache_dtype("int4", torch.float32).group_scales
    with pytest.raises(ValueError, match="group=None must be torch.uint8, None, None, e2m1"):
        KVCacheDtype("fp4_e2m1", torch.uint8, None)


def test_codec_stores_rows_without_other_scales() -> None:
    codec = KVCodec.build(FP4_KV, 64, rotation="hadamard")
    assert not codec.dynamic and codec.scales is None and not codec.packed
    assert codec.describe() == "scales: E4M3 per group of 16; rotation hadamard"
    for kw in ({"scale_mode": "dynamic"}, {"scales": KVScales.default(2)}):
        with pytest.raises(ValueError, match="fp4_e2m1.*neither dynamic per-token scales nor static scales"):
            KVCodec.build(FP4_KV, 64, **kw)
    with pytest.raises(ValueError, match="even head_dim, not 63"):
        KVCodec.build(FP4_KV, 63)
    assert KVCodec.bytes_per_head(FP4_KV, 64, dynamic=False) == 36          # 4.5 bits a value
    assert KVCodec.bytes_per_head(FP4_KV, 256, dynamic=False) == 144
    x = torch.randn(7, 2, 64, generator=torch.Generator().manual_seed(3))
    stored, ts = codec.encode(x, 0, 0)
    assert ts is None and torch.equal(stored, FP4_E2M1.encode(x))
    assert torch.equal(codec.decode(stored, 0, 1, torch.float32), FP4_E2M1.decode(stored, 64))
    back, clipped = codec.round_trip(x, 0, 0)
    assert clipped == 0 and 0 < float((back - x).norm() / x.norm()) < 0.15
    x[0, 0, 0] = 1e5                                                            # beyond 6 * 448
    assert codec.round_trip(x, 0, 0)[1] == 1


def _cache(kv: str, **kw) -> CacheConfig:
    return CacheConfig(kv_dtype=resolve_kv_cache_dtype(kv, torch.bfloat16), kv_cache_dtype=kv, **kw)


def test_options_refuse_other_scales_and_take_skip_layers() -> None:
    assert not _cache("fp4_e2m1").dynamic_scales
    assert _cache("nvfp4", kv_cache_dtype_skip_layers=(0,)).kv_cache_dtype_skip_layers == (0,)
    with pytest.raises(ValueError,
                       match=r"fp4_e2m1' stores a scale per group of 16 values \(E4M3\).*'dynamic' does not apply"):
        _cache("fp4_e2m1", kv_cache_scale_mode="dynamic")
    with pytest.raises(ValueError, match="quantization_param_path='scales.json' has no key offsets"):
        _cache("fp4_e2m1", quantization_param_path="scales.json")


def test_budget_counts_the_codes_and_the_group_scales() -> None:
    b = KVBudget.build(_cache("fp4_e2m1"), [None] * 4, head_dim=64, kv_heads=2, max_model_len=256,
                       max_num_batched_tokens=256)
    assert b.token_bytes == (2 * 2 * (32 + 4),)


def test_every_attention_backend_reads_it(tiny_models, monkeypatch) -> None:
    """The CPU backends and the triton backend (tests/engine/test_triton_engine.py runs it) take fp4_e2m1 caches."""
    path = tiny_models["llama_gqa"]

    def config(**kw):
        return EngineArgs(model=path, dtype="float32", **kw).create_engine_config(read_model_config("hf", path), "hf",
                                                                                   path)
    assert config(kv_cache_dtype="nvfp4", attention_backend="cpu_fused").cache.kv_dtype == FP4_KV
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton = config(kv_cache_dtype="fp4_e2m1", attention_backend="triton")
    assert triton.cache.kv_dtype == FP4_KV and triton.attention_backend == "triton"


def test_a_plan_with_an_fp4_layer_gives_the_reference_attentions_tokens(tiny_models, tmp_path) -> None:
    """A kv_cache_plan storing one layer in fp4_e2m1 (the rest FP8), prefix caching on: the fused CPU attention
    ('auto' on the CPU) gives the reference attention's greedy tokens."""
    from kv8 import SamplingParams
    from tests.helpers.engine import PROMPTS, assert_greedy_match, check_all_blocks_free, make_llm

    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"kv8_kv_plan": 1, "layers": {"0": {"kv_cache_dtype": "nvfp4"}}}))
    greedy = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=2)
    outs = []
    for backend in ("cpu_fused", "reference"):
        llm = make_llm(tiny_models["llama_gqa"], kv_cache_dtype="fp8", kv_cache_plan=str(plan),
                       attention_backend=backend, enable_prefix_caching=True, block_size=4)
        assert llm.engine.runner.backend.name == backend
        assert [p.kv_dtype.name for p in llm.engine.config.kv_plan().specs] == ["fp8_e4m3", "fp4_e2m1"]
        outs.append([o.outputs[0] for o in llm.generate(PROMPTS, greedy)])
        check_all_blocks_free(llm)
    assert_greedy_match(outs[0], outs[1])
