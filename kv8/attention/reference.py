"""The reference paged attention: plain torch, one sequence at a time, obviously correct.

This is the oracle every fast kernel is tested against. It reads the cache exactly as a kernel must: new
K/V of the whole batch are stored first (quantized for FP8), then every query attends over the *stored*
context, so a token reads the same bytes whether its K/V was written this step, an earlier step, or came
from the prefix cache. Softmax and accumulation are in float32.

Sliding window (``meta.sliding_window = W``): query position ``p`` sees keys ``p - W < k <= p``. Only the
blocks from ``first_block = first_key // block_size`` on are gathered (a sliced block table: the entries
before it may hold any value and are never looked at); the keys of that block before ``first_key`` are
decoded with it and dropped, so no key before the first query's window enters a product (see
:mod:`kv8.attention.metadata`).
"""

from __future__ import annotations

import torch

from kv8.attention.metadata import AttentionMetadata
from kv8.cache.paged_cache import PagedKVCache


def paged_attention_reference(query: torch.Tensor, cache: PagedKVCache, layer: int, meta: AttentionMetadata,
                              scale: float) -> torch.Tensor:
    """query ``[T, Hq, D]`` (already rotated) -> output ``[T, Hq, D]`` in query's dtype.

    Assumes the new tokens' K/V were stored already (see :func:`store_kv`).
    """
    num_heads = query.shape[1]
    bs = cache.shape.block_size
    window = meta.sliding_window
    out = torch.empty_like(query)
    for i in range(meta.num_seqs):
        q_start = int(meta.query_start_loc[i])
        q_len, s_len = meta.query_lens_list[i], meta.seq_lens_list[i]
        if q_len == 0:
            continue
        q = query[q_start:q_start + q_len].float()                    # [q, Hq, D]
        first = meta.first_key(i)                                      # keys before it are never used
        first_block = first // bs
        k, v = cache.gather(layer, meta.block_tables[i, first_block:], s_len - first_block * bs,
                            torch.float32)                             # [s - first_block * bs, Hkv, D]
        lead = first - first_block * bs                                # keys of first_block before `first`
        k, v = k[lead:], v[lead:]                                      # [s - first, Hkv, D]
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)                          # [s - first, Hq, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,shd->hqs", q, k) * scale            # [Hq, q, s - first]
        # Query j sits at position s_len - q_len + j and sees keys 0 .. that position (with a window W,
        # only the W keys ending there).
        q_pos = torch.arange(s_len - q_len, s_len, device=query.device).unsqueeze(1)
        k_pos = torch.arange(first, s_len, device=query.device).unsqueeze(0)
        hidden = k_pos > q_pos
        if window is not None:
            hidden |= k_pos <= q_pos - window
        scores.masked_fill_(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_start + q_len] = torch.einsum("hqs,shd->qhd", probs, v).to(query.dtype)
    return out
