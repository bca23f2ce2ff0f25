"""Tests for kv8.quant.scale_files: vLLM's KV scale JSON files, the real one and synthetic ones, read and
written."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from kv8.quant.formats import E4M3, E4M3FNUZ
from kv8.quant.scale_files import load_vllm_scales_json, write_vllm_scales_json
from kv8.quant.scales import KVScales, ModelScaleInfo, ScaleGranularity
from tests.helpers.scales import FIXTURE, LLAMA2_7B, SMOLLM2, TINY

QWEN2 = ModelScaleInfo(model_type="qwen2", num_layers=32, num_kv_heads=32, head_dim=128)


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


# ---- kv8's file with key offsets (key centering) ------------------------------------------------------------------
def _offsets(model: ModelScaleInfo) -> torch.Tensor:
    return torch.randn(model.num_layers, model.num_kv_heads, model.head_dim, generator=torch.Generator().manual_seed(1))


def test_kv8_file_round_trips_key_offsets(tmp_path: Path) -> None:
    from kv8.quant.key_offsets import KeyOffsets
    from kv8.quant.scale_files import (
        file_has_key_offsets,
        load_key_offsets,
        load_kv8_scales_json,
        write_kv8_scales_json,
    )

    scales = KVScales(torch.full((3, 2, 1), 0.5), torch.full((3, 2, 1), 0.25), ScaleGranularity.HEAD, "test",
                      "fp8_e4m3")
    c = _offsets(TINY)
    path = tmp_path / "centered.json"
    write_kv8_scales_json(path, scales, TINY, KeyOffsets(c, "test"))
    doc = json.loads(path.read_text())
    assert doc["version"] == 2 and len(doc["k_offset"]) == 3
    assert file_has_key_offsets(path)
    got = load_key_offsets(path, TINY)
    assert got is not None and torch.equal(got.k, c) and str(path) in got.source
    assert torch.equal(load_kv8_scales_json(path, TINY).k, scales.k)   # the scales read as before
    plain = tmp_path / "plain.json"
    write_kv8_scales_json(plain, scales, TINY)
    assert json.loads(plain.read_text())["version"] == 1 and "k_offset" not in json.loads(plain.read_text())
    assert not file_has_key_offsets(plain) and load_key_offsets(plain, TINY) is None
    assert not file_has_key_offsets(FIXTURE) and load_key_offsets(FIXTURE, LLAMA2_7B) is None   # vLLM's file


@pytest.mark.parametrize("mutate,pattern", [
    (lambda d: d.update(k_offset=[[[0.0] * 4] * 2] * 2), r"k_offset .* shape \[2, 2, 4\]; the model needs "
                                                         r"\[num_layers, num_kv_heads, head_dim\] = \[3, 2, 4\]"),
    (lambda d: d.update(k_offset=[[[0.0] * 3] * 2] * 3), r"k_offset .* shape \[3, 2, 3\]"),
    (lambda d: d.update(k_offset=[[0.0] * 4] * 3), r"'k_offset' must be a nested list of numbers"),
    (lambda d: d.update(k_offset=[[[0.0] * 4, [0.0] * 3]] * 3), r"'k_offset' is not a rectangular"),
    (lambda d: d["k_offset"][1][0].__setitem__(2, 1e39), r"k_offset for layer 1, KV head 0, channel 2 is inf"),
    (lambda d: d.update(version=1), r"'k_offset' \(key centering\) needs version 2"),
    (lambda d: d.update(version=4), r"version is 4; kv8 reads versions 1, 2, 3"),
])
def test_bad_key_offsets_name_the_field(tmp_path: Path, mutate: Any, pattern: str) -> None:
    from kv8.quant.key_offsets import KeyOffsets
    from kv8.quant.scale_files import load_key_offsets, load_scales_file, write_kv8_scales_json

    path = tmp_path / "c.json"
    write_kv8_scales_json(path, KVScales.default(3), TINY, KeyOffsets(_offsets(TINY), "test"))
    doc = json.loads(path.read_text())
    mutate(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=pattern):
        load_key_offsets(path, TINY)
    with pytest.raises(ValueError, match=pattern):   # the scales of such a file are refused too
        load_scales_file(path, TINY)


def test_key_offsets_invariants() -> None:
    from kv8.quant.key_offsets import KeyOffsets

    with pytest.raises(ValueError, match=r"k_offset must have shape \[num_layers, num_kv_heads, head_dim\]"):
        KeyOffsets(torch.zeros(3, 4), "test")
    with pytest.raises(ValueError, match="k_offset must be a float32 CPU tensor"):
        KeyOffsets(torch.zeros(1, 1, 2, dtype=torch.float64), "test")
    with pytest.raises(ValueError, match="KV heads 1..2 are not within the 2 heads"):
        KeyOffsets(torch.zeros(1, 2, 2), "test").heads(1, 2)
    with pytest.raises(ValueError, match="k_offset for layer 0, KV head 1, channel 0 is nan"):
        KeyOffsets(torch.tensor([[[0.0], [math.nan]]]), "test")


# ---- kv8's file with key scaling's factors ------------------------------------------------------------------------
def _factors(model: ModelScaleInfo) -> torch.Tensor:
    g = torch.Generator().manual_seed(2)
    return torch.rand(model.num_layers, model.num_kv_heads, model.head_dim, generator=g) * 4 + 0.25


def test_kv8_file_round_trips_key_scaling(tmp_path: Path) -> None:
    from kv8.quant.key_offsets import KeyOffsets
    from kv8.quant.key_scaling import KeyScaling
    from kv8.quant.scale_files import file_has_key_scaling, load_key_offsets, load_key_scaling, write_kv8_scales_json

    c, s = _offsets(TINY), _factors(TINY)
    path = tmp_path / "scaled.json"
    write_kv8_scales_json(path, KVScales.default(3), TINY, KeyOffsets(c, "test"), KeyScaling(s, "test"))
    doc = json.loads(path.read_text())
    assert doc["version"] == 3 and len(doc["k_channel_scale"]) == 3
    assert file_has_key_scaling(path)
    got = load_key_scaling(path, TINY)
    assert got is not None and torch.equal(got.s, s) and str(path) in got.source
    offsets = load_key_offsets(path, TINY)
    assert offsets is not None and torch.equal(offsets.k, c)
    centered = tmp_path / "centered.json"
    write_kv8_scales_json(centered, KVScales.default(3), TINY, KeyOffsets(c, "test"))
    assert not file_has_key_scaling(centered) and load_key_scaling(centered, TINY) is None
    assert load_key_scaling(FIXTURE, LLAMA2_7B) is None   # vLLM's file
    with pytest.raises(ValueError, match="written only beside k_offset"):
        write_kv8_scales_json(tmp_path / "x.json", KVScales.default(3), TINY, None, KeyScaling(s, "test"))


@pytest.mark.parametrize("mutate,pattern", [
    (lambda d: d.update(k_channel_scale=[[[1.0] * 4] * 2] * 2), r"k_channel_scale .* shape \[2, 2, 4\]; the model "
                                                                r"needs \[num_layers, num_kv_heads, head_dim\]"),
    (lambda d: d.update(k_channel_scale=[[1.0] * 4] * 3), r"'k_channel_scale' must be a nested list of numbers"),
    (lambda d: d["k_channel_scale"][2][1].__setitem__(3, 0.0), r"k_channel_scale for layer 2, KV head 1, channel 3 "
                                                               r"is 0.0; key scales must be finite and > 0"),
    (lambda d: d["k_channel_scale"][0][1].__setitem__(0, -2.0), r"layer 0, KV head 1, channel 0 is -2.0"),
    (lambda d: d["k_channel_scale"][1][0].__setitem__(1, 1e39), r"layer 1, KV head 0, channel 1 is inf"),
    (lambda d: d.update(version=2), r"'k_channel_scale' \(key scaling\) needs version 3"),
    (lambda d: d.pop("k_offset"), r"'k_channel_scale' \(key scaling\) comes only beside 'k_offset'"),
])
def test_bad_key_scaling_names_the_field(tmp_path: Path, mutate: Any, pattern: str) -> None:
    from kv8.quant.key_offsets import KeyOffsets
    from kv8.quant.key_scaling import KeyScaling
    from kv8.quant.scale_files import load_key_scaling, load_scales_file, write_kv8_scales_json

    path = tmp_path / "s.json"
    write_kv8_scales_json(path, KVScales.default(3), TINY, KeyOffsets(_offsets(TINY), "test"),
                          KeyScaling(_factors(TINY), "test"))
    doc = json.loads(path.read_text())
    mutate(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=pattern):
        load_key_scaling(path, TINY)
    with pytest.raises(ValueError, match=pattern):   # the scales of such a file are refused too
        load_scales_file(path, TINY)


def test_key_scaling_invariants() -> None:
    from kv8.quant.key_scaling import KeyScaling

    with pytest.raises(ValueError, match=r"k_channel_scale must have shape \[num_layers, num_kv_heads, head_dim\]"):
        KeyScaling(torch.ones(3, 4), "test")
    with pytest.raises(ValueError, match="k_channel_scale must be a float32 CPU tensor"):
        KeyScaling(torch.ones(1, 1, 2, dtype=torch.float64), "test")
    with pytest.raises(ValueError, match="k_channel_scale for layer 0, KV head 1, channel 0 is nan"):
        KeyScaling(torch.tensor([[[1.0], [math.nan]]]), "test")
    with pytest.raises(ValueError, match="KeyScaling.source must be a non-empty string"):
        KeyScaling(torch.ones(1, 1, 2), "")
