"""The fused CPU kernels over caches whose K and V are in different formats (a K/V pair, ``kv_cache_dtype=
"KFORMAT/VFORMAT"``: ``kv8_layer.kv_dtype`` is K's format, ``v_kv_dtype`` V's; csrc/attention/attention.cpp), each
side with its own scales (per token on FP8 and integer sides, in the rows of group-scaled ones, none on 16/32-bit
ones; :func:`tests.helpers.kernels.make_pair_cache`).

* Store: K's bytes (and token scales) bit-exact with the reference store (each side's ``KVCodec.encode``), V's too,
  for every pair below, bf16 and fp32 inputs with special values (NaN, inf, all-zero rows) on the quantized sides,
  and a skipped (negative) slot.
* Attention: equals :func:`paged_attention_reference` over the decoded K and V (float32 softmax) within the
  tolerances of tests/kernels/test_fused_attention.py, for int8/int4_per_group32 ("k8v4"), int8/int4,
  fp8_e4m3 (dynamic)/int4_per_group32, bfloat16/int8, int4_per_group32/int8, fp4_e2m1/int4, fp8_e5m2/bfloat16 and
  float16/int8 (q bf16 and fp32):
  ragged batches mixing decode and chunked prefill, GQA 1 / 3 / 8, head_dim 64 / 128 / 256, blocks of 8 / 16 / 32
  and 24 (not a multiple of 16), sliding windows, forced partitions, decode batches whose items hold several KV heads,
  and the portable builds (the generic kernel).
* Which item kernel serves a pair's items (the decode kernel for k8v4 and int8/int4 decode items, staged tiles for
  the other items of pairs of integer, group-scaled, FP8 and bf16 sides, the generic kernel for the rest: fp16 /
  fp32 sides, int4_per_group32 with fp16 / fp32 compute), and that a layer whose token scales do not fit its sides'
  formats is refused.
* The engine: greedy tokens of the ``cpu_fused`` backend over a k8v4 cache equal the reference backend's on a tiny
  random llama (bf16: the decode kernel and staged prefill; float32: the generic kernel), with chunked prefill and
  prefix-cache hits.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kv8 import SamplingParams
from kv8.attention.metadata import AttentionMetadata
from kv8.attention.reference import paged_attention_reference
from kv8.cache.paged_cache import CacheShape, PagedKVCache
from kv8.kernels.cpu import attention as kernels
from kv8.kernels.cpu.attention import paged_attention_fused, store_kv_fused
from tests.helpers.engine import PROMPTS, assert_greedy_match, check_all_blocks_free, make_llm
from tests.helpers.kernels import (
    FP4,
    I4G,
    INT4,
    INT8,
    TOL,
    make_pair_cache,
    make_pair_case,
    random_kv,
    scattered_tables,
    stored,
)
from tests.helpers.tiny_models import make_tiny_model

#: (K's format, V's format)
PAIRS = [(INT8, I4G), (INT8, INT4), ("fp8_e4m3", I4G), ("bfloat16", INT8), (I4G, INT8), (FP4, INT4),
         ("fp8_e5m2", "bfloat16"), ("float16", INT8)]
#: the pairs whose decode items the decode kernel serves (csrc/attention/item_decode.h, decode_pair_fn)
DECODE_PAIRS = [(INT8, I4G), (INT8, INT4)]
#: the formats a pair's side may have for the fast kernels (tiles of both sides decoded to bf16: item_staged.h)
STAGEABLE = (INT8, INT4, FP4, I4G, "fp8_e4m3", "fp8_e4m3fnuz", "fp8_e5m2", "bfloat16")


def check_pair(lib: kernels.KernelLibrary, cache: PagedKVCache, meta: AttentionMetadata, q: torch.Tensor,
               partition_size: int = 0) -> None:
    """The fused attention over a K/V pair against the reference over its decoded K and V (float32 softmax)."""
    assert cache.codec.is_pair
    scale = q.shape[-1] ** -0.5
    ref = paged_attention_reference(q, cache, 1, meta, scale).float()
    got = paged_attention_fused(lib, q, cache, 1, meta, scale, partition_size)
    assert got.dtype == q.dtype and got.shape == q.shape
    err = (got.float() - ref).abs().max().item()
    # int4_per_group32 K on staged tiles (bf16 compute) rounds each K value to bf16 (2^-9 relative) before the
    # scores: on these wide-range values that moves an output by up to ~1.2 bf16 ulps (the single format too)
    slack = 2.0 if cache.k_dtype.name == I4G and q.dtype == torch.bfloat16 else 1.0
    bound = slack * TOL[q.dtype] * (1.0 + ref.abs().max().item())
    assert err <= bound, f"max |fused - reference| = {err:.3g} > {bound:.3g}"


def expected_kernel(lib: kernels.KernelLibrary, k_name: str, v_name: str, q_dtype: torch.dtype, dim: int, bs: int,
                    rows: int) -> str:
    """The item kernel a pair's items of ``rows`` rows should get (see attention.cpp's header)."""
    if not lib.has_fast_path or dim % 16 or k_name not in STAGEABLE or v_name not in STAGEABLE:
        return "generic"
    if (k_name, v_name) in DECODE_PAIRS and rows <= 4 and bs % 16 == 0 and dim in (64, 128, 256) \
            and q_dtype == torch.bfloat16:
        return "decode"
    if q_dtype != torch.bfloat16 and I4G in (k_name, v_name):
        return "generic"   # int4_per_group32's staged values round to bf16: bf16 compute only
    if lib.amx and rows > 4 and q_dtype == torch.bfloat16 and dim % 64 == 0 and dim <= 256:
        return "amx"       # the prefill loop on AMX tiles, as for a bf16 cache
    return "prefill" if rows > 4 and dim <= 128 else "tile"


# ------------------------------------------------------------------------------------------------
# Store
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k_name,v_name", PAIRS)
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
def test_pair_store_bit_exact(lib: kernels.KernelLibrary, k_name: str, v_name: str, in_dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(5)
    heads, dim, bs, tokens = 3, 64, 16, 50
    shape = CacheShape(2, 8, heads, bs, dim)
    ref, mine = make_pair_cache(shape, k_name, v_name), make_pair_cache(shape, k_name, v_name)
    key, value = random_kv(tokens, heads, dim, gen), random_kv(tokens, heads, dim, gen)
    for name, x in ((k_name, key), (v_name, value)):
        if name not in ("bfloat16", "float16"):  # special values in a quantized side (16/32-bit: a plain cast)
            x[4, 2, 5] = math.nan
            x[9, 0, 0] = -math.inf
            x[11, 1] = 0.0
    key, value = key.to(in_dtype), value.to(in_dtype)
    slots = torch.randperm(shape.num_blocks * bs, generator=gen)[:tokens]
    slots[7] = -1   # a padded row: stored nowhere
    ref.store(1, key, value, slots)
    store_kv_fused(lib, mine, 1, key, value, slots)
    kept = slots[slots >= 0]
    raw = stored(ref, 1, kept)
    assert len(raw) == 2 + (ref.k_token_scales is not None) + (ref.v_token_scales is not None)
    for a, b in zip(raw, stored(mine, 1, kept), strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------------
# Attention
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("k_name,v_name", PAIRS)
@pytest.mark.parametrize("q_dtype", [torch.bfloat16, torch.float32])
def test_pair_attention(lib: kernels.KernelLibrary, kernel_path: str, k_name: str, v_name: str,
                        q_dtype: torch.dtype) -> None:
    """A ragged batch of decode and chunked-prefill rows over cached prefixes (GQA 3, blocks of 16), on AMX tiles
    (where this CPU has them) and on AVX-512."""
    testing = kernels.KernelTesting(lib)
    for rows in (3, 48):
        got = testing.item_kernel(k_name, q_dtype, 64, 16, rows, v_kv_dtype=v_name)
        want = expected_kernel(lib, k_name, v_name, q_dtype, 64, 16, rows)
        assert got == want, (rows, got, want)
    cache, meta, q = make_pair_case(k_name, v_name, q_dtype)
    check_pair(lib, cache, meta, q)
    check_pair(lib, cache, meta, q, partition_size=32)


@pytest.mark.parametrize("group,dim,bs", [(1, 64, 16), (3, 64, 8), (8, 64, 32), (3, 128, 16), (1, 128, 32),
                                          (3, 256, 16), (3, 64, 24)])
@pytest.mark.parametrize("k_name,v_name", [(INT8, I4G), (INT8, INT4), (I4G, INT8)])
def test_pair_shapes(lib: kernels.KernelLibrary, kernel_path: str, group: int, dim: int, bs: int, k_name: str,
                     v_name: str) -> None:
    """GQA groups, head dims and block sizes (24: tiles that cross blocks; the decode kernel needs multiples of 16)."""
    cache, meta, q = make_pair_case(k_name, v_name, torch.bfloat16, group=group, dim=dim, bs=bs, heads=2,
                                   query_lens=[1, 9, 1, 3], seq_lens=[bs, 2 * bs + 3, 5 * bs + 1, 40],
                                   seed=group + dim + bs)
    check_pair(lib, cache, meta, q)


@pytest.mark.parametrize("k_name,v_name", [(INT8, I4G), (INT8, INT4), ("bfloat16", INT8), (I4G, INT8)])
@pytest.mark.parametrize("window", [1, 20, 100])
def test_pair_sliding_window(lib: kernels.KernelLibrary, k_name: str, v_name: str, window: int) -> None:
    """Sliding windows over decode and prefill rows (block-table entries before a window are never read)."""
    cache, meta, q = make_pair_case(k_name, v_name, torch.bfloat16, seed=window)
    check_pair(lib, cache, dataclasses.replace(meta, sliding_window=window), q)
    check_pair(lib, cache, dataclasses.replace(meta, sliding_window=window), q, partition_size=16)


@pytest.mark.parametrize("k_name,v_name", DECODE_PAIRS)
@pytest.mark.parametrize("dim", [64, 128])
def test_pair_decode_batch(lib: kernels.KernelLibrary, k_name: str, v_name: str, dim: int) -> None:
    """A decode batch (SmolLM2's GQA 3 with 3 KV heads): enough items that each holds every KV head of its sequence
    (plan.h), over contexts that end mid-tile and at block edges."""
    seq_lens = [200, 16, 77, 129, 64, 301, 1, 48]
    cache, meta, q = make_pair_case(k_name, v_name, torch.bfloat16, dim=dim, heads=3, query_lens=[1] * 8,
                                   seq_lens=seq_lens, seed=dim)
    check_pair(lib, cache, meta, q)


@pytest.mark.parametrize("k_name,v_name", [(INT8, I4G), ("fp8_e4m3", I4G), (I4G, INT8)])
def test_pair_portable_builds(portable_lib: kernels.KernelLibrary, k_name: str, v_name: str) -> None:
    """Builds without AVX-512 BF16 read every pair with the generic kernel."""
    assert kernels.KernelTesting(portable_lib).item_kernel(k_name, torch.bfloat16, 64, v_kv_dtype=v_name) == "generic"
    for q_dtype in (torch.bfloat16, torch.float32):
        cache, meta, q = make_pair_case(k_name, v_name, q_dtype)
        check_pair(portable_lib, cache, meta, q, partition_size=32)


def test_pair_single_format_kernels_unchanged(lib: kernels.KernelLibrary) -> None:
    """Naming V's format as K's is a cache of one format: its kernels are those of the format alone."""
    testing = kernels.KernelTesting(lib)
    for name in ("fp8_e4m3", "bfloat16", INT8, INT4, I4G, FP4):
        for rows in (1, 3, 48):
            assert testing.item_kernel(name, torch.bfloat16, 64, 16, rows, v_kv_dtype=name) == \
                testing.item_kernel(name, torch.bfloat16, 64, 16, rows)


@pytest.mark.parametrize("k_name,v_name,drop", [(INT8, I4G, "k"), (I4G, INT8, "v"), (INT8, I4G, "add_v"),
                                                (I4G, INT8, "add_k")])
def test_pair_token_scales_refused(lib: kernels.KernelLibrary, k_name: str, v_name: str, drop: str) -> None:
    """An integer side without its token scales, or a group-scaled side with some, is refused by the attention and
    the store (ValueError naming the call)."""
    gen = torch.Generator().manual_seed(9)
    seq_lens = [20]
    tables, num_blocks = scattered_tables(seq_lens, 16, gen)
    cache = make_pair_cache(CacheShape(2, num_blocks, 2, 16, 64), k_name, v_name)
    meta = AttentionMetadata.build([1], seq_lens, tables, 16)
    args = kernels.LayerArgs.from_buffer_copy(lib.layer_args(cache, 1))
    spare = torch.ones(num_blocks, 2, 16)
    if drop == "k":
        args.k_token_scales = None
    elif drop == "v":
        args.v_token_scales = None
    elif drop == "add_v":
        args.v_token_scales = spare.data_ptr()
    else:
        args.k_token_scales = spare.data_ptr()
    q = torch.randn(1, 6, 64, dtype=torch.bfloat16)
    out = torch.empty_like(q)
    call = kernels.AttentionCall(q.data_ptr(), out.data_ptr(), 1, 6, lib.compute_codes[q.dtype],
                                 meta.query_start_loc.data_ptr(), meta.seq_lens.data_ptr(),
                                 meta.block_tables.data_ptr(), meta.block_tables.shape[1], 1, 1, 1, 0.125, 0, 0, 0, 0)
    with pytest.raises(ValueError, match="paged attention"):
        lib.invoke(lib._lib.kv8_paged_attention, "paged attention", args, call)
    kv = random_kv(1, 2, 64, gen).to(torch.bfloat16)
    slots = torch.tensor([3])
    store = kernels.StoreCall(kv.data_ptr(), kv.data_ptr(), slots.data_ptr(), 1, lib.compute_codes[kv.dtype], 1)
    with pytest.raises(ValueError, match="store"):
        lib.invoke(lib._lib.kv8_store_kv, "store", args, store)


# ------------------------------------------------------------------------------------------------
# The engine
# ------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random llama, GQA 3 (6 query heads, 2 KV heads), head_dim 64: the decode kernel's k8v4 instances."""
    return make_tiny_model(str(tmp_path_factory.mktemp("k8v4")), "llama_gqa", head_dim=64)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_engine_k8v4_cpu_fused_matches_reference(lib: kernels.KernelLibrary, tiny_llama: str, dtype: str) -> None:
    """Greedy tokens over a k8v4 cache: the cpu_fused backend's equal the reference attention's (near-ties aside,
    assert_greedy_match), with prefills in chunks of 16 tokens and the prompts' blocks found again in the prefix
    cache. This random model's next-token distribution is nearly flat, and its bf16 logits (0.016 nats apart at
    -4.2) leave three or four tokens within one rounding of each other here and there (a softmax weight's last
    bits in the kernel move which): bf16 keeps 5 logprobs, so a near-tie's other token is seen."""
    if dtype == "bfloat16" and lib.has_fast_path:
        assert kernels.KernelTesting(lib).item_kernel(INT8, torch.bfloat16, 64, 16, 3, v_kv_dtype=I4G) == "decode"
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=5 if dtype == "bfloat16" else 2)
    outs = {}
    for backend in ("reference", "cpu_fused"):
        llm = make_llm(tiny_llama, dtype=dtype, kv_cache_dtype="k8v4", attention_backend=backend, block_size=16,
                       enable_prefix_caching=True, max_num_batched_tokens=16)
        assert llm.engine.runner.backend.name == backend
        assert llm.engine.caches[0].codec.name == "int8_per_token_head/int4_per_group32"
        outs[backend] = [o.outputs[0] for o in llm.generate(PROMPTS, greedy)]
        again = llm.generate(PROMPTS, greedy)
        assert any(o.num_cached_tokens > 0 for o in again)
        assert_greedy_match([o.outputs[0] for o in again], outs[backend])
        check_all_blocks_free(llm)
    assert_greedy_match(outs["cpu_fused"], outs["reference"])
