"""The reference paged attention (:mod:`kv8.attention.reference`) with sliding windows: equal to a dense torch
computation (every K/V gathered, one mask with causal + window) over ragged batches of decode and chunked prefill,
windows of 1 .. beyond the context, blocks of 8 and 16; and it never reads a position or a table entry before a
window (tests/helpers/windows.py poisons them)."""

from __future__ import annotations

import math

import pytest
import torch

from kv8.attention.metadata import AttentionMetadata
from kv8.attention.reference import paged_attention_reference
from kv8.cache.paged_cache import PagedKVCache
from tests.helpers.windows import Case, window_case


def dense_attention(q: torch.Tensor, cache: PagedKVCache, layer: int, case: Case, window: int | None,
                    scale: float) -> torch.Tensor:
    """Every context K/V gathered through the real tables, one [T, S] mask: causal and inside the window."""
    meta = case.meta
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(meta.num_seqs):
        q_len, s_len = meta.query_lens_list[i], meta.seq_lens_list[i]
        start = int(meta.query_start_loc[i])
        k, v = cache.gather(layer, torch.tensor(case.full_tables[i]), s_len, torch.float32)  # [S, Hkv, D]
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)                 # [S, Hq, D]
        qp = torch.arange(s_len - q_len, s_len)[:, None]
        kp = torch.arange(s_len)[None, :]
        allowed = kp <= qp
        if window is not None:
            allowed &= kp > qp - window
        scores = torch.einsum("thd,shd->hts", q[start:start + q_len].float(), k) * scale
        probs = torch.softmax(scores.masked_fill(~allowed, -math.inf), dim=-1)
        out[start:start + q_len] = torch.einsum("hts,shd->thd", probs, v)
    return out


@pytest.mark.parametrize("window", [None, 1, 5, 8, 16, 21, 40, 1000])
@pytest.mark.parametrize("kv_name,bs", [("float32", 16), ("fp8_e4m3", 8)])
def test_reference_matches_dense(kv_name: str, bs: int, window: int | None) -> None:
    case = window_case(kv_name, "head", torch.float32, window, bs=bs, poison=False, seed=3)
    scale = 0.125
    want = dense_attention(case.q, case.cache, 1, case, window, scale)
    got = paged_attention_reference(case.q, case.cache, 1, case.meta, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_reference_ignores_stale_entries() -> None:
    """With a poisoned cache (NaN before every first key) and stale entries (ids past the cache: an index
    error if gathered), the reference is finite and equals itself over the real tables."""
    case = window_case("bfloat16", "none", torch.float32, 12, bs=8, seed=4)
    stale = case.meta.block_tables
    assert bool(((stale < 0) | (stale >= case.cache.shape.num_blocks)).any())
    real = AttentionMetadata.build(list(case.meta.query_lens_list), list(case.meta.seq_lens_list), case.full_tables,
                                   8, sliding_window=12)
    got = paged_attention_reference(case.q, case.cache, 1, case.meta, 0.125)
    assert torch.isfinite(got).all()
    assert torch.equal(got, paged_attention_reference(case.q, case.cache, 1, real, 0.125))
