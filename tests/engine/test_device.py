"""The device option and what it places: EngineConfig's checks (a missing GPU, CPU-only backends, Triton outside its
interpreter), the codec and cache tensors on a device (the meta device stands in for a GPU here), random weights
(load_format="dummy"), the W8A8 FP8 linear method of GPUs with FP8 tensor cores (torch._scaled_mm runs on the CPU
too) and the collective backend of a device. The GPU itself is exercised by benchmarks/gpu_check.py."""

from __future__ import annotations

import shutil

import pytest
import torch

from kv8 import LLM, SamplingParams
from kv8.cache.codec import KVCodec
from kv8.cache.paged_cache import CacheShape, PagedKVCache
from kv8.distributed.group import collective_backend
from kv8.engine.args import EngineArgs
from kv8.engine.config import resolve_device
from kv8.layers.dense_backend import DenseBackend, select_dense_backend
from kv8.layers.linear import (
    Linear,
    MergedLinear,
    ScaledMMFP8LinearMethod,
    TorchFP8LinearMethod,
    quantize_fp8_activations,
    scaled_mm_fp8_reference,
)
from kv8.loader.model import read_hf_config
from kv8.quant.formats import E4M3, resolve_kv_cache_dtype
from kv8.quant.scales import KVScales, ScaleGranularity
from kv8.quant.weights import quantize_fp8_rows


def _config(path: str, **kw):
    return EngineArgs(model=path, **kw).create_engine_config(read_hf_config(path), "hf", path)


