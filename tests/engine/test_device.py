"""The device option and what it places: the platform it resolves to (kv8.platform: a GPU is faked by patching
torch.cuda's queries), EngineConfig's checks (a missing GPU, CPU-only backends, Triton outside its interpreter), the
codec and cache tensors on a device (the meta device stands in for a GPU here), random weights (load_format="dummy"),
the W8A8 FP8 linear method of GPUs with FP8 tensor cores (on such a GPU where there is one, else on the CPU where
torch's CPU _scaled_mm takes row-wise scales: 2.13's does, 2.11's does not) and what each part
reads from the platform. The GPU itself is exercised by benchmarks/gpu_check.py."""

from __future__ import annotations

import shutil
import types

import pytest
import torch

from kv8 import LLM, SamplingParams
from kv8.attention import backend as attention_backend
from kv8.cache.budget import default_kv_cache_memory
from kv8.cache.codec import KVCodec
from kv8.cache.paged_cache import CacheShape, PagedKVCache
from kv8.engine.args import EngineArgs
from kv8.engine.sampler import argmax_reference, select_argmax
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
from kv8.platform import CPU, Platform, resolve_device
from kv8.quant.formats import E4M3, resolve_kv_cache_dtype
from kv8.quant.scales import KVScales, ScaleGranularity
from kv8.quant.weights import quantize_fp8_rows


def _config(path: str, **kw):
    return EngineArgs(model=path, **kw).create_engine_config(read_hf_config(path), "hf", path)


def _fake_gpu(monkeypatch, capability=(9, 0), gcn_arch=None):
    """torch.cuda answers as a machine with one GPU of this compute capability (an AMD one under ROCm with
    ``gcn_arch``) would, for the queries Platform.resolve makes."""
    props = types.SimpleNamespace(name="Fake GPU", total_memory=80 * 2**30, gcnArchName=gcn_arch or "",
                                  multi_processor_count=132)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: props)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    monkeypatch.setattr(torch.version, "hip", "6.2" if gcn_arch else None)


