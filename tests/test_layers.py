"""kv8's dense CPU kernels (kv8.model.cpu_dense: packed linear, fused RMSNorm / SiLU * up / RoPE) against
their plain torch references, and in the engine against torch's dense layers."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

import kv8.model.cpu_dense as cpu_dense
from kv8.engine.args import EngineArgs
from kv8.engine.engine import LLMEngine
from kv8.model.cpu_dense import (PackedLinear, linear_reference, load_dense_kernels, rmsnorm_reference,
                                 rope_reference, select_dense_backend, silu_mul_reference)
from kv8.native import KernelUnavailable, cpu_flags
from kv8.observer import EngineObserver
from kv8.sampling_params import SamplingParams

HAS_BF16 = {"avx512f", "avx512bw", "avx512_bf16"} <= set(cpu_flags().split())
needs_kernel = pytest.mark.skipif(not HAS_BF16, reason="the packed kernel needs AVX-512 BF16")


@pytest.fixture(scope="module")
def lib() -> cpu_dense.DenseKernels:
    return load_dense_kernels()


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
    assert select_dense_backend("auto", torch.bfloat16) == "cpu"


@needs_kernel
@pytest.mark.parametrize("n,k", [(576, 576), (192, 576), (50, 33), (33, 64), (1, 2), (7, 5), (960, 1536)])
@pytest.mark.parametrize("m", [1, 3, 12, 13, 25, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_the_reference(lib: cpu_dense.DenseKernels, n: int, k: int, m: int,
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
def test_rows_do_not_depend_on_the_batch(lib: cpu_dense.DenseKernels) -> None:
    layer = _linear(100, 96, True, seed=1)
    packed = PackedLinear(lib, [layer])
    x = torch.randn(37, 96).bfloat16()
    whole = packed(x)
    for i in (0, 11, 12, 13, 36):
        assert torch.equal(whole[i:i + 1], packed(x[i:i + 1]))
    assert torch.equal(whole[5:30], packed(x[5:30]))


@needs_kernel
def test_projections_packed_together_equal_separate_ones(lib: cpu_dense.DenseKernels) -> None:
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
def test_bad_inputs(lib: cpu_dense.DenseKernels) -> None:
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


def _bf16_steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 values lie between a and b (elementwise, same sign assumed where nonzero)."""
    ia = a.view(torch.int16).int()
    ib = b.view(torch.int16).int()
    return (ia - ib).abs()


@needs_kernel
@pytest.mark.parametrize("t,e", [(1, 576), (5, 64), (37, 100), (300, 576)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_kernel_matches_torch(lib: cpu_dense.DenseKernels, t: int, e: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(t * e)
    x = (torch.randn(t, e, generator=gen) * 3).bfloat16()
    res = (torch.randn(t, e, generator=gen) * 5).bfloat16() if with_residual else None
    w = (torch.rand(e, generator=gen) + 0.5).bfloat16()
    got, h = lib.rmsnorm(x, res, w, 1e-5)
    want, want_h = rmsnorm_reference(x, res, w, 1e-5)
    assert torch.equal(h, want_h)  # the residual stream is exact: one bf16 add
    # Same roundings; only the order of the row's fp32 sum of squares differs, which can move 1/rms by an
    # ulp and so a rounding by one bf16 step.
    assert int(_bf16_steps_apart(got, want).max()) <= 1
    assert float((got == want).float().mean()) >= 0.99


@needs_kernel
@pytest.mark.parametrize("t,i", [(1, 1536), (7, 40), (200, 1536)])
def test_silu_mul_kernel_matches_torch(lib: cpu_dense.DenseKernels, t: int, i: int) -> None:
    gen = torch.Generator().manual_seed(i)
    gu = (torch.randn(t, 2 * i, generator=gen) * 4).bfloat16()
    gu[0, :6] = torch.tensor([-100.0, -20.0, 0.0, 20.0, 100.0, -0.0]).bfloat16()  # saturation and zeros
    got, want = lib.silu_mul(gu), silu_mul_reference(gu)
    assert got.shape == (t, i)
    assert int(_bf16_steps_apart(got, want).max()) <= 1
    assert float((got == want).float().mean()) >= 0.99


@needs_kernel
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 9, 3, 64), (33, 6, 2, 16), (5, 4, 4, 128), (3, 2, 1, 40)])
def test_rope_kernel_matches_torch_exactly(lib: cpu_dense.DenseKernels, t: int, hq: int, hkv: int, d: int) -> None:
    gen = torch.Generator().manual_seed(d)
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=gen).bfloat16()
    pos = torch.randint(0, 8000, (t,), generator=gen).float()
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    freqs = pos.unsqueeze(1) * inv.unsqueeze(0)
    got = lib.rope_qkv(qkv, freqs.cos(), freqs.sin(), hq, hkv, d)
    want = rope_reference(qkv, freqs.cos(), freqs.sin(), hq, hkv, d)
    for g, w in zip(got, want):
        assert g.is_contiguous() and torch.equal(g, w)


