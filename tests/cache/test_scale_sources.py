"""Tests for kv8.cache.scale_sources: KV scales in checkpoint tensors, and resolve_kv_scales' precedence (the
quantization_param_path file, then the checkpoint, then 1.0) and conversion."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch

from kv8.cache.scale_sources import is_kv_scale_name, resolve_kv_scales, scales_from_checkpoint
from kv8.quant.formats import E4M3, E4M3FNUZ
from kv8.quant.scale_files import load_vllm_scales_json
from kv8.quant.scales import KVScales, ScaleGranularity
from tests.helpers.scales import (
    AUTO,
    FIXTURE,
    FP8_E4M3,
    FP8_E4M3FNUZ,
    FP8_E5M2,
    LLAMA2_7B,
    SMOLLM2,
    TINY,
    tensor_scales,
)


def _scalar(x: float, shape: tuple[int, ...] = ()) -> torch.Tensor:
    return torch.full(shape, x, dtype=torch.float32)


# --------------------------------------------------------------------------------------------------
# Checkpoint tensors
# --------------------------------------------------------------------------------------------------


def _ckpt(suffixes: dict[str, list[torch.Tensor]], num_layers: int = 3) -> dict[str, torch.Tensor]:
    """{suffix: per-layer tensors} -> checkpoint dict with some unrelated weights mixed in."""
    out: dict[str, torch.Tensor] = {"model.embed_tokens.weight": torch.zeros(4, 4)}
    for suffix, values in suffixes.items():
        assert len(values) == num_layers
        for i, t in enumerate(values):
            out[f"model.layers.{i}.self_attn.{suffix}"] = t
            out[f"model.layers.{i}.self_attn.k_proj.weight"] = torch.zeros(2, 2)
    return out


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.kv_scale",
        "model.layers.12.self_attn.k_scale",
        "model.layers.12.self_attn.v_scale",
        "model.layers.3.self_attn.k_proj.k_scale",
        "model.layers.3.self_attn.v_proj.v_scale",
        "model.layers.3.self_attn.k_proj.output_scale",
        "model.layers.3.self_attn.v_proj.output_scale",
    ],
)
def test_is_kv_scale_name_accepts(name: str) -> None:
    assert is_kv_scale_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "model.layers.0.self_attn.k_proj.weight",
        "model.layers.0.self_attn.k_proj.input_scale",
        "model.layers.0.self_attn.k_proj.weight_scale",
        "model.layers.0.self_attn.q_proj.output_scale",
        "model.layers.0.self_attn.k_proj.v_scale",
        "model.layers.0.self_attn.k_scale.extra",
        "model.layers.x.self_attn.k_scale",
        "layers.0.self_attn.k_scale",
        "model.layers.0.mlp.k_scale",
    ],
)
def test_is_kv_scale_name_rejects(name: str) -> None:
    assert not is_kv_scale_name(name)


def test_checkpoint_without_scales_is_none() -> None:
    assert scales_from_checkpoint({"model.embed_tokens.weight": torch.zeros(2)}, {}, TINY) is None


def test_checkpoint_kv_scale_legacy() -> None:
    ckpt = _ckpt({"kv_scale": [_scalar(0.5), _scalar(0.25, (1,)), _scalar(2.0)]})
    scales = scales_from_checkpoint(ckpt, {}, TINY)
    assert scales is not None
    assert scales.granularity is ScaleGranularity.TENSOR
    assert scales.k.flatten().tolist() == [0.5, 0.25, 2.0]
    assert torch.equal(scales.k, scales.v)
    assert "kv_scale" in scales.source and scales.source.startswith("checkpoint")


@pytest.mark.parametrize(
    ("k_suffix", "v_suffix"),
    [
        ("k_scale", "v_scale"),
        ("k_proj.k_scale", "v_proj.v_scale"),
        ("k_proj.output_scale", "v_proj.output_scale"),
    ],
)
def test_checkpoint_k_and_v_namings(k_suffix: str, v_suffix: str) -> None:
    ckpt = _ckpt(
        {
            k_suffix: [_scalar(0.5), _scalar(0.25), _scalar(1.0)],
            v_suffix: [_scalar(4.0), _scalar(2.0), _scalar(3.0)],
        }
    )
    scales = scales_from_checkpoint(ckpt, {}, TINY)
    assert scales is not None
    assert scales.k.flatten().tolist() == [0.5, 0.25, 1.0]
    assert scales.v.flatten().tolist() == [4.0, 2.0, 3.0]
    assert k_suffix in scales.source and v_suffix in scales.source


def test_checkpoint_k_v_win_over_kv_scale() -> None:
    ckpt = _ckpt(
        {
            "kv_scale": [_scalar(9.0)] * 3,
            "k_scale": [_scalar(0.5)] * 3,
            "v_scale": [_scalar(0.75)] * 3,
        }
    )
    scales = scales_from_checkpoint(ckpt, {}, TINY)
    assert scales is not None
    assert scales.k.flatten().tolist() == [0.5] * 3
    assert scales.v.flatten().tolist() == [0.75] * 3
    assert "kv_scale" not in scales.source


def test_checkpoint_lone_k_scale_is_an_error_even_with_kv_scale() -> None:
    ckpt = _ckpt({"kv_scale": [_scalar(1.0)] * 3, "k_scale": [_scalar(0.5)] * 3})
    with pytest.raises(ValueError, match=r"layer 0: checkpoint has a k scale .*k_scale\) but no v scale"):
        scales_from_checkpoint(ckpt, {}, TINY)


def test_checkpoint_two_spellings_same_value_ok_different_value_error() -> None:
    same = _ckpt({"k_scale": [_scalar(0.5)] * 3, "k_proj.k_scale": [_scalar(0.5)] * 3, "v_scale": [_scalar(1.0)] * 3})
    scales = scales_from_checkpoint(same, {}, TINY)
    assert scales is not None and scales.k.flatten().tolist() == [0.5] * 3
    differ = dict(same)
    differ["model.layers.1.self_attn.k_proj.k_scale"] = _scalar(0.7)
    with pytest.raises(ValueError, match=r"layer 1: checkpoint tensors .* both give the k scale but differ"):
        scales_from_checkpoint(differ, {}, TINY)


def test_checkpoint_per_head_vectors() -> None:
    k = [torch.tensor([0.5, 0.25]), torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])]
    v = [torch.tensor([5.0, 6.0]), torch.tensor([7.0, 8.0]), torch.tensor([9.0, 10.0])]
    scales = scales_from_checkpoint(_ckpt({"k_scale": k, "v_scale": v}), {}, TINY)
    assert scales is not None
    assert scales.granularity is ScaleGranularity.HEAD
    assert scales.k.shape == (3, 2, 1)
    assert torch.equal(scales.k[:, :, 0], torch.stack(k))
    assert torch.equal(scales.v[:, :, 0], torch.stack(v))
    k1, _ = scales.layer(1)
    assert (torch.ones(TINY.num_kv_heads, TINY.head_dim) * k1).shape == (2, 4)


def test_checkpoint_mixed_scalar_and_per_head_promotes_to_head() -> None:
    ckpt = _ckpt({"kv_scale": [_scalar(0.5), torch.tensor([1.0, 2.0]), _scalar(3.0, (1,))]})
    scales = scales_from_checkpoint(ckpt, {}, TINY)
    assert scales is not None
    assert scales.granularity is ScaleGranularity.HEAD
    assert scales.k[:, :, 0].tolist() == [[0.5, 0.5], [1.0, 2.0], [3.0, 3.0]]


def test_checkpoint_bf16_scales_converted_to_float32() -> None:
    ckpt = _ckpt({"kv_scale": [torch.tensor(0.5, dtype=torch.bfloat16)] * 3})
    scales = scales_from_checkpoint(ckpt, {}, TINY)
    assert scales is not None and scales.k.dtype == torch.float32 and scales.k.flatten().tolist() == [0.5] * 3


@pytest.mark.parametrize(
    ("tensor", "pattern"),
    [
        (torch.ones(3),
         r"model\.layers\.1\.self_attn\.kv_scale has shape \[3\]; allowed: \[\], \[1\] or \[num_kv_heads=2\]"),
        (torch.ones(1, 2), r"has shape \[1, 2\]"),
        (torch.ones(2, 1), r"has shape \[2, 1\]"),
        (torch.tensor(1, dtype=torch.int32), r"has dtype torch\.int32; KV scales must be floating point"),
        (_scalar(0.0), r"holds \[0\.0\]; KV scales must be finite and > 0"),
        (_scalar(-1.0), r"holds \[-1\.0\]"),
        (_scalar(float("nan")), r"holds \[nan\]"),
        (torch.tensor([1.0, float("inf")]), r"holds \[1\.0, inf\]"),
    ],
)
def test_checkpoint_bad_tensor(tensor: torch.Tensor, pattern: str) -> None:
    ckpt = _ckpt({"kv_scale": [_scalar(1.0), tensor, _scalar(1.0)]})
    with pytest.raises(ValueError, match=pattern):
        scales_from_checkpoint(ckpt, {}, TINY)


def test_checkpoint_missing_layers() -> None:
    ckpt = {"model.layers.1.self_attn.kv_scale": _scalar(1.0)}
    with pytest.raises(ValueError, match=r"not for layer\(s\) \[0, 2\]"):
        scales_from_checkpoint(ckpt, {}, TINY)


def test_checkpoint_layer_beyond_model() -> None:
    ckpt = _ckpt({"kv_scale": [_scalar(1.0)] * 3})
    ckpt["model.layers.7.self_attn.kv_scale"] = _scalar(1.0)
    with pytest.raises(ValueError, match=r"layer\(s\) \[7\] but the model has 3 layers"):
        scales_from_checkpoint(ckpt, {}, TINY)


@pytest.mark.parametrize(
    ("config", "made_for", "why"),
    [
        ({}, "fp8_e4m3", "assumed fp8_e4m3"),
        ({"kv_cache_torch_dtype": None}, "fp8_e4m3", "assumed fp8_e4m3"),
        ({"kv_cache_torch_dtype": "float8_e4m3fn"}, "fp8_e4m3", "kv_cache_torch_dtype=float8_e4m3fn"),
        ({"kv_cache_torch_dtype": "float8_e4m3fnuz"}, "fp8_e4m3fnuz", "kv_cache_torch_dtype=float8_e4m3fnuz"),
        (
            {"quantization_config": {"quant_method": "compressed-tensors",
                                     "kv_cache_scheme": {"type": "float", "num_bits": 8, "strategy": "tensor"}}},
            "fp8_e4m3",
            "kv_cache_scheme",
        ),
        ({"quantization_config": {"kv_cache_scheme": None}}, "fp8_e4m3", "assumed fp8_e4m3"),
        (
            {"kv_cache_torch_dtype": "float8_e4m3fn",
             "quantization_config": {"kv_cache_scheme": {"type": "float", "num_bits": 8}}},
            "fp8_e4m3",
            "kv_cache_torch_dtype",
        ),
    ],
)
def test_checkpoint_made_for_from_config(config: dict[str, Any], made_for: str, why: str) -> None:
    scales = scales_from_checkpoint(_ckpt({"kv_scale": [_scalar(1.0)] * 3}), config, TINY)
    assert scales is not None and scales.made_for == made_for
    assert why in scales.source


@pytest.mark.parametrize(
    ("config", "pattern"),
    [
        ({"kv_cache_torch_dtype": "float16"}, r"kv_cache_torch_dtype is 'float16'; allowed"),
        ({"kv_cache_torch_dtype": "float8_e5m2"}, r"kv_cache_torch_dtype is 'float8_e5m2'"),
        ({"quantization_config": {"kv_cache_scheme": {"type": "int", "num_bits": 8}}}, r"type='int', num_bits=8"),
        ({"quantization_config": {"kv_cache_scheme": {"type": "float", "num_bits": 4}}}, r"num_bits=4"),
        ({"quantization_config": {"kv_cache_scheme": "fp8"}}, r"kv_cache_scheme must be an object"),
        (
            {"kv_cache_torch_dtype": "float8_e4m3fnuz",
             "quantization_config": {"kv_cache_scheme": {"type": "float", "num_bits": 8}}},
            r"config disagrees",
        ),
    ],
)
def test_checkpoint_bad_config(config: dict[str, Any], pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        scales_from_checkpoint(_ckpt({"kv_scale": [_scalar(1.0)] * 3}), config, TINY)


def test_bad_config_ignored_without_scale_tensors() -> None:
    assert scales_from_checkpoint({}, {"kv_cache_torch_dtype": "float16"}, TINY) is None


# --------------------------------------------------------------------------------------------------
# resolve_kv_scales
# --------------------------------------------------------------------------------------------------


def _kv8_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kv8" and r.levelno == logging.WARNING]


def test_resolve_non_fp8_returns_none(caplog: pytest.LogCaptureFixture) -> None:
    ckpt_scales = tensor_scales([0.5] * 32, E4M3.name)
    with caplog.at_level(logging.WARNING, logger="kv8"):
        assert resolve_kv_scales(AUTO, LLAMA2_7B, None, None) is None
        assert resolve_kv_scales(AUTO, LLAMA2_7B, None, ckpt_scales) is None
    assert _kv8_warnings(caplog) == []


def test_resolve_non_fp8_rejects_param_path() -> None:
    with pytest.raises(ValueError, match=r"quantization_param_path=.*kv_cache_dtype is 'bfloat16'.*set kv_cache_dtype"):
        resolve_kv_scales(AUTO, LLAMA2_7B, str(FIXTURE), None)


def test_resolve_param_path_wins_over_checkpoint(caplog: pytest.LogCaptureFixture) -> None:
    ckpt_scales = tensor_scales([9.0] * 32, E4M3.name)
    with caplog.at_level(logging.WARNING, logger="kv8"):
        scales = resolve_kv_scales(FP8_E4M3, LLAMA2_7B, str(FIXTURE), ckpt_scales)
    assert scales is not None
    assert torch.equal(scales.k, load_vllm_scales_json(FIXTURE, LLAMA2_7B).k)
    assert scales.source.startswith("quantization_param_path")
    assert _kv8_warnings(caplog) == []


def test_resolve_param_path_errors_propagate() -> None:
    with pytest.raises(ValueError, match=r"32 layers but the model has 30 layers"):
        resolve_kv_scales(FP8_E4M3, SMOLLM2, str(FIXTURE), None)


def test_resolve_checkpoint_when_no_path(caplog: pytest.LogCaptureFixture) -> None:
    ckpt_scales = scales_from_checkpoint(_ckpt({"kv_scale": [_scalar(0.5)] * 3}), {}, TINY)
    with caplog.at_level(logging.WARNING, logger="kv8"):
        scales = resolve_kv_scales(FP8_E4M3, TINY, None, ckpt_scales)
    assert scales is ckpt_scales
    assert _kv8_warnings(caplog) == []


def test_resolve_checkpoint_scales_must_fit_model() -> None:
    with pytest.raises(ValueError, match=r"cover 2 layers but the model has 3"):
        resolve_kv_scales(FP8_E4M3, TINY, None, tensor_scales([0.5, 0.5], E4M3.name))
    per_head = KVScales(k=torch.ones(3, 5, 1), v=torch.ones(3, 5, 1), granularity=ScaleGranularity.HEAD,
                        source="t", made_for=E4M3.name)
    with pytest.raises(ValueError, match=r"does not broadcast against \[num_kv_heads=2, head_dim=4\]"):
        resolve_kv_scales(FP8_E4M3, TINY, None, per_head)


def test_resolve_converts_for_fnuz_cache() -> None:
    from_file = resolve_kv_scales(FP8_E4M3FNUZ, LLAMA2_7B, str(FIXTURE), None)
    assert from_file is not None and from_file.made_for == E4M3FNUZ.name
    assert torch.equal(from_file.k, load_vllm_scales_json(FIXTURE, LLAMA2_7B).k * 2)
    ckpt = scales_from_checkpoint(
        _ckpt({"kv_scale": [_scalar(0.5)] * 3}), {"kv_cache_torch_dtype": "float8_e4m3fnuz"}, TINY
    )
    to_fn = resolve_kv_scales(FP8_E4M3, TINY, None, ckpt)
    assert to_fn is not None and to_fn.k.flatten().tolist() == [0.25] * 3 and to_fn.made_for == E4M3.name
    e5m2 = resolve_kv_scales(FP8_E5M2, TINY, None, ckpt)
    assert e5m2 is ckpt


def test_resolve_default_warns_once_per_call(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="kv8"):
        scales = resolve_kv_scales(FP8_E4M3, TINY, None, None)
    assert scales is not None and scales.source == "default 1.0"
    assert torch.equal(scales.k, torch.ones(3, 1, 1))
    warnings = _kv8_warnings(caplog)
    assert len(warnings) == 1
    message = warnings[0].getMessage()
    assert "1.0" in message and "accuracy may suffer" in message
    assert "kv8 calibrate" in message and "--quantization-param-path" in message
    assert "fp8_e4m3" in message
    # A second engine built in the same process warns again (once per construction, not once per process).
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kv8"):
        resolve_kv_scales(FP8_E5M2, TINY, None, None)
    assert len(_kv8_warnings(caplog)) == 1
