"""GGUF block-quantized weights kept as the file's bytes (``quantization="gguf"``), and their plain torch arithmetic.

A :class:`GGUFWeight` is one weight matrix ``W [N, K]`` as llama.cpp stores it: ``N`` rows of blocks. The types kept
are :data:`KEPT_TYPES`; four have blocks of 32 values, a float16 scale (Q4_1: and a float16 min) and 32 codes::

    Q8_0 (34 B): f16 d | int8 q[32]                 w_j = d * q_j
    Q4_0 (18 B): f16 d | u8 qs[16]                  w_j = d * (c_j - 8)
    Q4_1 (20 B): f16 d | f16 m | u8 qs[16]          w_j = d * c_j + m
    Q5_0 (22 B): f16 d | u32 qh | u8 qs[16]         w_j = d * (c_j + 16 h_j - 16)

with 4-bit codes ``c_j = qs[j] & 15`` and ``c_{j+16} = qs[j] >> 4`` (``j < 16``) and Q5_0's fifth bits ``h_j =
(qh >> j) & 1`` (``qh`` little-endian). Two K-quants have super-blocks of 256 values: Q4_K, 8 sub-blocks of 32 with
6-bit scales and mins, and Q6_K, 16 sub-blocks of 16 with int8 scales and 6-bit codes::

    Q4_K (144 B): f16 d | f16 dmin | u8 scales[12] | u8 qs[128]      w = d * sc_s * c - dmin * m_s
    Q6_K (210 B): u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d     w = d * scales_s * (q - 32)

Q4_K's sub-block ``s`` has scale ``sc_s`` and min ``m_s`` (6 bits each, packed in ``scales``: :func:`q4_k_scale_min`)
and its codes are the low (even ``s``) or high (odd ``s``) nibbles of ``qs[32 (s // 2) .. 32 (s // 2) + 31]``. Q6_K's
value ``v = 128 h + 32 t + j`` (``h < 2``, ``t < 4``, ``j < 32``) has the 6-bit code ``q = ql[64 h + 32 (t % 2) + j]
>> 4 (t // 2) & 15 | (qh[32 h + j] >> 2 t & 3) << 4`` (0..63) and sub-block ``s = v // 16`` (:func:`q6_k_codes`).
:data:`BLOCK_BYTES` counts bytes per block of :data:`BLOCK_VALUES` values (Q4_K: 144 per 256), so a row of ``K``
values (``K`` a multiple of the block) has :func:`row_bytes` ``= K / BLOCK_VALUES * BLOCK_BYTES`` bytes. Rows are
independent, so a row permutation (llama's q/k rows) or concatenation (merged q/k/v, gate/up) moves whole rows of
bytes.

* :func:`dequantize_blocks`: the float32 values, computed as ``gguf.quants.dequantize`` computes them (the same
  float32 operations, so bit for bit; the tests use the ``gguf`` package as the oracle).
* :func:`gguf_linear_reference`: ``x @ W.T + b`` in float32 on those values, one rounding to x's dtype -- the
  reference every fast path is tested against.
* :func:`gather_rows` / :func:`dequantize_rows`: some rows of a weight (an embedding's looked-up tokens) from blocks in
  either layout, in the file's layout / as float32: the blocks of the other rows are not read.
* :func:`quantize_activation_blocks` and :func:`gguf_activation_bound`: the kernel (``csrc/dense/gguf.h``) rounds
  each activation to int8 per block of 32 (``scale = amax / 127``), for every type (Q4_K: per sub-block; Q6_K: per
  two sub-blocks, whose integer products it sums exactly, each times its int8 scale, before that scale applies);
  :func:`gguf_activation_bound` is the largest difference that rounding can make to each output, ``sum_blocks scale /
  2 * sum_j |w_j|``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

__all__ = ["BLOCK", "BLOCK_BYTES", "BLOCK_VALUES", "GROUP_CHUNK_BYTES", "GROUP_ROWS", "KEPT_TYPES", "ExpandedWeight",
           "GGUFWeight", "random_blocks", "block_aligned", "shard_weight",
           "dequantize_blocks", "dequantize_rows", "gather_rows",
           "gguf_activation_bound", "gguf_linear_reference", "group_blocks", "q4_k_scale_min",
           "q6_k_codes", "quantize_activation_blocks", "row_bytes", "ungroup_blocks"]

BLOCK = 32
#: bytes per block of each type kept quantized (:data:`BLOCK_VALUES` values: 32, or a K-quant's super-block of 256)
BLOCK_BYTES: dict[str, int] = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q4_K": 144, "Q6_K": 210}
#: values per block of each type: a row's length must be a multiple of it
BLOCK_VALUES: dict[str, int] = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q4_K": 256, "Q6_K": 256}
KEPT_TYPES: tuple[str, ...] = tuple(BLOCK_BYTES)
#: weight rows per group of the kernel's layout (:func:`group_blocks`), interleaved block by block
GROUP_ROWS = 8
#: bytes of a weight's rows :func:`group_blocks` regroups at a time
GROUP_CHUNK_BYTES = 4 << 20
_Q4_K_BYTES = 144
_Q6_K_BYTES = 210


def row_bytes(qtype: str, in_features: int) -> int:
    """The bytes of one row of ``in_features`` values of ``qtype`` (a multiple of ``BLOCK_VALUES[qtype]``)."""
    return in_features // BLOCK_VALUES[qtype] * BLOCK_BYTES[qtype]

#: the widths of a weight block's sections in its canonical byte order (:func:`_canonical`), which
#: :func:`group_blocks` interleaves over a group's rows: the scales, then 4 bytes of codes at a time (Q4_K: its 12
#: bytes of 6-bit scales and mins one at a time; Q6_K: its int8 scales two at a time, the two sub-blocks of one
#: activation block of 32; ``csrc/dense/gguf.h`` has the same table)
_SECTIONS: dict[str, tuple[int, ...]] = {"Q8_0": (2,) + (4,) * 8, "Q4_0": (2,) + (4,) * 4,
                                         "Q4_1": (2, 2) + (4,) * 4, "Q5_0": (2, 4) + (4,) * 4,
                                         "Q4_K": (2, 2) + (1,) * 12 + (4,) * 32,
                                         "Q6_K": (2,) + (2,) * 8 + (4,) * 48}


#: the low and the high nibble of each byte of an int32 word (0xF0F0F0F0 as a signed int32)
_LOW_NIBBLES, _HIGH_NIBBLES = 0x0F0F0F0F, -0x0F0F0F10


def _q4_k_scale_words(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(copy, w1, w2, w3)``: a contiguous copy of Q4_K blocks ``[..., 144]`` and views of its bytes 4-7, 8-11 and
    12-15 as int32 words, whose 4 byte lanes are the sub-block pairs ``s, s + 4`` (``s < 4``): the bitwise
    operations below act on the 4 pairs at once (shifts are masked to stay inside a byte)."""
    copy = b.clone(memory_format=torch.contiguous_format)
    words = copy.view(torch.int32)                                   # (..., 36)
    return copy, words[..., 1], words[..., 2], words[..., 3]


