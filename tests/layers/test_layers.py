"""kv8.layers: every packed_bf16 fast path (linear, fused add + RMSNorm, SiLU * up, RoPE split from packed
q/k/v) against its plain torch reference; merged layers' shard loading; backend selection; and, in the
engine, the model on the packed kernels against the model on torch."""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import pytest
import torch

import kv8.kernels.cpu.dense as dense_kernels
import kv8.layers.dense_backend as dense_backend
from kv8.engine.args import EngineArgs
from kv8.engine.engine import LLMEngine
from kv8.kernels.cpu.abi import check_abi
from kv8.kernels.cpu.build import KernelUnavailable, cpu_flags
from kv8.kernels.cpu.dense import DenseKernels, unpack_reference
from kv8.layers.activation import GeluAndMul, SiluAndMul, gelu_tanh_mul_reference, silu_mul_reference
from kv8.layers.dense_backend import TORCH_BACKEND, DenseBackend, select_dense_backend
from kv8.layers.linear import GateUpLinear, Linear, LinearBase, MergedLinear, QKVLinear, linear_reference
from kv8.layers.norm import RMSNorm, rmsnorm_reference
from kv8.layers.rotary import RopeScaling, RotaryEmbedding, rope_reference
from tests.helpers.kernels import amx_path, dense_build_or_skip, dense_kernels_or_reason, prefill_logits

_KERNELS, _WHY = dense_kernels_or_reason()
needs_kernel = pytest.mark.skipif(_KERNELS is None, reason=f"kv8's dense kernels are unavailable: {_WHY}")


@pytest.fixture(scope="module", params=["native", "x86-64-v3"])
def lib(request: pytest.FixtureRequest) -> DenseKernels:
    """The engine's build, and the AVX2 path's where the native build is the AVX-512 one."""
    return dense_build_or_skip(request.param)


@pytest.fixture(scope="module")
def packed(lib: DenseKernels) -> DenseBackend:
    return DenseBackend("packed_bf16", lib)


_AMX_CPU = "amx_bf16" in cpu_flags().split()


@pytest.fixture(params=["vdpbf16ps", "amx"])
def linear_path(request: pytest.FixtureRequest, lib: DenseKernels):
    """Each of the packed linear's two paths in turn (AMX tiles only where this CPU has them)."""
    with amx_path(lib, request.param) as path:
        yield path


def _weights(out_features: int, in_features: int, bias: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out_features, in_features, generator=gen).bfloat16()
    return w, (torch.randn(out_features, generator=gen).bfloat16() if bias else None)


def _loaded(layer: LinearBase, shards: list[tuple[object, torch.Tensor, torch.Tensor | None]]) -> LinearBase:
    """``layer`` with each shard's weight (and bias) loaded through ``weight_loader``, then post-processed."""
    layer.weight = torch.nn.Parameter(torch.empty_like(layer.weight, dtype=torch.bfloat16), requires_grad=False)
    if layer.bias is not None:
        layer.bias = torch.nn.Parameter(torch.empty_like(layer.bias, dtype=torch.bfloat16), requires_grad=False)
    for shard_id, w, b in shards:
        layer.weight_loader(layer.weight, w, shard_id)  # type: ignore[arg-type]
        if b is not None:
            layer.weight_loader(layer.bias, b, shard_id)  # type: ignore[arg-type]
    layer.process_weights_after_loading()
    return layer


def _linear(backend: DenseBackend, w: torch.Tensor, b: torch.Tensor | None) -> LinearBase:
    return _loaded(Linear(w.shape[1], w.shape[0], b is not None, backend), [(None, w, b)])


def test_the_kernels_load_where_the_cpu_has_avx512_bf16() -> None:
    """This project's machine has AVX-512 BF16 and VBMI; there the kernels must build and load."""
    if not {"avx512f", "avx512bw", "avx512_bf16", "avx512vbmi"} <= set(cpu_flags().split()):
        pytest.skip("this CPU lacks AVX-512 BF16 or VBMI, which kv8's dense kernels need")
    assert _KERNELS is not None, _WHY
    assert select_dense_backend("auto", torch.bfloat16).name == "packed_bf16"


def test_the_linear_takes_amx_where_the_cpu_has_it() -> None:
    """On a CPU with AMX-BF16 (Linux grants the tiles on request) the packed linear uses them by default."""
    if _KERNELS is None or not _AMX_CPU:
        pytest.skip("no AMX-BF16 on this CPU (or no kernels)")
    assert _KERNELS.amx


