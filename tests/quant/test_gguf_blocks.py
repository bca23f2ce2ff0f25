"""GGUF blocks kept quantized (kv8.quant.gguf_blocks), the kernels that read them (``kv8_gguf_linear``,
``kv8_gguf_dequantize``: ``csrc/dense/gguf.h``) and the layer method that chooses between them by row count
(kv8.layers.linear.GGUFLinearMethod). Oracles: the ``gguf`` package (``gguf.quants.quantize`` writes the blocks,
``gguf.quants.dequantize`` is the float32 truth), float32 torch products, and the documented bound of the kernel's
int8 activations."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from kv8.kernels.cpu import dense
from kv8.kernels.cpu.dense import DenseKernels
from kv8.layers import linear
from kv8.layers.activation import SiluAndMul
from kv8.layers.dense_backend import DenseBackend
from kv8.layers.linear import (
    GGUF_DEQUANTIZE_ROWS,
    GateUpLinear,
    GGUFLinearMethod,
    GGUFSegment,
    LinearBase,
    MergedLinear,
    linear_f32,
)
from kv8.quant import gguf_blocks
from kv8.quant.gguf_blocks import (
    BLOCK,
    BLOCK_BYTES,
    BLOCK_VALUES,
    GROUP_ROWS,
    KEPT_TYPES,
    GGUFWeight,
    dequantize_blocks,
    dequantize_rows,
    gather_rows,
    gguf_activation_bound,
    gguf_linear_reference,
    group_blocks,
    q4_k_scale_min,
    q6_k_codes,
    quantize_activation_blocks,
    random_blocks,
    row_bytes,
    ungroup_blocks,
)
from tests.helpers.gguf_files import quantize
from tests.helpers.kernels import dense_build_or_skip, gguf_path


@pytest.fixture(scope="module", params=["native:avx2", "native:vnni256", "native:vnni512", "x86-64-v3:avx2"])
def lib(request: pytest.FixtureRequest) -> Iterator[DenseKernels]:
    """The engine's build on each path of its GGUF kernel (those this CPU has), and the AVX2 build where the native
    build is the AVX-512 one."""
    march, path = request.param.split(":")
    with gguf_path(dense_build_or_skip(march), path) as chosen:
        yield chosen


def _blocks(n: int, k: int, qtype: str, seed: int) -> torch.Tensor:
    """Random rows of different magnitudes (and one row of zeros) quantized by the gguf package (Q4_K, Q6_K:
    tests/helpers/gguf_files.quantize_q4_k / quantize_q6_k), with a shift per row (Q4_1 and Q4_K's mins): uint8 [n,
    bytes]."""
    rng = np.random.default_rng(seed)
    w = ((rng.standard_normal((n, k)) + rng.standard_normal((n, 1))) * np.exp2(rng.integers(-4, 2, (n, 1))))
    w = w.astype(np.float32)
    w[n // 2] = 0.0
    blocks = quantize(w, QT[qtype])
    return torch.from_numpy(np.ascontiguousarray(blocks)).reshape(n, -1)


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_dequantize_is_the_gguf_package_bit_for_bit(qtype: str) -> None:
    k = 3 * BLOCK_VALUES[qtype]
    blocks = _blocks(9, k, qtype, seed=1)
    assert blocks.shape == (9, row_bytes(qtype, k))
    want = gguf.quants.dequantize(blocks.numpy(), QT[qtype]).reshape(9, k)
    got = dequantize_blocks(blocks, qtype, k)
    assert got.dtype == torch.float32 and np.array_equal(got.numpy(), want)


def _random_q4_k(n: int, k: int, seed: int) -> torch.Tensor:
    """Q4_K super-blocks of random bytes (every scale / min bit pattern, both nibbles), d and dmin finite float16
    of both signs."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 256, 144), dtype=torch.uint8, generator=gen)
    scales = (torch.randn(n, k // 256, 2, generator=gen) * 0.01).half()
    blocks[..., 0:4] = scales.view(torch.uint8).reshape(n, k // 256, 4)
    return blocks.reshape(n, -1)


def _random_q6_k(n: int, k: int, seed: int) -> torch.Tensor:
    """Q6_K super-blocks of random bytes (every code, bit pair and int8 scale), d a finite float16 of either sign."""
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (n, k // 256, 210), dtype=torch.uint8, generator=gen)
    d = (torch.randn(n, k // 256, 1, generator=gen) * 0.01).half()
    blocks[..., 208:210] = d.view(torch.uint8).reshape(n, k // 256, 2)
    return blocks.reshape(n, -1)


def test_q6_k_dequantize_is_the_gguf_package_on_random_bytes() -> None:
    """Every bit of ql, qh and the int8 scales reaches the right value (random bytes, not only what a quantizer
    writes); q6_k_codes are the codes 0..63 those values are made of."""
    blocks = _random_q6_k(7, 768, seed=2)
    want = gguf.quants.dequantize(blocks.numpy(), QT.Q6_K).reshape(7, 768)
    got = dequantize_blocks(blocks, "Q6_K", 768)
    assert torch.equal(got.view(torch.int32), torch.from_numpy(want).view(torch.int32))
    codes = q6_k_codes(blocks.reshape(7, 3, 210)).reshape(7, 3, 16, 16)
    scale = blocks.reshape(7, 3, 210)[..., 192:208].contiguous().view(torch.int8).float()
    d = blocks.reshape(7, 3, 210)[..., 208:210].contiguous().view(torch.float16).float()
    assert torch.equal((d * scale)[..., None] * (codes.float() - 32), got.reshape(7, 3, 16, 16))


def test_q4_k_dequantize_is_the_gguf_package_on_random_bytes() -> None:
    """Every bit of the packed 6-bit scales and mins reaches the right sub-block (random bytes, not only what a
    quantizer writes)."""
    blocks = _random_q4_k(7, 768, seed=2)
    want = gguf.quants.dequantize(blocks.numpy(), QT.Q4_K).reshape(7, 768)
    got = dequantize_blocks(blocks, "Q4_K", 768)
    assert torch.equal(got.view(torch.int32), torch.from_numpy(want).view(torch.int32))


@pytest.mark.parametrize("qtype", KEPT_TYPES)
@pytest.mark.parametrize("n", [1, 5, 8, 9, 17, 24])   # a lone short group, whole groups, a tail of 1
def test_grouped_layout_moves_the_same_bytes(qtype: str, n: int) -> None:
    """group_blocks keeps the shape and the bytes' count and ungroup_blocks inverts it, on quantizer output and on
    random bytes (every bit of Q5_0's qh, Q4_K's packed scales and mins and Q6_K's ql and qh)."""
    k = 3 * BLOCK_VALUES[qtype]
    gen = torch.Generator().manual_seed(n)
    for blocks in (_blocks(n, k, qtype, seed=n),
                   torch.randint(0, 256, (n, row_bytes(qtype, k)), dtype=torch.uint8, generator=gen)):
        grouped = group_blocks(blocks, qtype, k)
        assert grouped.shape == blocks.shape and grouped.dtype == torch.uint8
        assert torch.equal(ungroup_blocks(grouped, qtype, k), blocks)
        if qtype not in ("Q5_0", "Q4_K", "Q6_K"):   # those re-encode their bit fields; the others only move bytes
            assert torch.equal(torch.sort(grouped.reshape(-1))[0], torch.sort(blocks.reshape(-1))[0])


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_grouping_chunk_by_chunk_gives_the_same_bytes(qtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """group_blocks regroups GROUP_CHUNK_BYTES of rows at a time: chunks of one and of two groups (43 rows: the
    last chunk with the tail group of 3) give the bytes of one pass over the whole weight."""
    k = 2 * BLOCK_VALUES[qtype]
    blocks = torch.randint(0, 256, (43, row_bytes(qtype, k)), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(4))
    whole = group_blocks(blocks, qtype, k)
    for groups in (1, 2):
        monkeypatch.setattr(gguf_blocks, "GROUP_CHUNK_BYTES", groups * GROUP_ROWS * blocks.shape[1])
        assert torch.equal(group_blocks(blocks, qtype, k), whole)


@pytest.mark.parametrize("qtype", KEPT_TYPES)
@pytest.mark.parametrize("n", [3, 8, 13, 49])   # a lone short group, one whole group, tails of 5 and 1
def test_rows_gathered_from_either_layout_are_the_files(qtype: str, n: int) -> None:
    """gather_rows reads rows (any order, repeated, across group edges and in the short last group) out of the file's
    layout or the grouped one as the file's bytes of those rows, also on random bytes (every bit of Q5_0's qh and
    Q4_K's scales); dequantize_rows gives the gguf package's values of those rows, bit for bit."""
    k = 2 * BLOCK_VALUES[qtype]
    gen = torch.Generator().manual_seed(n)
    ids = torch.cat([torch.arange(n).flip(0), torch.randint(0, n, (17,), generator=gen)])
    quantized = _blocks(n, k, qtype, seed=n)
    for blocks in (quantized,
                   torch.randint(0, 256, (n, row_bytes(qtype, k)), dtype=torch.uint8, generator=gen)):
        for held, grouped in ((blocks, False), (group_blocks(blocks, qtype, k), True)):
            assert torch.equal(gather_rows(held, qtype, k, ids, grouped), blocks[ids])
    blocks = quantized
    want = torch.from_numpy(gguf.quants.dequantize(blocks.numpy(), QT[qtype]).reshape(n, k))[ids]
    got = dequantize_rows(group_blocks(blocks, qtype, k), qtype, k, ids, True)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert gather_rows(blocks, qtype, k, ids[:0], True).shape == (0, blocks.shape[1])


def test_grouped_layout_interleaves_eight_rows_section_by_section() -> None:
    """Q4_1, 9 rows of 2 blocks: the first group's block 0 is the 8 rows' d, their m, then 4 bytes of qs of each row
    at a time; its block 1 follows; the last group (row 8 alone) holds that row's blocks as in the file."""
    n, k = 9, 64
    blocks = _blocks(n, k, "Q4_1", seed=3)
    file = blocks.reshape(n, 2, 20)
    flat = group_blocks(blocks, "Q4_1", k).reshape(-1)
    for w in range(2):
        blk = flat[w * 160:(w + 1) * 160]
        assert torch.equal(blk[:16], file[:8, w, 0:2].reshape(-1))
        assert torch.equal(blk[16:32], file[:8, w, 2:4].reshape(-1))
        for t in range(4):
            assert torch.equal(blk[32 + 32 * t:64 + 32 * t], file[:8, w, 4 + 4 * t:8 + 4 * t].reshape(-1))
    assert torch.equal(flat[320:], blocks[8])


def test_grouped_q4_k_scales_are_the_packed_six_bits() -> None:
    """Q4_K's sections of scales: sc_lo, m_lo and hi bytes hold the same 6-bit scales and mins as the file."""
    blocks = _random_q4_k(8, 256, seed=5)
    sc, mn = q4_k_scale_min(blocks[:, 4:16])                           # (8 rows, 8 sub-blocks)
    blk = group_blocks(blocks, "Q4_K", 256).reshape(-1)
    sc_lo, m_lo, hi = (blk[32 + 32 * i:64 + 32 * i].reshape(4, 8).T.long() for i in range(3))   # (rows, s < 4)
    got_sc = torch.cat([(sc_lo & 15) | ((hi & 3) << 4), (sc_lo >> 4) | (((hi >> 2) & 3) << 4)], dim=1)
    got_mn = torch.cat([(m_lo & 15) | (((hi >> 4) & 3) << 4), (m_lo >> 4) | ((hi >> 6) << 4)], dim=1)
    assert torch.equal(got_sc, sc.long()) and torch.equal(got_mn, mn.long())


def test_grouped_q6_k_holds_each_blocks_codes_as_the_kernel_reads_them() -> None:
    """Q6_K, 8 rows of one super-block: d of the 8 rows, then their scale pairs, then per block b of 32 values 4 loads
    of lo bytes (4 codes of each sub-block of each row: nibbles) and 2 of hi bytes (the codes' top bit pairs), so that
    load k of block b holds, at row r's 4 bytes, the codes 32 b + 4 k + i (low nibbles) and 32 b + 16 + 4 k + i (high
    nibbles); hi load u, bits 2 k, 2 k + 1, the top bits of the codes 32 b + 16 u + 4 k + i."""
    blocks = _random_q6_k(8, 256, seed=5)
    codes = q6_k_codes(blocks).long()                                    # (rows, 256)
    blk = group_blocks(blocks, "Q6_K", 256).reshape(-1).long()
    assert torch.equal(blk[:16].reshape(8, 2), blocks[:, 208:210].long())
    assert torch.equal(blk[16:144].reshape(8, 8, 2).permute(1, 0, 2).reshape(8, 16), blocks[:, 192:208].long())
    for b in range(8):
        base = 144 + 192 * b
        for k in range(4):
            lo = blk[base + 32 * k:base + 32 * k + 32].reshape(8, 4)      # (rows, i)
            assert torch.equal(lo & 15, codes[:, 32 * b + 4 * k:32 * b + 4 * k + 4] & 15)
            assert torch.equal(lo >> 4, codes[:, 32 * b + 16 + 4 * k:32 * b + 16 + 4 * k + 4] & 15)
        for u in range(2):
            hi = blk[base + 128 + 32 * u:base + 160 + 32 * u].reshape(8, 4)
            for k in range(4):
                first = 32 * b + 16 * u + 4 * k
                assert torch.equal((hi >> (2 * k)) & 3, codes[:, first:first + 4] >> 4)


def test_activation_blocks_round_to_the_nearest_step() -> None:
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    x[1, :32] = 0.0
    codes, scale = quantize_activation_blocks(x)
    assert codes.shape == (3, 2, 32) and scale.shape == (3, 2)
    assert scale[1, 0] == 0 and bool((codes[1, 0] == 0).all())
    xb = x.float().reshape(3, 2, 32)
    assert torch.equal(codes.abs().amax(dim=-1)[scale > 0], torch.full_like(scale[scale > 0], 127.0))
    # within half a step, up to float32's rounding of x * (127 / amax) (a code unit's ~1e-5 near 127)
    assert bool(((codes * scale[..., None] - xb).abs() <= scale[..., None] * (0.5 + 1e-4)).all())


SHAPES = [(37, 96), (70, 160), (33, 224), (19, 800)]   # N off the tile, K = 32 x odd (800: 3 groups of 8 + 1)
SHAPES_256 = [(37, 256), (19, 768), (33, 512)]         # Q4_K, Q6_K: K a multiple of 256, N odd
#: (type, N, K) of every type on its shapes
CASES = [(t, n, k) for t in KEPT_TYPES for n, k in (SHAPES if BLOCK_VALUES[t] == BLOCK else SHAPES_256)]


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 17, 32, 33])   # tiles of 4 and each rest
@pytest.mark.parametrize("qtype, n, k", CASES)
def test_kernel_is_within_the_activation_bound_of_the_reference(lib: DenseKernels, qtype: str, rows: int, n: int,
                                                                 k: int) -> None:
    """|kernel - float32 reference| <= sum_b scale_b / 2 * |w_b|_1 (the int8 activations) + the one bf16 rounding
    (+ fp32 sums); and against the activations' rounding done in torch the difference is only the bf16 rounding."""
    blocks = _blocks(n, k, qtype, seed=rows + n)
    gen = torch.Generator().manual_seed(k + rows)
    x = (torch.randn(rows, k, generator=gen) * 3).bfloat16()
    bias = torch.randn(n, generator=gen) if rows != 3 else None
    y = lib.gguf_linear(x, group_blocks(blocks, qtype, k), qtype, n, bias)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
    w = dequantize_blocks(blocks, qtype, k)
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    fp32_sums = 1e-5 * (x.double().abs() @ w.double().abs().T)
    bf16 = 2.0 ** -8 * exact.abs()
    err = (y.double() - exact).abs()
    bound = gguf_activation_bound(x, blocks, qtype)
    assert bool((err <= bound + bf16 * 1.01 + fp32_sums).all()), (err - bound - bf16).max()
    codes, scale = quantize_activation_blocks(x)
    rounded = (codes * scale[..., None]).reshape(rows, k).double() @ w.double().T + (0 if bias is None else
                                                                                     bias.double())
    assert bool(((y.double() - rounded).abs() <= 2.0 ** -8 * rounded.abs() * 1.01 + fp32_sums).all())
    ref = gguf_linear_reference(x, blocks, qtype, bias)
    assert ref.dtype == torch.bfloat16 and bool(((y.double() - ref.double()).abs()
                                                 <= bound + 2 * bf16 * 1.01 + fp32_sums).all())


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_each_row_is_computed_alone(lib: DenseKernels, qtype: str) -> None:
    """A row's output does not depend on the batch (tiles of 4 rows or 1): bit for bit; a row of zeros is the bias."""
    k = max(128, BLOCK_VALUES[qtype])
    blocks = group_blocks(_blocks(41, k, qtype, seed=7), qtype, k)
    x = torch.randn(6, k).bfloat16()
    x[2] = 0.0
    bias = torch.randn(41)
    batch = lib.gguf_linear(x, blocks, qtype, 41, bias)
    for i in range(6):
        assert torch.equal(batch[i], lib.gguf_linear(x[i:i + 1], blocks, qtype, 41, bias)[0])
    assert torch.equal(batch[2], bias.bfloat16())
    assert lib.gguf_linear(x[:0], blocks, qtype, 41, bias).shape == (0, 41)


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_a_rows_result_depends_on_neither_the_batch_nor_its_group(lib: DenseKernels, qtype: str) -> None:
    """M = 1..9 rows (tiles of 4 and their rests): each row bit for bit the one-row call; and each weight row's output
    the same whether it sits in a full group of 8 or in the last, short group (N = 43: 5 groups and 3 rows; the
    rows 24..26 multiplied alone, as a group of 3, and rows 40..42 as a whole group's first rows)."""
    n, k = 43, 2 * BLOCK_VALUES[qtype]
    blocks = _blocks(n, k, qtype, seed=11)
    gen = torch.Generator().manual_seed(12)
    x = (torch.randn(9, k, generator=gen) * 2).bfloat16()
    bias = torch.randn(n, generator=gen)
    full = lib.gguf_linear(x, group_blocks(blocks, qtype, k), qtype, n, bias)
    for m in range(1, 10):
        y = lib.gguf_linear(x[:m], group_blocks(blocks, qtype, k), qtype, n, bias)
        assert torch.equal(y, full[:m]), m
    for lo, hi in ((24, 27), (40, 43), (0, 8), (8, 43)):
        part = lib.gguf_linear(x, group_blocks(blocks[lo:hi].contiguous(), qtype, k), qtype, hi - lo,
                               bias[lo:hi].contiguous())
        assert torch.equal(part, full[:, lo:hi]), (lo, hi)


#: out_features off the groups of 8: one short group alone, a pair of groups whose second is short, 5 groups and 3 rows,
#: and (enough work for two threads) 37 groups and 4 rows, 41 full groups (vnni512: the last paired with itself), 41
#: and 5 rows
ODD_N = [5, 12, 43, 300, 328, 333]


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_odd_shapes_rows_and_threads(lib: DenseKernels, qtype: str) -> None:
    """out_features not a multiple of 8 (ODD_N), K an odd number of blocks where the type allows it (7 x 32; Q4_K: 3
    super-blocks), M = 1..9, on 1 and 2 threads: within the activation bound of the float32 reference, and each row
    the same bits at every M and on either thread count (the groups' split between threads changes nothing)."""
    k = 3 * BLOCK_VALUES[qtype] if BLOCK_VALUES[qtype] != BLOCK else 7 * BLOCK
    gen = torch.Generator().manual_seed(41)
    for n in ODD_N:
        blocks = _blocks(n, k, qtype, seed=n)
        grouped = group_blocks(blocks, qtype, k)
        x = (torch.randn(9, k, generator=gen) * 3).bfloat16()
        bias = torch.randn(n, generator=gen)
        with _threads(1):
            one = lib.gguf_linear(x, grouped, qtype, n, bias)
        with _threads(2):
            for m in range(1, 10):
                assert torch.equal(lib.gguf_linear(x[:m], grouped, qtype, n, bias), one[:m]), (n, m)
        exact = x.double() @ dequantize_blocks(blocks, qtype, k).double().T + bias.double()
        slack = 2.0 ** -8 * exact.abs() * 1.01 + 1e-5 * (x.double().abs() @
                                                          dequantize_blocks(blocks, qtype, k).double().abs().T)
        assert bool(((one.double() - exact).abs() <= gguf_activation_bound(x, blocks, qtype) + slack).all()), n


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_every_path_computes_the_same_bits(qtype: str) -> None:
    """The GGUF kernel's paths (avx2 maddubs, vnni256, vnni512; the x86-64-v3 build's avx2 too) compute the same
    exact integer dot products and the same float32 operations per output, so their results are equal bit for bit:
    on the odd shapes above, M = 1..9 and 1 and 2 threads."""
    native = dense_build_or_skip("native")
    libs = [(f"native {path}", native, path) for path in native.gguf_paths]
    with contextlib.suppress(pytest.skip.Exception):
        v3 = dense_build_or_skip("x86-64-v3")
        libs += [("x86-64-v3 avx2", v3, "avx2")]
    if len(libs) < 2:
        pytest.skip(f"one GGUF kernel path here ({libs[0][0] if libs else 'none'}): nothing to compare")
    k = 3 * BLOCK_VALUES[qtype] if BLOCK_VALUES[qtype] != BLOCK else 7 * BLOCK
    gen = torch.Generator().manual_seed(7)
    for n in ODD_N:
        grouped = group_blocks(_blocks(n, k, qtype, seed=n + 1), qtype, k)
        x = (torch.randn(9, k, generator=gen) * 3).bfloat16()
        x[4] = 0.0
        bias = torch.randn(n, generator=gen) if n % 2 else None
        for threads in (1, 2):
            with _threads(threads):
                want = None
                for name, lib, path in libs:
                    with gguf_path(lib, path):
                        for m in range(9, 0, -1):
                            y = lib.gguf_linear(x[:m], grouped, qtype, n, bias)
                            want = y if want is None else want
                            assert torch.equal(y, want[:m]), (name, n, m, threads)


def test_kernel_rejects_what_it_cannot_read(lib: DenseKernels) -> None:
    blocks = _blocks(8, 64, "Q4_0", seed=0)
    x = torch.randn(2, 64).bfloat16()
    assert set(lib.gguf_types) == set(KEPT_TYPES)
    with pytest.raises(ValueError, match=r"GGUF block type 'Q5_K' has no kernel in this build; it has: "):
        lib.gguf_linear(x, blocks, "Q5_K", 8, None)
    with pytest.raises(ValueError, match="invalid kernel arguments"):   # Q4_K: K not a multiple of 256
        lib.gguf_linear(x, blocks, "Q4_K", 8, None)
    with pytest.raises(ValueError, match=r"blocks must be a contiguous uint8 \[9, row bytes\]"):
        lib.gguf_linear(x, blocks, "Q4_0", 9, None)
    with pytest.raises(ValueError, match="x must be a 2-D bfloat16 tensor"):
        lib.gguf_linear(x.float(), blocks, "Q4_0", 8, None)
    with pytest.raises(ValueError, match="invalid kernel arguments"):   # K not a multiple of 32: the C side refuses
        lib.gguf_linear(torch.zeros(1, 48).bfloat16(), torch.zeros(8, 27, dtype=torch.uint8), "Q4_0", 8, None)


def test_weight_checks_its_type_and_bytes() -> None:
    blocks = _blocks(4, 64, "Q8_0", seed=0)
    assert GGUFWeight("Q8_0", blocks, 64, "blk.0.attn_q.weight").shape == (4, 64)
    with pytest.raises(ValueError, match=r"'blk.0.ffn_up.weight' has type Q5_K; kept quantized: \['Q8_0', 'Q4_0', "
                                         r"'Q4_1', 'Q5_0', 'Q4_K', 'Q6_K'\]"):
        GGUFWeight("Q5_K", blocks, 64, "blk.0.ffn_up.weight")
    with pytest.raises(ValueError, match=r"has 64 columns, not a positive multiple of 256 \(Q4_K\)"):
        GGUFWeight("Q4_K", blocks[:, :36], 64, "w")
    with pytest.raises(ValueError, match=r"blocks must be uint8 \[rows, 36\]"):
        GGUFWeight("Q4_0", blocks, 64, "w")
    with pytest.raises(ValueError, match="not a positive multiple of 32"):
        GGUFWeight("Q8_0", blocks, 48, "w")


# and one block per type, and 300 rows (enough values for both threads)
@pytest.mark.parametrize("qtype, n, k", [*CASES, *((t, 1, BLOCK_VALUES[t]) for t in KEPT_TYPES),
                                         *((t, 300, 800 if BLOCK_VALUES[t] == BLOCK else 768) for t in KEPT_TYPES)])
def test_dequantize_kernel_is_dequantize_blocks_bit_for_bit(lib: DenseKernels, qtype: str, n: int, k: int) -> None:
    blocks = _blocks(n, k, qtype, seed=n * k)
    got = lib.gguf_dequantize(group_blocks(blocks, qtype, k), qtype, k)
    want = dequantize_blocks(blocks, qtype, k)
    assert got.dtype == torch.float32 and got.shape == (n, k)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))   # the bits: -0.0 and 0.0 differ
    assert lib.gguf_dequantize(group_blocks(blocks, qtype, k)[:0], qtype, k).shape == (0, k)


def test_q4_k_kernels_on_random_bytes(lib: DenseKernels) -> None:
    """The C side's scale and min unpacking on every bit pattern: the dequantize kernel bit for bit, the int8 kernel
    within its bound."""
    blocks = _random_q4_k(21, 512, seed=4)
    w = dequantize_blocks(blocks, "Q4_K", 512)
    grouped = group_blocks(blocks, "Q4_K", 512)
    assert torch.equal(lib.gguf_dequantize(grouped, "Q4_K", 512).view(torch.int32), w.view(torch.int32))
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(4)).bfloat16()
    y = lib.gguf_linear(x, grouped, "Q4_K", 21, None)
    exact = x.double() @ w.double().T
    slack = 2.0 ** -8 * exact.abs() * 1.01 + 1e-5 * (x.double().abs() @ w.double().abs().T)
    assert bool(((y.double() - exact).abs() <= gguf_activation_bound(x, blocks, "Q4_K") + slack).all())


def test_q6_k_kernels_on_random_bytes(lib: DenseKernels) -> None:
    """The C side's Q6_K decoding on every code, bit pair and int8 scale (-128 included): the dequantize kernel bit
    for bit, the int8 kernel within its bound at M = 1, 3, 17 and 64 rows (tiles and their rests), N = 21 (a short
    last group)."""
    blocks = _random_q6_k(21, 512, seed=4)
    w = dequantize_blocks(blocks, "Q6_K", 512)
    grouped = group_blocks(blocks, "Q6_K", 512)
    assert torch.equal(lib.gguf_dequantize(grouped, "Q6_K", 512).view(torch.int32), w.view(torch.int32))
    gen = torch.Generator().manual_seed(4)
    for m in (1, 3, 17, 64):
        x = (torch.randn(m, 512, generator=gen) * 3).bfloat16()
        y = lib.gguf_linear(x, grouped, "Q6_K", 21, None)
        exact = x.double() @ w.double().T
        slack = 2.0 ** -8 * exact.abs() * 1.01 + 1e-5 * (x.double().abs() @ w.double().abs().T)
        assert bool(((y.double() - exact).abs() <= gguf_activation_bound(x, blocks, "Q6_K") + slack).all()), m


def test_dequantize_kernel_rejects_what_it_cannot_read(lib: DenseKernels) -> None:
    assert dense._GGUF_BLOCK_BYTES == BLOCK_BYTES   # the wrapper's copies (kv8.kernels cannot import kv8.quant)
    assert dense._GGUF_BLOCK_VALUES == BLOCK_VALUES
    blocks = _blocks(8, 64, "Q4_0", seed=0)
    with pytest.raises(ValueError, match=r"GGUF block type 'Q5_K' has no kernel in this build"):
        lib.gguf_dequantize(blocks, "Q5_K", 64)
    with pytest.raises(ValueError, match=r"blocks \[8, 36\] of Q8_0 do not hold rows of 64 values"):
        lib.gguf_dequantize(blocks, "Q8_0", 64)
    with pytest.raises(ValueError, match="blocks must be a contiguous 2-D uint8 tensor"):
        lib.gguf_dequantize(blocks.float(), "Q4_0", 64)
    with pytest.raises(ValueError, match="invalid kernel arguments"):   # K not a multiple of 32: the C side refuses
        lib.gguf_dequantize(torch.zeros(8, 27, dtype=torch.uint8), "Q4_0", 48)


def _gguf_layer(lib: DenseKernels, blocks: torch.Tensor, qtype: str, bias: torch.Tensor | None) -> LinearBase:
    """A kv8 ``Linear`` holding ``blocks`` (the file's layout) on ``quantization="gguf"``, as the loader builds it."""
    n, k = blocks.shape[0], blocks.shape[1] // BLOCK_BYTES[qtype] * BLOCK_VALUES[qtype]
    backend = DenseBackend("packed_bf16", lib, "gguf", wide_rows=GGUF_DEQUANTIZE_ROWS)   # the fixed rule
    layer = LinearBase(k, [n], bias is not None, backend)
    layer.load_gguf(GGUFWeight(qtype, blocks, k))
    if bias is not None:
        assert layer.bias is not None
        layer.bias.data = bias.clone()
    layer.process_weights_after_loading()
    assert isinstance(layer.method, GGUFLinearMethod) and [s.grouped for s in layer.gguf_segments] == [True]
    return layer


@pytest.mark.parametrize("qtype, n, k", CASES)
def test_layer_uses_the_int8_kernel_below_the_threshold_and_the_float32_gemm_from_it(lib: DenseKernels, qtype: str,
                                                                                      n: int, k: int) -> None:
    """Below ``dequantize_rows`` the layer's output is the int8 kernel's, bit for bit; from it, the float32 GEMM on
    the dequantized blocks (no activation rounding): ``linear_f32`` bit for bit, the exact product within float32
    sums and one bf16 rounding, and gguf_linear_reference within the two roundings. Leading dims are flattened."""
    blocks = _blocks(n, k, qtype, seed=n + k)
    gen = torch.Generator().manual_seed(n * k)
    bias = torch.randn(n, generator=gen) if n % 2 else None
    layer = _gguf_layer(lib, blocks, qtype, bias)
    threshold = GGUF_DEQUANTIZE_ROWS
    assert isinstance(layer.method, GGUFLinearMethod) and layer.method.dequantize_rows == threshold
    w = dequantize_blocks(blocks, qtype, k)
    for rows in (1, threshold - 1, threshold, threshold + 9):
        x = (torch.randn(rows, k, generator=gen) * 3).bfloat16()
        y = layer(x.view(1, rows, k))
        assert y.shape == (1, rows, n) and y.dtype == torch.bfloat16
        y = y[0]
        int8 = lib.gguf_linear(x, layer.gguf_segments[0].blocks, qtype, n, layer.bias_f32)
        if rows < threshold:
            assert torch.equal(y, int8)
            continue
        assert torch.equal(y, linear_f32(x, w, bias))
        assert not torch.equal(y, int8)   # the int8 activations' rounding shows somewhere: another path
        exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
        fp32_sums = 1e-5 * (x.double().abs() @ w.double().abs().T)
        bf16 = 2.0 ** -8 * exact.abs()
        assert bool(((y.double() - exact).abs() <= bf16 * 1.01 + fp32_sums).all())
        ref = gguf_linear_reference(x, blocks, qtype, bias)
        assert bool(((y.double() - ref.double()).abs() <= 2 * bf16 * 1.01 + fp32_sums).all())


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_layer_threshold_is_per_method_and_other_dtypes_take_the_float32_gemm(lib: DenseKernels, qtype: str) -> None:
    """A method built with ``dequantize_rows=2`` switches at 2 rows; a float32 input (which the int8 kernel does not
    read) takes the dequantized path at any row count, in float32."""
    k = 3 * BLOCK_VALUES[qtype]
    blocks = _blocks(37, k, qtype, seed=5)
    layer = _gguf_layer(lib, blocks, qtype, None)
    layer.method = GGUFLinearMethod(lib, dequantize_rows=2)
    w = dequantize_blocks(blocks, qtype, k)
    x = torch.randn(2, k, generator=torch.Generator().manual_seed(2)).bfloat16()
    assert torch.equal(layer(x[:1]), lib.gguf_linear(x[:1], layer.gguf_segments[0].blocks, qtype, 37, None))
    assert torch.equal(layer(x), linear_f32(x, w, None))
    y32 = layer(x[:1].float())
    assert y32.dtype == torch.float32 and torch.equal(y32, linear_f32(x[:1].float(), w, None))
    assert torch.allclose(y32, gguf_linear_reference(x[:1].float(), blocks, qtype, None), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"must be >= 0 \(0: the int8 kernel at every row count\), got -1"):
        GGUFLinearMethod(lib, dequantize_rows=-1)
    layer.method = GGUFLinearMethod(lib, dequantize_rows=0)   # never dequantized: the int8 kernel at any row count
    many = torch.randn(70, k, generator=torch.Generator().manual_seed(3)).bfloat16()
    assert torch.equal(layer(many), lib.gguf_linear(many, layer.gguf_segments[0].blocks, qtype, 37, None))


def test_each_segment_switches_at_its_own_types_rows(lib: DenseKernels) -> None:
    """A merged layer of a Q4_K and a Q6_K projection (two segments) on a backend whose ``gguf_wide_rows`` never
    dequantize Q4_K and dequantize Q6_K from 2 rows: at 2 rows its Q4_K rows are the int8 kernel's and its Q6_K rows
    the float32 GEMM's, bit for bit; at 1 row both are the int8 kernel's."""
    k = 256
    q4, q6 = _blocks(24, k, "Q4_K", seed=1), _blocks(16, k, "Q6_K", seed=2)
    backend = DenseBackend("packed_bf16", lib, "gguf", wide_rows=GGUF_DEQUANTIZE_ROWS,
                           gguf_wide_rows=(("Q4_K", 0), ("Q6_K", 2)))
    layer = MergedLinear(k, [24, 16], False, backend)
    layer.load_gguf(GGUFWeight("Q4_K", q4, k), 0)
    layer.load_gguf(GGUFWeight("Q6_K", q6, k), 1)
    layer.process_weights_after_loading()
    method, (first, second) = layer.method, layer.gguf_segments
    assert isinstance(method, GGUFLinearMethod) and isinstance(first, GGUFSegment) and isinstance(second, GGUFSegment)
    assert [(s.qtype, method.dequantize_rows_of(s.qtype)) for s in (first, second)] == [("Q4_K", 0), ("Q6_K", 2)]
    assert method.dequantize_rows_of("Q8_0") == GGUF_DEQUANTIZE_ROWS   # a type not listed: the backend's wide_rows
    x = (torch.randn(2, k, generator=torch.Generator().manual_seed(4)) * 3).bfloat16()
    y = layer(x)
    assert torch.equal(y[:, :24], lib.gguf_linear(x, first.blocks, "Q4_K", 24, None))
    assert torch.equal(y[:, 24:], linear_f32(x, dequantize_blocks(q6, "Q6_K", k), None))
    one = layer(x[:1])
    assert torch.equal(one[:, 24:], lib.gguf_linear(x[:1], second.blocks, "Q6_K", 16, None))
    with pytest.raises(ValueError, match=r"Q6_K: the row count .* must be >= 0"):
        GGUFLinearMethod(lib, type_rows={"Q6_K": -1})
    with pytest.raises(ValueError, match=r"Q6_K: blocks are dequantized to one of f32, bf16, got 'fp8'"):
        GGUFLinearMethod(lib, type_expansion={"Q6_K": "fp8"})


@pytest.mark.parametrize("qtype", KEPT_TYPES)
def test_random_blocks_have_normal_scales_and_the_files_layout(qtype: str) -> None:
    """The tuner's timing weights: the file's row bytes for the type, every float16 scale (and min) 2**-7, values
    finite; the same seed gives the same blocks; a type that is not kept is refused by name."""
    k = 2 * BLOCK_VALUES[qtype]
    weight = random_blocks(qtype, 9, k, torch.Generator().manual_seed(0))
    assert weight.shape == (9, k) and weight.blocks.shape[1] == row_bytes(qtype, k)
    values = dequantize_blocks(weight.blocks, qtype, k)
    assert bool(torch.isfinite(values).all()) and bool((values != 0).any())
    units = weight.blocks.reshape(-1, BLOCK_BYTES[qtype])
    offsets = {"Q4_1": (0, 2), "Q4_K": (0, 2), "Q6_K": (208,)}.get(qtype, (0,))
    for offset in offsets:
        assert bool((units[:, offset:offset + 2].contiguous().view(torch.float16) == 2.0 ** -7).all())
    assert torch.equal(weight.blocks, random_blocks(qtype, 9, k, torch.Generator().manual_seed(0)).blocks)
    with pytest.raises(ValueError, match="GGUF type 'Q5_K' is not kept as blocks"):
        random_blocks("Q5_K", 9, 256, torch.Generator())


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K", "Q6_K"])
def test_a_large_segment_is_dequantized_a_slice_of_rows_at_a_time(lib: DenseKernels, qtype: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for 16 rows of float32 scratch (GGUF_SCRATCH_BYTES), a 61-row segment (slices of 16, the last of
    13: group edges, a short last group) dequantizes slice by slice: the same outputs as the whole matrix at once up
    to the float32 sums' order (bias included), on the kernels and on the torch reference (the blocks in the file's
    layout)."""
    n, k = 61, BLOCK_VALUES[qtype]
    blocks = _blocks(n, k, qtype, seed=7)
    bias = torch.randn(n, generator=torch.Generator().manual_seed(7))
    x = torch.randn(GGUF_DEQUANTIZE_ROWS + 2, k, generator=torch.Generator().manual_seed(8)).bfloat16()
    w = dequantize_blocks(blocks, qtype, k)
    whole = linear_f32(x, w, bias)
    layer = _gguf_layer(lib, blocks, qtype, bias)
    reference = LinearBase(k, [n], True, DenseBackend("torch", None, "gguf"))
    reference.load_gguf(GGUFWeight(qtype, blocks, k))
    assert reference.bias is not None
    reference.bias.data = bias.clone()
    reference.process_weights_after_loading()
    monkeypatch.setattr(linear, "GGUF_SCRATCH_BYTES", 16 * 4 * k)
    calls: list[int] = []
    dequantize = lib.gguf_dequantize
    monkeypatch.setattr(lib, "gguf_dequantize", lambda b, *a: calls.append(b.shape[0]) or dequantize(b, *a))
    tol = 1e-5 * (x.float().abs() @ w.abs().T) + 2.0 ** -8 * whole.float().abs()
    for held in (layer, reference):
        y = held(x)
        assert y.dtype == torch.bfloat16 and bool(((y.float() - whole.float()).abs() <= tol).all())
    assert calls == [16, 16, 16, 13]


@pytest.mark.parametrize("qtype", KEPT_TYPES)
@pytest.mark.parametrize("n", [61, 40, 96])
def test_dequantize_packed_is_the_packed_bf16_weights(lib: DenseKernels, qtype: str, n: int) -> None:
    """``gguf_dequantize_packed`` writes in one pass what ``pack`` makes of the float32 dequantization rounded to bf16
    (torch's rounding), bit for bit: the whole matrix (a short last panel and group: 61 rows), any run of its panels,
    and, gated, the interleaved order of ``[gate; up]`` (halves of 20 and 48 rows: zero-padded to 32 and 48). Both
    paths of the kernel: a panel of four whole groups (every panel of 96 rows and of its 48-row halves, the first of
    61 and 40) takes the AVX-512 path for every type but Q6_K where the build has it, every other panel (and Q6_K)
    the generic one."""
    k = 2 * BLOCK_VALUES[qtype]
    blocks = _blocks(n, k, qtype, seed=n)
    grouped = group_blocks(blocks, qtype, k)
    wb = dequantize_blocks(blocks, qtype, k).bfloat16()
    whole = lib.pack(wb)
    assert torch.equal(lib.gguf_dequantize_packed(grouped, qtype, k), whole)
    panels = -(-n // 32)
    for first, count in [(0, 1), (panels - 1, 1), (1, panels - 1), (panels, 0)]:
        got = lib.gguf_dequantize_packed(grouped, qtype, k, first_panel=first, panels=count)
        assert torch.equal(got, whole[first * 32 * k:(first + count) * 32 * k])
    if n % 2 == 0:
        gated = lib.pack(lib.interleave_gate_up(wb))
        assert torch.equal(lib.gguf_dequantize_packed(grouped, qtype, k, gated=True), gated)
        half = -(-(n // 2) // 16)
        tail = lib.gguf_dequantize_packed(grouped, qtype, k, gated=True, first_panel=half - 1, panels=1)
        assert torch.equal(tail, gated[(half - 1) * 32 * k:])


def test_dequantize_packed_refuses_bad_arguments(lib: DenseKernels) -> None:
    """Each bad argument is refused by name: rows of the wrong width, an odd gated matrix, panels past the end, a type
    without a kernel."""
    k = 64
    grouped = group_blocks(_blocks(40, k, "Q4_1", seed=3), "Q4_1", k)
    with pytest.raises(ValueError, match=r"do not hold rows of in_features=96 values \(a positive multiple of 32\)"):
        lib.gguf_dequantize_packed(grouped, "Q4_1", 96)
    with pytest.raises(ValueError, match="gated: blocks hold \\[gate; up\\], an even number of rows, got 39"):
        lib.gguf_dequantize_packed(grouped[:39].contiguous(), "Q4_1", k, gated=True)
    with pytest.raises(ValueError, match="panels 1..3 are not within the 2 panels of the packed matrix of 40 rows"):
        lib.gguf_dequantize_packed(grouped, "Q4_1", k, first_panel=1, panels=2)
    with pytest.raises(ValueError, match="panels -1..0 are not within the 2 panels"):
        lib.gguf_dequantize_packed(grouped, "Q4_1", k, first_panel=-1, panels=1)
    with pytest.raises(ValueError, match="GGUF block type 'Q5_K' has no kernel in this build"):
        lib.gguf_dequantize_packed(grouped, "Q5_K", k)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q4_K"])
@pytest.mark.parametrize("inter", [40, 64])
def test_bf16_expansion_fuses_silu_into_the_gate_up_projection(lib: DenseKernels, qtype: str, inter: int,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A GateUpLinear of one bf16-expanded segment runs the packed kernel's gated form from the switch on: bit for bit
    the expanded projection followed by the silu_mul kernel (I = 40: halves padded to 48), also a panel at a time (a
    scratch of one panel's bf16); below the switch, and with gate and up of different types (two segments), the
    projection, then the activation."""
    k, switch = BLOCK_VALUES[qtype], 8
    backend = DenseBackend("packed_bf16", lib, "gguf", wide_rows=switch, gguf_expand="bf16")

    def layer(up_type: str) -> GateUpLinear:
        made = GateUpLinear(k, inter, False, backend, SiluAndMul(backend))
        made.load_gguf(GGUFWeight(qtype, _blocks(inter, k, qtype, seed=21), k), 0)
        made.load_gguf(GGUFWeight(up_type, _blocks(inter, k, up_type, seed=22), k), 1)
        made.process_weights_after_loading()
        return made

    one, two = layer(qtype), layer("Q8_0")
    assert len(one.gguf_segments) == 1 and len(two.gguf_segments) == 2
    x = (torch.randn(switch + 5, k, generator=torch.Generator().manual_seed(23)) * 2).bfloat16()
    calls: list[bool] = []
    packed_of = lib.gguf_dequantize_packed
    monkeypatch.setattr(lib, "gguf_dequantize_packed",
                        lambda *a, **kw: calls.append(bool(kw.get("gated", a[3] if len(a) > 3 else False)))
                        or packed_of(*a, **kw))
    for held in (one, two):
        for rows in (x, x[:switch - 1]):
            want = lib.silu_mul(held.method.apply(held, rows))
            assert torch.equal(held(rows), want)
            assert torch.equal(held(rows.view(1, *rows.shape)), want.view(1, *want.shape))
    assert calls.count(True) == 2   # the fused form: `one` from the switch (twice: two leading shapes)
    whole = one(x)
    monkeypatch.setattr(linear, "GGUF_SCRATCH_BYTES", 2 * 32 * k)
    calls.clear()
    assert torch.equal(one(x), whole)
    assert calls == [True] * -(-inter // 16)


@pytest.mark.parametrize("qtype", ["Q4_1", "Q8_0", "Q4_K", "Q6_K"])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_expansion_is_the_reference_on_bf16_weights(lib: DenseKernels, qtype: str, bias: bool) -> None:
    """A segment whose expansion is bf16 (``gguf_expand="bf16"``, the tuner's candidate on CPUs with AMX): below its
    switch the int8 kernel's result bit for bit; from the switch on the blocks dequantized into the packed layout
    (rounded to bf16) and multiplied by the packed kernel -- the float32 reference on those bf16 weights (float32 sums
    and bias, one rounding) to within a bf16 rounding of the output. A float32 input keeps the float32 GEMM."""
    n, k, switch = 40, 2 * BLOCK_VALUES[qtype], 8
    blocks = _blocks(n, k, qtype, seed=11)
    b = torch.randn(n, generator=torch.Generator().manual_seed(12)) if bias else None
    backend = DenseBackend("packed_bf16", lib, "gguf", wide_rows=switch, gguf_expand="bf16")
    assert backend.label == f"packed_bf16+bf16_from_{switch}"
    layer = LinearBase(k, [n], bias, backend)
    layer.load_gguf(GGUFWeight(qtype, blocks, k))
    if b is not None:
        assert layer.bias is not None
        layer.bias.data = b.clone()
    layer.process_weights_after_loading()
    method = layer.method
    assert isinstance(method, GGUFLinearMethod) and method.expansion_of(qtype) == "bf16"
    x = (torch.randn(switch + 3, k, generator=torch.Generator().manual_seed(13)) * 2).bfloat16()
    segment = layer.gguf_segments[0]
    short = layer(x[:switch - 1])
    assert torch.equal(short, lib.gguf_linear(x[:switch - 1], segment.blocks, qtype, n, None if b is None else b))
    w = dequantize_blocks(blocks, qtype, k).bfloat16().float()
    want = x.float() @ w.T + (0.0 if b is None else b)
    got = layer(x)
    assert got.dtype == torch.bfloat16
    packed = lib.gguf_dequantize_packed(segment.blocks, qtype, k)
    assert torch.equal(got, lib.linear(x, packed, n, None if b is None else b))
    tol = 1e-5 * (x.float().abs() @ w.abs().T) + 2.0 ** -8 * want.abs()
    assert bool(((got.float() - want).abs() <= tol).all())
    f32 = dequantize_blocks(blocks, qtype, k)
    assert bool((got.float() - (x.float() @ f32.T)).abs().max() > 0)   # not the float32 weights' products
    y32 = layer(x.float())
    assert y32.dtype == torch.float32 and torch.equal(y32, linear_f32(x.float(), f32, b))