_BITS = torch.arange(8, dtype=torch.uint8)


def _canonical(b: torch.Tensor, qtype: str) -> torch.Tensor:
    """Weight blocks ``[..., unit]`` (the file's bytes, :data:`BLOCK_BYTES` each) -> the same information in the
    byte order whose :data:`_SECTIONS` the kernel's layout interleaves (a bijection of each block; the inverse:
    :func:`_file_order`). Q8_0, Q4_0, Q4_1: the file's block. Q5_0: ``d``, then ``qh`` transposed so that bit ``k``
    of byte ``i`` is ``h_{4k+i}`` (byte ``i`` of the 4 codes ``4k .. 4k+3`` of section ``k``), then ``qs``. Q4_K:
    ``d``, ``dmin``, then the 6-bit scales and mins as ``sc_lo[4] m_lo[4] hi[4]``::

        sc_lo[s] = sc_s & 15 | (sc_{s+4} & 15) << 4      m_lo[s]: the same for the mins       (s < 4)
        hi[s]    = sc_s >> 4 | (sc_{s+4} >> 4) << 2 | (m_s >> 4) << 4 | (m_{s+4} >> 4) << 6

    then ``qs[128]``. Q6_K: ``d``, ``scales[16]``, then per block ``b`` of 32 values (``b < 8``) 24 bytes of codes,
    16 of low nibbles and 8 of high bits, for the values ``32 b + 16 u + 4 k + i`` (``u < 2``, ``k < 4``, ``i <
    4``)::

        lo[b][4 k + i] = q(32 b + 4 k + i) & 15 | (q(32 b + 16 + 4 k + i) & 15) << 4
        hi[b][4 u + i] = sum_k (q(32 b + 16 u + 4 k + i) >> 4) << 2 k

    so that 4 bytes of ``lo`` are 4 codes of each sub-block of the block and 4 bytes of ``hi`` the top bits of the
    16 codes of one sub-block."""
    if qtype == "Q6_K":
        return _q6_k_canonical(b)
    if qtype == "Q5_0":
        h = ((b[..., 2:6, None] >> _BITS) & 1).reshape(*b.shape[:-1], 8, 4)   # [k, i] = h_{4k+i}
        t = (h << _BITS[:, None]).sum(dim=-2).to(torch.uint8)                 # byte i: bit k = h_{4k+i}
        return torch.cat([b[..., :2], t, b[..., 6:]], dim=-1)
    if qtype == "Q4_K":
        # the packed bytes (q4_k_scale_min): d_s = sc_s | (sc_{s+4} >> 4) << 6, m_s the same for the mins, md_s =
        # sc_{s+4} & 15 | (m_{s+4} & 15) << 4; so sc_lo = lo(d) | lo(md) << 4, m_lo = lo(m) | hi(md) and
        # hi = hi(d) >> 4 | hi(m), with lo / hi a byte's low / high nibble in place
        c, d, m, md = _q4_k_scale_words(b)
        sc_lo = (d & _LOW_NIBBLES) | ((md & _LOW_NIBBLES) << 4)
        m_lo = (m & _LOW_NIBBLES) | (md & _HIGH_NIBBLES)
        hi = ((d >> 4) & _LOW_NIBBLES) | (m & _HIGH_NIBBLES)
        d.copy_(sc_lo)
        m.copy_(m_lo)
        md.copy_(hi)
        return c
    return b


