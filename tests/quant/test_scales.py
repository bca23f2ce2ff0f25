"""Tests for kv8.quant.scales: KVScales itself (defaults, conversion between FP8 formats, validation) and
ModelScaleInfo."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kv8.cache.scale_sources import resolve_kv_scales
from kv8.quant.formats import E4M3, E4M3FNUZ, E5M2
from kv8.quant.scales import KVScales, ModelScaleInfo, ScaleGranularity
from tests.helpers.scales import FP8_E4M3, TINY, tensor_scales

# --------------------------------------------------------------------------------------------------
# KVScales itself
# --------------------------------------------------------------------------------------------------


def test_default_scales() -> None:
    scales = KVScales.default(4)
    assert scales.num_layers == 4 and scales.source == "default 1.0" and scales.made_for is None
    assert torch.equal(scales.k, torch.ones(4, 1, 1)) and torch.equal(scales.v, torch.ones(4, 1, 1))
    with pytest.raises(ValueError, match="num_layers must be an int >= 1, got 0"):
        KVScales.default(0)


def test_for_format_e4m3_to_fnuz_doubles_and_back_halves() -> None:
    fn = tensor_scales([0.5, 0.25], E4M3.name)
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
    scales = tensor_scales([0.5, 0.25], made_for)
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
