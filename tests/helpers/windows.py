"""Sliding-window attention cases, for the tests of the reference attention (tests/attention/test_reference.py) and
of the fused CPU kernels' windows (tests/kernels/test_attention_window.py): a ragged batch over a cache whose every
position a window hides is poisoned (NaN) and whose table entries before the window are stale."""

from __future__ import annotations

import dataclasses

import torch

from kv8.attention.metadata import AttentionMetadata
from kv8.cache.codec import KVCodec
from kv8.cache.paged_cache import CacheShape, PagedKVCache
from kv8.quant.formats import resolve_kv_cache_dtype
from kv8.quant.scales import KVScales, ScaleGranularity
from tests.helpers.kernels import FP8, fill_codes, scattered_tables

NAN_CODE = {"fp8_e4m3": 0x7F, "fp8_e4m3fnuz": 0x80, "fp8_e5m2": 0x7F}
STALE = [0, 10 ** 6, -3, 1 << 40]  # what a freed block's table entry may hold; block 0 is all NaN

# A ragged batch: decode steps and chunked prefill over cached prefixes, lengths at / across block edges.
QUERY_LENS = [1, 1, 1, 5, 16, 17, 1, 3]
SEQ_LENS = [1, 16, 33, 21, 48, 17, 130, 77]


@dataclasses.dataclass
class Case:
    cache: PagedKVCache
    meta: AttentionMetadata      # with the window and stale entries before it
    full_tables: list[list[int]]  # the real block ids of every context position
    q: torch.Tensor


def first_key(q_len: int, s_len: int, window: int | None) -> int:
    return 0 if window is None else max(0, s_len - q_len + 1 - window)


def _random_kv(n: int, heads: int, dim: int, gen: torch.Generator) -> torch.Tensor:
    mag = torch.exp2(torch.empty(n, heads, dim).uniform_(-8.0, 3.0, generator=gen))
    return torch.randn(n, heads, dim, generator=gen) * mag + torch.randn(n, heads, dim, generator=gen)


def window_case(kv_name: str, gran: str, q_dtype: torch.dtype, window: int | None, *, group: int = 2,
                dim: int = 64, bs: int = 16, heads: int = 2, query_lens: list[int] | None = None,
                seq_lens: list[int] | None = None, seed: int = 0, poison: bool = True) -> Case:
    """A 2-layer cache whose layer 1 holds the context tokens, metadata with ``window`` and queries
    ``[T, heads * group, dim]``. ``poison``: every position before a sequence's first key (and every slot
    that holds no context token) is NaN, block 0 is all NaN and in no table, and the entries of blocks wholly
    before the first key are stale (STALE, cycled); else every context token is stored and tables are real."""
    query_lens = QUERY_LENS if query_lens is None else query_lens
    seq_lens = SEQ_LENS if seq_lens is None else seq_lens
    gen = torch.Generator().manual_seed(seed)
    kv = resolve_kv_cache_dtype(kv_name, torch.bfloat16)
    full_tables, num_blocks = scattered_tables(seq_lens, bs, gen, block0_unused=True)
    scales = None
    if kv_name in FP8 and gran != "dynamic":
        shape = {"tensor": (2, 1, 1), "head": (2, heads, 1), "channel": (2, heads, dim)}[gran]
        scales = KVScales(k=0.004 + 0.03 * torch.rand(shape, generator=gen),
                          v=0.004 + 0.03 * torch.rand(shape, generator=gen),
                          granularity=ScaleGranularity(gran), source="test", made_for=None)
    codec = KVCodec.build(kv, dim, scale_mode="dynamic" if gran == "dynamic" else "static", scales=scales)
    cache = PagedKVCache(CacheShape(2, num_blocks, heads, bs, dim), codec)
    if kv_name in FP8:
        fill_codes(cache, NAN_CODE[kv_name])
    elif kv.codes is not None:  # integer codes have no NaN: the NaN token scales below poison them
        fill_codes(cache, 127)
    else:
        fill_codes(cache, float("nan"))
    for ts in (cache.k_token_scales, cache.v_token_scales):
        if ts is not None:
            ts.fill_(float("nan"))
    slots = []
    for q_len, s_len, table in zip(query_lens, seq_lens, full_tables):
        first = first_key(q_len, s_len, window) if poison else 0
        slots += [table[p // bs] * bs + p % bs for p in range(first, s_len)]
        # The reference decodes whole blocks (PagedKVCache.gather) and drops the first needed block's
        # leading rows after decoding them, so their dynamic scales must be valid; their codes stay NaN.
        for ts in (cache.k_token_scales, cache.v_token_scales):
            for p in range(first // bs * bs, first) if ts is not None else ():
                ts[1, table[p // bs], :, p % bs] = 1.0
    dtype = q_dtype if kv.is_quantized else kv.storage_dtype
    n = len(slots)
    cache.store(1, _random_kv(n, heads, dim, gen).to(dtype), _random_kv(n, heads, dim, gen).to(dtype),
                torch.tensor(slots, dtype=torch.int64))
    tables = [list(t) for t in full_tables]
    if poison:
        k = 0
        for q_len, s_len, table in zip(query_lens, seq_lens, tables):
            for b in range(first_key(q_len, s_len, window) // bs):
                table[b] = STALE[k % len(STALE)]
                k += 1
    meta = AttentionMetadata.build(list(query_lens), list(seq_lens), tables, bs, sliding_window=window)
    q = torch.randn(sum(query_lens), heads * group, dim, generator=gen).to(q_dtype)
    return Case(cache, meta, full_tables, q)