# ---- options ---------------------------------------------------------------------------------------------------
def test_auto_is_the_cpu_without_a_gpu(tiny_llama, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu" and resolve_device("CUDA") == "cuda"
    assert _config(tiny_llama).device == "cpu"
    with pytest.raises(ValueError, match=r"device='tpu' is not supported; choose one of: auto, cpu, cuda"):
        resolve_device("tpu")


def test_cuda_without_a_gpu_says_what_to_do(tiny_llama, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match=r"device='cuda' but torch sees no CUDA GPU .*install torch with CUDA.*"
                                         r"or use device='cpu'"):
        _config(tiny_llama, device="cuda")


@pytest.mark.parametrize(("option", "message"), [
    (dict(dense_backend="packed_bf16"), r"dense_backend='packed_bf16' runs on the CPU only, not on device='cuda'"),
    (dict(dense_backend="torch_fp32"), r"dense_backend='torch_fp32' runs on the CPU only, not on device='cuda'"),
    (dict(attention_backend="cpu_fused"), r"attention_backend='cpu_fused' runs on the CPU only, not on "
                                          r"device='cuda'; use attention_backend='auto'"),
])
def test_cpu_only_backends_on_cuda_are_refused(tiny_llama, monkeypatch, option, message):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # past the GPU check: the option is the error
    with pytest.raises(ValueError, match=message):
        _config(tiny_llama, device="cuda", **option)
    assert _config(tiny_llama, device="cuda").device == "cuda"       # auto backends are fine there


def test_triton_on_the_cpu_needs_the_interpreter(tiny_llama, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=r"attention_backend='triton' runs on device='cuda'; on the CPU only in "
                                         r"Triton's interpreter \(TRITON_INTERPRET=1"):
        _config(tiny_llama, device="cpu", attention_backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _config(tiny_llama, device="cpu", attention_backend="triton").attention_backend == "triton"


def test_load_format_is_checked(tiny_llama):
    with pytest.raises(ValueError, match=r"load_format='random' is not supported; choose one of: auto, dummy"):
        _config(tiny_llama, load_format="random")


def test_collective_backend_of_each_device():
    assert collective_backend("cuda") == "nccl" and collective_backend("cpu") == "gloo"
    with pytest.raises(ValueError, match=r"device='mps' has no collective backend; allowed: cpu, cuda"):
        collective_backend("mps")


# ---- placement ---------------------------------------------------------------------------------------------------
def test_cache_and_codec_tensors_live_on_the_cache_device():
    """The meta device stands in for a GPU: every tensor the cache and its codec read is there, the scales'
    values are the CPU KVScales' (which stay on the CPU)."""
    fmt = resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16)
    k = torch.rand(2, 2, 1) + 0.5
    scales = KVScales(k=k, v=k * 2, granularity=ScaleGranularity.HEAD, source="test", made_for=None)
    codec = KVCodec.build(fmt, 16, rotation="hadamard", scales=scales)
    cache = PagedKVCache(CacheShape(2, 3, 2, 4, 16), codec, device="meta")
    assert cache.data.device.type == "meta" and cache.codec.rotation is not None
    assert cache.codec.rotation.device.type == "meta"
    assert all(t.device.type == "meta" for t in cache.layer_scales(1))
    assert codec.layer_scales(1)[0].device.type == "cpu" and scales.k.device.type == "cpu"   # the original stays
    assert torch.equal(codec.layer_scales(1)[1], scales.v[1])
    dynamic = PagedKVCache(CacheShape(2, 3, 2, 4, 16), KVCodec.build(fmt, 16, scale_mode="dynamic"), device="meta")
    assert dynamic.token_scales is not None and dynamic.token_scales.device.type == "meta"
    with pytest.raises(ValueError, match=r"layer index must be an int in \[0, 2\), got 2"):
        cache.layer_scales(2)


def test_dummy_weights_need_no_checkpoint(tiny_llama, tmp_path):
    """load_format="dummy" reads the config and tokenizer only: a directory without weights serves, the same seed
    gives the same random model, every block comes back."""
    bare = tmp_path / "bare"
    shutil.copytree(tiny_llama, bare, ignore=shutil.ignore_patterns("*.safetensors"))
    assert not list(bare.glob("*.safetensors"))
    params = SamplingParams(max_tokens=6, temperature=0.0)
    runs = []
    for _ in range(2):
        llm = LLM(model=str(bare), load_format="dummy", dtype="float32", max_model_len=128, kv_cache_memory="4MiB")
        runs.append([o.outputs[0].token_ids for o in llm.generate(["Paris is", "Once upon a time"], params)])
        kv = llm.engine.kv_manager
        assert kv.num_free_blocks == kv.num_blocks
        llm.engine.shutdown()
    assert runs[0] == runs[1] and all(len(t) == 6 for t in runs[0])
    with pytest.raises(ValueError, match="lacks|safetensors|no .*weights"):
        LLM(model=str(bare), dtype="float32", max_model_len=128, kv_cache_memory="4MiB")


# ---- the W8A8 linear method --------------------------------------------------------------------------------------
def _layer(cls, backend, in_features, out_features, bias, seed=0):
    torch.manual_seed(seed)
    layer = cls(in_features, out_features, bias, backend) if cls is Linear else \
        cls(in_features, [out_features // 2, out_features - out_features // 2], bias, backend)
    weight = torch.randn(out_features, in_features) * 0.05
    layer.weight.data = weight.to(torch.bfloat16)
    if bias:
        layer.bias.data = torch.randn(out_features).to(torch.bfloat16)
    layer.process_weights_after_loading()
    return layer, weight.to(torch.bfloat16)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 7])
def test_scaled_mm_method_equals_its_reference(bias, rows):
    backend = DenseBackend("torch", None, "fp8", fp8_scaled_mm=True)
    layer, weight = _layer(MergedLinear, backend, 64, 48, bias)
    assert isinstance(layer.method, ScaledMMFP8LinearMethod)
    assert layer.weight_fp8.dtype == torch.float8_e4m3fn and not hasattr(layer, "weight")
    codes, scale = quantize_fp8_rows(weight)
    assert torch.equal(layer.weight_fp8.view(torch.uint8), codes) and torch.equal(layer.scale_row[0], scale)
    x = torch.randn(2, rows, 64).to(torch.bfloat16)
    got = layer(x)
    assert got.shape == (2, rows, 48) and got.dtype == torch.bfloat16
    want = scaled_mm_fp8_reference(x.reshape(-1, 64), codes, scale, layer.bias).view(2, rows, 48)
    torch.testing.assert_close(got.float(), want.float(), rtol=2 ** -7, atol=1e-3)


def test_scaled_mm_method_keeps_unaligned_layers_dequantized():
    """K or N not a multiple of 16: torch._scaled_mm cannot take them, the layer multiplies by the dequantized
    weight (what TorchFP8LinearMethod does)."""
    backend = DenseBackend("torch", None, "fp8", fp8_scaled_mm=True)
    layer, weight = _layer(MergedLinear, backend, 40, 24, True)
    plain, _ = _layer(MergedLinear, DenseBackend("torch", None, "fp8"), 40, 24, True)
    assert isinstance(plain.method, TorchFP8LinearMethod) and not hasattr(layer, "weight_fp8")
    x = torch.randn(3, 40).to(torch.bfloat16)
    assert torch.equal(layer(x), plain(x))


def test_activation_quantization_is_per_row_and_saturation_free():
    x = torch.tensor([[0.0, 0.0], [1.0, -3.0], [1e-30, 2e-30]])
    codes, scale = quantize_fp8_activations(x)
    assert codes.dtype == torch.float8_e4m3fn and scale.shape == (3, 1)
    assert codes[0].float().eq(0).all()                                  # a zero row stays zeros
    assert codes[1, 1].float().item() == -448.0 and codes[2, 1].float().item() == 448.0   # each row's amax -> 448
    assert torch.equal(codes.view(torch.uint8)[1:], E4M3.encode(x[1:] / scale[1:]))   # round to nearest even


def test_scaled_mm_is_chosen_only_for_fp8_on_gpus_with_fp8_tensor_cores(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    assert select_dense_backend("auto", torch.bfloat16, "fp8", "cuda").fp8_scaled_mm
    assert not select_dense_backend("auto", torch.bfloat16, None, "cuda").fp8_scaled_mm
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (8, 0))   # A100: no FP8 tensor cores
    ampere = select_dense_backend("auto", torch.bfloat16, "fp8", "cuda")
    assert ampere.name == "torch" and ampere.kernels is None and not ampere.fp8_scaled_mm
    with pytest.raises(ValueError, match="fp8_scaled_mm needs the torch dense backend with quantization='fp8'"):
        DenseBackend("torch", None, None, fp8_scaled_mm=True)


def test_engine_info_line_names_the_device(tiny_llama, caplog):
    with caplog.at_level("INFO", logger="kv8"):
        llm = LLM(model=tiny_llama, dtype="float32", max_model_len=64, kv_cache_memory="2MiB", device="cpu")
    llm.engine.shutdown()
    assert any("KV cache on cpu:" in r.getMessage() for r in caplog.records)
    assert any("on cpu, dense backend" in r.getMessage() for r in caplog.records)


def test_info_names_the_device(tiny_llama, capsys, monkeypatch):
    from kv8.entrypoints.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["info", tiny_llama, "--device", "auto"]) == 0
    assert "\ndevice       cpu (" in capsys.readouterr().out
    assert main(["info", tiny_llama, "--device", "cuda"]) == 2
    assert "kv8: error: device='cuda' but torch sees no CUDA GPU" in capsys.readouterr().err