@needs_kernel
@pytest.mark.parametrize("n,k", [(576, 576), (192, 576), (50, 33), (33, 64), (1, 2), (7, 5), (960, 1536)])
@pytest.mark.parametrize("m", [1, 3, 12, 13, 17, 25, 33, 64, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_the_reference(packed: DenseBackend, linear_path: str, n: int, k: int, m: int,
                                             bias: bool) -> None:
    """Both paths (AMX where K % 32 == 0; K = 33, 2, 5 take vdpbf16ps either way), row counts around the AMX
    tile (16), block (32) and row chunk (192) edges."""
    w, b = _weights(n, k, bias, seed=n * 1000 + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    layer = _linear(packed, w, b)
    assert not hasattr(layer, "weight") and layer.packed.dtype == torch.bfloat16   # weights kept once, packed
    got = layer(x)
    ref = linear_reference(x, w, b)
    exact = (x.double() @ w.double().T + (b.double() if bias else 0.0))
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    # One rounding to bf16 (at most a bf16 step, 2^-7 relative) of an fp32 sum (whose rounding errors are
    # bounded by the sum of |products| times a small multiple of 2^-24); the torch reference rounds the same
    # way and mostly lands on the same bf16 value.
    abs_sum = x.double().abs() @ w.double().abs().T + (b.double().abs() if bias else 0.0)
    step = exact.abs() * 2.0 ** -7 + abs_sum * 2.0 ** -16
    assert bool(((got.double() - exact).abs() <= step).all())
    assert float((got == ref).float().mean()) >= 0.97


def avx2_sums(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The AVX2 linear's float32 sums (``csrc/dense/avx2.h``): for each row and column, products of x with the float32
    weights ``w [N, K]`` added in k order (a product of two bf16 values is exact, so each FMA is one rounded add)."""
    xf, acc = x.float(), torch.zeros(x.shape[0], w.shape[0])
    for k in range(x.shape[1]):
        acc = acc + xf[:, k:k + 1] * w[:, k]
    return acc


@pytest.mark.parametrize("n,k", [(50, 33), (7, 5), (33, 64), (96, 130), (1, 2), (70, 601)])
@pytest.mark.parametrize("m", [1, 3, 17, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_avx2_linear_sums_in_k_order_bit_for_bit(lib: DenseKernels, n: int, k: int, m: int, bias: bool) -> None:
    """The AVX2 path's contract exactly: float32 sums in k order, + bias (float32), one rounding to bf16 (torch's).
    m = 17 and 200 take the blocked GEMM (200: chunks of rows); k = 601, its k blocks (the sums continued across
    them) with an odd K's pad in the last one."""
    if lib.isa != "avx2":
        pytest.skip("the AVX-512 path sums two products per vdpbf16ps (tested against the reference above)")
    w, _ = _weights(n, k, False, seed=n + k)
    b = torch.randn(n, generator=torch.Generator().manual_seed(k)) if bias else None
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    want = avx2_sums(x, w.float()) + (b if b is not None else 0.0)
    assert torch.equal(lib.linear(x, lib.pack(w), n, b).view(torch.int16), want.bfloat16().view(torch.int16))


def test_avx2_linear_adds_in_k_order_even_k_first(lib: DenseKernels) -> None:
    """Sums whose value depends on the order: W[c] = (2^10, 2^-20, -2^10, t_c, 0), x = 1. In k order the 2^-20 is lost
    beside 2^10 and t_c (< 2^-14) survives: t_c exactly; odd k first, or any order adding t_c before -2^10, gives 0."""
    if lib.isa != "avx2":
        pytest.skip("the AVX-512 path sums two products per vdpbf16ps")
    t = torch.exp2(-torch.arange(16, 56).float())        # 40 columns: more than a panel
    w = torch.zeros(40, 5)
    w[:, 0], w[:, 1], w[:, 2], w[:, 3] = 2.0 ** 10, 2.0 ** -20, -(2.0 ** 10), t
    got = lib.linear(torch.ones(3, 5).bfloat16(), lib.pack(w.bfloat16()), 40, None)
    assert torch.equal(got, t.bfloat16().expand(3, 40))
    assert torch.equal(avx2_sums(torch.ones(1, 5).bfloat16(), w)[0], t)   # the oracle of the test above agrees


@pytest.mark.parametrize("n", [200, 230, 300, 333])
@pytest.mark.parametrize("k", [33, 576])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_avx2_one_row_in_passes_of_panels_bit_for_bit(lib: DenseKernels, n: int, k: int, threads: int) -> None:
    """One row walks each thread's run of panels three at a time (two where two or four are left, one where one is),
    prefetching past each panel into the next pass's: 7 to 11 panels over 1 to 3 threads give runs of 2 to 11 panels,
    passes of 1, 2 and 3, and a partial last panel; the sums are the k-order oracle's, bit for bit."""
    if lib.isa != "avx2":
        pytest.skip("the AVX2 path's one-row kernel")
    w, _ = _weights(n, k, False, seed=n + k)
    b = torch.randn(n, generator=torch.Generator().manual_seed(k))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(n)).bfloat16()
    want = avx2_sums(x, w.float()) + b
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = lib.linear(x, lib.pack(w), n, b)
    finally:
        torch.set_num_threads(saved)
    assert torch.equal(got.view(torch.int16), want.bfloat16().view(torch.int16))


@needs_kernel
@pytest.mark.parametrize("v", [1, 5, 16, 17, 100, 4099, 49152])
@pytest.mark.parametrize("b", [1, 3, 8, 33])
def test_argmax_kernel_matches_torch(lib: DenseKernels, b: int, v: int) -> None:
    """The first index of each row's maximum, as torch.argmax: ties within and across the 16 lanes and in the
    tail, -inf entries, rows of -inf only (index 0), +inf; rows split over threads (b * v large) or not."""
    x = torch.randn(b, v, generator=torch.Generator().manual_seed(b * 100_000 + v))
    if v > 3:
        for col in (v - 1, v // 2, v // 3 + 1):   # the same maximum in three places: the lowest wins
            x[:, col] = 50.0
    x[0, : (v + 1) // 2] = float("-inf")
    if b > 1:
        x[1] = float("-inf")
    if b > 2:
        x[2, -1] = float("inf")
    assert torch.equal(lib.argmax(x), torch.argmax(x, dim=-1))
    assert torch.equal(lib.argmax(x[:, : max(v - 1, 1)]), torch.argmax(x[:, : max(v - 1, 1)], dim=-1))  # strided


@needs_kernel
def test_argmax_kernel_rejects_bad_input(lib: DenseKernels) -> None:
    with pytest.raises(ValueError, match="float32"):
        lib.argmax(torch.zeros(2, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="2-D"):
        lib.argmax(torch.zeros(3))
    with pytest.raises(ValueError, match="columns"):
        lib.argmax(torch.zeros(2, 0))


@needs_kernel
def test_rows_do_not_depend_on_the_batch(packed: DenseBackend, linear_path: str) -> None:
    layer = _linear(packed, *_weights(100, 96, True, seed=1))
    x = torch.randn(37, 96).bfloat16()
    whole = layer(x)
    for i in (0, 11, 12, 13, 36):
        assert torch.equal(whole[i:i + 1], layer(x[i:i + 1]))
    assert torch.equal(whole[5:30], layer(x[5:30]))


@pytest.mark.parametrize("backend_name", ["torch", "packed_bf16"])
def test_merged_layers_equal_separate_ones(backend_name: str) -> None:
    """QKVLinear (q/k/v biases, GQA) and MergedLinear (gate/up) loaded shard by shard compute what one layer
    per shard computes; leading dims are kept."""
    if backend_name == "packed_bf16" and _KERNELS is None:
        pytest.skip(f"kv8's dense kernels are unavailable: {_WHY}")
    backend = TORCH_BACKEND if backend_name == "torch" else DenseBackend("packed_bf16", _KERNELS)
    (wq, bq), (wk, bk), (wv, bv) = _weights(96, 64, True, 1), _weights(32, 64, True, 2), _weights(32, 64, True, 3)
    qkv = _loaded(QKVLinear(64, 16, 6, 2, True, backend), [("v", wv, bv), ("q", wq, bq), ("k", wk, bk)])
    assert qkv.output_sizes == [96, 32, 32] and qkv.out_features == 160
    x = torch.randn(2, 5, 64).bfloat16()
    out = qkv(x)
    assert out.shape == (2, 5, 160)
    for part, (w, b) in zip(out.split(qkv.output_sizes, dim=-1), ((wq, bq), (wk, bk), (wv, bv))):
        assert torch.equal(part, _linear(backend, w, b)(x))
    (wg, _), (wu, _) = _weights(48, 64, False, 4), _weights(48, 64, False, 5)
    gate_up = _loaded(MergedLinear(64, [48, 48], False, backend), [(1, wu, None), (0, wg, None)])
    for part, w in zip(gate_up(x).split(48, dim=-1), (wg, wu)):
        assert torch.equal(part, _linear(backend, w, None)(x))


@needs_kernel
@pytest.mark.parametrize("inter", [1, 17, 48, 64, 1536])
@pytest.mark.parametrize("m", [1, 7, 13, 200])
@pytest.mark.parametrize("bias", [False, True])
def test_gate_up_with_fused_silu_equals_projection_then_silu(packed: DenseBackend, linear_path: str, inter: int,
                                                              m: int, bias: bool) -> None:
    """GateUpLinear fuses SiLU * up into the packed kernel (gate/up rows interleaved by 16, padded halves when
    I is not a multiple of 16, rows beyond one 192-row chunk; K = 320: the AVX2 path's GEMM in two k blocks): bit
    for bit the unfused projection followed by the silu_mul kernel; its plain apply still gives [gate | up]."""
    k = 320
    (wg, bg), (wu, bu) = _weights(inter, k, bias, 6), _weights(inter, k, bias, 7)
    fused = _loaded(GateUpLinear(k, inter, bias, packed, SiluAndMul(packed)), [(0, wg, bg), (1, wu, bu)])
    assert fused.fuses_silu
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).bfloat16()
    projection = torch.cat([_linear(packed, wg, bg)(x), _linear(packed, wu, bu)(x)], dim=-1)
    assert torch.equal(fused.method.apply(fused, x), projection)
    got = fused(x)
    assert got.shape == (m, inter)
    assert torch.equal(got, SiluAndMul(packed)(projection))
    assert torch.equal(fused(x.view(1, m, k)), got.view(1, m, inter))   # leading dims kept


@pytest.mark.parametrize("n,k", [(50, 33), (7, 5), (64, 576), (96, 130), (1, 2)])
def test_unpack_gives_back_the_packed_matrix_exactly(lib: DenseKernels, n: int, k: int) -> None:
    """The C++ unpack (each path) and its torch reference give the weights back bit for bit, from any panel on, with
    whole and short blocks of pair-rows (k of 5, 33, 130: a last block past K) and a short last panel."""
    w, _ = _weights(n, k, False, seed=n + k)
    packed = lib.pack(w)
    assert torch.equal(lib.unpack(packed, 0, n, k), w.float())
    assert torch.equal(unpack_reference(packed, 0, n, k), w.float())
    if n > 32:
        assert torch.equal(lib.unpack(packed, 32, n - 32, k), w[32:].float())
        assert torch.equal(lib.unpack(packed, 32, 3, k), w[32:35].float())
        assert torch.equal(unpack_reference(packed, 32, 3, k), w[32:35].float())
    assert lib.unpack(packed, 0, 0, k).shape == (0, k)
    with pytest.raises(ValueError, match="first=5 must be a multiple of 32"):
        lib.unpack(packed, 5, 1, k)
    with pytest.raises(ValueError, match="holding rows 0..1000"):   # past the packed matrix
        lib.unpack(packed, 0, 1000, k)
    with pytest.raises(ValueError, match="1-D torch.bfloat16 tensor"):   # FP8 codes need their scale
        lib.unpack(packed.view(torch.uint8), 0, n, k)


@pytest.mark.parametrize("n,k", [(50, 33), (576, 576), (96, 130)])
@pytest.mark.parametrize("bias", [False, True])
def test_wide_rows_multiply_long_chunks_in_float32(lib: DenseKernels, n: int, k: int, bias: bool,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A packed layer with ``wide_rows``: calls of fewer rows run the kernel (bit for bit the plain packed layer),
    calls of at least that many rows compute linear_f32 on the unpacked weights (bit for bit the float32 method's
    arithmetic), slab by slab when the weight exceeds one slab."""
    from kv8.layers.linear import linear_f32

    monkeypatch.setattr("kv8.layers.linear.WIDE_SLAB_VALUES", 32 * k)   # one 32-row panel per slab: several slabs
    w, b = _weights(n, k, bias, seed=n * 7 + k)
    plain = _linear(DenseBackend("packed_bf16", lib), w, b)
    wide = _linear(DenseBackend("packed_bf16", lib, wide_rows=20), w, b)
    short = torch.randn(19, k, generator=torch.Generator().manual_seed(1)).bfloat16()
    assert torch.equal(wide(short), plain(short))
    long = torch.randn(2, 20, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    got = wide(long)
    assert got.shape == (2, 20, n) and got.dtype == torch.bfloat16
    bias_f32 = None if b is None else b.float()
    assert torch.equal(got, linear_f32(long.reshape(40, k), w.float(), bias_f32).view(2, 20, n))
    # the packed kernel's sums differ only in their order: within a bf16 step of each other
    torch.testing.assert_close(got.float(), plain(long).float(), rtol=2 ** -7, atol=2 ** -7)


@pytest.mark.parametrize("inter", [17, 64])
@pytest.mark.parametrize("bias", [False, True])
def test_wide_rows_with_fused_silu_equal_the_float32_projection_then_silu(lib: DenseKernels, inter: int,
                                                                          bias: bool) -> None:
    from kv8.layers.linear import linear_f32

    k = 96
    (wg, bg), (wu, bu) = _weights(inter, k, bias, 8), _weights(inter, k, bias, 9)
    wide = DenseBackend("packed_bf16", lib, wide_rows=8)
    fused = _loaded(GateUpLinear(k, inter, bias, wide, SiluAndMul(wide)), [(0, wg, bg), (1, wu, bu)])
    assert fused.fuses_silu
    x = torch.randn(8, k, generator=torch.Generator().manual_seed(3)).bfloat16()
    w = torch.cat([wg, wu]).float()
    b = None if bg is None or bu is None else torch.cat([bg, bu]).float()
    projection = linear_f32(x, w, b)
    assert torch.equal(fused.method.apply(fused, x), projection)
    assert torch.equal(fused(x), lib.silu_mul(projection))
    short = x[:7]   # below wide_rows: the fused kernel
    plain = _loaded(GateUpLinear(k, inter, bias, DenseBackend("packed_bf16", lib), SiluAndMul(wide)),
                    [(0, wg, bg), (1, wu, bu)])
    assert torch.equal(fused(short), plain(short))


def test_wide_rows_only_for_packed_bf16(lib: DenseKernels) -> None:
    assert DenseBackend("packed_bf16", lib, wide_rows=512).label == "packed_bf16+f32_from_512"
    assert DenseBackend("packed_bf16", lib).label == "packed_bf16"
    assert DenseBackend("packed_bf16", lib, "fp8", wide_rows=512).label == "packed_bf16+f32_from_512"
    for bad in (dict(name="torch", kernels=None, wide_rows=512), dict(name="torch", kernels=None, quantization="fp8",
                                                                      wide_rows=512),
                dict(name="packed_bf16", kernels=lib, wide_rows=-1)):
        with pytest.raises(ValueError, match="wide_rows="):
            DenseBackend(**bad)   # type: ignore[arg-type]


def test_gguf_wide_rows_give_each_block_type_its_switch(lib: DenseKernels) -> None:
    """``gguf_wide_rows``: each listed type's own row count (0: the int8 kernel at every row count), the others
    ``wide_rows``; named in the label; only with packed_bf16 and quantization="gguf", one sorted pair per type."""
    backend = DenseBackend("packed_bf16", lib, "gguf", gguf_wide_rows=(("Q4_K", 0), ("Q6_K", 32)))
    assert backend.label == "packed_bf16[Q4_K:int8,Q6_K:f32_from_32]"
    assert (backend.wide_rows_of("Q4_K"), backend.wide_rows_of("Q6_K"), backend.wide_rows_of("Q8_0")) == (0, 32, 0)
    wide = DenseBackend("packed_bf16", lib, "gguf", wide_rows=32, gguf_wide_rows=(("Q6_K", 0),))
    assert wide.label == "packed_bf16+f32_from_32[Q6_K:int8]" and wide.wide_rows_of("Q5_0") == 32
    for bad in (dict(name="packed_bf16", kernels=lib, quantization="fp8", gguf_wide_rows=(("Q6_K", 32),)),
                dict(name="torch", kernels=None, quantization="gguf", gguf_wide_rows=(("Q6_K", 32),)),
                dict(name="packed_bf16", kernels=lib, quantization="gguf", gguf_wide_rows=(("Q6_K", 32), ("Q4_K", 0))),
                dict(name="packed_bf16", kernels=lib, quantization="gguf", gguf_wide_rows=(("Q6_K", 32), ("Q6_K", 0))),
                dict(name="packed_bf16", kernels=lib, quantization="gguf", gguf_wide_rows=(("Q6_K", -1),))):
        with pytest.raises(ValueError, match="gguf_wide_rows="):
            DenseBackend(**bad)
    # what the blocks are dequantized to: a type of its own (gguf_bf16) or the backend's (gguf_expand)
    mixed = DenseBackend("packed_bf16", lib, "gguf", gguf_wide_rows=(("Q4_K", 0), ("Q6_K", 128)), gguf_bf16=("Q6_K",))
    assert mixed.label == "packed_bf16[Q4_K:int8,Q6_K:bf16_from_128]"
    assert [mixed.expansion_of(q) for q in ("Q4_K", "Q6_K", "Q8_0")] == ["f32", "bf16", "f32"]
    every = DenseBackend("packed_bf16", lib, "gguf", wide_rows=128, gguf_expand="bf16")
    assert every.label == "packed_bf16+bf16_from_128" and every.expansion_of("Q8_0") == "bf16"
    for bad, match in ((dict(gguf_expand="f16", wide_rows=128), "gguf_expand='f16': one of f32, bf16"),
                       (dict(gguf_expand="bf16"), "needs quantization='gguf' and a switch"),
                       (dict(gguf_wide_rows=(("Q6_K", 0),), gguf_bf16=("Q6_K",)), "gguf_bf16=.*a switch of its own"),
                       (dict(gguf_wide_rows=(("Q6_K", 32),), gguf_bf16=("Q8_0",)), "gguf_bf16=.*a switch of its own")):
        with pytest.raises(ValueError, match=match):
            DenseBackend("packed_bf16", lib, "gguf", **bad)   # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gguf_expand='bf16' needs quantization='gguf'"):
        DenseBackend("packed_bf16", lib, "fp8", wide_rows=512, gguf_expand="bf16")


@pytest.mark.parametrize("backend_name", ["torch", "packed_bf16"])
def test_gate_up_with_other_activations_or_torch_runs_the_activation_after(backend_name: str) -> None:
    if backend_name == "packed_bf16" and _KERNELS is None:
        pytest.skip(f"kv8's dense kernels are unavailable: {_WHY}")
    backend = TORCH_BACKEND if backend_name == "torch" else DenseBackend("packed_bf16", _KERNELS)
    (wg, _), (wu, _) = _weights(40, 64, False, 8), _weights(40, 64, False, 9)
    x = torch.randn(5, 64).bfloat16()
    gelu = _loaded(GateUpLinear(64, 40, False, backend, GeluAndMul()), [(0, wg, None), (1, wu, None)])
    silu = _loaded(GateUpLinear(64, 40, False, backend, SiluAndMul(backend)), [(0, wg, None), (1, wu, None)])
    assert not gelu.fuses_silu and silu.fuses_silu == (backend_name == "packed_bf16")
    projection = torch.cat([_linear(backend, wg, None)(x), _linear(backend, wu, None)(x)], dim=-1)
    assert torch.equal(gelu(x), gelu_tanh_mul_reference(projection))
    assert torch.equal(silu(x), SiluAndMul(backend)(projection))


def test_shard_loading_rejects_bad_shards_and_shapes() -> None:
    qkv = QKVLinear(8, 4, 2, 1, False, TORCH_BACKEND)
    qkv.weight = torch.nn.Parameter(torch.empty(16, 8), requires_grad=False)
    with pytest.raises(ValueError, match="QKVLinear has shards 'q', 'k', 'v', not 'o'"):
        qkv.weight_loader(qkv.weight, torch.zeros(8, 8), "o")
    with pytest.raises(ValueError, match=r"has shape \(8, 8\), the model expects \(4, 8\)"):
        qkv.weight_loader(qkv.weight, torch.zeros(8, 8), "k")
    merged = MergedLinear(8, [4, 4], False, TORCH_BACKEND)
    with pytest.raises(ValueError, match="MergedLinear has shards 0..1, not 2"):
        merged.weight_loader(merged.weight, torch.zeros(4, 8), 2)


def test_merged_layers_load_a_whole_merged_matrix() -> None:
    """A checkpoint that stores q/k/v (or gate/up) merged, as Phi-3's does, loads with ``shard_id=None``."""
    w = torch.randn(16, 8)
    qkv = QKVLinear(8, 4, 2, 1, False, TORCH_BACKEND)
    qkv.weight = torch.nn.Parameter(torch.empty(16, 8), requires_grad=False)
    qkv.weight_loader(qkv.weight, w, None)
    assert torch.equal(qkv.weight, w)
    merged = MergedLinear(8, [4, 4], False, TORCH_BACKEND)
    merged.weight = torch.nn.Parameter(torch.empty(8, 8), requires_grad=False)
    with pytest.raises(ValueError, match=r"has shape \(4, 8\), the model expects \(8, 8\)"):
        merged.weight_loader(merged.weight, torch.zeros(4, 8), None)


@needs_kernel
def test_bad_inputs(packed: DenseBackend, lib: DenseKernels) -> None:
    layer = _linear(packed, *_weights(8, 16, False, 0))
    with pytest.raises(ValueError, match="bfloat16 input, got torch.float32"):
        layer(torch.randn(2, 16))
    with pytest.raises(ValueError, match="input has 15 features, the layer 16"):
        layer(torch.randn(2, 15).bfloat16())
    with pytest.raises(ValueError, match="2-D bfloat16"):
        lib.pack(torch.randn(4, 4))
    assert layer(torch.empty(0, 16, dtype=torch.bfloat16)).shape == (0, 8)


def _bf16_steps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bf16 values lie between a and b (elementwise, same sign assumed where nonzero)."""
    ia = a.view(torch.int16).int()
    ib = b.view(torch.int16).int()
    return (ia - ib).abs()


@needs_kernel
@pytest.mark.parametrize("t,e", [(1, 576), (5, 64), (37, 100), (300, 576)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rmsnorm_kernel_matches_torch(lib: DenseKernels, t: int, e: int, with_residual: bool) -> None:
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
def test_silu_mul_kernel_matches_torch(lib: DenseKernels, t: int, i: int) -> None:
    gen = torch.Generator().manual_seed(i)
    gu = (torch.randn(t, 2 * i, generator=gen) * 4).bfloat16()
    gu[0, :6] = torch.tensor([-100.0, -20.0, 0.0, 20.0, 100.0, -0.0]).bfloat16()  # saturation and zeros
    got, want = lib.silu_mul(gu), silu_mul_reference(gu)
    assert got.shape == (t, i)
    assert int(_bf16_steps_apart(got, want).max()) <= 1
    assert float((got == want).float().mean()) >= 0.99


@needs_kernel
@pytest.mark.parametrize("t,hq,hkv,d", [(1, 9, 3, 64), (33, 6, 2, 16), (5, 4, 4, 128), (3, 2, 1, 40)])
def test_rope_kernel_matches_torch_exactly(lib: DenseKernels, t: int, hq: int, hkv: int, d: int) -> None:
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
def test_elementwise_kernels_reject_bad_inputs(lib: DenseKernels) -> None:
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


_ENTRIES = {"kv8_linear": dense_kernels.LinearCall, "kv8_linear_fp8": dense_kernels.LinearCall,
            "kv8_rmsnorm": dense_kernels.RmsNormCall, "kv8_silu_mul": dense_kernels.SiluMulCall,
            "kv8_rope_qkv": dense_kernels.RopeCall, "kv8_argmax_rows": dense_kernels.ArgmaxCall,
            "kv8_unpack": dense_kernels.UnpackCall, "kv8_unpack_fp8": dense_kernels.UnpackCall}
_SIZES = {"in_features": 4, "out_features": 4, "hidden": 4, "intermediate": 4, "cols": 4, "row_stride": 12,
          "num_heads": 1, "num_kv_heads": 1, "head_dim": 4, "num_threads": 1}


def _entry_rc(fn: Any, struct: type[ctypes.Structure], **fields: int) -> int:
    """``fn`` (a raw entry point) on a ``struct`` of _SIZES's shapes with ``fields`` set and NULL pointers."""
    call = struct()
    for name, *_ in struct._fields_:
        setattr(call, name, fields.get(name, _SIZES.get(name, 0)))
    return int(fn(ctypes.byref(call)))


def test_every_entry_point_keeps_the_one_contract_of_both_paths(lib: DenseKernels) -> None:
    """The C side's argument checks (one check_args per entry point, whichever path the build has): an empty batch
    returns OK without reading its NULL pointers; a batch with rows refuses NULL pointers, and every entry refuses
    num_threads = 0 and rows = -1; kv8_linear and kv8_unpack refuse a scale, kv8_linear_fp8 and kv8_unpack_fp8 need
    one; kv8_unpack refuses a first row within a panel."""
    raw = ctypes.CDLL(str(lib.path))
    for entry, struct in _ENTRIES.items():
        fn = getattr(raw, entry)
        assert _entry_rc(fn, struct, rows=0) == 0, entry                 # an empty batch: nothing read
        assert _entry_rc(fn, struct, rows=1) == 5, entry                 # ERR_ARGS: NULL pointers with a row
        assert _entry_rc(fn, struct, rows=0, num_threads=0) == 5, entry
        assert _entry_rc(fn, struct, rows=-1) == 5, entry
    assert raw.kv8_linear(ctypes.byref(dense_kernels.LinearCall(None, None, 8, rows=0, in_features=4,
                                                                out_features=4, num_threads=1))) == 5
    assert raw.kv8_linear_fp8(ctypes.byref(dense_kernels.LinearCall(8, 8, None, None, 8, 1, 4, 4, 1))) == 5
    unpack = dense_kernels.UnpackCall
    assert raw.kv8_unpack(ctypes.byref(unpack(8, 8, 8, first=0, rows=1, in_features=4, num_threads=1))) == 5
    assert raw.kv8_unpack_fp8(ctypes.byref(unpack(8, None, 8, first=0, rows=1, in_features=4, num_threads=1))) == 5
    assert raw.kv8_unpack(ctypes.byref(unpack(None, None, None, first=16, rows=0, in_features=4, num_threads=1))) == 5


@needs_kernel
def test_what_the_library_refuses_raises_its_message(lib: DenseKernels) -> None:
    """Arguments the Python checks let through and the C side refuses: a ValueError with the library's message."""
    x = torch.randn(2, 16).bfloat16()
    packed = lib.pack(torch.randn(8, 16).bfloat16())
    with pytest.raises(ValueError, match=r"packed linear for x \[2, 16\], N=0: invalid kernel arguments"):
        lib.linear(x, packed, 0, None)
    with pytest.raises(ValueError, match=r"cannot pack a weight of shape \[0, 16\]"):
        lib.pack(torch.empty(0, 16, dtype=torch.bfloat16))
    assert lib.error_message(999) == "error 999"


@needs_kernel
def test_dense_struct_mirror_mismatch_is_refused(lib: DenseKernels) -> None:
    """A dense library whose argument structs differ from the ctypes mirror is KernelUnavailable."""
    check_abi(lib.abi_layout(), lib.STRUCTS, "kv8.kernels.cpu.dense")  # the real mirror matches

    class Narrow(ctypes.Structure):   # LinearCall with 32-bit row counts
        _fields_ = [(n, ctypes.c_int32 if t is ctypes.c_int64 else t) for n, t in dense_kernels.LinearCall._fields_]

    structs = tuple((name, Narrow if struct is dense_kernels.LinearCall else struct) for name, struct in lib.STRUCTS)
    with pytest.raises(KernelUnavailable, match="mirror in kv8.kernels.cpu.dense"):
        check_abi(lib.abi_layout(), structs, "kv8.kernels.cpu.dense")


@needs_kernel
@pytest.mark.parametrize("with_residual", [False, True])
def test_norm_and_activation_modules_match_their_torch_path(packed: DenseBackend, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 64, generator=gen) * 3).bfloat16()
    res = (torch.randn(9, 64, generator=gen) * 5).bfloat16() if with_residual else None
    norms = [RMSNorm(64, 1e-5, backend) for backend in (TORCH_BACKEND, packed)]
    for norm in norms:
        norm.weight.data = (torch.rand(64, generator=torch.Generator().manual_seed(4)) + 0.5).bfloat16()
    (want, want_h), (got, h) = (norm(x, res) for norm in norms)
    assert torch.equal(h, want_h) and int(_bf16_steps_apart(got, want).max()) <= 1
    gu = (torch.randn(9, 80, generator=gen) * 4).bfloat16()
    want, got = SiluAndMul(TORCH_BACKEND)(gu), SiluAndMul(packed)(gu)
    assert got.shape == (9, 40) and int(_bf16_steps_apart(got, want).max()) <= 1


@needs_kernel
@pytest.mark.parametrize("hq,hkv,d", [(9, 3, 64), (4, 4, 16)])
def test_rotary_module_matches_its_torch_path(packed: DenseBackend, hq: int, hkv: int, d: int) -> None:
    """One interface, ``rotary(qkv, rotary.angles(positions, dtype))``, on both paths."""
    gen = torch.Generator().manual_seed(d)
    qkv = torch.randn(21, (hq + 2 * hkv) * d, generator=gen).bfloat16()
    positions = torch.randint(0, 8000, (21,), generator=gen)
    ropes = [RotaryEmbedding(d, hq, hkv, 10000.0, None, backend) for backend in (TORCH_BACKEND, packed)]
    want, got = (rope(qkv, rope.angles(positions, torch.bfloat16)) for rope in ropes)
    for g, w, heads in zip(got, want, (hq, hkv, hkv)):
        assert g.shape == w.shape == (21, heads, d) and g.is_contiguous() and w.is_contiguous()
        assert int(_bf16_steps_apart(g, w).max()) <= 1
        assert float((g == w).float().mean()) >= 0.99


def _longrope(original: int, n: int) -> RopeScaling:
    scaling = RopeScaling.from_dict({"rope_type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(n)],
                                     "long_factor": [2.0 + 0.5 * i for i in range(n)]},
                                    {"original_max_position_embeddings": original,
                                     "max_position_embeddings": 4 * original})
    assert scaling is not None
    return scaling


@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_longrope_angles_match_transformers_per_position(partial: float) -> None:
    """cos/sin equal transformers' Phi-3 rotary embedding exactly: for a forward of positions below the original
    context (short factors), and for one position at a time beyond it (long factors, as transformers decodes);
    kv8 applies that per token within one batch. Partial rotary: only the first dims rotate, as transformers."""
    from transformers import Phi3Config
    from transformers.models.phi3.modeling_phi3 import Phi3RotaryEmbedding, apply_rotary_pos_emb

    d, original, r = 16, 32, int(16 * partial)
    scaling = _longrope(original, r // 2)
    cfg = Phi3Config(hidden_size=64, num_attention_heads=4, max_position_embeddings=4 * original,
                     original_max_position_embeddings=original, partial_rotary_factor=partial, pad_token_id=0,
                     eos_token_id=2, rope_scaling={"type": "longrope", "short_factor": list(scaling.short_factor),
                                                   "long_factor": list(scaling.long_factor)})
    hf = Phi3RotaryEmbedding(cfg)
    ours = RotaryEmbedding(d, 4, 2, 10000.0, scaling, TORCH_BACKEND, rotary_dim=r)
    x = torch.zeros(1, 1, dtype=torch.float32)

    def hf_angles(positions: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = hf(x, torch.tensor([positions]))
        return cos[0], sin[0]                                        # [T, R]

    short = list(range(original))
    cos, sin = hf_angles(short)
    got = ours.angles(torch.tensor(short), torch.float32)
    assert torch.equal(got.cos[:, 0], cos) and torch.equal(got.sin[:, 0], sin)
    mixed = [0, 40, 31, 32, 5, 127, 33]
    got = ours.angles(torch.tensor(mixed), torch.float32)
    for i, p in enumerate(mixed):
        cos, sin = hf_angles([p])
        assert torch.equal(got.cos[i, 0], cos[0]) and torch.equal(got.sin[i, 0], sin[0]), p
    assert ours.inv_freq_long is not None and bool((ours.inv_freq_long < ours.inv_freq).all())   # they differ
    # rotation of q and k [T, H, D]: transformers takes [B, H, T, D]
    gen = torch.Generator().manual_seed(0)
    q, k = torch.randn(len(mixed), 4, d, generator=gen), torch.randn(len(mixed), 2, d, generator=gen)
    got_q, got_k = ours.rotate(q, k, got)
    for i, p in enumerate(mixed):
        cos, sin = hf_angles([p])
        want_q, want_k = apply_rotary_pos_emb(q[i:i + 1].transpose(0, 1)[None], k[i:i + 1].transpose(0, 1)[None],
                                              cos[None], sin[None])
        assert torch.equal(got_q[i], want_q[0, :, 0]) and torch.equal(got_k[i], want_k[0, :, 0])
    assert torch.equal(got_q[..., r:], q[..., r:])


@needs_kernel
@pytest.mark.parametrize("partial", [1.0, 0.5])
def test_longrope_rotary_module_matches_its_torch_path(packed: DenseBackend, partial: float) -> None:
    """LongRoPE (attention factor, long factors from position 32) on the packed backend: the fused kernel for a
    whole-head rotary, torch for a partial one; the same rotation as the torch backend to bf16 rounding."""
    d, r = 32, int(32 * partial)
    scaling = _longrope(32, r // 2)
    gen = torch.Generator().manual_seed(5)
    qkv = torch.randn(21, (4 + 2 * 2) * d, generator=gen).bfloat16()
    positions = torch.cat((torch.arange(25, 40), torch.tensor([0, 127, 31, 32, 64, 3])))
    ropes = [RotaryEmbedding(d, 4, 2, 10000.0, scaling, backend, rotary_dim=r) for backend in (TORCH_BACKEND, packed)]
    assert (ropes[1].kernels is not None) == (partial == 1.0)
    want, got = (rope(qkv, rope.angles(positions, torch.bfloat16)) for rope in ropes)
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.is_contiguous()
        assert int(_bf16_steps_apart(g, w).max()) <= 1


def test_rotary_dim_must_be_even_and_within_the_head() -> None:
    with pytest.raises(ValueError, match=r"rotary_dim=7 must be even and in \[2, head_dim=16\]"):
        RotaryEmbedding(16, 2, 1, 10000.0, None, TORCH_BACKEND, rotary_dim=7)
    with pytest.raises(ValueError, match="short_factor and long_factor have 4 entries; this model rotates 16 dims"):
        RotaryEmbedding(16, 2, 1, 10000.0, _longrope(32, 4), TORCH_BACKEND)


def test_backend_selection() -> None:
    assert select_dense_backend("torch", torch.bfloat16) is TORCH_BACKEND
    assert select_dense_backend("auto", torch.float32) is TORCH_BACKEND
    with pytest.raises(ValueError, match="kernels exactly when it is 'packed_bf16'"):
        DenseBackend("packed_bf16")


def test_missing_compiler_falls_back_once_or_raises(monkeypatch: pytest.MonkeyPatch, tmp_path,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("CXX", "kv8-no-such-compiler")
    monkeypatch.setenv("KV8_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(dense_kernels, "_LOADED", {})
    monkeypatch.setattr(dense_kernels, "_FAILED", {})
    monkeypatch.setattr(dense_backend, "_auto_fallback_logged", False)
    with caplog.at_level(logging.WARNING, logger="kv8"):
        assert select_dense_backend("auto", torch.bfloat16) is TORCH_BACKEND
        assert select_dense_backend("auto", torch.bfloat16) is TORCH_BACKEND
    warnings = [r for r in caplog.records if "CPU kernels are unavailable" in r.getMessage()]
    assert len(warnings) == 1 and "kv8-no-such-compiler" in warnings[0].getMessage()
    with pytest.raises(KernelUnavailable, match="not on PATH"):
        select_dense_backend("packed_bf16", torch.bfloat16)


@needs_kernel
@pytest.mark.parametrize("name,kw", [("llama_gqa", {}), ("qwen2", {}), ("qwen3", {}),
                                     ("llama_gqa", {"kv_cache_rotation": "hadamard"})])
def test_engine_with_packed_kernels_matches_torch(tiny_models: dict[str, str], name: str, kw: dict) -> None:
    """Same model in bf16 with torch's dense layers and with kv8's kernels (Qwen2: q/k/v biases; Qwen3: QK-norm; with a
    rotated cache): the logits of every prompt position agree to bf16 rounding noise."""
    prompt = [3 + (7 * i) % 40 for i in range(40)]
    ref, _ = prefill_logits(tiny_models[name], "torch", prompt, **kw)
    got, tokens = prefill_logits(tiny_models[name], "packed_bf16", prompt, **kw)
    assert got.shape == ref.shape and len(tokens) == 4
    assert float((got - ref).abs().max()) <= 0.05 * float(ref.std())
    # the packed argmax is one of the reference's maxima (a tie in the reference, which the AVX2 path's float32 sums
    # meet where torch's bf16 GEMM has one, is no disagreement) at nearly every position
    at_max = ref.gather(-1, got.argmax(-1, keepdim=True)).squeeze(-1) == ref.max(-1).values
    assert float(at_max.float().mean()) >= 0.95


def test_engine_config_rejects_packed_kernels_for_float32(tiny_models: dict[str, str]) -> None:
    with pytest.raises(ValueError, match="dense_backend='packed_bf16' needs dtype bfloat16"):
        LLMEngine(EngineArgs(model=tiny_models["llama"], dtype="float32", dense_backend="packed_bf16",
                             num_kv_blocks=8, max_model_len=64))
    with pytest.raises(ValueError, match="dense_backend='x' is not supported"):
        LLMEngine(EngineArgs(model=tiny_models["llama"], dense_backend="x", num_kv_blocks=8, max_model_len=64))
