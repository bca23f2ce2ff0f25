"""The packed bf16 linear kernel (kv8.model.cpu_linear) against its plain torch reference, and in the engine."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import kv8.model.cpu_linear as cpu_linear
from kv8.engine.args import EngineArgs
from kv8.engine.engine import LLMEngine
from kv8.model.cpu_linear import PackedLinear, linear_reference, load_linear_kernels, select_linear_backend
from kv8.native import KernelUnavailable, cpu_flags
from kv8.sampling_params import SamplingParams

HAS_BF16 = {"avx512f", "avx512bw", "avx512_bf16"} <= set(cpu_flags().split())
needs_kernel = pytest.mark.skipif(not HAS_BF16, reason="the packed kernel needs AVX-512 BF16")


@pytest.fixture(scope="module")
def lib() -> cpu_linear.LinearKernels:
    return load_linear_kernels()


def _linear(out_features: int, in_features: int, bias: bool, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    layer = nn.Linear(in_features, out_features, bias=bias).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.normal_()
        if bias:
            layer.bias.normal_()
    return layer


def test_the_kernel_exists_on_this_machine() -> None:
    """This project's machine has AVX-512 BF16; the kernel must build and load there."""
    assert HAS_BF16
    assert select_linear_backend("auto", torch.bfloat16) == "cpu_packed"


