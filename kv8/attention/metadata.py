"""Attention metadata: what one forward pass needs to know about the batch layout.

The batch is flattened: the new tokens of all scheduled sequences are concatenated (``T`` tokens). For
sequence ``i``::

    new tokens        q[query_start_loc[i] : query_start_loc[i + 1]]      (query_lens[i] of them)
    context length    seq_lens[i]  (cached prefix + new tokens)
    positions         seq_lens[i] - query_lens[i] ... seq_lens[i] - 1
    blocks            block_tables[i, : ceil(seq_lens[i] / block_size)]   (rest is padding, never read)

A decode step is the case ``query_lens[i] == 1``; a prefill chunk over a cached prefix is any larger value.
New query token ``j`` of sequence ``i`` attends causally to context tokens ``0 .. seq_lens[i] - query_lens[i] + j``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor       # [T] int64: cache slot of each new token
    query_start_loc: torch.Tensor    # [B + 1] int64: cumulative query lengths
    seq_lens: torch.Tensor           # [B] int64: context length after this step
    block_tables: torch.Tensor       # [B, max_blocks] int64, padded with 0
    query_lens_list: tuple[int, ...]  # host copies, for loops in the reference
    seq_lens_list: tuple[int, ...]
    sliding_window: int | None = None   # keys at positions > query position - window (None: all)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @staticmethod
    def build(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, sliding_window: int | None = None) -> AttentionMetadata:
        """Build from per-sequence host lists. ``block_tables[i]`` must cover ``seq_lens[i]`` tokens."""
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            if len(table) * block_size < s_len:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {s_len} tokens")
            for pos in range(s_len - q_len, s_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max((len(t) for t in block_tables), default=0)
        tables = torch.zeros(len(block_tables), max(width, 1), dtype=torch.int64)
        for i, t in enumerate(block_tables):
            tables[i, :len(t)] = torch.tensor(t, dtype=torch.int64)
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        return AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(qsl, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
            block_tables=tables,
            query_lens_list=tuple(query_lens),
            seq_lens_list=tuple(seq_lens),
            sliding_window=sliding_window,
        )