@needs_kernel
def test_elementwise_kernels_reject_bad_inputs(lib: cpu_dense.DenseKernels) -> None:
    with pytest.raises(ValueError, match="x must be a 2-D bfloat16 tensor"):
        lib.rmsnorm(torch.randn(2, 8), None, torch.ones(8).bfloat16(), 1e-5)
    with pytest.raises(ValueError, match="weight must be bfloat16 \\[8\\]"):
        lib.rmsnorm(torch.randn(2, 8).bfloat16(), None, torch.ones(4).bfloat16(), 1e-5)
    with pytest.raises(ValueError, match="residual \\[2, 4\\] must match x \\[2, 8\\]"):
        lib.rmsnorm(torch.randn(2, 8).bfloat16(), torch.randn(2, 4).bfloat16(), torch.ones(8).bfloat16(), 1e-5)
    with pytest.raises(ValueError, match="gate_up has 7 columns"):
        lib.silu_mul(torch.randn(2, 7).bfloat16())
    with pytest.raises(ValueError, match="qkv has 10 columns"):
        lib.rope_qkv(torch.randn(2, 10).bfloat16(), torch.zeros(2, 2), torch.zeros(2, 2), 1, 1, 4)
    with pytest.raises(ValueError, match="cos must be float32 \\[2, 2\\]"):
        lib.rope_qkv(torch.randn(2, 12).bfloat16(), torch.zeros(2, 2).bfloat16(), torch.zeros(2, 2), 1, 1, 4)


def test_backend_selection() -> None:
    assert select_dense_backend("torch", torch.bfloat16) == "torch"
    assert select_dense_backend("auto", torch.float32) == "torch"
    with pytest.raises(ValueError, match="dense_backend='fast' is not known; choose one of: auto, torch, cpu"):
        select_dense_backend("fast", torch.bfloat16)
    with pytest.raises(ValueError, match="needs dtype bfloat16"):
        select_dense_backend("cpu", torch.float32)


def test_missing_compiler_falls_back_once_or_raises(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CXX", "kv8-no-such-compiler")
    monkeypatch.setenv("KV8_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_dense, "_LOADED", [])
    monkeypatch.setattr(cpu_dense, "_FAILED", [])
    monkeypatch.setattr(cpu_dense, "_auto_fallback_logged", False)
    with caplog.at_level(logging.WARNING, logger="kv8"):
        assert select_dense_backend("auto", torch.bfloat16) == "torch"
        assert select_dense_backend("auto", torch.bfloat16) == "torch"
    warnings = [r for r in caplog.records if "CPU kernels are unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "kv8-no-such-compiler" in warnings[0].getMessage()
    with pytest.raises(KernelUnavailable, match="not on PATH"):
        select_dense_backend("cpu", torch.bfloat16)


def _prefill_logits(model: str, dense_backend: str, prompt: list[int], **kw: object) -> tuple[torch.Tensor, list[int]]:
    rows: list[torch.Tensor] = []

    class Rows(EngineObserver):
        def on_prompt_logits(self, request_id: str, start: int, logits: torch.Tensor) -> None:
            rows.append(logits)

    engine = LLMEngine(EngineArgs(model=model, dtype="bfloat16", dense_backend=dense_backend, num_kv_blocks=16,
                                  max_model_len=128, kv_cache_dtype="fp8_e4m3", **kw), Rows())  # type: ignore[arg-type]
    assert engine.dense_backend == dense_backend
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=0))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens = list(out.outputs[0].token_ids)
    return torch.cat(rows), tokens


@needs_kernel
@pytest.mark.parametrize("name,kw", [("llama_gqa", {}), ("qwen2", {}),
                                     ("llama_gqa", {"kv_cache_rotation": "hadamard"})])
def test_engine_with_cpu_kernels_matches_torch(tiny_models: dict[str, str], name: str, kw: dict) -> None:
    """Same model in bf16 with torch's dense layers and with kv8's kernels (Qwen2: q/k/v biases; with a
    rotated cache): the logits of every prompt position agree to bf16 rounding noise."""
    prompt = [3 + (7 * i) % 40 for i in range(40)]
    ref, _ = _prefill_logits(tiny_models[name], "torch", prompt, **kw)
    got, tokens = _prefill_logits(tiny_models[name], "cpu", prompt, **kw)
    assert got.shape == ref.shape and len(tokens) == 4
    assert float((got - ref).abs().max()) <= 0.05 * float(ref.std())
    assert float((got.argmax(-1) == ref.argmax(-1)).float().mean()) >= 0.95


def test_engine_config_rejects_cpu_kernels_for_float32(tiny_models: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="dense_backend='cpu' needs dtype bfloat16"):
        LLMEngine(EngineArgs(model=tiny_models["llama"], dtype="float32", dense_backend="cpu",
                             num_kv_blocks=8, max_model_len=64))
    with pytest.raises(ValueError, match="dense_backend='x' is not known"):
        LLMEngine(EngineArgs(model=tiny_models["llama"], dense_backend="x", num_kv_blocks=8, max_model_len=64))
