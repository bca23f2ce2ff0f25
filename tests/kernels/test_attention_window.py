"""Sliding-window attention (``AttentionMetadata.sliding_window``) in the fused CPU kernels. The window's metadata
and the reference against a dense computation are tested in tests/attention/; the cases are tests/helpers/windows.py.

* Fused vs reference, with windows smaller than, equal to, not a multiple of and larger than the block size
  (and larger than the context): every KV dtype and scale mode (static per tensor / head / channel, dynamic),
  q in bf16 and fp32, head_dim 64 / 128 / 256 x GQA 1 / 4 / 8, blocks of 8 / 16 / 32, forced and automatic
  context partitions (the split is over the window: a long decode's items cover O(W) tokens), the decode-item
  kernel (asserted to serve), the tile kernel and its prefill loop (long prefills, asserted to serve), and the
  generic (non-AVX-512) build.
* Never read: in every case above the cache is poisoned -- every position before a sequence's first key
  (whole blocks and the leading rows of the first needed block) holds NaN (FP8: the format's NaN code; int8 /
  int4: code 127 with a NaN scale; dynamic scales NaN too, except those of the leading rows, which the reference
  decodes before dropping them) -- and
  the block-table entries of blocks wholly before the window are stale: 0 (a block that is all NaN), ids
  past the cache, negative ids. The outputs are finite and equal the reference; the same metadata without a
  window is refused (a bad block id), so the entries would be caught if they were read.

Tolerances as in tests/kernels/test_fused_attention.py: |fused - ref| <= tol * (1 + max|ref|), tol = 2^-7 (bf16 output)
or 5e-5 (fp32 output).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kv8.attention.metadata import AttentionMetadata
from kv8.attention.reference import paged_attention_reference
from kv8.kernels.cpu import attention as kernels
from kv8.kernels.cpu.attention import paged_attention_fused
from tests.helpers.kernels import FP4, I4G, INT4, INT8, decode_kernel, portable_path, prefill_kernel
from tests.helpers.windows import STALE, Case, window_case

FP8 = ["fp8_e4m3", "fp8_e4m3fnuz", "fp8_e5m2"]
TOL = {torch.float32: 5e-5, torch.bfloat16: 2.0 ** -7}


def check(lib: kernels.KernelLibrary, case: Case, partitions: tuple[int, ...] = (0,)) -> None:
    """Fused (with each forced ``partition_size``; 0 = automatic) == reference within TOL, both finite."""
    scale = case.q.shape[-1] ** -0.5
    ref = paged_attention_reference(case.q, case.cache, 1, case.meta, scale).float()
    assert torch.isfinite(ref).all(), "the reference read a poisoned position"
    bound = TOL[case.q.dtype] * (1.0 + ref.abs().max().item())
    for partition_size in partitions:
        got = paged_attention_fused(lib, case.q, case.cache, 1, case.meta, scale, partition_size).float()
        assert torch.isfinite(got).all(), f"the kernel read a poisoned position (partition_size={partition_size})"
        err = (got - ref).abs().max().item()
        assert err <= bound, f"max |fused - reference| = {err:.3g} > {bound:.3g} (partition_size={partition_size})"


def item_kernel(lib: kernels.KernelLibrary, kv_name: str, q_dtype: torch.dtype, dim: int, bs: int, rows: int) -> str:
    return kernels.KernelTesting(lib).item_kernel(kv_name, q_dtype, dim, bs, rows)


# ------------------------------------------------------------------------------------------------
# Fused vs reference
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kv_name,gran", [(k, g) for k in FP8 for g in ("tensor", "head", "channel", "dynamic")]
                         + [(k, "none") for k in ("bfloat16", "float16", "float32")]
                         + [(INT8, "dynamic"), (INT4, "dynamic")])
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_window_kv_dtypes_and_scales(lib: kernels.KernelLibrary, kv_name: str, gran: str, q_dtype: torch.dtype) -> None:
    """Every KV dtype and scale mode; windows smaller than, equal to, not a multiple of and larger than the
    block size (16), and beyond every context (200)."""
    for window in ((3, 24) if q_dtype == torch.bfloat16 else (16, 200)):
        check(lib, window_case(kv_name, gran, q_dtype, window, seed=window))


@pytest.mark.parametrize("group,dim,bs", [(1, 64, 16), (4, 64, 8), (8, 64, 32), (1, 128, 8), (4, 128, 32),
                                          (8, 128, 16), (1, 256, 32), (4, 256, 16), (8, 256, 8)])
@pytest.mark.parametrize("kv_name,q_dtype", [("fp8_e4m3", torch.bfloat16), ("bfloat16", torch.float32)])
def test_window_shapes(lib: kernels.KernelLibrary, group: int, dim: int, bs: int, kv_name: str,
                       q_dtype: torch.dtype) -> None:
    """head_dim 64 / 128 / 256 x GQA 1 / 4 / 8, blocks of 8 / 16 / 32 (of 8: tiles span two blocks, the first
    tile's leading rows may lie in a block before the window); windows below, at, off and above the block size."""
    for window in ((bs // 2 + 1, bs + 5) if kv_name == "fp8_e4m3" else (bs, 3 * bs)):
        check(lib, window_case(kv_name, "head", q_dtype, window, group=group, dim=dim, bs=bs, heads=1,
                               query_lens=[1, 9, 1, 3, 20], seq_lens=[bs, 2 * bs + 3, 5 * bs + 1, 40, 90],
                               seed=group + dim + window))


@pytest.mark.parametrize("kv_name,q_dtype", [("fp8_e4m3", torch.bfloat16), ("fp8_e5m2", torch.float32),
                                             ("bfloat16", torch.bfloat16), ("float32", torch.float32)])
def test_window_partitions(lib: kernels.KernelLibrary, kv_name: str, q_dtype: torch.dtype) -> None:
    """Context splits over the window (forced, and automatic for the long decodes), combined by log-sum-exp,
    including partitions some rows of a chunk do not reach."""
    for window in (37, 160):
        check(lib, window_case(kv_name, "head", q_dtype, window, query_lens=[1, 20, 0, 7],
                               seq_lens=[700, 300, 33, 2000], seed=window), partitions=(0, 16, 48, 256))


@pytest.mark.parametrize("kv_name,gran", [("fp8_e4m3", "tensor"), ("fp8_e5m2", "channel"),
                                          ("fp8_e4m3fnuz", "dynamic"), ("bfloat16", "none"), (INT8, "dynamic"),
                                          (INT4, "dynamic"), (FP4, "none"), (I4G, "none")])
@pytest.mark.parametrize("group", [1, 2, 4])
@pytest.mark.usefixtures("kernel_path")
def test_window_decode_item_kernel(lib: kernels.KernelLibrary, kv_name: str, gran: str, group: int) -> None:
    """The decode-item kernel (bf16 compute, <= 4 rows: up to 4 / group query tokens per sequence, each row with
    its own window) serves these items (asserted) and equals the reference; windows that put the first and last
    tile of an item in one 64-token chunk, and first tiles with leading rows before the window."""
    bs, dim = 16, 128 if group == 2 else 256
    per_seq = 4 // group
    seq_lens = [1, 15, 16, 17, 63, 64, 65, 129, 300]
    query_lens = [min(1 + i % per_seq, n) for i, n in enumerate(seq_lens)]
    decode_kernel(lib, kv_name, gran, dim, bs, group * per_seq)
    for window in (1, 7, 40, 100):
        case = window_case(kv_name, gran, torch.bfloat16, window, group=group, dim=dim, bs=bs, heads=1,
                           query_lens=query_lens, seq_lens=seq_lens, seed=window + group)
        check(lib, case, partitions=(0, 32))


@pytest.mark.parametrize("kv_name,gran", [("fp8_e4m3", "channel"), ("fp8_e5m2", "dynamic"),
                                          ("fp8_e4m3fnuz", "head"), ("bfloat16", "none"), ("float16", "none")])
def test_window_portable_builds(portable_lib: kernels.KernelLibrary, kv_name: str, gran: str) -> None:
    assert item_kernel(portable_lib, kv_name, torch.bfloat16, 64, 16, 48) == portable_path(portable_lib, 64)
    for q_dtype, bs in ((torch.bfloat16, 16), (torch.float32, 8)):
        for window in (5, 24):
            check(portable_lib, window_case(kv_name, gran, q_dtype, window, bs=bs, seed=window), partitions=(0, 32))


@pytest.mark.parametrize("kv_name,gran", [(k, g) for k in FP8 for g in ("tensor", "dynamic")]
                         + [("bfloat16", "none"), ("float32", "none")])
@pytest.mark.parametrize("group", [4, 8])
@pytest.mark.usefixtures("kernel_path")
def test_window_gemma3_shape(lib: kernels.KernelLibrary, kv_name: str, gran: str, group: int) -> None:
    """Gemma-3 local layers: head_dim 256, one KV head, 4 (and 8) query heads, window 512, blocks of 16:
    decode at 100 / 600 / 1100 tokens and a prefill chunk of 40 over a cached prefix; bf16 and fp32 compute
    (8 query heads: bf16, whose decode items take the tile kernel)."""
    for q_dtype in (torch.bfloat16, torch.float32) if group == 4 else (torch.bfloat16,):
        case = window_case(kv_name, gran, q_dtype, 512, group=group, dim=256, heads=1,
                           query_lens=[1, 1, 40, 1], seq_lens=[600, 1100, 560, 100], seed=group)
        check(lib, case)


@pytest.mark.parametrize("kv_name,gran,q_dtype", [("fp8_e4m3", "tensor", torch.bfloat16),
                                                  ("fp8_e5m2", "dynamic", torch.float32),
                                                  ("fp8_e4m3fnuz", "channel", torch.bfloat16),
                                                  ("bfloat16", "none", torch.bfloat16),
                                                  ("bfloat16", "none", torch.float32)])
@pytest.mark.parametrize("group,dim,bs", [(3, 64, 16), (4, 128, 8), (1, 64, 32)])
@pytest.mark.usefixtures("kernel_path")
def test_window_long_prefill(lib: kernels.KernelLibrary, kv_name: str, gran: str, q_dtype: torch.dtype, group: int,
                             dim: int, bs: int) -> None:
    """Long prefills in the tile kernel's prefill loop (asserted to serve; on AMX tiles and on AVX-512 where
    both exist) with windows of 37, 100 and 512: the window's edge crosses the chunks of every item at every
    offset, items start mid-tile (k0), chunked prefills over cached prefixes end mid-tile; poisoned before each
    first key; automatic and forced partitions."""
    prefill_kernel(lib, kv_name, gran, q_dtype, dim, bs)
    for window in (37, 100, 512):
        check(lib, window_case(kv_name, gran, q_dtype, window, group=group, dim=dim, bs=bs, heads=2,
                               query_lens=[600, 150, 1, 91], seq_lens=[600, 700, 650, 333], seed=window + dim),
              partitions=(0, 96))


@pytest.mark.parametrize("kv_name,gran,q_dtype", [(INT8, "dynamic", torch.bfloat16), (INT4, "dynamic", torch.float32),
                                                  (FP4, "none", torch.bfloat16), (FP4, "none", torch.float32),
                                                  (I4G, "none", torch.bfloat16)])
@pytest.mark.parametrize("group,dim,bs", [(3, 64, 16), (4, 128, 8), (2, 256, 16)])
def test_window_staged_prefill(lib: kernels.KernelLibrary, kv_name: str, gran: str, q_dtype: torch.dtype, group: int,
                               dim: int, bs: int) -> None:
    """Long prefills of the integer and group-scaled caches on the tile kernel's staged bf16 tiles (asserted to
    serve: the prefill loop, the chunked tile loop for head_dim 256) with windows of 37 and 100: items that start
    mid-tile, the window's edge inside chunks; poisoned before each first key (int8 / int4: code 127 with NaN
    scales; FP4 / int4_per_group32: bytes 0x7F, whose group scales read as NaN); automatic and forced partitions."""
    prefill_kernel(lib, kv_name, gran, q_dtype, dim, bs)
    for window in (37, 100):
        check(lib, window_case(kv_name, gran, q_dtype, window, group=group, dim=dim, bs=bs, heads=2,
                               query_lens=[300, 150, 1, 91], seq_lens=[300, 400, 350, 333], seed=window + dim),
              partitions=(0, 96))


# ------------------------------------------------------------------------------------------------
# Never read, and O(W)
# ------------------------------------------------------------------------------------------------

def test_stale_entries_would_be_caught(lib: kernels.KernelLibrary) -> None:
    """The poisoned cases' stale entries are refused (a bad block id) by a call without the window, and give
    NaN where they point at block 0: a kernel reading them could not pass the tests above."""
    case = window_case("fp8_e4m3", "tensor", torch.bfloat16, 16, query_lens=[1], seq_lens=[130])
    assert case.meta.block_tables[0, :7].tolist() == [STALE[i % 4] for i in range(7)]
    check(lib, case)
    with pytest.raises(ValueError, match="block id"):
        paged_attention_fused(lib, case.q, case.cache, 1, dataclasses.replace(case.meta, sliding_window=None), 0.1)
    only_zero = window_case("fp8_e4m3", "tensor", torch.bfloat16, 16, query_lens=[1], seq_lens=[40])
    assert only_zero.meta.block_tables[0, 0].item() == 0  # block 0 holds NaN codes only
    full = paged_attention_fused(lib, only_zero.q, only_zero.cache, 1,
                                 dataclasses.replace(only_zero.meta, sliding_window=None), 0.1)
    assert torch.isnan(full.float()).all()
    check(lib, only_zero)


def test_window_decode_cost_is_window_sized(lib: kernels.KernelLibrary) -> None:
    """A decode at 64k tokens with a window of 64 over a 6-block cache: every entry before the window is an
    out-of-range id, so any O(context) walk of the table would fail; the result equals that of the same keys
    at the start of a short sequence."""
    bs, dim, window, ctx = 16, 256, 64, 1 << 16
    case = window_case("fp8_e4m3", "tensor", torch.bfloat16, window, group=4, dim=dim, bs=bs, heads=1,
                       query_lens=[1], seq_lens=[window + 16], seed=9)
    real = case.full_tables[0]
    table = [10 ** 6] * (ctx // bs - len(real)) + real
    meta = AttentionMetadata.build([1], [ctx], [table], bs, sliding_window=window)
    short = AttentionMetadata.build([1], [window + 16], [real], bs, sliding_window=window)
    scale = dim ** -0.5
    got = paged_attention_fused(lib, case.q, case.cache, 1, meta, scale)
    want = paged_attention_fused(lib, case.q, case.cache, 1, short, scale)
    assert torch.equal(got, want)  # same keys (positions shifted by a multiple of the block size), same result
