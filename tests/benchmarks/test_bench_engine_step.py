"""``benchmarks/bench_engine_step.py``: a tuner candidate's label given as a backend is pinned as
``dense_backend="auto"``'s choice while the engine is built (no timing), and only then."""

from __future__ import annotations

import sys

import pytest
import torch

import kv8.loader.model as loader_model
from kv8.layers.linear import WIDE_ROWS
from kv8.layers.tuning import LinearShape
from tests.helpers.kernels import dense_kernels_or_reason
from tests.helpers.paths import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_engine_step  # noqa: E402

SHAPES = [LinearShape(96, 64, 2), LinearShape(1000, 64, 1, quantize=False, lm_head=True)]


def test_a_dense_backend_name_is_passed_through() -> None:
    tuned = loader_model.tuned_dense_backend
    with bench_engine_step.pinned_backend("torch_fp32") as option:
        assert option == "torch_fp32" and loader_model.tuned_dense_backend is tuned


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_a_tuner_label_is_autos_choice_while_the_engine_is_built(quantization: str | None) -> None:
    kernels, why = dense_kernels_or_reason()
    if kernels is None:
        pytest.skip(f"kv8's dense kernels are unavailable: {why}")
    label = f"packed_bf16+f32_from_{WIDE_ROWS}"
    tuned = loader_model.tuned_dense_backend
    with bench_engine_step.pinned_backend(label) as option:
        assert option == "auto"
        backend, plan = loader_model.tuned_dense_backend(SHAPES, torch.bfloat16, quantization)
        assert backend.label == label and backend.quantization == quantization and plan == {}
        with pytest.raises(SystemExit, match="is not a tuner candidate here"):
            loader_model.tuned_dense_backend(SHAPES, torch.float32, quantization)   # no packed kernels for float32
    assert loader_model.tuned_dense_backend is tuned
