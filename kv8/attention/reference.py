"""The reference paged attention: plain torch, one sequence at a time, obviously correct.

This is the oracle every fast kernel is tested against. It reads the cache exactly as a kernel must: new
K/V of the whole batch are stored first (quantized for FP8), then every query attends over the *stored*
context, so a token reads the same bytes whether its K/V was written this step, an earlier step, or came
from the prefix cache. Softmax and accumulation are in float32.
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
    num_heads, bs = query.shape[1], cache.shape.block_size
    out = torch.empty_like(query)
    for i in range(meta.num_seqs):
        q_start = int(meta.query_start_loc[i])
        q_len, s_len = meta.query_lens_list[i], meta.seq_lens_list[i]
        q = query[q_start:q_start + q_len].float()                    # [q, Hq, D]
        # Keys from block `first` on: with a window, blocks before the first query's window are never read.
        window = meta.sliding_window
        first = 0 if window is None else max(s_len - q_len - window + 1, 0) // bs
        k, v = cache.gather(layer, meta.block_tables[i, first:], s_len - first * bs, torch.float32)   # [s', Hkv, D]
        group = num_heads // k.shape[1]
        k = k.repeat_interleave(group, dim=1)                          # [s', Hq, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,shd->hqs", q, k) * scale            # [Hq, q, s']
        # Query j sits at position s_len - q_len + j and sees keys 0 .. that position (the last `window` of them).
        q_pos = torch.arange(s_len - q_len, s_len).unsqueeze(1)
        k_pos = torch.arange(first * bs, s_len).unsqueeze(0)
        scores.masked_fill_(k_pos > q_pos, float("-inf"))
        if window is not None:
            scores.masked_fill_(k_pos <= q_pos - window, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[q_start:q_start + q_len] = torch.einsum("hqs,shd->qhd", probs, v).to(query.dtype)
    return out
