"""The attention metadata (:mod:`kv8.attention.metadata`): its sliding window is validated, ``first_key`` is the
lowest position any new token of a sequence sees, and the slots are those of the new tokens' blocks."""

from __future__ import annotations

import dataclasses

import pytest

from kv8.attention.metadata import AttentionMetadata


@pytest.mark.parametrize("bad", [0, -1, 2.5, True, "4"])
def test_metadata_rejects_bad_window(bad: object) -> None:
    with pytest.raises(ValueError, match="sliding_window"):
        AttentionMetadata.build([1], [5], [[0]], 16, sliding_window=bad)  # type: ignore[arg-type]
    meta = AttentionMetadata.build([1], [5], [[0]], 16)
    assert meta.sliding_window is None
    with pytest.raises(ValueError, match="sliding_window"):
        dataclasses.replace(meta, sliding_window=bad)


def test_metadata_first_key_and_slots() -> None:
    """first_key = max(0, seq_len - query_len + 1 - W); blocks before first_key // bs are never needed, and
    slot_mapping uses only the new tokens' blocks (stale entries before the window do not matter)."""
    meta = AttentionMetadata.build([2, 1, 3, 1], [40, 40, 3, 20], [[9, 9, 2, 5, 7], [9] * 5, [4], [9, 9, 3]], 8,
                                   sliding_window=20)
    assert [meta.first_key(i) for i in range(4)] == [19, 20, 0, 0]
    assert meta.slot_mapping.tolist() == [7 * 8 + 6, 7 * 8 + 7, 9 * 8 + 7, 4 * 8, 4 * 8 + 1, 4 * 8 + 2, 3 * 8 + 3]
    # The lowest key of query position p is p - W + 1: position 38 (first query of seq 0) sees 19 .. 38.
    assert AttentionMetadata.build([1], [39], [[0] * 5], 8, sliding_window=20).first_key(0) == 19
    assert AttentionMetadata.build([1], [40], [[0] * 5], 8).first_key(0) == 0