# ---- the platform ------------------------------------------------------------------------------------------------
def test_auto_is_the_cpu_without_a_gpu(tiny_llama, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == "cpu" and resolve_device("CUDA") == "cuda"
    assert Platform.resolve("auto") is CPU and Platform.resolve("CPU") is CPU
    assert _config(tiny_llama).platform is CPU
    with pytest.raises(ValueError, match=r"device='tpu' is not supported; choose one of: auto, cpu, cuda"):
        resolve_device("tpu")
    with pytest.raises(ValueError, match=r"device='tpu' is not supported; choose one of: auto, cpu, cuda"):
        Platform.resolve("tpu")


def test_the_cpu_platform():
    assert CPU.device == torch.device("cpu") and CPU.rank_device(3) == torch.device("cpu")
    assert (CPU.collective_backend, CPU.attention_backend) == ("gloo", "cpu_fused")
    assert not (CPU.cuda_graphs or CPU.fp8_tensor_cores or CPU.pinned_memory or CPU.host_reads_sync)
    assert CPU.native_fp8 == () and CPU.describe().startswith("cpu (")
    assert not CPU.host_tensor([1, 2], torch.int64).is_pinned()


@pytest.mark.parametrize(("capability", "gcn_arch", "tensor_cores", "native"), [
    ((9, 0), None, True, ("fp8_e4m3", "fp8_e5m2")),      # H100
    ((8, 9), None, False, ("fp8_e4m3", "fp8_e5m2")),     # L4, RTX 4090: FP8 conversion, no FP8 _scaled_mm
    ((8, 0), None, False, ()),                           # A100
    ((9, 4), "gfx942:sramecc+:xnack-", False, ("fp8_e4m3fnuz",)),   # MI300X under ROCm
    ((9, 0), "gfx90a", False, ()),                       # MI250
])
def test_a_gpu_platform_is_resolved_once_from_torch(monkeypatch, capability, gcn_arch, tensor_cores, native):
    _fake_gpu(monkeypatch, capability, gcn_arch)
    platform = Platform.resolve("auto")
    assert platform == Platform.cuda(capability, "Fake GPU", gcn_arch, 80 * 2**30, compute_units=132)
    assert platform.kind == "cuda" and platform.device == torch.device("cuda")
    assert (platform.collective_backend, platform.attention_backend) == ("nccl", "triton")
    assert platform.cuda_graphs and platform.pinned_memory and platform.host_reads_sync
    assert platform.fp8_tensor_cores is tensor_cores and platform.native_fp8 == native
    assert platform.describe() == f"cuda (Fake GPU, 80 GiB, compute capability {capability[0]}.{capability[1]})"


def test_a_platform_is_checked():
    with pytest.raises(ValueError, match=r"Platform.kind='mps' is not supported; choose one of: cpu, cuda"):
        Platform("mps")
    with pytest.raises(ValueError, match=r"Platform.capability=None must be given exactly for kind 'cuda'"):
        Platform("cuda")
    with pytest.raises(ValueError, match=r"Platform.capability=\(9, 0\) must be given exactly for kind 'cuda'"):
        Platform("cpu", capability=(9, 0))


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
    _fake_gpu(monkeypatch)   # past the GPU check: the option is the error
    with pytest.raises(ValueError, match=message):
        _config(tiny_llama, device="cuda", **option)
    assert _config(tiny_llama, device="cuda").platform.kind == "cuda"       # auto backends are fine there


def test_cuda_graphs_follow_the_platform_and_the_options(tiny_llama, monkeypatch):
    assert not _config(tiny_llama, device="cpu").uses_cuda_graphs
    _fake_gpu(monkeypatch)
    assert _config(tiny_llama, device="cuda").uses_cuda_graphs
    assert not _config(tiny_llama, device="cuda", enforce_eager=True).uses_cuda_graphs


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


def test_parts_read_the_platform(monkeypatch):
    """What used to re-read the device string: the attention backend of ``auto``, the sampler's argmax, the KV
    budget's memory."""
    monkeypatch.setitem(attention_backend.BACKENDS, "triton", lambda platform: "the triton backend")
    assert attention_backend.get_backend("auto", Platform.cuda((9, 0))) == "the triton backend"
    assert attention_backend.get_backend("auto", CPU) != "the triton backend"
    assert select_argmax(Platform.cuda((9, 0))) is argmax_reference
    monkeypatch.setattr(Platform, "memory_available", lambda self: 2 * 2**30 if self.kind == "cuda" else None)
    assert default_kv_cache_memory(Platform.cuda((9, 0))) == 2**29           # 25% of what is free
    assert default_kv_cache_memory(CPU) == 2 * 2**30                        # 25% of 8 GiB when unreadable


# ---- placement ---------------------------------------------------------------------------------------------------
def test_cache_and_codec_tensors_live_on_the_cache_device():
    """The meta device stands in for a GPU: every tensor the cache and its codec read is there, the scales'
    values are the CPU KVScales' (which stay on the CPU)."""
    fmt = resolve_kv_cache_dtype("fp8_e4m3", torch.bfloat16)
    k = torch.rand(2, 2, 1) + 0.5
    scales = KVScales(k=k, v=k * 2, granularity=ScaleGranularity.HEAD, source="test", made_for=None)
    codec = KVCodec.build(fmt, 16, rotation="hadamard", scales=scales)
    cache = PagedKVCache(CacheShape(2, 3, 2, 4, 16), codec, device="meta")
    assert all(t.device.type == "meta" for t in cache.tensors) and cache.codec.rotation is not None
    assert cache.codec.rotation.device.type == "meta"
    assert all(t.device.type == "meta" for t in cache.layer_scales(1))
    assert codec.layer_scales(1)[0].device.type == "cpu" and scales.k.device.type == "cpu"   # the original stays
    assert torch.equal(codec.layer_scales(1)[1], scales.v[1])
    dynamic = PagedKVCache(CacheShape(2, 3, 2, 4, 16), KVCodec.build(fmt, 16, scale_mode="dynamic"), device="meta")
    assert dynamic.k_token_scales is not None and dynamic.k_token_scales.device.type == "meta"
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


def _scaled_mm_device() -> str:
    """Where the W8A8 method's test runs ``torch._scaled_mm``: a GPU with FP8 tensor cores (the method's own
    device), else the CPU; a CPU torch whose ``_scaled_mm`` takes per-tensor scales only (torch 2.11's: "Now
    _scaled_mm only supports per-tensor scaling for CPU backend") cannot run the method's row-wise scales there,
    and the test is skipped, saying so."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9):
        return "cuda"
    a = torch.ones(16, 16).to(torch.float8_e4m3fn)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError as e:
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes no row-wise scales ({str(e).splitlines()[0]}) "
                    "and there is no GPU with FP8 tensor cores")
    return "cpu"


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [0, 1, 7])
def test_scaled_mm_method_equals_its_reference(bias, rows):
    device = _scaled_mm_device()
    backend = DenseBackend("torch", None, "fp8", fp8_scaled_mm=True)
    layer, weight = _layer(MergedLinear, backend, 64, 48, bias)
    assert isinstance(layer.method, ScaledMMFP8LinearMethod)
    assert layer.weight_fp8.dtype == torch.float8_e4m3fn and not hasattr(layer, "weight")
    codes, scale = quantize_fp8_rows(weight)
    assert torch.equal(layer.weight_fp8.view(torch.uint8), codes) and torch.equal(layer.scale_row[0], scale)
    x = torch.randn(2, rows, 64).to(torch.bfloat16)
    got = layer.to(device)(x.to(device)).cpu()
    assert got.shape == (2, rows, 48) and got.dtype == torch.bfloat16
    bias_cpu = None if layer.bias is None else layer.bias.cpu()
    want = scaled_mm_fp8_reference(x.reshape(-1, 64), codes, scale, bias_cpu).view(2, rows, 48)
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


def test_scaled_mm_is_chosen_only_for_fp8_on_gpus_with_fp8_tensor_cores():
    hopper = Platform.cuda((9, 0))
    assert select_dense_backend("auto", torch.bfloat16, "fp8", hopper).fp8_scaled_mm
    assert not select_dense_backend("auto", torch.bfloat16, None, hopper).fp8_scaled_mm
    ampere = select_dense_backend("auto", torch.bfloat16, "fp8", Platform.cuda((8, 0)))   # no FP8 tensor cores
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


def test_triton_on_a_gpu_refuses_4_bit_codes_above_head_dim_128(tmp_path, monkeypatch):
    """Compiled kernels read 4-bit codes up to head_dim 128 (kv8.kernels.triton.formats.COMPILED_PACKED_MAX_HEAD_DIM):
    on a GPU a model of head_dim 256 with a 4-bit side (one format or a K/V pair) is refused at
    load, naming the format, the side and the head_dim; int8 and FP8 are not. In Triton's interpreter every
    head_dim is read right, so nothing is refused."""
    from tests.helpers.tiny_models import make_tiny_model

    model = make_tiny_model(str(tmp_path / "d256"), "llama", head_dim=256)
    _fake_gpu(monkeypatch)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for name, side, fmt in (("int4_per_group32", "K", "int4_g32"), ("k8v4", "V", "int4_g32"),
                            ("fp4_e2m1", "K", "e2m1"), ("int8/int4", "V", "int4")):
        with pytest.raises(ValueError, match=rf"kv_cache_dtype='{name}': the triton attention backend \(the GPU "
                                             rf"path\) cannot read this format \({side}'s {fmt} codes at "
                                             r"head_dim=256: the compiled Triton attention reads 4-bit codes up to "
                                             r"head_dim 128 only"):
            _config(model, device="cuda", kv_cache_dtype=name)
    for name in ("int8_per_token_head", "fp8_e4m3", "auto"):
        assert _config(model, device="cuda", kv_cache_dtype=name).attention_backend == "auto"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert _config(model, device="cuda", kv_cache_dtype="k8v4").cache.is_pair
