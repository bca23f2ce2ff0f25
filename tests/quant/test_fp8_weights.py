"""``quantization="fp8"``: E4M3 weights with a scale per output row (kv8.quant.weights), the packed kernel that
reads them (``kv8_linear_fp8``) on both of its paths against a float64 reference, the layers' methods, the
option at the engine's boundary, and the real SmolLM2 with FP8 weights against its bf16 weights."""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np
import pytest
import torch

from kv8 import LLM, SamplingParams
from kv8.engine.args import EngineArgs
from kv8.kernels.cpu.build import KernelUnavailable
from kv8.kernels.cpu.dense import DenseKernels, load_dense_kernels, unpack_reference
from kv8.layers.activation import SiluAndMul
from kv8.layers.dense_backend import DenseBackend
from kv8.layers.linear import (
    GateUpLinear,
    Linear,
    LinearBase,
    PackedFP8LinearMethod,
    QKVLinear,
    RowParallelLinear,
    TorchFP8LinearMethod,
    linear_f32,
)
from kv8.layers.vocab_parallel import ParallelLMHead
from kv8.quant.formats import E4M3
from kv8.quant.weights import dequantize_fp8_rows, quantize_fp8_rows
from tests.helpers.kernels import amx_path, dense_build_or_skip
from tests.helpers.tiny_models import TINY_CONFIGS


def _kernels() -> DenseKernels | None:
    try:
        return load_dense_kernels()
    except KernelUnavailable:
        return None


_KERNELS = _kernels()


@pytest.fixture(scope="module", params=["native", "x86-64-v3"])
def lib(request: pytest.FixtureRequest) -> DenseKernels:
    """The engine's build, and the AVX2 path's where the native build is the AVX-512 one."""
    return dense_build_or_skip(request.param)


@pytest.fixture(params=["vdpbf16ps", "amx"])
def path(request: pytest.FixtureRequest, lib: DenseKernels):
    with amx_path(lib, request.param) as p:
        yield p