@needs_kernel
@pytest.mark.parametrize("n,k", [(576, 576), (192, 576), (50, 33), (33, 64), (1, 2), (7, 5), (960, 1536)])
@pytest.mark.parametrize("m", [1, 3, 12, 13, 25, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_the_reference(lib: cpu_linear.LinearKernels, n: int, k: int, m: int,
                                             bias: bool) -> None:
    layer = _linear(n, k, bias, seed=n * 1000 + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    got = PackedLinear(lib, [layer])(x)
    ref = linear_reference(x, layer.weight, layer.bias)
    exact = (x.double() @ layer.weight.double().T + (layer.bias.double() if bias else 0.0))
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # One rounding to bf16 (at most a bf16 step, 2^-7 relative) of an fp32 sum (whose rounding errors are
    # bounded by the sum of |products| times a small multiple of 2^-24); the torch reference rounds the same
    # way and mostly lands on the same bf16 value.
    abs_sum = x.double().abs() @ layer.weight.double().abs().T + (layer.bias.double().abs() if bias else 0.0)
    step = exact.abs() * 2.0 ** -7 + abs_sum * 2.0 ** -16
    assert bool(((got.double() - exact).abs() <= step).all())
    assert float((got == ref).float().mean()) >= 0.97


@needs_kernel
def test_rows_do_not_depend_on_the_batch(lib: cpu_linear.LinearKernels) -> None:
    layer = _linear(100, 96, True, seed=1)
    packed = PackedLinear(lib, [layer])
    x = torch.randn(37, 96).bfloat16()
    whole = packed(x)
    for i in (0, 11, 12, 13, 36):
        assert torch.equal(whole[i:i + 1], packed(x[i:i + 1]))
    assert torch.equal(whole[5:30], packed(x[5:30]))


@needs_kernel
def test_projections_packed_together_equal_separate_ones(lib: cpu_linear.LinearKernels) -> None:
    q, k, v = _linear(96, 64, True, 1), _linear(32, 64, False, 2), _linear(32, 64, True, 3)
    fused = PackedLinear(lib, [q, k, v])
    assert fused.sizes == [96, 32, 32] and fused.out_features == 160
    x = torch.randn(2, 5, 64).bfloat16()  # leading dims are kept
    out = fused(x)
    assert out.shape == (2, 5, 160)
    parts = out.split(fused.sizes, dim=-1)
    for part, layer in zip(parts, (q, k, v)):
        assert torch.equal(part, PackedLinear(lib, [layer])(x))


@needs_kernel
def test_bad_inputs(lib: cpu_linear.LinearKernels) -> None:
    layer = _linear(8, 16, False, 0)
    packed = PackedLinear(lib, [layer])
    with pytest.raises(ValueError, match="bfloat16 input, got torch.float32"):
        packed(torch.randn(2, 16))
    with pytest.raises(ValueError, match="input has 15 features, the layer 16"):
        packed(torch.randn(2, 15).bfloat16())
    with pytest.raises(ValueError, match="share in_features"):
        PackedLinear(lib, [layer, _linear(8, 32, False, 0)])
    with pytest.raises(ValueError, match="2-D bfloat16"):
        lib.pack(torch.randn(4, 4))
    assert packed(torch.empty(0, 16, dtype=torch.bfloat16)).shape == (0, 8)


def test_backend_selection() -> None:
    assert select_linear_backend("torch", torch.bfloat16) == "torch"
    assert select_linear_backend("auto", torch.float32) == "torch"
    with pytest.raises(ValueError, match="linear_backend='fast' is not known; choose one of: auto, torch, cpu_packed"):
        select_linear_backend("fast", torch.bfloat16)
    with pytest.raises(ValueError, match="needs dtype bfloat16"):
        select_linear_backend("cpu_packed", torch.float32)


def test_missing_compiler_falls_back_once_or_raises(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CXX", "kv8-no-such-compiler")
    monkeypatch.setenv("KV8_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_linear, "_LOADED", [])
    monkeypatch.setattr(cpu_linear, "_FAILED", [])
    monkeypatch.setattr(cpu_linear, "_auto_fallback_logged", False)
    with caplog.at_level(logging.WARNING, logger="kv8"):
        assert select_linear_backend("auto", torch.bfloat16) == "torch"
        assert select_linear_backend("auto", torch.bfloat16) == "torch"
    warnings = [r for r in caplog.records if "packed CPU kernel is unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "kv8-no-such-compiler" in warnings[0].getMessage()
    with pytest.raises(KernelUnavailable, match="not on PATH"):
        select_linear_backend("cpu_packed", torch.bfloat16)


def _prefill_logits(model: str, linear_backend: str, prompt: list[int]) -> tuple[torch.Tensor, list[int]]:
    engine = LLMEngine(EngineArgs(model=model, dtype="bfloat16", linear_backend=linear_backend, num_kv_blocks=16,
                                  max_model_len=128, kv_cache_dtype="fp8_e4m3"))
    assert engine.linear_backend == linear_backend
    rows: list[torch.Tensor] = []
    engine.runner.prompt_logits_hook = lambda rid, start, logits: rows.append(logits)
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    return torch.cat(rows), tokens


@needs_kernel
@pytest.mark.parametrize("name", ["llama_gqa", "qwen2"])
def test_engine_with_packed_linears_matches_torch_linears(tiny_models: dict[str, str], name: str) -> None:
    """Same model in bf16 with torch's and with the packed linear layers (Qwen2: q/k/v biases): the logits of
    every prompt position agree to bf16 rounding noise."""
    prompt = [3 + (7 * i) % 40 for i in range(40)]
    ref, _ = _prefill_logits(tiny_models[name], "torch", prompt)
    got, tokens = _prefill_logits(tiny_models[name], "cpu_packed", prompt)
    assert got.shape == ref.shape and len(tokens) == 4
    assert float((got - ref).abs().max()) <= 0.05 * float(ref.std())
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.95


def test_engine_config_rejects_packed_linears_for_float32(tiny_models: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="linear_backend='cpu_packed' needs dtype bfloat16"):
        LLMEngine(EngineArgs(model=tiny_models["llama"], dtype="float32", linear_backend="cpu_packed",
                             num_kv_blocks=8, max_model_len=64))
    with pytest.raises(ValueError, match="linear_backend='x' is not known"):
        LLMEngine(EngineArgs(model=tiny_models["llama"], linear_backend="x", num_kv_blocks=8, max_model_len=64))
