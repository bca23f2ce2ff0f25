"""GGUF block-quantized weights kept as the file's bytes (``quantization="gguf"``), and their plain torch arithmetic.

A :class:`GGUFWeight` is one weight matrix ``W [N, K]`` as llama.cpp stores it: ``N`` rows of blocks. The types kept
are :data:`KEPT_TYPES`; four have blocks of 32 values, a float16 scale (Q4_1: and a float16 min) and 32 codes::

    Q8_0 (34 B): f16 d | int8 q[32]                 w_j = d * q_j
    Q4_0 (18 B): f16 d | u8 qs[16]                  w_j = d * (c_j - 8)
    Q4_1 (20 B): f16 d | f16 m | u8 qs[16]          w_j = d * c_j + m
    Q5_0 (22 B): f16 d | u32 qh | u8 qs[16]         w_j = d * (c_j + 16 h_j - 16)

with 4-bit codes ``c_j = qs[j] & 15`` and ``c_{j+16} = qs[j] >> 4`` (``j < 16``) and Q5_0's fifth bits ``h_j =
(qh >> j) & 1`` (``qh`` little-endian). Q4_K has super-blocks of 256 values, 8 sub-blocks of 32 with 6-bit scales and
mins::

    Q4_K (144 B): f16 d | f16 dmin | u8 scales[12] | u8 qs[128]      w = d * sc_s * c - dmin * m_s

where sub-block ``s`` has scale ``sc_s`` and min ``m_s`` (6 bits each, packed in ``scales``: :func:`q4_k_scale_min`)
and its codes are the low (even ``s``) or high (odd ``s``) nibbles of ``qs[32 (s // 2) .. 32 (s // 2) + 31]``.
:data:`BLOCK_BYTES` counts bytes per 32 values for every type (Q4_K: 144 / 8 = 18), so a row of ``K`` values has
``K / 32 * BLOCK_BYTES`` bytes; :data:`BLOCK_VALUES` is the values per block (``K`` must be a multiple). Rows are
independent, so a row permutation (llama's q/k rows) or concatenation (merged q/k/v, gate/up) moves whole rows of
bytes.

* :func:`dequantize_blocks`: the float32 values, computed as ``gguf.quants.dequantize`` computes them (the same
  float32 operations, so bit for bit; the tests use the ``gguf`` package as the oracle).
* :func:`gguf_linear_reference`: ``x @ W.T + b`` in float32 on those values, one rounding to x's dtype -- the
  reference every fast path is tested against.
* :func:`quantize_activation_blocks` and :func:`gguf_activation_bound`: the kernel (``csrc/dense/gguf.h``) rounds
  each activation to int8 per block of 32 (``scale = amax / 127``), for every type (Q4_K: per sub-block);
  :func:`gguf_activation_bound` is the largest difference that rounding can make to each output, ``sum_blocks scale /
  2 * sum_j |w_j|``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["BLOCK", "BLOCK_BYTES", "BLOCK_VALUES", "GROUP", "KEPT_TYPES", "ExpandedWeight", "GGUFWeight",
           "dequantize_blocks",
           "gguf_activation_bound", "gguf_linear_reference", "group_blocks", "q4_k_scale_min",
           "quantize_activation_blocks", "ungroup_blocks"]

BLOCK = 32
#: bytes per 32 values of each type kept quantized (Q4_K: a 144-byte super-block holds 256 values, 18 bytes per 32)
BLOCK_BYTES: dict[str, int] = {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20, "Q5_0": 22, "Q4_K": 18}
#: values per block of each type: a row's length must be a multiple of it
BLOCK_VALUES: dict[str, int] = {"Q8_0": 32, "Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q4_K": 256}
KEPT_TYPES: tuple[str, ...] = tuple(BLOCK_BYTES)
#: blocks per group of the kernel's layout (:func:`group_blocks`)
GROUP = 8
_HEAD_BYTES = {"Q8_0": 2, "Q4_0": 2, "Q4_1": 4, "Q5_0": 2}   # the scales before a block's codes: d (and m)
_Q4_K_BYTES = 144


def _group_parts(in_features: int) -> list[tuple[int, int]]:
    """``(first block, blocks)`` of each group of a row: groups of `GROUP`, the last one with the rest."""
    nb = in_features // BLOCK
    return [(b, min(GROUP, nb - b)) for b in range(0, nb, GROUP)]


def group_blocks(blocks: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """The kernel's layout of ``blocks [N, row bytes]`` (the file's): the same bytes, each row's blocks in groups of
    `GROUP` (the last group: the rest), a group of ``g`` blocks being its ``g`` float16 ``d`` (Q4_1: then its ``g``
    ``m``), then the ``g`` blocks' codes (``csrc/dense/gguf.h``)::

        file:    [d0 m0 codes0] [d1 m1 codes1] ... [d7 m7 codes7] [d8 m8 codes8] ...
        grouped: [d0 .. d7] [m0 .. m7] [codes0 .. codes7] [d8 ...] ...

    Q4_K's super-blocks are such groups already (their 8 sub-blocks' scales, then the codes): the file's layout is
    the kernel's, returned as it is.
    """
    if qtype == "Q4_K":
        return blocks.contiguous()
    n, size = blocks.shape[0], BLOCK_BYTES[qtype]
    b = blocks.reshape(n, in_features // BLOCK, size)
    head = _HEAD_BYTES[qtype]
    parts = []
    for first, g in _group_parts(in_features):
        grp = b[:, first:first + g]                                     # (N, g, bytes)
        scales = [grp[..., s:s + 2].reshape(n, 2 * g) for s in range(0, head, 2)]
        parts += [*scales, grp[..., head:].reshape(n, g * (size - head))]
    return torch.cat(parts, dim=1).contiguous()


def ungroup_blocks(grouped: torch.Tensor, qtype: str, in_features: int) -> torch.Tensor:
    """The file's layout of blocks in :func:`group_blocks`' layout (its inverse)."""
    if qtype == "Q4_K":
        return grouped.contiguous()
    n, size = grouped.shape[0], BLOCK_BYTES[qtype]
    head = _HEAD_BYTES[qtype]
    out = torch.empty(n, in_features // BLOCK, size, dtype=torch.uint8)
    offset = 0
    for first, g in _group_parts(in_features):
        for s in range(0, head, 2):
            out[:, first:first + g, s:s + 2] = grouped[:, offset:offset + 2 * g].reshape(n, g, 2)
            offset += 2 * g
        codes = g * (size - head)
        out[:, first:first + g, head:] = grouped[:, offset:offset + codes].reshape(n, g, size - head)
        offset += codes
    return out.reshape(n, -1)


@dataclass(frozen=True)
class GGUFWeight:
    """One weight ``[rows, in_features]`` held as GGUF blocks: ``blocks`` is uint8 ``[rows, in_features / 32 *
    BLOCK_BYTES[qtype]]``, contiguous, owning its memory, ``in_features`` a multiple of ``BLOCK_VALUES[qtype]``;
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
        row_bytes = self.in_features // BLOCK * BLOCK_BYTES[self.qtype]
        b = self.blocks
        if b.dtype != torch.uint8 or b.ndim != 2 or b.shape[1] != row_bytes:
            raise ValueError(f"GGUF tensor {self.name!r}: blocks must be uint8 [rows, {row_bytes}], got {b.dtype} "
                             f"{list(b.shape)}")

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, in_features)``: the Hugging Face shape of the weight."""
        return (self.blocks.shape[0], self.in_features)


@dataclass(frozen=True)
class ExpandedWeight:
    """A decoder weight of a GGUF type not kept as blocks (Q6_K, Q5_K, F16, ...) under ``quantization="gguf"``:
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
    if qtype == "Q5_0":
        return _dequantize_q5_0(blocks, in_features)
    n = blocks.shape[0]
    b = blocks.reshape(n, in_features // BLOCK, BLOCK_BYTES[qtype])   # (N, blocks, bytes)
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