def _weight(n: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # rows of different magnitudes, so that each row's own scale matters
    return (torch.randn(n, k, generator=gen) * torch.exp2(torch.randint(-6, 3, (n, 1), generator=gen))).bfloat16()


# ---- quantizer ----------------------------------------------------------------------------------------------------

def test_rows_are_quantized_to_e4m3_with_their_own_scale() -> None:
    w = _weight(40, 72, seed=1)
    w[7] = 0.0
    codes, scale = quantize_fp8_rows(w)
    assert codes.dtype == torch.uint8 and codes.shape == w.shape and scale.dtype == torch.float32
    amax = w.float().abs().amax(dim=1)
    assert scale[7] == 1.0 and bool((codes[7] == 0).all())
    live = amax > 0
    assert torch.equal(scale[live], amax[live] / 448.0)
    # the codes are ml_dtypes' float8_e4m3fn rounding of w / scale (an independent encoder)
    want = (w.float() / scale[:, None]).numpy().astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(codes.numpy(), want)
    # each row's largest magnitude is the format's largest finite value, so nothing saturates
    assert bool((E4M3.decode(codes).abs().amax(dim=1)[live] == 448.0).all())
    back = dequantize_fp8_rows(codes, scale)
    assert bool(((back - w.float()).abs() <= w.float().abs() * 2.0 ** -4 + scale[:, None] * 2.0 ** -9).all())


def test_whole_row_maxima_set_the_scales_of_a_shard() -> None:
    w = _weight(8, 64, seed=2)
    full = w.float().abs().amax(dim=1)
    codes, scale = quantize_fp8_rows(w[:, :32], full)   # a rank's half of each row, the whole rows' maxima
    assert torch.equal(scale, full / 448.0)
    assert torch.equal(codes, quantize_fp8_rows(w, full)[0][:, :32])
    with pytest.raises(ValueError, match="at least the row's largest magnitude"):
        quantize_fp8_rows(w, full / 2)


def test_the_quantizer_rejects_what_it_cannot_quantize() -> None:
    with pytest.raises(ValueError, match="2-D float"):
        quantize_fp8_rows(torch.zeros(4, dtype=torch.int32).view(2, 2))
    with pytest.raises(ValueError, match="non-finite"):
        quantize_fp8_rows(torch.tensor([[1.0, float("inf")]]))


# ---- kernel -------------------------------------------------------------------------------------------------------

def _reference(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """float64: sum_k x * decode(code), times the row's scale, plus the bias (unrounded)."""
    y = (x.double() @ E4M3.decode(codes).double().T) * scale.double()
    return y + bias.double() if bias is not None else y


@pytest.mark.parametrize("n,k", [(96, 64), (100, 576), (33, 1536), (7, 30), (50, 33)])
@pytest.mark.parametrize("m", [1, 3, 5, 17, 33, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_kernel_matches_the_float64_reference(lib: DenseKernels, path: str, n: int, k: int, m: int,
                                                  bias: bool) -> None:
    """Both paths (AMX where K % 32 == 0: M <= 32 decodes each k step ahead of the tiles, larger M whole panels
    once per call; vdpbf16ps: M <= 192 decodes each pair-row in registers for every block of up to 10 rows, larger
    M decodes groups of panels once per call), odd N and K, one rounding to bf16 of an fp32 sum."""
    codes, scale = quantize_fp8_rows(_weight(n, k, seed=n + k))
    b = torch.randn(n, generator=torch.Generator().manual_seed(3)) if bias else None
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    got = lib.linear(x, lib.pack_fp8(codes), n, b, scale=scale)
    exact = _reference(x, codes, scale, b)
    abs_sum = (x.double().abs() @ E4M3.decode(codes).double().abs().T) * scale.double()
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert bool(((got.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + abs_sum * 2.0 ** -16).all())


@pytest.mark.parametrize("n,k", [(50, 33), (7, 30), (96, 64), (40, 601)])
@pytest.mark.parametrize("m", [1, 3, 17, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_avx2_fp8_kernel_is_the_sum_of_its_decoded_weights_bit_for_bit(lib: DenseKernels, n: int, k: int, m: int,
                                                                     bias: bool) -> None:
    """The AVX2 path's contract exactly: the codes decoded to their E4M3 values times 2^-8, float32 sums in k order,
    then acc * (scale * 256) + bias with one rounding to float32 (float64 here: acc * scale is exact in it) and to
    bf16."""
    if lib.isa != "avx2":
        pytest.skip("the AVX-512 path sums two products per vdpbf16ps (tested against the float64 reference above)")
    codes, scale = quantize_fp8_rows(_weight(n, k, seed=n * k))
    b = torch.randn(n, generator=torch.Generator().manual_seed(3)) if bias else None
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    got = lib.linear(x, lib.pack_fp8(codes), n, b, scale=scale)
    assert torch.equal(got.view(torch.int16), _avx2_sums(x, codes, scale, b).view(torch.int16))


def _avx2_sums(x: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """The AVX2 path's result: float32 sums of x * decode(code) * 2^-8 in k order, times scale * 256, plus b."""
    xf, w = x.float(), E4M3.decode(codes).float() * 2.0 ** -8
    acc = torch.zeros(x.shape[0], codes.shape[0])
    for j in range(codes.shape[1]):
        acc = acc + xf[:, j:j + 1] * w[:, j]
    y = acc.double() * (scale * 256.0).double() + (b.double() if b is not None else 0.0)
    return y.float().bfloat16()


@pytest.mark.parametrize("n", [200, 333])
@pytest.mark.parametrize("k", [33, 601])
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("large", [False, True])
def test_avx2_fp8_one_row_in_passes_of_panels_bit_for_bit(lib: DenseKernels, n: int, k: int, threads: int,
                                                         large: bool) -> None:
    """One row of FP8 weights walks each thread's run of panels two at a time (one where one is left), prefetching
    past each panel into the next pass's, with x scaled by 2^112 or, with a |x| >= 2^16 (large), the weights: runs of 2
    to 11 panels and a partial last panel give the bits of the k-order sums of the decoded weights."""
    if lib.isa != "avx2":
        pytest.skip("the AVX2 path's one-row kernel")
    codes, scale = quantize_fp8_rows(_weight(n, k, seed=n * k))
    b = torch.randn(n, generator=torch.Generator().manual_seed(3))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(n)).bfloat16()
    if large:
        x[0, 5] = 3.0e5
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = lib.linear(x, lib.pack_fp8(codes), n, b, scale=scale)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(got.view(torch.int16), _avx2_sums(x, codes, scale, b).view(torch.int16))


@pytest.mark.parametrize("m", [1, 3, 17])
def test_avx2_fp8_rows_with_large_x_keep_their_bits(lib: DenseKernels, m: int) -> None:
    """The AVX2 path widens x times 2^112 (its decoded weights are the E4M3 values times 2^-120), which would overflow
    where |x| >= 2^16: a chunk of rows with such a value multiplies the decoded weights by 2^112 instead. Its rows have
    the bits of the exact sums, and the other rows those of a call without the large row."""
    if lib.isa != "avx2":
        pytest.skip("the AVX2 path's scaling of x")
    codes, scale = quantize_fp8_rows(_weight(70, 96, seed=9))
    b = torch.randn(70, generator=torch.Generator().manual_seed(3))
    x = torch.randn(m + 1, 96, generator=torch.Generator().manual_seed(m)).bfloat16()
    x[0, 5], x[0, 50] = 3.0e5, -7.0e4
    packed = lib.pack_fp8(codes)
    got = lib.linear(x, packed, 70, b, scale=scale)
    assert torch.equal(got.view(torch.int16), _avx2_sums(x, codes, scale, b).view(torch.int16))
    assert torch.equal(got[:1], lib.linear(x[:1], packed, 70, b, scale=scale))
    assert torch.equal(got[1:], lib.linear(x[1:], packed, 70, b, scale=scale))


def test_the_kernel_decodes_every_code_exactly(lib: DenseKernels, path: str) -> None:
    """All 254 non-NaN E4M3 codes (subnormals, both zeros, the largest) times one-hot rows of x with scale 1:
    each output is one decoded weight, which bf16 holds exactly."""
    codes = torch.arange(256, dtype=torch.int64).to(torch.uint8)
    codes[(codes == 0x7F) | (codes == 0xFF)] = 0
    codes = codes.view(8, 32)                       # N = 8 rows of K = 32 codes
    x = torch.eye(32).bfloat16()                    # M = 32 one-hot rows
    got = lib.linear(x, lib.pack_fp8(codes), 8, None, scale=torch.ones(8))
    assert torch.equal(got.float(), E4M3.decode(codes).T)


def test_fp8_packing_holds_each_code_once(lib: DenseKernels) -> None:
    codes = torch.arange(70 * 10, dtype=torch.int64).remainder(255).to(torch.uint8).view(70, 10)
    packed = lib.pack_fp8(codes)
    assert packed.dtype == torch.uint8 and packed.numel() == 96 * 10   # N padded to 96, K even
    assert torch.equal(torch.sort(packed).values[-700:], torch.sort(codes.flatten()).values[-700:])
    with pytest.raises(ValueError, match="2-D uint8"):
        lib.pack_fp8(codes.float())


def test_fp8_rows_do_not_depend_on_the_batch(lib: DenseKernels, path: str) -> None:
    """M <= 32 (AMX: decoded per k step) and M = 40 (AMX: whole panels decoded first; vdpbf16ps: four blocks of
    ten rows, each decoding in registers) give every row the bits of a one-row call."""
    codes, scale = quantize_fp8_rows(_weight(100, 96, seed=5))
    packed = lib.pack_fp8(codes)
    x = torch.randn(40, 96).bfloat16()
    whole = lib.linear(x, packed, 100, None, scale=scale)
    for i in (0, 17, 39):
        assert torch.equal(whole[i:i + 1], lib.linear(x[i:i + 1], packed, 100, None, scale=scale))
    assert torch.equal(whole[3:30], lib.linear(x[3:30], packed, 100, None, scale=scale))


@pytest.mark.parametrize("gated", [False, True])
def test_fp8_codes_in_registers_or_in_a_buffer_give_the_same_bits(lib: DenseKernels, path: str, gated: bool) -> None:
    """``fp8_register_rows`` (the per-machine switch, :data:`kv8.kernels.cpu.dense.FP8_REGISTER_ROWS`): a call of up
    to that many rows decodes each pair-row in registers per block of rows, a longer one a few panels at a time into a
    buffer. Every row count gives the same bits both ways (the same sums in the same order), gated or not, and the
    float64 reference's value; a negative count is refused."""
    n, k = (80, 64) if gated else (100, 576)
    codes, scale = quantize_fp8_rows(_weight(2 * n if gated else n, k, seed=21))
    if gated:
        codes, scale = lib.interleave_gate_up(codes), lib.interleave_gate_up(scale).contiguous()
    packed = lib.pack_fp8(codes)
    b = torch.randn(codes.shape[0], generator=torch.Generator().manual_seed(5))
    for m in (1, 9, 16, 17, 40, 200):
        x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
        runs = [lib.linear(x, packed, n, b, gated=gated, scale=scale, fp8_register_rows=r) for r in (0, 16, 192, 500)]
        assert all(torch.equal(runs[0], other) for other in runs[1:]), m
        if not gated:
            exact = _reference(x, codes, scale, b)
            abs_sum = (x.double().abs() @ E4M3.decode(codes).double().abs().T) * scale.double()
            assert bool(((runs[0].double() - exact).abs() <= exact.abs() * 2.0 ** -8 + abs_sum * 2.0 ** -16).all())
    with pytest.raises(ValueError, match=r"fp8_register_rows=-1 must be >= 0"):
        lib.linear(x, packed, n, b, gated=gated, scale=scale, fp8_register_rows=-1)


def test_the_register_rows_switch_is_the_backends_and_reaches_the_method(lib: DenseKernels) -> None:
    """``DenseBackend.fp8_register_rows``: other than the fixed rule only for packed_bf16 with FP8 weights (refused
    elsewhere, naming the field), named in the label, and handed to the FP8 method; the layer's outputs keep their
    bits."""
    from kv8.kernels.cpu.dense import FP8_REGISTER_ROWS
    from kv8.layers.linear import linear_method

    short = DenseBackend("packed_bf16", lib, "fp8", fp8_register_rows=16)
    assert short.label == "packed_bf16+fp8_buffer_from_17"
    assert DenseBackend("packed_bf16", lib, "fp8", wide_rows=512, fp8_register_rows=16).label == \
        "packed_bf16+f32_from_512+fp8_buffer_from_17"
    assert DenseBackend("packed_bf16", lib, "fp8").label == "packed_bf16"
    method = linear_method(short)
    assert isinstance(method, PackedFP8LinearMethod) and method.register_rows == 16
    plain = linear_method(DenseBackend("packed_bf16", lib, "fp8"))
    assert isinstance(plain, PackedFP8LinearMethod) and plain.register_rows == FP8_REGISTER_ROWS
    for kwargs in (dict(name="packed_bf16", kernels=lib, quantization=None), dict(name="torch", quantization="fp8"),
                   dict(name="packed_bf16", kernels=lib, quantization="gguf")):
        with pytest.raises(ValueError, match=r"fp8_register_rows=16: >= 0, and other than 192 only for packed_bf16 "
                                             r"with quantization='fp8'"):
            DenseBackend(fp8_register_rows=16, **kwargs)   # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"fp8_register_rows=-1"):
        DenseBackend("packed_bf16", lib, "fp8", fp8_register_rows=-1)
    w = _weight(96, 64, 8)
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(9)).bfloat16()
    fast, slow = (_loaded(RowParallelLinear(64, 96, False, backend), [(None, w)])
                  for backend in (short, DenseBackend("packed_bf16", lib, "fp8")))
    assert torch.equal(fast(x), slow(x))
    seen: list[object] = []

    class Spy:   # the kernels, recording what the method passes
        def __getattr__(self, name: str) -> object:
            return getattr(lib, name)

        def linear(self, *args: object, **kwargs: object) -> torch.Tensor:
            seen.append(kwargs.get("fp8_register_rows"))
            return lib.linear(*args, **kwargs)   # type: ignore[arg-type]

    fast.method.kernels = Spy()   # type: ignore[union-attr, assignment]
    assert torch.equal(fast(x), slow(x)) and seen == [16]


def test_fp8_panels_decoded_in_groups_give_the_rows_of_one_row_calls(lib: DenseKernels, path: str) -> None:
    """M = 200 rows (two chunks of 192) and 32 panels of K = 1,536 codes: each thread decodes its panels a group
    at a time (1 MiB of bf16: 10 panels) and both chunks pass over every group. Every row has the bits of a
    one-row call (which decodes in registers, or each k step ahead on AMX) and the float64 reference's value."""
    codes, scale = quantize_fp8_rows(_weight(1000, 1536, seed=11))
    packed = lib.pack_fp8(codes)
    b = torch.randn(1000, generator=torch.Generator().manual_seed(4))
    x = torch.randn(200, 1536, generator=torch.Generator().manual_seed(6)).bfloat16()
    whole = lib.linear(x, packed, 1000, b, scale=scale)
    for i in (0, 150, 191, 192, 199):
        assert torch.equal(whole[i:i + 1], lib.linear(x[i:i + 1], packed, 1000, b, scale=scale))
    exact = _reference(x, codes, scale, b)
    abs_sum = (x.double().abs() @ E4M3.decode(codes).double().abs().T) * scale.double()
    assert bool(((whole.double() - exact).abs() <= exact.abs() * 2.0 ** -8 + abs_sum * 2.0 ** -16).all())


@pytest.mark.parametrize("n,k", [(50, 33), (7, 5), (96, 130), (64, 576), (1, 2)])
def test_unpack_decodes_the_codes_times_their_scales_bit_for_bit(lib: DenseKernels, n: int, k: int) -> None:
    """The C++ unpack of FP8 panels (each path's byte order) and its torch reference: ``decode(code) * scale`` of
    every row, as :func:`dequantize_fp8_rows` computes it in float32, from any panel on; every code but NaN."""
    gen = torch.Generator().manual_seed(n * 3 + k)
    codes = torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x01   # the NaN codes (the quantizer never writes them)
    scale = torch.rand(n, generator=gen) * torch.exp2(torch.randint(-20, 10, (n,), generator=gen).float())
    packed = lib.pack_fp8(codes)
    want = dequantize_fp8_rows(codes, scale, torch.float32)
    assert torch.equal(lib.unpack(packed, 0, n, k, scale=scale), want)
    assert torch.equal(unpack_reference(packed, 0, n, k, scale, lib.isa), want)
    if n > 32:
        assert torch.equal(lib.unpack(packed, 32, n - 32, k, scale=scale), want[32:])
        assert torch.equal(unpack_reference(packed, 32, 3, k, scale, lib.isa), want[32:35])
    with pytest.raises(ValueError, match="scale must be a contiguous 1-D float32 tensor of at least"):
        lib.unpack(packed, 0, n, k, scale=scale[:-1])
    with pytest.raises(ValueError, match="1-D torch.uint8 tensor"):   # bf16 panels have no scale
        lib.unpack(lib.pack(codes.bfloat16()), 0, n, k, scale=scale)


# ---- layers -------------------------------------------------------------------------------------------------------

def _loaded(layer: LinearBase, shards: list[tuple[object, torch.Tensor]]) -> LinearBase:
    layer.weight = torch.nn.Parameter(torch.empty_like(layer.weight, dtype=torch.bfloat16), requires_grad=False)
    for shard_id, w in shards:
        layer.weight_loader(layer.weight, w, shard_id)  # type: ignore[arg-type]
    layer.process_weights_after_loading()
    return layer


def test_fp8_layers_on_the_kernel_match_the_torch_method(lib: DenseKernels, path: str) -> None:
    """QKV, o_proj-style and gate/up (SiLU fused into the FP8 kernel) layers: the kernel against torch on the
    same quantized weights; the LM head and a plain Linear keep their bf16 weights."""
    fp8 = DenseBackend("packed_bf16", lib, "fp8")
    torch_fp8 = DenseBackend("torch", None, "fp8")
    wq, wk, wv = _weight(96, 64, 1), _weight(32, 64, 2), _weight(32, 64, 3)
    wg, wu, wo = _weight(80, 64, 4), _weight(80, 64, 5), _weight(64, 96, 6)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(64, 64, generator=gen).bfloat16()   # 64 rows: a few blocks on each path
    for make, shards, inp in (
        (lambda b: QKVLinear(64, 16, 6, 2, False, b), [("q", wq), ("k", wk), ("v", wv)], x),
        (lambda b: RowParallelLinear(96, 64, False, b), [(None, wo)], torch.randn(64, 96, generator=gen).bfloat16()),
    ):
        fast, ref = _loaded(make(fp8), shards), _loaded(make(torch_fp8), shards)
        assert isinstance(fast.method, PackedFP8LinearMethod) and isinstance(ref.method, TorchFP8LinearMethod)
        assert fast.packed.dtype == torch.uint8 and not hasattr(fast, "weight")
        got, want = fast(inp).float(), ref(inp).float()
        assert got.shape == want.shape
        # torch multiplies by decode * scale rounded to bf16, the kernel by the exact decode, scaled after the sum
        row_max = want.abs().amax(dim=-1, keepdim=True)
        assert bool(((got - want).abs() <= row_max * 2.0 ** -6 + 1e-3).all()), (got - want).abs().max()
    # gate/up with SiLU * up fused: both against the float64 value of their arithmetic. The kernel rounds g and u to
    # bf16, then silu(g), then the product (four roundings, each within 2^-8 relative: bf16 keeps 8 significant
    # bits); torch also rounds each weight to bf16 before the sum (2^-8 of each term). Products of large g and u
    # (here up to ~800) move by several bf16 steps that way, so neither is a tight oracle of the other.
    fast = _loaded(GateUpLinear(64, 80, False, fp8, SiluAndMul(fp8)), [(0, wg), (1, wu)])
    ref = _loaded(GateUpLinear(64, 80, False, torch_fp8, SiluAndMul(torch_fp8)), [(0, wg), (1, wu)])
    assert isinstance(fast.method, PackedFP8LinearMethod) and isinstance(ref.method, TorchFP8LinearMethod)
    (cg, sg), (cu, su) = quantize_fp8_rows(wg), quantize_fp8_rows(wu)
    w_gate = E4M3.decode(cg).double() * sg.double()[:, None]
    w_up = E4M3.decode(cu).double() * su.double()[:, None]
    g, u = x.double() @ w_gate.T, x.double() @ w_up.T
    sum_g, sum_u = x.double().abs() @ w_gate.abs().T, x.double().abs() @ w_up.abs().T   # the terms' sizes
    exact = torch.nn.functional.silu(g) * u
    rounding = 2.0 ** -8 * (4 * exact.abs() + 1.1 * g.abs() * u.abs())
    for out, weights in ((fast(x), 0.0), (ref(x), 2.0 ** -8)):   # torch: + the weights' rounding through g and u
        bound = rounding + weights * (1.1 * sum_g * u.abs() + sum_u * (g.abs() + 0.3)) + 1e-3
        err = (out.double() - exact).abs()
        assert bool((err <= bound).all()), (weights, (err / bound).max())
    gate_up = _loaded(GateUpLinear(64, 80, False, fp8, SiluAndMul(fp8)), [(0, wg), (1, wu)])
    assert gate_up.fuses_silu
    assert torch.equal(gate_up(x), SiluAndMul(fp8)(gate_up.method.apply(gate_up, x)))
    for kept in (Linear(64, 32, False, fp8), ParallelLMHead(64, 32, fp8)):
        assert kept.method.name == "packed_bf16"


def test_the_option_is_validated_at_the_boundary() -> None:
    hf = dict(model_type="llama", vocab_size=10, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    assert EngineArgs(quantization="fp8").create_engine_config(hf, "hf", "/m").quantization == "fp8"
    with pytest.raises(ValueError, match=r"quantization='int4' is not supported; choose one of: fp8"):
        EngineArgs(quantization="int4").create_engine_config(hf, "hf", "/m")
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser, include=["quantization"])
    assert parser.parse_args(["--quantization", "fp8"]).quantization == "fp8"
    assert parser.parse_args([]).quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "int8"])


@pytest.mark.parametrize("family", sorted(TINY_CONFIGS))
def test_every_family_runs_with_fp8_weights(tiny_models: dict[str, str], family: str) -> None:
    """Each tiny model family (merged q/k/v and gate/up, Phi-3's whole-tensor checkpoint, Gemma's GeGLU,
    sliding windows) in bf16 with FP8 weights: the decoder's layers take the FP8 method, the LM head keeps bf16,
    and the prompt's log-probabilities stay near the bf16 weights' (random weights: a few percent per weight)."""
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0, ignore_eos=True)
    logprobs, methods = {}, {}
    for q in (None, "fp8"):
        llm = LLM(tiny_models[family], quantization=q, kv_cache_memory="8MiB", max_model_len=256)
        out = llm.generate("hello world this is a test of the model", params)[0]
        logprobs[q] = torch.tensor([p[t].logprob for t, p in zip(out.prompt_token_ids[1:], out.prompt_logprobs[1:])])
        methods[q] = {m.method.name for m in llm.engine.model.modules() if isinstance(m, LinearBase)}
    fast = _KERNELS is not None
    assert methods[None] == {"packed_bf16" if fast else "torch"}
    assert methods["fp8"] == ({"packed_fp8", "packed_bf16"} if fast else {"torch_fp8", "torch"})
    diff = (logprobs["fp8"] - logprobs[None]).abs().max().item()
    assert 0 < diff < 0.5, diff


# ---- the real model -----------------------------------------------------------------------------------------------

TEXT = ("The river rises in the northern hills and flows south through a wide valley of farms and small towns. "
        "In the nineteenth century a canal was built beside it, and the towns grew as boats carried grain, coal "
        "and timber to the coast. Today the canal is used mostly by visitors, and the old warehouses along its "
        "banks have become museums, shops and homes.")


@pytest.mark.slow
def test_smollm2_with_fp8_weights_stays_close_to_its_bf16_weights() -> None:
    """Over an English paragraph: the mean log-likelihood of its tokens moves by < 0.1 nats, the top token
    agrees at >= 90% of positions, and greedy decoding still answers the capital question. (The move is the
    quantization's own: +0.051 nats through torch on the dequantized weights, +0.053 through kv8's kernel, on the
    AMD EPYC without AMX; a bound of 0.05 held on the Intel Xeon's AMX arithmetic only.)"""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    runs = {}
    for q in (None, "fp8"):
        llm = LLM(model="smollm2-135m", quantization=q, kv_cache_memory="64MiB", max_model_len=512)
        out = llm.generate(TEXT, params)[0]
        runs[q] = out
        if q == "fp8":
            text = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=8))[0]
            assert "Paris" in text.outputs[0].text, text.outputs[0].text
            names = {m.method.name for m in llm.engine.runner.model.modules() if isinstance(m, LinearBase)}
            assert names & {"packed_fp8", "torch_fp8"} and len(names) == 2, names   # the decoder's, and the head
    ids = runs[None].prompt_token_ids
    nll = {q: -sum(p[t].logprob for t, p in zip(ids[1:], r.prompt_logprobs[1:])) / (len(ids) - 1)
           for q, r in runs.items()}
    assert abs(nll["fp8"] - nll[None]) < 0.1, nll
    top = {q: [max(p.items(), key=lambda kv: kv[1].logprob)[0] for p in r.prompt_logprobs[1:]] for q, r in runs.items()}
    agree = sum(a == b for a, b in zip(top[None], top["fp8"])) / len(top[None])
    assert agree >= 0.9, agree


@pytest.mark.parametrize("n,k", [(50, 33), (576, 576), (96, 130)])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_wide_rows_multiply_long_chunks_in_float32(lib: DenseKernels, n: int, k: int, bias: bool,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """An FP8 layer with ``wide_rows``: calls of fewer rows run the FP8 kernel (bit for bit the plain FP8 layer),
    calls of at least that many rows compute linear_f32 on the decoded weights ``decode(code) * scale`` (bit for bit,
    the torch_fp32 method's arithmetic on the same FP8 weights), slab by slab when the weight exceeds one slab."""
    monkeypatch.setattr("kv8.layers.linear.WIDE_SLAB_VALUES", 32 * k)   # one 32-row panel per slab: several slabs
    w = _weight(n, k, seed=n * 5 + k)
    gen = torch.Generator().manual_seed(n)
    b = torch.randn(n, generator=gen).bfloat16() if bias else None

    def make(backend: DenseBackend) -> LinearBase:   # an o_proj-style layer (one rank: the whole matrix), FP8
        layer = RowParallelLinear(k, n, bias, backend)
        if b is not None:
            layer.bias = torch.nn.Parameter(torch.empty(n, dtype=torch.bfloat16), requires_grad=False)
            layer.weight_loader(layer.bias, b)
        return _loaded(layer, [(None, w)])

    plain = make(DenseBackend("packed_bf16", lib, "fp8"))
    wide = make(DenseBackend("packed_bf16", lib, "fp8", wide_rows=20))
    assert isinstance(wide.method, PackedFP8LinearMethod) and wide.method.wide_rows == 20
    short = torch.randn(19, k, generator=gen).bfloat16()
    assert torch.equal(wide(short), plain(short))
    long = torch.randn(2, 20, k, generator=gen).bfloat16()
    got = wide(long)
    assert got.shape == (2, 20, n) and got.dtype == torch.bfloat16
    codes, scale = quantize_fp8_rows(w)
    decoded = dequantize_fp8_rows(codes, scale, torch.float32)
    bias_f32 = None if b is None else b.float()
    assert torch.equal(got, linear_f32(long.reshape(40, k), decoded, bias_f32).view(2, 20, n))
    # the packed kernel sums exact products in another order and scales each sum once: within a bf16 step
    torch.testing.assert_close(got.float(), plain(long).float(), rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("inter", [17, 64])
def test_fp8_wide_rows_with_fused_silu_equal_the_float32_projection_then_silu(lib: DenseKernels, inter: int) -> None:
    """A gate/up FP8 layer with SiLU fused and ``wide_rows``: a long call is the float32 projection on the decoded
    weights, then ``kv8_silu_mul`` on it rounded; a short one the fused FP8 kernel, bit for bit."""
    k = 96
    wg, wu = _weight(inter, k, 8), _weight(inter, k, 9)
    wide = DenseBackend("packed_bf16", lib, "fp8", wide_rows=8)
    fused = _loaded(GateUpLinear(k, inter, False, wide, SiluAndMul(wide)), [(0, wg), (1, wu)])
    assert fused.fuses_silu and isinstance(fused.method, PackedFP8LinearMethod)
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(3)).bfloat16()
    (cg, sg), (cu, su) = quantize_fp8_rows(wg), quantize_fp8_rows(wu)
    decoded = torch.cat([dequantize_fp8_rows(cg, sg, torch.float32), dequantize_fp8_rows(cu, su, torch.float32)])
    projection = linear_f32(x, decoded, None)
    assert torch.equal(fused.method.apply(fused, x), projection)
    assert torch.equal(fused(x), lib.silu_mul(projection))
    plain_backend = DenseBackend("packed_bf16", lib, "fp8")
    plain = _loaded(GateUpLinear(k, inter, False, plain_backend, SiluAndMul(plain_backend)), [(0, wg), (1, wu)])
    assert torch.equal(fused(x[:7]), plain(x[:7]))   # below wide_rows: the fused FP8 kernel
