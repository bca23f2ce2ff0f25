"""Attention metadata: what one forward pass needs to know about the batch layout.

The batch is flattened: the new tokens of all scheduled sequences are concatenated (``T`` tokens). For
sequence ``i``::

    new tokens        q[query_start_loc[i] : query_start_loc[i + 1]]      (query_lens[i] of them)
    context length    seq_lens[i]  (cached prefix + new tokens)
    positions         seq_lens[i] - query_lens[i] ... seq_lens[i] - 1
    blocks            block_tables[i, : ceil(seq_lens[i] / block_size)]   (rest is padding, never read)

A decode step is the case ``query_lens[i] == 1``; a prefill chunk over a cached prefix is any larger value.
New query token ``j`` of sequence ``i`` sits at position ``p = seq_lens[i] - query_lens[i] + j`` and attends
causally to context tokens ``0 .. p``.

Sliding window (``sliding_window = W``, Hugging Face's semantics; ``None`` = full causal attention): the query
at position ``p`` attends to the ``W`` keys ``p - W < k <= p`` (itself included). The lowest key any query of
sequence ``i`` needs is that of its first new token, ``first_key = max(0, seq_len - query_len + 1 - W)``, so
the blocks ``b < first_block = first_key // block_size`` lie entirely before every query's window
(block ``b`` holds positions ``b * bs .. b * bs + bs - 1``, all ``< first_key`` exactly when
``(b + 1) * bs <= first_key``)::

    W = 20, bs = 8, seq_len = 40, query_len = 2: queries at 38, 39; first_key = 40 - 2 + 1 - 20 = 19
    positions  0 .. 7 | 8 .. 15 | 16 .. 23 | 24 .. 31 | 32 .. 39
    block idx     0   |    1    |    2     |    3     |    4          first_block = 19 // 8 = 2
                  never read    | 16..18 masked, 19.. read

Invariant: with a window, ``block_tables[i, :first_block]`` may hold ANY value (the engine frees those blocks
and writes 0 in their place, or a reused id); no attention implementation reads these entries or their
blocks. The table must still be ``ceil(seq_lens[i] / block_size)`` entries wide. Keys before ``first_key`` in
block ``first_block`` are real tokens of the sequence; the kernels mask them (and read zeros in their place).
``slot_mapping`` is computed from the blocks of the new tokens only, which always lie inside the window.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kv8.platform import CPU, Platform


def token_slot(table: Sequence[int], pos: int, block_size: int) -> int:
    """The cache slot of position ``pos`` of a sequence with block table ``table``."""
    return table[pos // block_size] * block_size + pos % block_size


def _check_sliding_window(w: object) -> None:
    if w is not None and (not isinstance(w, int) or isinstance(w, bool) or w < 1):
        raise ValueError(f"sliding_window={w!r} must be None (full causal attention) or an int >= 1")


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor       # [T] int64: cache slot of each new token
    query_start_loc: torch.Tensor    # [B + 1] int64: cumulative query lengths
    seq_lens: torch.Tensor           # [B] int64: context length after this step
    block_tables: torch.Tensor       # [B, max_blocks] int64, padded with 0
    query_lens_list: tuple[int, ...]  # host copies, for loops in the reference
    seq_lens_list: tuple[int, ...]
    sliding_window: int | None = None  # W: each query sees the W keys ending at itself; None = full causal

    def __post_init__(self) -> None:
        _check_sliding_window(self.sliding_window)  # also guards dataclasses.replace(meta, sliding_window=...)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    def first_key(self, i: int) -> int:
        """The lowest context position any new token of sequence ``i`` attends to (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, self.seq_lens_list[i] - self.query_lens_list[i] + 1 - self.sliding_window)

    def first_position_rows(self) -> list[int]:
        """The rows of this step's new tokens that are at position 0 of their sequence (a prefill's first chunk),
        in order; empty when none is."""
        rows, start = [], 0
        for q_len, s_len in zip(self.query_lens_list, self.seq_lens_list):
            if q_len and s_len == q_len:
                rows.append(start)
            start += q_len
        return rows

    @staticmethod
    def build(query_lens: list[int], seq_lens: list[int], block_tables: list[list[int]],
              block_size: int, *, sliding_window: int | None = None,
              device: torch.device | str = "cpu", platform: Platform = CPU) -> AttentionMetadata:
        """Build from per-sequence host lists. ``block_tables[i]`` must cover ``seq_lens[i]`` tokens (with a
        window, entries before it may be anything: see the module docstring). The tensors are made on
        ``device``, one of ``platform``'s, by copies that do not wait for it (the lists stay on the host).
        ``ValueError`` for a ``sliding_window`` that is neither None nor an int >= 1."""
        _check_sliding_window(sliding_window)
        slots: list[int] = []
        for q_len, s_len, table in zip(query_lens, seq_lens, block_tables):
            if len(table) * block_size < s_len:
                raise ValueError(f"block table of {len(table)} blocks cannot hold {s_len} tokens")
            slots.extend(token_slot(table, pos, block_size) for pos in range(s_len - q_len, s_len))
        width = max(max((len(t) for t in block_tables), default=0), 1)
        # one tensor from zero-padded rows (a tensor per row costs ~10 us each, per step)
        dev = torch.device(device)
        tables = platform.to_device([list(t) + [0] * (width - len(t)) for t in block_tables], torch.int64, dev) \
            if block_tables else torch.zeros(0, 1, dtype=torch.int64, device=dev)
        qsl = [0]
        for q in query_lens:
            qsl.append(qsl[-1] + q)
        return AttentionMetadata(
            slot_mapping=platform.to_device(slots, torch.int64, dev),
            query_start_loc=platform.to_device(qsl, torch.int64, dev),
            seq_lens=platform.to_device(seq_lens, torch.int64, dev),
            block_tables=tables,
            query_lens_list=tuple(query_lens),
            seq_lens_list=tuple(seq_lens),
            sliding_window=sliding_window,
        )