def _file_order(c: torch.Tensor, qtype: str) -> torch.Tensor:
    """The inverse of :func:`_canonical`."""
    if qtype == "Q6_K":
        return _q6_k_file_order(c)
    if qtype == "Q5_0":
        h = ((c[..., 2:6][..., None, :] >> _BITS[:, None]) & 1)                  # [k, i] = h_{4k+i}
        h = h.reshape(*c.shape[:-1], 4, 8)                                       # [byte, bit] = h_{8 byte + bit}
        qh = (h << _BITS).sum(dim=-1).to(torch.uint8)
        return torch.cat([c[..., :2], qh, c[..., 6:]], dim=-1)
    if qtype == "Q4_K":
        b, sc_lo, m_lo, hi = _q4_k_scale_words(c)
        d = (sc_lo & _LOW_NIBBLES) | ((hi & _LOW_NIBBLES) << 4)
        m = (m_lo & _LOW_NIBBLES) | (hi & _HIGH_NIBBLES)
        md = ((sc_lo >> 4) & _LOW_NIBBLES) | (m_lo & _HIGH_NIBBLES)
        sc_lo.copy_(d)
        m_lo.copy_(m)
        hi.copy_(md)
        return b
    return c


_SHIFT2 = 2 * torch.arange(4, dtype=torch.uint8)   # Q6_K's bit pairs: 0, 2, 4, 6


def q6_k_codes(blocks: torch.Tensor) -> torch.Tensor:
    """Q6_K blocks ``[..., 210]`` (the file's bytes) -> their 256 codes ``[..., 256]`` uint8 (0..63) in value order:
    ``ql``'s nibbles and ``qh``'s bit pairs put together (see the module docstring)."""
    lead = blocks.shape[:-1]
    ql = blocks[..., 0:128].reshape(*lead, 2, 1, 64)                      # (.., h, 1, 64)
    low = torch.cat([ql & 15, ql >> 4], dim=-2).reshape(*lead, 2, 4, 32)  # (.., h, t, j): t // 2 the nibble
    qh = blocks[..., 128:192].reshape(*lead, 2, 1, 32)                    # (.., h, 1, j)
    high = (qh >> _SHIFT2[:, None]) & 3                                   # (.., h, t, j)
    return (low | (high << 4)).reshape(*lead, 256)


