"""Tests for kv8.quant.scales: vLLM JSON files, checkpoint scale tensors, precedence and conversion."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from kv8.cache.scale_sources import is_kv_scale_name, resolve_kv_scales, scales_from_checkpoint
from kv8.quant.formats import E4M3, E4M3FNUZ, E5M2, resolve_kv_cache_dtype
from kv8.quant.scale_files import load_vllm_scales_json, write_vllm_scales_json
from kv8.quant.scales import KVScales, ModelScaleInfo, ScaleGranularity
from tests.helpers.paths import FIXTURES

FIXTURE = FIXTURES / "vllm-llama2-7b-kv_cache_scales.json"
LLAMA2_7B = ModelScaleInfo(model_type="llama", num_layers=32, num_kv_heads=32, head_dim=128)
SMOLLM2 = ModelScaleInfo(model_type="llama", num_layers=30, num_kv_heads=3, head_dim=64)
QWEN2 = ModelScaleInfo(model_type="qwen2", num_layers=32, num_kv_heads=32, head_dim=128)
TINY = ModelScaleInfo(model_type="llama", num_layers=3, num_kv_heads=2, head_dim=4)

FP8_E4M3 = resolve_kv_cache_dtype("fp8", torch.bfloat16)
FP8_E4M3FNUZ = resolve_kv_cache_dtype("fp8_e4m3fnuz", torch.bfloat16)
FP8_E5M2 = resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16)
AUTO = resolve_kv_cache_dtype("auto", torch.bfloat16)


def _write_json(tmp_path: Path, doc: Any, name: str = "scales.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(doc) if not isinstance(doc, str) else doc, encoding="utf-8")
    return path


def _vllm_doc(
    layers: dict[str, Any] | None = None, dtype: str = "float8_e4m3fn", model_type: str = "llama", rank: str = "0"
) -> dict[str, Any]:
    if layers is None:
        layers = {"0": 0.5, "1": 0.25, "2": 0.125}
    return {"model_type": model_type, "kv_cache": {"dtype": dtype, "scaling_factor": {rank: layers}}}


def _scalar(x: float, shape: tuple[int, ...] = ()) -> torch.Tensor:
    return torch.full(shape, x, dtype=torch.float32)


# --------------------------------------------------------------------------------------------------
# vLLM JSON: the real file
# --------------------------------------------------------------------------------------------------


def test_real_vllm_file_loads_for_32_layer_llama() -> None:
    expected = json.loads(FIXTURE.read_text())["kv_cache"]["scaling_factor"]["0"]
    scales = load_vllm_scales_json(FIXTURE, LLAMA2_7B)
    assert scales.granularity is ScaleGranularity.TENSOR
    assert scales.made_for == E4M3.name
    assert scales.num_layers == 32
    assert scales.k.shape == (32, 1, 1) and scales.k.dtype == torch.float32
    want = torch.tensor([expected[str(i)] for i in range(32)], dtype=torch.float32).reshape(32, 1, 1)
    assert torch.equal(scales.k, want)
    assert torch.equal(scales.v, want)  # one scale per layer for both K and V
    assert scales.source == f"quantization_param_path {FIXTURE}"
    k0, v0 = scales.layer(0)
    assert k0.shape == (1, 1) and math.isclose(float(k0), expected["0"], rel_tol=1e-7)
    assert float(v0) == float(k0)


def test_real_vllm_file_rejected_for_30_layers_naming_both_counts() -> None:
    with pytest.raises(ValueError, match=r"32 layers.*30 layers") as exc:
        load_vllm_scales_json(FIXTURE, SMOLLM2)
    assert str(FIXTURE) in str(exc.value)


def test_real_vllm_file_rejected_for_other_model_type() -> None:
    with pytest.raises(ValueError, match=r"'llama'.*'qwen2'") as exc:
        load_vllm_scales_json(FIXTURE, QWEN2)
    assert str(FIXTURE) in str(exc.value)


# --------------------------------------------------------------------------------------------------
# vLLM JSON: synthetic files
# --------------------------------------------------------------------------------------------------


def test_synthetic_file_fnuz_dtype_and_values(tmp_path: Path) -> None:
    path = _write_json(tmp_path, _vllm_doc(dtype="float8_e4m3fnuz", layers={"0": 1, "1": 0.5, "2": 3.0}))
    scales = load_vllm_scales_json(path, TINY)
    assert scales.made_for == E4M3FNUZ.name
    assert scales.k.flatten().tolist() == [1.0, 0.5, 3.0]


@pytest.mark.parametrize(
    ("layers", "pattern"),
    [
        ({"0": 0.5, "1": 0.5, "3": 0.5}, r"no scale for layer\(s\) \[2\].*unexpected layer keys: \[3\]"),
        ({"0": 0.5, "1": 0.5}, r"scales for 2 layers but the model has 3 layers"),
        ({"0": 0.5, "1": 0.0, "2": 0.5}, r"scale for layer 1 is 0\.0; scales must be finite and > 0"),
        ({"0": 0.5, "1": 0.5, "2": -0.5}, r"scale for layer 2 is -0\.5; scales must be finite and > 0"),
        ({"0": "0.5", "1": 0.5, "2": 0.5}, r"scale for layer 0 is '0\.5'; expected a number"),
        ({"0": True, "1": 0.5, "2": 0.5}, r"scale for layer 0 is True; expected a number"),
        ({"0": None, "1": 0.5, "2": 0.5}, r"scale for layer 0 is None; expected a number"),
        ({"0": 0.5, "1": 0.5, "2": 1e-60}, r"scale for layer 2 .* not representable as float32"),
        ({"0": 0.5, "x": 0.5, "2": 0.5}, r"layer key 'x' is not a non-negative integer"),
        ({"0": 0.5, "1": 0.5, "01": 0.5}, r"layer 1 appears twice"),
    ],
)
def test_synthetic_file_bad_layers(tmp_path: Path, layers: dict[str, Any], pattern: str) -> None:
    path = _write_json(tmp_path, _vllm_doc(layers=layers))
    with pytest.raises(ValueError, match=pattern) as exc:
        load_vllm_scales_json(path, TINY)
    assert str(path) in str(exc.value)


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity"])
def test_synthetic_file_non_finite_scale(tmp_path: Path, literal: str) -> None:
    # Python's json reads these non-standard literals, so the loader must reject them itself.
    text = json.dumps(_vllm_doc(layers={"0": 0.5, "1": 0.5, "2": 0.5})).replace('"2": 0.5', f'"2": {literal}')
    path = _write_json(tmp_path, text)
    with pytest.raises(ValueError, match=r"scale for layer 2 is .*(nan|inf).*finite and > 0"):
        load_vllm_scales_json(path, TINY)


@pytest.mark.parametrize("dtype", ["float8_e5m2", "fp8", "float16", "fp8_e4m3"])
def test_synthetic_file_unknown_dtype(tmp_path: Path, dtype: str) -> None:
    path = _write_json(tmp_path, _vllm_doc(dtype=dtype))
    with pytest.raises(ValueError, match=rf"kv_cache\.dtype is '{dtype}'.*float8_e4m3fn.*float8_e4m3fnuz"):
        load_vllm_scales_json(path, TINY)


def test_synthetic_file_missing_tp_rank(tmp_path: Path) -> None:
    path = _write_json(tmp_path, _vllm_doc(rank="1"))
    with pytest.raises(ValueError, match=r"no scales for TP rank 0 \(ranks present: \[1\]\)"):
        load_vllm_scales_json(path, TINY)


def test_synthetic_file_wrong_number_of_tp_ranks(tmp_path: Path) -> None:
    doc = _vllm_doc()
    doc["kv_cache"]["scaling_factor"]["1"] = dict(doc["kv_cache"]["scaling_factor"]["0"])
    path = _write_json(tmp_path, doc)
    with pytest.raises(ValueError, match=r"2 TP rank\(s\) \[0, 1\] but kv8 runs with tensor-parallel size 1"):
        load_vllm_scales_json(path, TINY)
    # With the matching tp_size, each rank loads.
    assert load_vllm_scales_json(path, TINY, tp_rank=1, tp_size=2).num_layers == 3


def test_bad_tp_arguments(tmp_path: Path) -> None:
    path = _write_json(tmp_path, _vllm_doc())
    with pytest.raises(ValueError, match=r"tp_rank must be in \[0, tp_size=1\), got 1"):
        load_vllm_scales_json(path, TINY, tp_rank=1)
    with pytest.raises(ValueError, match=r"tp_rank must be a non-negative int"):
        load_vllm_scales_json(path, TINY, tp_rank=-1)


def test_synthetic_file_bad_json(tmp_path: Path) -> None:
    path = _write_json(tmp_path, '{"model_type": "llama", "kv_cache": {')
    with pytest.raises(ValueError, match=r"not a valid JSON KV cache scales file") as exc:
        load_vllm_scales_json(path, TINY)
    assert str(path) in str(exc.value)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.json"
    with pytest.raises(ValueError, match=r"nope\.json: cannot read KV cache scales file"):
        load_vllm_scales_json(path, TINY)


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"cannot read KV cache scales file"):
        load_vllm_scales_json(tmp_path, TINY)


@pytest.mark.parametrize(
    ("doc", "pattern"),
    [
        ([1, 2], r"top level must be a JSON object, got list"),
        ({"kv_cache": {}}, r"missing key 'model_type'"),
        ({"model_type": "llama"}, r"missing key 'kv_cache'"),
        ({"model_type": "llama", "kv_cache": []}, r"'kv_cache' must be an object"),
        ({"model_type": "llama", "kv_cache": {"scaling_factor": {}}}, r"missing key 'kv_cache\.dtype'"),
        ({"model_type": "llama", "kv_cache": {"dtype": "float8_e4m3fn"}}, r"missing key 'kv_cache\.scaling_factor'"),
        (
            {"model_type": "llama", "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": [0.5]}},
            r"'kv_cache\.scaling_factor' must be an object keyed by TP rank",
        ),
        (
            {"model_type": "llama", "kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"0": [0.5]}}},
            r"scaling_factor\[0\] must be an object keyed by layer index",
        ),
        ({"model_type": None, "kv_cache": {}}, r"model_type None but the model is 'llama'"),
    ],
)
def test_synthetic_file_structure_errors(tmp_path: Path, doc: Any, pattern: str) -> None:
    path = _write_json(tmp_path, doc)
    with pytest.raises(ValueError, match=pattern):
        load_vllm_scales_json(path, TINY)


def test_write_vllm_scales_json_round_trip(tmp_path: Path) -> None:
    original = load_vllm_scales_json(FIXTURE, LLAMA2_7B)
    out = tmp_path / "out.json"
    write_vllm_scales_json(out, original, "llama")
    again = load_vllm_scales_json(out, LLAMA2_7B)
    assert torch.equal(again.k, original.k) and again.made_for == original.made_for
    assert json.loads(out.read_text())["kv_cache"]["dtype"] == "float8_e4m3fn"


def test_write_vllm_scales_json_rejects_what_the_format_cannot_hold(tmp_path: Path) -> None:
    k = torch.full((2, 1, 1), 0.5)
    differing = KVScales(k=k, v=k * 2, granularity=ScaleGranularity.TENSOR, source="t", made_for=E4M3.name)
    with pytest.raises(ValueError, match="k and v differ"):
        write_vllm_scales_json(tmp_path / "a.json", differing, "llama")
    per_head = KVScales(k=torch.ones(2, 2, 1), v=torch.ones(2, 2, 1), granularity=ScaleGranularity.HEAD,
                        source="t", made_for=E4M3.name)
    with pytest.raises(ValueError, match="one scale per layer; got head granularity"):
        write_vllm_scales_json(tmp_path / "b.json", per_head, "llama")
    with pytest.raises(ValueError, match="made_for is None"):
        write_vllm_scales_json(tmp_path / "c.json", KVScales.default(2), "llama")
    assert not any(tmp_path.iterdir())


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
# KVScales itself
# --------------------------------------------------------------------------------------------------


def _tensor_scales(values: list[float], made_for: str | None) -> KVScales:
    t = torch.tensor(values, dtype=torch.float32).reshape(-1, 1, 1)
    return KVScales(k=t, v=t * 2, granularity=ScaleGranularity.TENSOR, source="test", made_for=made_for)


def test_default_scales() -> None:
    scales = KVScales.default(4)
    assert scales.num_layers == 4 and scales.source == "default 1.0" and scales.made_for is None
    assert torch.equal(scales.k, torch.ones(4, 1, 1)) and torch.equal(scales.v, torch.ones(4, 1, 1))
    with pytest.raises(ValueError, match="num_layers must be an int >= 1, got 0"):
        KVScales.default(0)


def test_for_format_e4m3_to_fnuz_doubles_and_back_halves() -> None:
    fn = _tensor_scales([0.5, 0.25], E4M3.name)
    fnuz = fn.for_format(E4M3FNUZ)
    assert fnuz.made_for == E4M3FNUZ.name
    assert fnuz.k.flatten().tolist() == [1.0, 0.5] and fnuz.v.flatten().tolist() == [2.0, 1.0]
    assert "x2 for fp8_e4m3fnuz" in fnuz.source
    back = fnuz.for_format(E4M3)
    assert back.made_for == E4M3.name
    assert torch.equal(back.k, fn.k) and torch.equal(back.v, fn.v)
    assert "/2 for fp8_e4m3" in back.source


@pytest.mark.parametrize(
    ("made_for", "fmt"),
    [("fp8_e4m3", E4M3), ("fp8_e4m3fnuz", E4M3FNUZ), ("fp8_e4m3", E5M2), ("fp8_e4m3fnuz", E5M2), (None, E4M3FNUZ)],
)
def test_for_format_unchanged(made_for: str | None, fmt: Any) -> None:
    scales = _tensor_scales([0.5, 0.25], made_for)
    assert scales.for_format(fmt) is scales


def test_kvscales_copies_its_tensors() -> None:
    t = torch.full((2, 1, 1), 0.5)
    scales = KVScales(k=t, v=t, granularity=ScaleGranularity.TENSOR, source="t", made_for=None)
    t.fill_(-1.0)
    assert scales.k.flatten().tolist() == [0.5, 0.5]


def test_channel_granularity_is_representable() -> None:
    t = torch.rand(3, 2, 4) + 0.5
    scales = KVScales(k=t, v=t, granularity=ScaleGranularity.CHANNEL, source="t", made_for=E4M3.name)
    k, v = scales.layer(2)
    assert k.shape == (2, 4) and torch.equal(k, t[2])
    assert resolve_kv_scales(FP8_E4M3, TINY, None, scales) is not None


@pytest.mark.parametrize(
    ("k", "v", "granularity", "pattern"),
    [
        (torch.ones(2, 1, 1), torch.ones(3, 1, 1), ScaleGranularity.TENSOR,
         r"k shape \[2, 1, 1\] != .*v shape \[3, 1, 1\]"),
        (torch.ones(2, 1), torch.ones(2, 1), ScaleGranularity.TENSOR, r"KVScales\.k must have shape"),
        (torch.ones(0, 1, 1), torch.ones(0, 1, 1), ScaleGranularity.TENSOR, r"num_layers>=1"),
        (torch.ones(2, 1, 1, dtype=torch.float64), torch.ones(2, 1, 1), ScaleGranularity.TENSOR, r"k must be float32"),
        (torch.ones(2, 1, 1), torch.ones(2, 1, 1, device="meta"), ScaleGranularity.TENSOR, r"v must be on the CPU"),
        (torch.ones(2, 2, 1), torch.ones(2, 2, 1), ScaleGranularity.TENSOR, r"tensor-granularity .* \[L, 1, 1\]"),
        (torch.ones(2, 2, 4), torch.ones(2, 2, 4), ScaleGranularity.HEAD, r"head-granularity .* \[L, H, 1\]"),
        (torch.tensor([[[1.0]], [[0.0]]]), torch.ones(2, 1, 1), ScaleGranularity.TENSOR,
         r"KVScales\.k scale for layer 1 \(head 0, channel 0\) is 0\.0; scales must be finite and > 0"),
        (torch.ones(2, 1, 1), torch.tensor([[[float("nan")]], [[1.0]]]), ScaleGranularity.TENSOR,
         r"KVScales\.v scale for layer 0 .* is nan"),
        (torch.ones(2, 1, 1), -torch.ones(2, 1, 1), ScaleGranularity.TENSOR, r"v scale for layer 0 .* is -1\.0"),
        ([1.0], torch.ones(2, 1, 1), ScaleGranularity.TENSOR, r"k must be a torch\.Tensor, got list"),
        (torch.ones(2, 1, 1), torch.ones(2, 1, 1), "tensor", r"granularity must be a ScaleGranularity"),
    ],
)
def test_kvscales_validation(k: Any, v: Any, granularity: Any, pattern: str) -> None:
    with pytest.raises(ValueError, match=pattern):
        KVScales(k=k, v=v, granularity=granularity, source="test", made_for=None)


def test_kvscales_validation_made_for_and_source() -> None:
    t = torch.ones(1, 1, 1)
    with pytest.raises(ValueError, match=r"made_for must be one of .*got 'float8_e4m3fn'"):
        KVScales(k=t, v=t, granularity=ScaleGranularity.TENSOR, source="t", made_for="float8_e4m3fn")
    with pytest.raises(ValueError, match=r"source must be a non-empty string"):
        KVScales(k=t, v=t, granularity=ScaleGranularity.TENSOR, source="", made_for=None)


def test_layer_index_checked() -> None:
    scales = KVScales.default(2)
    with pytest.raises(ValueError, match=r"layer index must be an int in \[0, 2\), got 2"):
        scales.layer(2)


def test_model_scale_info_validation() -> None:
    with pytest.raises(ValueError, match=r"num_layers must be an int >= 1, got 0"):
        ModelScaleInfo(model_type="llama", num_layers=0, num_kv_heads=1, head_dim=1)
    with pytest.raises(ValueError, match=r"model_type must be a non-empty string"):
        ModelScaleInfo(model_type="", num_layers=1, num_kv_heads=1, head_dim=1)


# --------------------------------------------------------------------------------------------------
# resolve_kv_scales
# --------------------------------------------------------------------------------------------------


def _kv8_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "kv8" and r.levelno == logging.WARNING]


def test_resolve_non_fp8_returns_none(caplog: pytest.LogCaptureFixture) -> None:
    ckpt_scales = _tensor_scales([0.5] * 32, E4M3.name)
    with caplog.at_level(logging.WARNING, logger="kv8"):
        assert resolve_kv_scales(AUTO, LLAMA2_7B, None, None) is None
        assert resolve_kv_scales(AUTO, LLAMA2_7B, None, ckpt_scales) is None
    assert _kv8_warnings(caplog) == []


def test_resolve_non_fp8_rejects_param_path() -> None:
    with pytest.raises(ValueError, match=r"quantization_param_path=.*kv_cache_dtype is 'bfloat16'.*set kv_cache_dtype"):
        resolve_kv_scales(AUTO, LLAMA2_7B, str(FIXTURE), None)


def test_resolve_param_path_wins_over_checkpoint(caplog: pytest.LogCaptureFixture) -> None:
    ckpt_scales = _tensor_scales([9.0] * 32, E4M3.name)
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
        resolve_kv_scales(FP8_E4M3, TINY, None, _tensor_scales([0.5, 0.5], E4M3.name))
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
