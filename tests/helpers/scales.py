"""KV scales in the tests of the scale files (:mod:`kv8.quant.scale_files`), of :class:`KVScales`
(:mod:`kv8.quant.scales`) and of the scale sources (:mod:`kv8.cache.scale_sources`): vLLM's recorded scale file and
models it is read for, the cache dtypes scales are resolved for, and per-tensor scales from values."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kv8.quant.formats import resolve_kv_cache_dtype
from kv8.quant.scales import KVScales, ModelScaleInfo, ScaleGranularity
from tests.helpers.paths import FIXTURES

#: vLLM's KV cache scale file of Llama-2-7B (tests/fixtures): one scale per layer for K and V, e4m3
FIXTURE = FIXTURES / "vllm-llama2-7b-kv_cache_scales.json"
LLAMA2_7B = ModelScaleInfo(model_type="llama", num_layers=32, num_kv_heads=32, head_dim=128)
SMOLLM2 = ModelScaleInfo(model_type="llama", num_layers=30, num_kv_heads=3, head_dim=64)
TINY = ModelScaleInfo(model_type="llama", num_layers=3, num_kv_heads=2, head_dim=4)

FP8_E4M3 = resolve_kv_cache_dtype("fp8", torch.bfloat16)
FP8_E4M3FNUZ = resolve_kv_cache_dtype("fp8_e4m3fnuz", torch.bfloat16)
FP8_E5M2 = resolve_kv_cache_dtype("fp8_e5m2", torch.bfloat16)
AUTO = resolve_kv_cache_dtype("auto", torch.bfloat16)


def tensor_scales(values: list[float], made_for: str | None) -> KVScales:
    """Per-tensor scales, made for ``made_for``: K one of ``values`` per layer, V twice it."""
    t = torch.tensor(values, dtype=torch.float32).reshape(-1, 1, 1)
    return KVScales(k=t, v=t * 2, granularity=ScaleGranularity.TENSOR, source="test", made_for=made_for)


def model_scale_info(model_dir: str) -> ModelScaleInfo:
    """What a scales file is validated against, for the Hugging Face model directory ``model_dir`` (its config.json)."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    heads = cfg["num_attention_heads"]
    return ModelScaleInfo(cfg["model_type"], cfg["num_hidden_layers"], cfg.get("num_key_value_heads", heads),
                          cfg.get("head_dim", cfg["hidden_size"] // heads))