def _q6_k_ql_qh(q: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`q6_k_codes`' code extraction: codes ``[..., 256]`` -> ``ql[128] qh[64]`` ``[..., 192]``."""
    lead = q.shape[:-1]
    v = q.reshape(*lead, 2, 4, 32)                                        # (.., h, t, j)
    ql = (v[..., 0:2, :] & 15) | ((v[..., 2:4, :] & 15) << 4)              # (.., h, t % 2, j)
    qh = ((v >> 4) << _SHIFT2[:, None]).sum(dim=-2).to(torch.uint8)      # (.., h, j)
    return torch.cat([ql.reshape(*lead, 128), qh.reshape(*lead, 64)], dim=-1)


def _q6_k_canonical(b: torch.Tensor) -> torch.Tensor:
    """Q6_K's file block -> :func:`_canonical`'s order: ``d``, ``scales``, then per block of 32 ``lo[16] hi[8]``."""
    lead = b.shape[:-1]
    v = q6_k_codes(b).reshape(*lead, 8, 2, 4, 4)                          # (.., b, u, k, i)
    lo = (v[..., 0, :, :] & 15) | ((v[..., 1, :, :] & 15) << 4)            # (.., b, k, i)
    hi = ((v >> 4) << _SHIFT2[:, None]).sum(dim=-2).to(torch.uint8)        # (.., b, u, i)
    codes = torch.cat([lo.reshape(*lead, 8, 16), hi.reshape(*lead, 8, 8)], dim=-1).reshape(*lead, 192)
    return torch.cat([b[..., 208:210], b[..., 192:208], codes], dim=-1)


def _q6_k_file_order(c: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`_q6_k_canonical`."""
    lead = c.shape[:-1]
    codes = c[..., 18:].reshape(*lead, 8, 24)
    lo = codes[..., :16].reshape(*lead, 8, 1, 4, 4)                       # (.., b, 1, k, i)
    lo = torch.cat([lo & 15, lo >> 4], dim=-3)                            # (.., b, u, k, i)
    hi = codes[..., 16:].reshape(*lead, 8, 2, 1, 4)                       # (.., b, u, 1, i)
    v = lo | (((hi >> _SHIFT2[:, None]) & 3) << 4)
    return torch.cat([_q6_k_ql_qh(v.reshape(*lead, 256)), c[..., 2:18], c[..., 0:2]], dim=-1)


def _interleave_index(qtype: str, g: int) -> torch.Tensor:
    """``[g * unit]`` int64: for each byte of a group's weight block in the kernel's layout, its place in the ``g``
    rows' canonical blocks ``[g, unit]`` (flattened): section after section, each the ``g`` rows' bytes of it."""
    unit = BLOCK_BYTES[qtype]
    index, offset = [], 0
    for w in _SECTIONS[qtype]:
        index += [r * unit + offset + i for r in range(g) for i in range(w)]
        offset += w
    return torch.tensor(index, dtype=torch.int64)


def _section_runs(qtype: str) -> list[tuple[int, int, int]]:
    """``(first byte, sections, width)`` of each run of consecutive :data:`_SECTIONS` of one width in a canonical
    block (Q4_K: ``(0, 2, 2)``, ``(4, 12, 1)``, ``(16, 32, 4)``): a run's bytes of ``g`` rows ``[g, sections,
    width]`` are laid out ``[sections, g, width]`` in the kernel's layout (:func:`_interleave_index`, as strides)."""
    runs: list[tuple[int, int, int]] = []
    offset = 0
    for width in _SECTIONS[qtype]:
        if runs and runs[-1][2] == width:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1, width)
        else:
            runs.append((offset, 1, width))
        offset += width
    return runs


def _full_and_tail(n: int) -> list[tuple[int, int]]:
    """``(first row, rows)`` of the rows in whole groups of `GROUP_ROWS` and of the last group's rest (each part
    omitted when empty)."""
    full = n // GROUP_ROWS * GROUP_ROWS
    return [(first, count) for first, count in ((0, full), (full, n - full)) if count]


