"""KV scales reach the cache through the engine: vLLM's real file, checkpoint tensors, FNUZ conversion."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from kv8 import LLM, SamplingParams
from tests.helpers.paths import FIXTURES
from tests.helpers.tiny_models import make_tiny_model

VLLM_SCALES = str(FIXTURES / "vllm-llama2-7b-kv_cache_scales.json")


def make_llm(path, **kw):
    return LLM(model=path, dtype="float32", max_model_len=128, kv_cache_memory="4MiB", **kw)


def test_vllm_real_file_loads_for_a_32_layer_llama(tmp_path):
    path = make_tiny_model(str(tmp_path), "llama", num_hidden_layers=32, hidden_size=32, intermediate_size=64,
                           num_attention_heads=2, num_key_value_heads=2)
    llm = make_llm(path, kv_cache_dtype="fp8", quantization_param_path=VLLM_SCALES)
    with open(VLLM_SCALES) as f:
        expected = [v for _, v in sorted(json.load(f)["kv_cache"]["scaling_factor"]["0"].items(),
                                         key=lambda kv: int(kv[0]))]
    scales = llm.engine.cache.scales
    assert torch.equal(scales.k.flatten(), torch.tensor(expected, dtype=torch.float32))
    assert torch.equal(scales.v, scales.k)
    assert llm.generate("Paris is", SamplingParams(temperature=0, max_tokens=4))[0].outputs[0].token_ids
    # fnuz: scales made for e4m3fn are doubled.
    fnuz = make_llm(path, kv_cache_dtype="fp8_e4m3fnuz", quantization_param_path=VLLM_SCALES)
    assert torch.equal(fnuz.engine.cache.scales.k.flatten(), 2 * torch.tensor(expected, dtype=torch.float32))


def test_checkpoint_scales_are_used_and_stored_values_follow_them(tiny_models, tmp_path):
    src = tiny_models["llama_gqa"]
    dst = tmp_path / "scaled"
    dst.mkdir()
    for name in os.listdir(src):
        if name != "model.safetensors":
            (dst / name).write_bytes(open(os.path.join(src, name), "rb").read())
    tensors = load_file(os.path.join(src, "model.safetensors"))
    for layer in range(2):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.5 + layer)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor([0.25, 0.125])  # per KV head
    save_file(tensors, str(dst / "model.safetensors"))
    cfg = json.loads((dst / "config.json").read_text())
    cfg["kv_cache_torch_dtype"] = "float8_e4m3fn"
    (dst / "config.json").write_text(json.dumps(cfg))
    llm = make_llm(str(dst), kv_cache_dtype="fp8")
    scales = llm.engine.cache.scales
    assert scales.granularity.value == "head"
    assert torch.equal(scales.k[:, :, 0], torch.tensor([[0.5, 0.5], [1.5, 1.5]]))
    assert torch.equal(scales.v[:, :, 0], torch.tensor([[0.25, 0.125], [0.25, 0.125]]))
    out = llm.generate("Paris is the", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3
    # Calibrated static scales describe unrotated K/V: refused with a rotated cache, allowed with dynamic scales.
    with pytest.raises(ValueError, match="calibrated with rotation 'none', but kv_cache_rotation='hadamard'"):
        make_llm(str(dst), kv_cache_dtype="fp8", kv_cache_rotation="hadamard")
    assert make_llm(str(dst), kv_cache_dtype="fp8", kv_cache_rotation="hadamard",
                    kv_cache_scale_mode="dynamic").engine.cache.dynamic_scales
    # Without an FP8 cache the scales are simply not needed.
    assert make_llm(str(dst), kv_cache_dtype="float32").engine.cache.scales is None


def test_default_scale_warns_once(tiny_llama, caplog):
    with caplog.at_level("WARNING", logger="kv8"):
        make_llm(tiny_llama, kv_cache_dtype="fp8_e4m3")
    warnings = [r for r in caplog.records if "scaling factor 1.0" in r.getMessage()]
    assert len(warnings) == 1


def test_unreadable_scales_file_is_a_clear_error(tiny_llama, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="bad.json"):
        make_llm(tiny_llama, kv_cache_dtype="fp8", quantization_param_path=str(bad))
    with pytest.raises(ValueError, match="missing.json"):
        make_llm(tiny_llama, kv_cache_dtype="fp8", quantization_param_path=str(tmp_path / "missing.json"))