def group_blocks(blocks: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """The kernel's layout of ``blocks [N, row bytes]`` (the file's; ``csrc/dense/gguf.h``): the rows in groups of
    `GROUP_ROWS` = 8 (the last group: the rest, ``g`` rows), each group its weight blocks in order (32 values; Q4_K:
    a super-block of 256), each block the ``g`` rows' blocks interleaved section by section (:data:`_SECTIONS` of
    the block's canonical bytes, :func:`_canonical`), so that one 32-byte load holds 4 codes of each of 8 rows::

        file:    row 0: [d m qs0..3 qs4..7 .. qs12..15] [next block] ..   row 1: ..   .. row 7: ..
        grouped: block 0: [d of rows 0..7] [m of rows 0..7] [qs0..3 of rows 0..7] .. [qs12..15 of rows 0..7]
                 block 1: .. ;   then the next group of 8 rows

    (Q4_1; Q8_0's sections: ``d``, 8 x 4 codes; Q4_0: ``d``, 4 x 4 bytes of ``qs``; Q5_0: ``d``, ``qh``
    transposed, 4 x 4 bytes of ``qs``; Q4_K: ``d``, ``dmin``, 12 single bytes of scales, 32 x 4 bytes of ``qs``;
    Q6_K: ``d``, 8 pairs of scales, then per block of 32 values 4 x 4 bytes of ``lo`` and 2 x 4 of ``hi``).
    The same number of bytes, as a ``[N, row bytes]`` uint8 tensor whose rows are no longer the weight's rows.
    Each run of sections of one width moves as one strided copy (:func:`_section_runs`), :data:`GROUP_CHUNK_BYTES` of
    rows at a time (whole groups), so the transient canonical copy stays small beside the result.
    """
    n, unit = blocks.shape[0], BLOCK_BYTES[qtype]
    nwb = in_features // BLOCK_VALUES[qtype]                              # weight blocks per row
    size = nwb * unit                                                     # bytes per row
    out = torch.empty(n * size, dtype=torch.uint8)
    step = max(GROUP_ROWS, GROUP_CHUNK_BYTES // size // GROUP_ROWS * GROUP_ROWS)
    for start in range(0, n, step):
        chunk = min(step, n - start)
        canon = _canonical(blocks[start:start + chunk].reshape(chunk, nwb, unit), qtype)     # (chunk, nwb, unit)
        for first, count in _full_and_tail(chunk):   # a tail group only in the last chunk (step: whole groups)
            g = min(GROUP_ROWS, count)
            rows = canon[first:first + count].reshape(count // g, g, nwb, unit).permute(0, 2, 1, 3)  # (.., g, unit)
            at = (start + first) * size
            grouped = out[at:at + count * size].view(count // g, nwb, g * unit)
            for offset, sections, width in _section_runs(qtype):
                place = grouped[..., offset * g:(offset + sections * width) * g].unflatten(-1, (sections, g, width))
                place.copy_(rows[..., offset:offset + sections * width].unflatten(-1, (sections, width))
                            .transpose(2, 3))
    return out.reshape(n, -1)


def ungroup_blocks(grouped: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """The file's layout of blocks in :func:`group_blocks`' layout (its inverse)."""
    n, unit = grouped.shape[0], BLOCK_BYTES[qtype]
    nwb = in_features // BLOCK_VALUES[qtype]
    flat = grouped.reshape(-1)
    canon = torch.empty(n, nwb, unit, dtype=torch.uint8)
    for first, count in _full_and_tail(n):
        g = min(GROUP_ROWS, count)
        part = flat[first * nwb * unit:(first + count) * nwb * unit].view(count // g, nwb, g * unit)
        # (groups, nwb, g, unit)
        rows = canon[first:first + count].view(count // g, g, nwb, unit).permute(0, 2, 1, 3)
        for offset, sections, width in _section_runs(qtype):
            held = part[..., offset * g:(offset + sections * width) * g].unflatten(-1, (sections, g, width))
            rows[..., offset:offset + sections * width].unflatten(-1, (sections, width)).copy_(held.transpose(2, 3))
    return _file_order(canon, qtype).reshape(n, -1).contiguous()


@functools.lru_cache(maxsize=32)
def _row_offsets(qtype: str, g: int, nwb: int) -> torch.Tensor:
    """``[g, nwb * unit]`` int64: where each canonical byte of row ``i`` of a group of ``g`` rows lies in
    :func:`group_blocks`' layout, counted from the group's first byte (weight block ``w`` of the group starts at ``w
    * g * unit``; inside it, :func:`_interleave_index`'s order)."""
    unit = BLOCK_BYTES[qtype]
    inverse = torch.argsort(_interleave_index(qtype, g)).reshape(g, unit)     # (row, canonical byte) -> place
    return (torch.arange(nwb, dtype=torch.int64)[:, None] * (g * unit) + inverse[:, None, :]).reshape(g, -1)


def gather_rows(blocks: torch.Tensor, qtype: str, in_features: int, rows: torch.Tensor,
                grouped: bool) -> torch.Tensor:
    """Rows ``rows [T]`` (int64, each in ``[0, N)``) of a weight held as ``blocks [N, row bytes]`` -- the file's
    layout, or :func:`group_blocks`' when ``grouped`` -- as ``[T, row bytes]`` uint8 in the file's layout (a new
    tensor); only those rows' bytes are read. Row ``r`` of the grouped layout is local row ``r % 8`` of the group
    starting at byte ``(r - r % 8) * row bytes`` (every group but the last holds 8 rows; the last, ``N % 8`` when
    that is not 0, is interleaved over its own ``g`` rows)::

        flat bytes:  [group 0: 8 rows' blocks interleaved] [group 1] .. [last group: g rows]
        row r:       base (r - r % 8) * row bytes  +  _row_offsets(qtype, 8 or g)[r % 8]   -> its canonical bytes

    No value-dependent shapes or Python reads of values (CPU graphs can record it)."""
    if not grouped:
        return blocks.index_select(0, rows)
    n, width = blocks.shape
    nwb = in_features // BLOCK_VALUES[qtype]
    local = rows.remainder(GROUP_ROWS)
    offsets = _row_offsets(qtype, GROUP_ROWS, nwb).index_select(0, local)            # (T, row bytes)
    tail = n % GROUP_ROWS
    if tail:   # rows of the last group: its own interleave (a row index past it is clamped, then not chosen)
        last = _row_offsets(qtype, tail, nwb).index_select(0, local.clamp(max=tail - 1))
        offsets = torch.where((rows >= n - tail)[:, None], last, offsets)
    offsets = offsets + ((rows - local) * width)[:, None]
    canon = blocks.reshape(-1).take(offsets)                                            # (T, row bytes), canonical
    return _file_order(canon.reshape(rows.shape[0], nwb, BLOCK_BYTES[qtype]), qtype).reshape(rows.shape[0], width)


def dequantize_rows(blocks: torch.Tensor, qtype: str, in_features: int, rows: torch.Tensor,
                    grouped: bool) -> torch.Tensor:
    """float32 ``[T, in_features]``: rows ``rows [T]`` of the weight held as ``blocks`` (:func:`gather_rows`),
    dequantized as :func:`dequantize_blocks` does (bit for bit the ``gguf`` package's values)."""
    return dequantize_blocks(gather_rows(blocks, qtype, in_features, rows, grouped), qtype, in_features)


@dataclass(frozen=True)
class GGUFWeight:
    """One weight ``[rows, in_features]`` held as GGUF blocks: ``blocks`` is uint8 ``[rows, row_bytes(qtype,
    in_features)]``, contiguous, owning its memory, ``in_features`` a multiple of ``BLOCK_VALUES[qtype]``;
    ``name`` is the file's tensor name (for messages)."""

    qtype: str
    blocks: torch.Tensor
    in_features: int
    name: str = ""

    def __post_init__(self) -> None:
        if self.qtype not in BLOCK_BYTES:
            raise ValueError(f"GGUF tensor {self.name!r} has type {self.qtype}; kept quantized: {list(KEPT_TYPES)}")
        values = BLOCK_VALUES[self.qtype]
        if self.in_features <= 0 or self.in_features % values:
            raise ValueError(f"GGUF tensor {self.name!r} has {self.in_features} columns, not a positive multiple of "
                             f"{values} ({self.qtype})")
        size = row_bytes(self.qtype, self.in_features)
        b = self.blocks
        if b.dtype != torch.uint8 or b.ndim != 2 or b.shape[1] != size:
            raise ValueError(f"GGUF tensor {self.name!r}: blocks must be uint8 [rows, {size}], got {b.dtype} "
                             f"{list(b.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, in_features)``: the Hugging Face shape of the weight."""
        return (self.blocks.shape[0], self.in_features)


@dataclass(frozen=True)
class ExpandedWeight:
    """A decoder weight of a GGUF type not kept as blocks (Q5_K, Q2_K, F16, ...) under ``quantization="gguf"``:
    dequantized alone at load, ``weight [rows, in_features]`` in the compute dtype; ``qtype`` is the file's type name
    and ``name`` its tensor name (for ``kv8 info`` and messages)."""

    qtype: str
    weight: torch.Tensor
    name: str = ""

    def __post_init__(self) -> None:
        if self.weight.ndim != 2 or not self.weight.is_floating_point():
            raise ValueError(f"GGUF tensor {self.name!r}: the dequantized weight must be a 2-D float tensor, got "
                             f"{self.weight.dtype} {list(self.weight.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        return (self.weight.shape[0], self.weight.shape[1])


def _half(part: torch.Tensor) -> torch.Tensor:
    """``[..., 2]`` uint8 little-endian float16 -> ``[..., 1]`` float32."""
    return part.contiguous().view(torch.float16).float()


def q4_k_scale_min(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K's 12 packed bytes ``[..., 12]`` (uint8) -> the 8 sub-blocks' 6-bit ``(scales, mins)``, each ``[..., 8]``
    uint8. Bytes 0-3 hold the low 6 bits of scales 0-3 (their top 2 bits: the top bits of scales 4-7), bytes 4-7 the
    same for mins, bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and mins 4-7 (high nibble)::

        byte 0..3:  s4..7[5:4] | s0..3[5:0]      byte 4..7: m4..7[5:4] | m0..3[5:0]
        byte 8..11: m4..7[3:0] | s4..7[3:0]
    """
    d, m, md = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc, mn


def _dequantize_q4_k(blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """Q4_K as ``gguf.quants`` computes it: ``(d * sc) * c - dmin * m`` in float32 (both products exact)."""
    n = blocks.shape[0]
    sb = blocks.reshape(n, in_features // 256, _Q4_K_BYTES)            # (N, super-blocks, 144)
    d, dmin = _half(sb[..., 0:2]), _half(sb[..., 2:4])                  # (N, S, 1)
    sc, mn = q4_k_scale_min(sb[..., 4:16])                              # (N, S, 8)
    qs = sb[..., 16:].reshape(n, -1, 4, 1, 32)                          # (N, S, 4 pairs of sub-blocks, 1, 32)
    codes = torch.cat([qs & 15, qs >> 4], dim=3).reshape(n, -1, 8, 32)  # (N, S, 8, 32): low nibbles first
    values = (d * sc.float())[..., None] * codes.float() - (dmin * mn.float())[..., None]
    return values.reshape(n, in_features)


def _dequantize_q6_k(blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """Q6_K as ``gguf.quants`` computes it: ``(d * scale_s) * (q - 32)`` in float32 (the first product exact)."""
    n = blocks.shape[0]
    sb = blocks.reshape(n, in_features // 256, _Q6_K_BYTES)             # (N, super-blocks, 210)
    d = _half(sb[..., 208:210])                                         # (N, S, 1)
    scales = sb[..., 192:208].contiguous().view(torch.int8).float()     # (N, S, 16)
    codes = q6_k_codes(sb).reshape(n, -1, 16, 16).float() - 32.0        # (N, S, 16 sub-blocks, 16)
    return ((d * scales)[..., None] * codes).reshape(n, in_features)


def _dequantize_q5_0(blocks: torch.Tensor, in_features: int) -> torch.Tensor:
    """Q5_0 as ``gguf.quants`` computes it: ``d * (code - 16)`` in float32, ``code`` the nibble plus 16 times its bit
    of ``qh``."""
    n = blocks.shape[0]
    b = blocks.reshape(n, in_features // BLOCK, 22)                       # (N, blocks, 22)
    d = _half(b[..., 0:2])
    shifts = torch.arange(8, dtype=torch.uint8)
    high = ((b[..., 2:6, None] >> shifts) & 1).reshape(n, -1, 32)       # bit j of the little-endian u32 qh
    qs = b[..., 6:]
    codes = torch.cat([qs & 15, qs >> 4], dim=-1) | (high << 4)          # (N, blocks, 32), 0..31
    return (d * (codes.float() - 16.0)).reshape(n, in_features)


def dequantize_blocks(blocks: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """``blocks [N, row bytes]`` uint8 of type ``qtype`` -> float32 ``[N, in_features]``, as
    ``gguf.quants.dequantize`` computes it (float32 scale times code, plus the min for Q4_1, minus it for Q4_K)."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"GGUF block type {qtype!r} is not one of {list(KEPT_TYPES)}")
    if qtype == "Q4_K":
        return _dequantize_q4_k(blocks, in_features)
    if qtype == "Q6_K":
        return _dequantize_q6_k(blocks, in_features)
    if qtype == "Q5_0":
        return _dequantize_q5_0(blocks, in_features)
    n = blocks.shape[0]
    b = blocks.reshape(n, in_features // BLOCK, BLOCK_BYTES[qtype])     # (N, blocks, bytes)
    d = _half(b[..., 0:2])                                              # (N, blocks, 1)
    if qtype == "Q8_0":
        values = d * b[..., 2:].contiguous().view(torch.int8).float()
    else:
        qs = b[..., 4:] if qtype == "Q4_1" else b[..., 2:]
        codes = torch.cat([qs & 15, qs >> 4], dim=-1)                   # (N, blocks, 32): element order
        values = d * (codes.float() - 8.0) if qtype == "Q4_0" else d * codes.float() + _half(b[..., 2:4])
    return values.reshape(n, in_features)


def gguf_linear_reference(x: torch.Tensor, blocks: torch.Tensor, qtype: str, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., K] @ W.T (+ bias)`` with ``W`` dequantized to float32 (:func:`dequantize_blocks`), float32 sums,
    one rounding to x's dtype."""
    k = x.shape[-1]
    y = x.float() @ dequantize_blocks(blocks, qtype, k).T
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def quantize_activation_blocks(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``x [M, K]`` -> ``(codes [M, K / 32, 32] float32 in [-127, 127], scale [M, K / 32] float32)`` with
    ``x ~ codes * scale``, ``scale = amax / 127`` per block of 32 and ``codes = rint(x * (127 / amax))`` (a block of
    zeros: scale 0): what the kernel (``csrc/dense/gguf.h``) does to its input, in the same float32 operations."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = xb.abs().amax(dim=-1)
    # a true float32 division (torch's ``127.0 / tensor`` multiplies by the reciprocal, rounding twice)
    inv = torch.where(amax > 0, torch.full_like(amax, 127.0).div(amax.clamp(min=torch.finfo(torch.float32).tiny)),
                      torch.zeros_like(amax))
    codes = torch.round(xb * inv[..., None]).clamp(-127.0, 127.0)
    return codes, amax / 127.0


def gguf_activation_bound(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """``[M, N]`` float32: the most the kernel's int8 activations can move each output of ``x [M, K] @ W.T``, ``sum_b
    scale_mb / 2 * sum_{j in b} |w_nj|`` (each code is within half a step of ``x / scale``)."""
    m, k = x.shape
    _, scale = quantize_activation_blocks(x)
    w_abs = dequantize_blocks(blocks, qtype, k).abs().reshape(blocks.shape[0], k // BLOCK, BLOCK).sum(dim=-1)
    return 0.5 * scale.double() @ w_abs.double().T


#: the offsets of each type's float16 fields in its block (the scale; Q4_1 and Q4_K: and the min; Q6_K's ``d`` last)
_HALF_OFFSETS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q4_K": (0, 2), "Q6_K": (208,)}


def random_blocks(qtype: str, rows: int, in_features: int, generator: torch.Generator) -> GGUFWeight:
    """A weight of ``qtype`` blocks with random codes (Q4_K, Q6_K: random sub-block scales too) and every float16
    scale and min 2**-7: what the dense tuner times (speed does not depend on the values; normal scales keep every
    arithmetic path off subnormals, NaNs and infinities)."""
    if qtype not in BLOCK_BYTES:
        raise ValueError(f"GGUF type {qtype!r} is not kept as blocks; choose one of: {list(KEPT_TYPES)}")
    unit = BLOCK_BYTES[qtype]
    units = rows * (in_features // BLOCK_VALUES[qtype])
    raw = torch.randint(0, 256, (units, unit), generator=generator, dtype=torch.uint8)
    half = torch.tensor([2.0 ** -7], dtype=torch.float16).view(torch.uint8)
    for offset in _HALF_OFFSETS[qtype]:
        raw[:, offset:offset + 2] = half
    return GGUFWeight(qtype, raw.reshape(rows, -1), in_features, "timing")


def block_aligned(columns: tuple[int, int], qtype: str) -> bool:
    """Whether the columns ``(first, count)`` of a weight of ``qtype`` blocks are whole blocks (:data:`BLOCK_VALUES`:
    32 values; Q4_K: 256), so that their bytes are whole blocks of each row."""
    values = BLOCK_VALUES[qtype]
    return columns[0] % values == 0 and columns[1] % values == 0 and columns[1] > 0


def shard_weight(weight: GGUFWeight | ExpandedWeight, rows: tuple[int, int],
                 columns: tuple[int, int]) -> GGUFWeight | ExpandedWeight:
    """Rows ``(first, count)`` and columns ``(first, count)`` of ``weight`` (a tensor-parallel rank's part), in new
    memory: blocks are cut between rows and, for the columns, between blocks (``ValueError`` when the columns are not
    :func:`block_aligned`); a dequantized weight anywhere. Rows past the weight's last (the vocabulary's padding on
    the last rank) are zeros: zero bytes are blocks whose scale and min are 0, so they dequantize to 0."""
    first, count = rows
    held = max(0, min(count, weight.shape[0] - first))
    if isinstance(weight, ExpandedWeight):
        part = weight.weight.new_zeros(count, columns[1])
        part[:held] = weight.weight[first:first + held, columns[0]:columns[0] + columns[1]]
        return ExpandedWeight(weight.qtype, part, weight.name)
    if not block_aligned(columns, weight.qtype):
        raise ValueError(f"GGUF tensor {weight.name!r} ({weight.qtype}): columns {columns[0]}..{sum(columns) - 1} of "
                         f"its {weight.in_features} are not whole blocks of {BLOCK_VALUES[weight.qtype]} values")
    start, size = row_bytes(weight.qtype, columns[0]), row_bytes(weight.qtype, columns[1])
    blocks = torch.zeros(count, size, dtype=torch.uint8)
    blocks[:held] = weight.blocks[first:first + held, start:start + size]
    return GGUFWeight(weight.qtype, blocks, columns[1], weight.name)
