"""Paged attention over kv8's KV cache for a whole mixed batch, in Triton: prefill chunks over cached context,
fresh prefills and decode rows in one launch, reading FP8, int8, int4 or FP4 codes (or 16/32-bit values) in place.

Semantics are exactly :func:`kv8.attention.reference.paged_attention_reference`: query ``j`` of sequence ``i`` sits
at position ``p = seq_lens[i] - query_len_i + j`` and sees keys ``k <= p`` (with a sliding window ``W`` only
``p - W < k <= p``); softmax and accumulation are float32; the output is in the query's dtype.

Work decomposition (grid ``(T // BLOCK_Q + B, Hkv, NUM_SPLITS)``; T = query rows, B = sequences)::

    one program = (one query tile of one sequence) x (one KV head) x (one key segment)

    query tile: BLOCK_Q consecutive new tokens of a sequence, times the GROUP = Hq / Hkv query heads that share
    the KV head (GQA), packed into the BLOCK_M >= BLOCK_Q * GROUP rows of one matrix:

        row r  ->  token q0 + r // GROUP,  query head kv_head * GROUP + r % GROUP      (rows past the tile masked)

    so every K/V tile is loaded once for the whole group and both products are tl.dot's of BLOCK_M rows.

* **Finding the sequence.** A sequence with ``L`` new tokens starting at ``query_start_loc[i]`` owns the programs
  ``start_i = query_start_loc[i] // BLOCK_Q + i`` onwards (``start_{i+1} - start_i >= ceil(L / BLOCK_Q)``); a
  program binary-searches the last ``i`` with ``start_i <= pid``. The grid needs no host copy of the lengths:
  ``T // BLOCK_Q + B`` programs cover every batch (vLLM's bound), the surplus ones return at once. A decode row
  (L = 1) is one tile; a prefill chunk is ``ceil(L / BLOCK_Q)`` tiles -- the same code, only the causal mask
  differs. Rows with ``L = 0`` own no tile.
* **Keys a tile reads.** Tile rows cover positions ``p_lo .. p_hi``; keys ``key_lo .. p_hi`` with ``key_lo =
  max(0, p_lo - W + 1)`` (0 without a window), walked in TILE_N-key tiles ``j = key_lo // TILE_N ..``. A key
  position outside ``key_lo .. p_hi`` (the tile's ends) is clamped into that range before any address is formed,
  so every load is unmasked and reads a key of the range: the table entries before the window's first block
  (which may hold any value, -1 included) and the slots past ``seq_len`` (poison) are never read, and the
  clamped duplicates' scores are -inf (the causal and window masks), so their values weigh 0. Where TILE_N
  divides ``block_size`` (``TILE_IN_BLOCK``) a key tile lies inside one block and reads one table entry, ``(j *
  TILE_N) // block_size``: it is >= the window's first block (``j * TILE_N >= key_lo`` rounded down to a tile,
  hence to the same block) and < ``ceil(seq_len / block_size)``. Otherwise (64-key FP8 tiles over blocks of 16,
  blocks of 8) each key loads its own entry ``pos // block_size``. Positions are int32, token rows int64.
* **Row alignment** (``ROW_ALIGN``). The launch derives, from the K and V caches' data pointers and strides
  (:func:`row_alignment`), the largest power of two, at most 16 bytes, that every row start is a multiple of, and
  the kernel tells Triton the row offsets are multiples of it (``tl.multiple_of``): Triton sees only 16-byte
  divisibility of arguments, so rows that are not 16-byte multiples (int4_per_group32's and fp4_e2m1's 72 bytes at
  head_dim 128, 8-byte aligned) would otherwise be loaded a byte or a word at a time and not pipelined. Views at
  any offset or stride are read correctly: the value claims no more than the tensors have (1 claims nothing).
* **The key loop** is software-pipelined (the launch's ``num_stages``, :func:`launch_config`): K/V tiles of later
  iterations are in flight (``cp.async``) while one is used. FP8 tiles are converted from the shared-memory copy
  in the loads' own layout, 16 consecutive codes per thread, by ``cvt.rn.f16x2.e4m3x2`` (or ``e5m2x2``) pairs
  (:func:`~kv8.kernels.triton.dequant.decode_fp8_native`), and staged again as float16 for the tensor cores;
  converting in the tensor-core operand layout instead reads the codes byte by byte. With ``KEY_ROWS`` (below)
  the loop runs in two parts: first over the key tiles that every row of the query tile sees whole (all their
  keys at or before the tile's first position ``p_lo``; with a window, after ``p_hi - W`` too), with no clamped
  addresses and no causal or window mask (their scores are all finite: a masked row's query is zero), loading
  whole blocks as ``[blocks, block_size, D]`` (one table entry and one base address per block); then over the
  other tiles (the last one; with a window also the first ones), clamped and masked as above. A decode row spends
  all its iterations but at most the last in the first part. Only the float32 summation order (the tiles' order)
  depends on the split.
* **Orientation** (``KEY_ROWS``). A tensor-core product's rows come in 16s and its columns in 8s, and a decode
  tile has few query rows (4 for one token at GQA 4). The decode tiles over FP8 codes with static or no scales
  therefore put the keys in the products' rows::

      S^T [TILE_N, BLOCK_M] = K [TILE_N, D] @ Q^T [D, BLOCK_M]         (softmax along axis 0)
      acc^T [D, BLOCK_M]   += V^T [D, TILE_N] @ P^T [TILE_N, BLOCK_M]

  with ``BLOCK_M = 8`` where the other orientation pads 4 rows to 16: half the tensor-core instructions, score
  elements and accumulator rescales per key. K and V tiles are both loaded ``[TILE_N, D]`` (one table gather
  serves both); ``acc`` is transposed back once after the loop. Same values as the other orientation: each score
  and each output element is the same float32 sum of the same exact products, only its order inside a
  tensor-core instruction may differ. Over dynamic scales (int8, dynamic FP8: bfloat16 operands and a scale per
  key) the decode tiles keep the usual orientation: in this one their registers spill.
* **Split-K (flash-decoding).** With ``NUM_SPLITS > 1`` the tile's key range is cut into ``NUM_SPLITS`` equal runs
  of key tiles, one per program along grid axis 2; each writes its unnormalised float32 state (running max ``m``
  in log2 units, sum ``l``, accumulator ``acc``) to a workspace, an empty run writing ``(-inf, 0, 0)``, and
  :func:`_merge_splits_kernel` (grid ``(T, Hq)``) combines them: ``M = max m_s``, ``out = sum 2^(m_s - M) acc_s /
  sum 2^(m_s - M) l_s``. With one split the attention kernel normalises and writes ``out`` itself (no workspace,
  no second launch). Every real row sees at least its own key, so ``l > 0``.
* **Scales** (float32 multiplications): static K scales of a per-tensor/per-head layout multiply the scores (one
  scalar per KV head, with ``scale * log2(e)``); per-channel K scales multiply q's channels (``q . (k s) = (q s) .
  k``); static V scales multiply the accumulator's channels at the end (``sum p (v s) = (sum p v) s``). Dynamic
  per-token scales multiply the score columns (K) and the probability columns before the PV product (V). An int8
  cache (``int8_per_token_head``) always has dynamic scales: its codes convert to the dot's dtype exactly
  (``|code| <= 127``) and are scaled like dynamic FP8, with the same tiles. So does an int4 cache
  (``int4_per_token_head``, ``PACKED``): each key's row is ``D / 2`` bytes, loaded in each tile's own layout (V
  ``[TILE_N, D_PAD / 2]``, K^T ``[D_PAD / 2, TILE_N]``) and unpacked in registers along the channel axis
  (:func:`~kv8.kernels.triton.dequant.unpack_nibbles`: sign-extended nibbles joined -- for K^T permuted -- and
  reshaped into channel order); its decode tiles take 4 warps (:func:`launch_config`). An ``int4_per_group32``
  cache (``GROUPED``) has no scale arguments: its rows carry a float16 scale per 32 values after the codes (of
  either sign, read by its bits; codes -8 .. 7), loaded ``[TILE_N, 2 D / 32]`` bytes beside them; the codes times
  their group's scale (exact in float32, reshaped to
  ``[.., D / 32, 32, ..]``) go into the dot in the query's 16-bit dtype (rounded once, as a decode to that dtype
  would) or float32, with the tiles of dynamic scales. An ``fp4_e2m1`` cache (``GROUPED`` with
  ``FP8_FMT.scale_format``) is read the same way: E2M1 codes unpacked in registers
  (:func:`~kv8.kernels.triton.dequant.unpack_e2m1`: sign, exponent and mantissa moved into a half's), one E4M3 scale
  code per 16 values loaded ``[TILE_N, D_PAD / 16]`` beside them (a tile group past ``ceil(D / 16)`` masked to 0;
  the last group may be shorter) and decoded by the exact bit path; an E2M1 value times an E4M3 scale is exact in
  float32 and in either 16-bit dtype.
* **K and V in different formats** (``v_fp8``: e.g. ``kv_cache_dtype="k8v4"``, int8 K and int4_per_group32 V).
  The kernel's format constexprs come in two sets: ``FP8_FMT``, ``NATIVE_FP8``, ``SCALES``, ``PACKED``,
  ``GROUPED`` and ``ROW_ALIGN`` describe the K cache, ``V_FMT``, ``V_NATIVE``, ``V_SCALES``, ``V_PACKED``,
  ``V_GROUPED`` and ``V_ROW_ALIGN`` the V cache; a K tile is loaded and decoded by K's, a V tile by V's (a packed
  side as above, the other as its own format's ``[.., D]`` tile), each with its own token scales or group scales.
  A single-format launch passes the same values twice, so it compiles to the same kernel as before the split (the
  sm_90 SASS of the int8, int4_per_group32 and FP8 decodes is unchanged). A side of FP8 codes in a pair has
  dynamic scales (no static scales with two formats). Both products take the query's 16-bit dtype where each side
  would as a single format (codes with per-key or per-group scales, a 16-bit side of the query's dtype), else
  float32; the tiles are the wider side's (:attr:`KernelVariant.config`: a side of codes gives the 1-byte tiles
  with per-key scales, a packed or group side its warps and register cap), and the row alignment is each side's
  own.
* **Dot precision** (``DOT_DTYPE``, one for both products). Decoded FP8 values are exact in float16 (and in
  bfloat16), so over an FP8 cache with static or no scales both products take **float16** operands with float32
  accumulation, whatever the 16-bit query: FP8 codes convert to float16 pairs in one instruction, to bfloat16 only
  through float16 and a scalar conversion per element. A bfloat16 query is not exact in float16 as it is (range),
  so each row of it is first multiplied by a power of two (``ROW_SCALE``: ``2^e``, ``e = min(141 - E, 100)`` for
  ``E`` the float32 biased exponent of the row's largest ``|q|``, which lands in ``[2^14, 2^15)``), and the row's
  score multiplier takes ``2^-e`` back: in a row whose largest ``|q|`` is at least ``2^-86`` every element of at
  least ``2^-31`` times that largest is then exact in float16, a smaller one off by at most ``2^-39`` times it.
  QK is exact products summed in float32; PV rounds the probabilities to float16 (absolute error <= 2^-12, finer
  than the query dtype's rounding).
  Over dynamic scales (probabilities times V token scales, whose range float16 may not hold) and over a cache of
  the query's own dtype the operands are the query's dtype. q times per-channel K scales is not exact in 16 bits:
  it goes in as ``hi + lo`` (``Q_SPLIT``, two products; ``|q s - hi - lo| <= 2^-16 |q s|`` in bfloat16, ``2^-22``
  in float16). Every other combination (float32 query, a 16/32-bit cache not of the query's dtype) multiplies
  float32 operands with ``input_precision="ieee"`` (no TF32), in 16 x 16 tiles.
* **In Triton's interpreter** (``TRITON_INTERPRET=1``, CPU tensors; how the tests run without a GPU) the same
  values come out: 16-bit operands are multiplied as float32 (it cannot multiply bfloat16; the products are exact
  either way), and bfloat16 conversions go through the bits because its own casts truncate and flush subnormals.
  The native FP8 conversions are never used there. Reductions are ``tl.reduce`` with kv8's combiners, so the
  kernels interpret whichever of triton and kv8 was imported first. These workarounds, and whether this process
  interprets, are :mod:`kv8.kernels.triton.interpreter`'s (the key loop's form is the one branch here).

What a caller must provide (checked, ``ValueError`` before any launch, unless marked unchecked):

* ``query``/``out`` ``[T, Hq, D]``, one dtype (bfloat16, float16 or float32), last dim contiguous (other strides
  free); ``1 <= D <= 256`` (any D: padded to a power of two and masked); ``Hq`` a multiple of ``Hkv``.
* ``k_cache``/``v_cache`` ``[num_blocks, Hkv, block_size, D]`` (:class:`kv8.cache.paged_cache.PagedKVCache`'s
  per-layer views), last dim contiguous: ``uint8`` codes with ``fp8`` an FP8 format
  (:func:`kv8.kernels.triton.formats.kernel_format` derives what the kernels need of it: E4M3FN, E4M3FNUZ, E5M2),
  ``int8`` codes with ``fp8`` the int8 format (:data:`kv8.quant.formats.INT8`), ``uint8`` bytes of two int4 codes
  with ``fp8`` :data:`kv8.quant.formats.INT4` (the last dim ``D / 2``; ``D`` even), ``uint8`` rows of int4 codes
  and their float16 group scales with ``fp8`` :data:`kv8.quant.int4_group.INT4_G32` (``D / 2 + 2 D / 32``; ``D`` a
  multiple of 32), ``uint8`` rows of E2M1 codes and their E4M3 group scales with ``fp8``
  :data:`kv8.quant.fp4.FP4_E2M1` (``D / 2 + ceil(D / 16)``; ``D`` even), or bfloat16/float16/float32 values with
  ``fp8=None``.
* K and V in different formats: ``fp8`` K's, ``v_fp8`` V's (default ``SAME_AS_K``: one format), each cache of its
  own dtype and row width as above (``[num_blocks, Hkv, block_size]`` shared); ``k_token_scales`` exactly when K is
  FP8 or per-token integer codes, ``v_token_scales`` exactly when V is; no static scales.
* ``query_start_loc [B + 1]`` and ``seq_lens [B]`` contiguous, ``block_tables [B, max_blocks]`` with a contiguous
  last dim; int32 or int64, each independently. Unchecked (the launch reads no tensor on the host, so it can be
  captured in a CUDA graph): ``query_start_loc`` nondecreasing from 0 with ``query_start_loc[B] <= T``, ``0 <=
  query_len_i <= seq_lens[i]``, the table entries a sequence needs are valid block ids and hold its keys.
* FP8: static ``k_scale``/``v_scale`` broadcastable to ``[Hkv, D]`` (any float dtype; copied to float32) or
  dynamic ``k_token_scales``/``v_token_scales`` float32 ``[num_blocks, Hkv, block_size]`` (any strides); int8 and
  int4: the dynamic ones; int4_per_group32 and fp4_e2m1: none.
* The split workspace (``num_kv_splits > 1``) is ``T * Hq * splits * (D_PAD + 2)`` float32, allocated per call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kv8.kernels.triton import interpreter
from kv8.kernels.triton.dequant import (
    apply_group_scales,
    decode_fp8,
    decode_fp8_bits,
    group_scales,
    native_fp8_supported,
)
from kv8.kernels.triton.formats import (
    SAME_AS_K,
    AnyLayout,
    KernelFormat,
    SameAsK,
    check_compiled_packed_head_dim,
    code_dtype,
    code_width,
    scale_bytes,
    side_formats,
)
from kv8.kernels.triton.interpreter import INTERPRETER, add_combine, cast_rn, dot, max_combine, widen
from kv8.kernels.triton.launch import Launch
from kv8.platform import CPU, Platform
from kv8.validators import check_int, check_number

__all__ = ["MAX_KV_SPLITS", "SCALES_DYNAMIC", "SCALES_NONE", "SCALES_STATIC", "KernelVariant", "Launch",
           "LaunchConfig", "choose_num_kv_splits", "launch_config", "plan_launches", "row_alignment",
           "unified_attention"]

MAX_KV_SPLITS = 64
_QUERY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INDEX_DTYPES = (torch.int32, torch.int64)
_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}
_LOG2E = math.log2(math.e)
SCALES_NONE, SCALES_STATIC, SCALES_DYNAMIC = 0, 1, 2  # the kernel's SCALES constexpr
_MAX_INT32 = 2 ** 31 - 1
_GROUP_MAX_REGISTERS = 255     # the group formats' register cap (KernelVariant.config)

# split-K heuristic (see choose_num_kv_splits)
_SPLIT_MAX_QUERY_LEN = 16      # split only decode-like batches (decode rows, short speculative chunks)
_SPLIT_MIN_KEYS = 256          # keys a split should at least get
_WAVES = 4                     # resident programs to aim for, per compute unit


@triton.jit
def _spread(x, AXIS: tl.constexpr):
    """Vector ``x`` as a 2-D tensor whose values run along ``AXIS``: ``x[:, None]`` (0) or ``x[None, :]`` (1)."""
    if AXIS == 0:
        res = x[:, None]
    else:
        res = x[None, :]
    return res


@triton.jit
def _row_group_scales(rows, FMT: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr):
    """The group scales of ``FMT`` (a group format) that follow the ``HEAD_DIM / 2`` code bytes of each row at
    ``rows`` ``[TILE_N]`` -> float32 ``[TILE_N, D_PAD / group_size]`` (a tile group past the row's reads 0)."""
    NG: tl.constexpr = D_PAD // FMT.group_size
    if FMT.scale_format is not None:
        # fp4_e2m1: an FP8 scale code (E4M3) per group follows the codes, one byte each, the last group maybe
        # shorter (a tile group past it reads 0), decoded by the exact bit path
        SCALE_FMT: tl.constexpr = FMT.scale_format
        NG_ROW: tl.constexpr = (HEAD_DIM + FMT.group_size - 1) // FMT.group_size
        offs_g = tl.arange(0, NG)
        sc = rows[:, None] + HEAD_DIM // 2 + offs_g[None, :]
        if NG_ROW == NG:     # the tile's groups are the row's: unmasked (vectorised where aligned)
            gs = decode_fp8_bits(tl.load(sc), SCALE_FMT, tl.float32)
        else:
            gs = decode_fp8_bits(tl.load(sc, mask=(offs_g < NG_ROW)[None, :], other=0), SCALE_FMT, tl.float32)
    else:
        # int4_per_group32: the groups' float16 scales follow the codes, 2 bytes each
        offs_g = tl.arange(0, 2 * NG)
        sc = rows[:, None] + HEAD_DIM // 2 + offs_g[None, :]
        if D_PAD == HEAD_DIM:   # the tile's groups are the row's: unmasked (vectorised where aligned)
            gs = group_scales(tl.load(sc))
        else:
            gs = group_scales(tl.load(sc, mask=(offs_g < 2 * (HEAD_DIM // FMT.group_size))[None, :], other=0))
    return gs


@triton.jit
def _attend_key_tile(
    j, q_hi, q_lo, m_i, l_i, acc, q_pos, row_ok, s_mult, key_lo, key_hi, window, table_row, kv_head,
    k_ptr, v_ptr, k_tok_ptr, v_tok_ptr, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_ksb, stride_ksh, stride_kst, stride_vsb, stride_vsh, stride_vst,
    D_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr,
    TILE_IN_BLOCK: tl.constexpr, FP8_FMT: tl.constexpr, NATIVE_FP8: tl.constexpr, SCALES: tl.constexpr,
    USE_WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr, Q_SPLIT: tl.constexpr, KEY_ROWS: tl.constexpr,
    MASKED: tl.constexpr, PACKED: tl.constexpr, GROUPED: tl.constexpr, ROW_ALIGN: tl.constexpr,
    V_FMT: tl.constexpr, V_NATIVE: tl.constexpr, V_SCALES: tl.constexpr, V_PACKED: tl.constexpr,
    V_GROUPED: tl.constexpr, V_ROW_ALIGN: tl.constexpr,
):
    """One online-softmax step over key tile ``j`` (keys ``j * TILE_N ..``) -> the updated ``(m_i, l_i, acc)``.

    ``KEY_ROWS`` (module docstring, *Orientation*): scores ``[TILE_N, BLOCK_M]`` and ``acc`` ``[D_PAD, BLOCK_M]``
    (``q_hi``/``q_lo`` ``[D_PAD, BLOCK_M]``), else ``[BLOCK_M, TILE_N]`` and ``[BLOCK_M, D_PAD]``. ``MASKED`` False:
    the caller promises every key of the tile is visible to every row (no causal or window edge, no clamped key).
    ``PACKED`` (int4 codes, two per byte): each tile's bytes are loaded in its layout with half the channels (K^T
    ``[D_PAD / 2, TILE_N]`` in the usual orientation) and unpacked in registers along the channel axis. ``FP8_FMT``,
    ``NATIVE_FP8``, ``SCALES``, ``PACKED``, ``GROUPED`` and ``ROW_ALIGN`` describe the K cache, the ``V_`` ones the V
    cache (the same values for a single-format cache)."""
    ROWS: tl.constexpr = 1 if KEY_ROWS else 0      # the axis of query rows in s, p and acc
    KEYS: tl.constexpr = 1 - ROWS                  # the axis of keys in s and p
    K_KEYS: tl.constexpr = 0 if KEY_ROWS else 1    # the axis of keys in the K tile: K [TILE_N, D] or K^T [D, TILE_N]
    V_KEYS: tl.constexpr = 0                       # ... in the V tile: V [TILE_N, D] (KEY_ROWS: the same layout as
    #                                                K's, so both tiles' addresses come from one table gather)
    offs_n = tl.arange(0, TILE_N)
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    pos = j * TILE_N + offs_n                                      # [TILE_N] key positions (int32)
    if MASKED:
        # addresses of keys outside key_lo .. key_hi - 1 are clamped into it (module docstring): every load reads
        # a key of this tile's range, unmasked, and the scores of the keys outside are -inf below
        posc = tl.minimum(tl.maximum(pos, key_lo), key_hi - 1)
    else:
        posc = pos
    # each key is one row of a contiguous (block, head) bs x D tile
    if TILE_IN_BLOCK:
        # the tile lies inside one block (TILE_N divides bs, tiles start at multiples of TILE_N): one table
        # entry, at index >= first_block since j >= key_lo // TILE_N; a scalar base and small offsets
        block = tl.load(table_row + (j * TILE_N) // BLOCK_SIZE).to(tl.int64)
        slot = posc % BLOCK_SIZE
        k_head = block * stride_kb + kv_head * stride_kh
        v_head = block * stride_vb + kv_head * stride_vh
        k_slot = slot * stride_kt
        v_slot = slot * stride_vt
        # the (block, head) base and the slots' offsets are multiples of ROW_ALIGN (K) and V_ROW_ALIGN (V) elements
        # (row_alignment; a hint on the value where it is made: Triton drops one on a called function's argument)
        if ROW_ALIGN > 1:
            k_head = tl.multiple_of(k_head, ROW_ALIGN)
        if V_ROW_ALIGN > 1:
            v_head = tl.multiple_of(v_head, V_ROW_ALIGN)
        if ROW_ALIGN > 1:
            k_slot = tl.multiple_of(k_slot, ROW_ALIGN)
        if V_ROW_ALIGN > 1:
            v_slot = tl.multiple_of(v_slot, V_ROW_ALIGN)
        k_base = k_ptr + k_head
        v_base = v_ptr + v_head
        k_ptrs = k_base + _spread(k_slot, K_KEYS) + _spread(offs_d, 1 - K_KEYS)
        v_ptrs = v_base + _spread(v_slot, V_KEYS) + _spread(offs_d, 1 - V_KEYS)
        k_ts_ptr = k_tok_ptr + block * stride_ksb + kv_head * stride_ksh + slot * stride_kst
        v_ts_ptr = v_tok_ptr + block * stride_vsb + kv_head * stride_vsh + slot * stride_vst
        k_rows = k_base + k_slot                                   # [TILE_N] row starts (PACKED's loads)
        v_rows = v_base + v_slot
    else:
        # keys of several blocks (or blocks smaller than a tile): one table entry per key
        if (not MASKED) and TILE_N % BLOCK_SIZE == 0:
            # whole blocks, unclamped: the slots do not depend on j
            blocks = tl.load(table_row + j * (TILE_N // BLOCK_SIZE) + offs_n // BLOCK_SIZE).to(tl.int64)
            slots = offs_n % BLOCK_SIZE
        else:
            blocks = tl.load(table_row + posc // BLOCK_SIZE).to(tl.int64)
            slots = posc % BLOCK_SIZE
        k_head = kv_head * stride_kh
        v_head = kv_head * stride_vh
        k_off = blocks * stride_kb + slots * stride_kt                            # [TILE_N] row offsets in the head
        v_off = blocks * stride_vb + slots * stride_vt
        if ROW_ALIGN > 1:   # each a multiple of ROW_ALIGN (K) / V_ROW_ALIGN (V) elements (row_alignment)
            k_head = tl.multiple_of(k_head, ROW_ALIGN)
        if V_ROW_ALIGN > 1:
            v_head = tl.multiple_of(v_head, V_ROW_ALIGN)
        if ROW_ALIGN > 1:
            k_off = tl.multiple_of(k_off, ROW_ALIGN)
        if V_ROW_ALIGN > 1:
            v_off = tl.multiple_of(v_off, V_ROW_ALIGN)
        k_ptrs = k_ptr + k_head + _spread(k_off, K_KEYS) + _spread(offs_d, 1 - K_KEYS)
        v_ptrs = v_ptr + v_head + _spread(v_off, V_KEYS) + _spread(offs_d, 1 - V_KEYS)
        k_ts_ptr = k_tok_ptr + blocks * stride_ksb + kv_head * stride_ksh + slots * stride_kst
        v_ts_ptr = v_tok_ptr + blocks * stride_vsb + kv_head * stride_vsh + slots * stride_vst
        k_rows = k_ptr + k_head + k_off
        v_rows = v_ptr + v_head + v_off
    if PACKED or V_PACKED:
        # int4 and the group formats: each key's row is D / 2 bytes of two codes (then the group scales), laid out as
        # the tiles are (K^T [D / 2, TILE_N] bytes in the usual orientation); a side that is not packed (a cache of
        # two formats) loads its [.., D] tile as below
        offs_w = tl.arange(0, D_PAD // 2)
        if PACKED:
            k_src = _spread(k_rows, K_KEYS) + _spread(offs_w, 1 - K_KEYS)
        else:
            k_src = k_ptrs
        if V_PACKED:
            v_src = v_rows[:, None] + offs_w[None, :]
        else:
            v_src = v_ptrs
        if D_PAD == HEAD_DIM:
            k_raw = tl.load(k_src)
            v_raw = tl.load(v_src)
        else:
            w_ok = offs_w < HEAD_DIM // 2
            if PACKED:
                k_raw = tl.load(k_src, mask=_spread(w_ok, 1 - K_KEYS), other=0)
            else:
                k_raw = tl.load(k_src, mask=_spread(d_ok, 1 - K_KEYS), other=0)
            if V_PACKED:
                v_raw = tl.load(v_src, mask=w_ok[None, :], other=0)
            else:
                v_raw = tl.load(v_src, mask=_spread(d_ok, 1 - V_KEYS), other=0)
        if GROUPED:
            k_gs = _row_group_scales(k_rows, FP8_FMT, HEAD_DIM, D_PAD)
        if V_GROUPED:
            v_gs = _row_group_scales(v_rows, V_FMT, HEAD_DIM, D_PAD)
    elif KEY_ROWS and (not MASKED) and (not TILE_IN_BLOCK) and TILE_N % BLOCK_SIZE == 0 and D_PAD == HEAD_DIM:
        # whole blocks, unclamped, both tiles [TILE_N, D]: loaded as [blocks, BLOCK_SIZE, D], one table entry and
        # one base address per block, the offsets inside a block loop-invariant and non-negative (int32 products of
        # non-negative strides; zero-extended: one 64-bit add per 16-byte load)
        NB: tl.constexpr = TILE_N // BLOCK_SIZE
        blk = tl.load(table_row + j * NB + tl.arange(0, NB)).to(tl.int64)                  # [NB]
        offs_s = tl.arange(0, BLOCK_SIZE)
        k_off = ((offs_s * stride_kt)[:, None] + offs_d[None, :]).to(tl.uint32).to(tl.int64)   # [BLOCK_SIZE, D]
        v_off = ((offs_s * stride_vt)[:, None] + offs_d[None, :]).to(tl.uint32).to(tl.int64)
        k_blocks = k_ptr + kv_head * stride_kh + blk * stride_kb                           # [NB] pointers
        v_blocks = v_ptr + kv_head * stride_vh + blk * stride_vb
        k_raw = tl.reshape(tl.load(k_blocks[:, None, None] + k_off[None, :, :]), [TILE_N, D_PAD])
        v_raw = tl.reshape(tl.load(v_blocks[:, None, None] + v_off[None, :, :]), [TILE_N, D_PAD])
    elif D_PAD == HEAD_DIM:
        k_raw = tl.load(k_ptrs)
        v_raw = tl.load(v_ptrs)
    else:
        k_raw = tl.load(k_ptrs, mask=_spread(d_ok, 1 - K_KEYS), other=0)
        v_raw = tl.load(v_ptrs, mask=_spread(d_ok, 1 - V_KEYS), other=0)
    if GROUPED:   # codes times their group's scale in float32 (exact), then the dot's dtype
        k = cast_rn(apply_group_scales(decode_fp8(k_raw, FP8_FMT, NATIVE_FP8, tl.float32, 1 - K_KEYS), k_gs,
                                       1 - K_KEYS, FP8_FMT.group_size), DOT_DTYPE)
    else:
        k = decode_fp8(k_raw, FP8_FMT, NATIVE_FP8, DOT_DTYPE, 1 - K_KEYS)
    if KEY_ROWS:
        s = dot(k, q_hi)                             # [TILE_N, BLOCK_M]
        if Q_SPLIT:
            s += dot(k, q_lo)
    else:
        s = dot(q_hi, k)                             # [BLOCK_M, TILE_N]
        if Q_SPLIT:
            s += dot(q_lo, k)
    if SCALES == 2:
        s = s * _spread(tl.load(k_ts_ptr), KEYS)
    s = s * _spread(s_mult, ROWS)
    if MASKED:
        visible = _spread(row_ok, ROWS) & (_spread(pos, KEYS) <= _spread(q_pos, ROWS))
        if USE_WINDOW:
            visible = visible & (_spread(pos, KEYS) > _spread(q_pos - window, ROWS))
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.reduce(s, KEYS, max_combine))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)      # a row that saw nothing yet stays (-inf, 0)
    else:
        m_new = tl.maximum(m_i, tl.reduce(s, KEYS, max_combine))   # finite: every score is
        m_base = m_new
    alpha = tl.exp2(m_i - m_base)
    p = tl.exp2(s - _spread(m_base, ROWS))
    l_i = l_i * alpha + tl.reduce(p, KEYS, add_combine)

    if V_GROUPED:
        v = cast_rn(apply_group_scales(decode_fp8(v_raw, V_FMT, V_NATIVE, tl.float32), v_gs, 1,
                                       V_FMT.group_size), DOT_DTYPE)
    else:
        v = decode_fp8(v_raw, V_FMT, V_NATIVE, DOT_DTYPE)
    if V_SCALES == 2:
        p = p * _spread(tl.load(v_ts_ptr), KEYS)
    if KEY_ROWS:
        acc = acc * alpha[None, :] + dot(tl.trans(v), cast_rn(p, DOT_DTYPE))   # [D_PAD, BLOCK_M]
    else:
        acc = acc * alpha[:, None] + dot(cast_rn(p, DOT_DTYPE), v)          # [BLOCK_M, D_PAD]
    return m_new, l_i, acc


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_ptr, v_ptr,
    qsl_ptr, seq_lens_ptr, table_ptr,
    k_scale_ptr, v_scale_ptr,              # static [Hkv, D] float32 (unused otherwise)
    k_tok_ptr, v_tok_ptr,                  # dynamic [num_blocks, Hkv, bs] float32 (unused otherwise)
    part_acc_ptr, part_m_ptr, part_l_ptr,  # split-K workspace [T, Hq, S, D_PAD], [T, Hq, S], [T, Hq, S]
    num_seqs, num_q_heads, qk_scale, window,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
    stride_ksb, stride_ksh, stride_kst, stride_vsb, stride_vsh, stride_vst,
    stride_table,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, TILE_N: tl.constexpr, TILE_IN_BLOCK: tl.constexpr,
    NUM_SPLITS: tl.constexpr, FP8_FMT: tl.constexpr, NATIVE_FP8: tl.constexpr, SCALES: tl.constexpr,
    K_CHANNEL_SCALE: tl.constexpr, USE_WINDOW: tl.constexpr, DOT_DTYPE: tl.constexpr, Q_SPLIT: tl.constexpr,
    ROW_SCALE: tl.constexpr, KEY_ROWS: tl.constexpr, Q_LEN_MIN: tl.constexpr, Q_LEN_MAX: tl.constexpr,
    PACKED: tl.constexpr, GROUPED: tl.constexpr, ROW_ALIGN: tl.constexpr,
    V_FMT: tl.constexpr, V_NATIVE: tl.constexpr, V_SCALES: tl.constexpr, V_PACKED: tl.constexpr,
    V_GROUPED: tl.constexpr, V_ROW_ALIGN: tl.constexpr,
):
    pid_q = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    # ---- which sequence and which of its query tiles (module docstring) ----
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(qsl_ptr + mid) // BLOCK_Q + mid <= pid_q:
            lo = mid + 1
        else:
            hi = mid
    seq = lo - 1
    q_start = tl.load(qsl_ptr + seq).to(tl.int64)
    q_len = tl.load(qsl_ptr + seq + 1).to(tl.int64) - q_start
    q0 = (pid_q - (q_start // BLOCK_Q + seq)) * BLOCK_Q            # first new token of this tile
    if (q0 >= q_len) | (q_len < Q_LEN_MIN) | (q_len > Q_LEN_MAX):   # past the sequence, or the other launch's
        return
    # positions are int32 (a sequence holds < 2^31 keys); token rows, which address q and out, are int64
    seq_len = tl.load(seq_lens_ptr + seq).to(tl.int32)
    q_len32 = q_len.to(tl.int32)
    q0_32 = q0.to(tl.int32)
    context = seq_len - q_len32                                    # position of new token 0

    # ---- the tile's rows: (token, query head) pairs of this KV head's group ----
    offs_m = tl.arange(0, BLOCK_M)
    tok = q0 + offs_m // GROUP                                     # [BLOCK_M] token within the sequence
    q_head = kv_head * GROUP + offs_m % GROUP                      # [BLOCK_M]
    row_ok = (offs_m < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = context + q0_32 + offs_m // GROUP                      # [BLOCK_M] absolute positions
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    q_rows = q_start + tok
    q = widen(tl.load(q_ptr + q_rows[:, None] * stride_qt + q_head[:, None] * stride_qh + offs_d[None, :],
                       mask=row_ok[:, None] & d_ok[None, :], other=0.0))           # [BLOCK_M, D_PAD] float32

    s_mult = qk_scale                                              # scale * log2(e), times a scalar K scale
    if SCALES == 1:
        if K_CHANNEL_SCALE:
            q = q * tl.load(k_scale_ptr + kv_head * HEAD_DIM + offs_d, mask=d_ok, other=0.0)[None, :]
        else:
            s_mult = qk_scale * tl.load(k_scale_ptr + kv_head * HEAD_DIM)
    s_mult = tl.full([BLOCK_M], 1.0, dtype=tl.float32) * s_mult  # [BLOCK_M]: one multiplier per row
    if ROW_SCALE:
        # a bfloat16 query into float16 operands (module docstring): each row times 2^e, e = min(141 - E, 100)
        # for E the biased exponent of its largest |q| (that max lands in [2^14, 2^15)); the scores get 2^-e back
        amax = tl.reduce(tl.where(q < 0.0, -q, q), 1, max_combine)                  # [BLOCK_M]
        e = tl.minimum(141 - ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF), 100)
        q = q * ((e + 127) << 23).to(tl.float32, bitcast=True)[:, None]
        s_mult = s_mult * ((127 - e) << 23).to(tl.float32, bitcast=True)
    # q in the dot's dtype; q * (channel K scale) is not exact in 16 bits, so it goes in as hi + lo parts
    # (|q - hi - lo| <= 2^-16 |q| for bfloat16, 2^-22 for float16), two products of exact 16-bit operands
    q_hi = cast_rn(q, DOT_DTYPE)
    q_lo = q_hi
    if Q_SPLIT:
        q_lo = cast_rn(q - widen(q_hi), DOT_DTYPE)

    # ---- the keys this tile needs, and this split's share of their tiles ----
    p_lo = context + q0_32
    p_hi = context + tl.minimum(q0_32 + BLOCK_Q, q_len32) - 1
    key_hi = p_hi + 1                                              # exclusive; <= seq_len
    key_lo = p_lo * 0
    if USE_WINDOW:
        key_lo = tl.maximum(p_lo - window + 1, 0)
    j_lo = key_lo // TILE_N
    j_hi = (key_hi + TILE_N - 1) // TILE_N
    if NUM_SPLITS > 1:
        per_split = (j_hi - j_lo + NUM_SPLITS - 1) // NUM_SPLITS
        j_lo = j_lo + split * per_split
        j_hi = tl.minimum(j_lo + per_split, j_hi)

    # keys as the products' rows (FP8 decode tiles, static scales; module docstring, *Orientation*): the tiles every
    # row sees whole (no causal or window edge, no clamped key) go through a loop without masks, the others (the
    # last ones, and with a window the first ones: [j_lo, u_lo) and [u_hi, j_hi)) through the masked loop
    u_lo = j_hi
    u_hi = j_hi
    if KEY_ROWS:
        u_lo = j_lo
        if USE_WINDOW:
            u_lo = tl.maximum(j_lo, (tl.maximum(p_hi - window + 1, 0) + TILE_N - 1) // TILE_N)
        u_hi = tl.minimum(j_hi, (p_lo + 1) // TILE_N)
        whole = u_lo < u_hi
        u_lo = tl.where(whole, u_lo, j_hi)
        u_hi = tl.where(whole, u_hi, j_hi)
    n_lead = u_lo - j_lo
    n_masked = n_lead + j_hi - u_hi

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)      # running max, log2 units
    l_i = tl.full([BLOCK_M], 0.0, dtype=tl.float32)
    if KEY_ROWS:
        q_hi = tl.trans(q_hi)                                      # [D_PAD, BLOCK_M]
        q_lo = tl.trans(q_lo)
        acc = tl.full([D_PAD, BLOCK_M], 0.0, dtype=tl.float32)
    else:
        acc = tl.full([BLOCK_M, D_PAD], 0.0, dtype=tl.float32)
    table_row = table_ptr + seq * stride_table
    # Triton's interpreter cannot take loaded scalars as range() bounds (numpy >= 2.4 refuses int() of its
    # 1-element arrays); compiled, a for loop is what the software pipeliner overlaps with the loads
    # (kv8.kernels.triton.interpreter: its one workaround outside that module).
    if INTERPRETER:
        j = u_lo
        while j < u_hi:
            m_i, l_i, acc = _attend_key_tile(
                j, q_hi, q_lo, m_i, l_i, acc, q_pos, row_ok, s_mult, key_lo, key_hi, window, table_row, kv_head,
                k_ptr, v_ptr, k_tok_ptr, v_tok_ptr, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
                stride_ksb, stride_ksh, stride_kst, stride_vsb, stride_vsh, stride_vst,
                D_PAD, HEAD_DIM, BLOCK_SIZE, TILE_N, TILE_IN_BLOCK, FP8_FMT, NATIVE_FP8, SCALES, USE_WINDOW,
                DOT_DTYPE, Q_SPLIT, KEY_ROWS, False, PACKED, GROUPED, ROW_ALIGN,
                V_FMT, V_NATIVE, V_SCALES, V_PACKED, V_GROUPED, V_ROW_ALIGN)
            j += 1
        t = 0
        while t < n_masked:
            m_i, l_i, acc = _attend_key_tile(
                tl.where(t < n_lead, j_lo + t, u_hi + t - n_lead), q_hi, q_lo, m_i, l_i, acc, q_pos, row_ok,
                s_mult, key_lo, key_hi, window, table_row, kv_head,
                k_ptr, v_ptr, k_tok_ptr, v_tok_ptr, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
                stride_ksb, stride_ksh, stride_kst, stride_vsb, stride_vsh, stride_vst,
                D_PAD, HEAD_DIM, BLOCK_SIZE, TILE_N, TILE_IN_BLOCK, FP8_FMT, NATIVE_FP8, SCALES, USE_WINDOW,
                DOT_DTYPE, Q_SPLIT, KEY_ROWS, True, PACKED, GROUPED, ROW_ALIGN,
                V_FMT, V_NATIVE, V_SCALES, V_PACKED, V_GROUPED, V_ROW_ALIGN)
            t += 1
    elif KEY_ROWS:
        for j in range(u_lo, u_hi):
            m_i, l_i, acc = _attend_key_tile(
                j, q_hi, q_lo, m_i, l_i, acc, q_pos, row_ok, s_mult, key_lo, key_hi, window, table_row, kv_head,
                k_ptr, v_ptr, k_tok_ptr, v_tok_ptr, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
                stride_ksb, stride_ksh, stride_kst, stride_vsb, stride_vsh, stride_vst,
                D_PAD, HEAD_DIM, BLOCK_SIZE, TILE_N, TILE_IN_BLOCK, FP8_FMT, NATIVE_FP8, SCALES, USE_WINDOW,
                DOT_DTYPE, Q_SPLIT, KEY_ROWS, False, PACKED, GROUPED, ROW_ALIGN,
                V_FMT, V_NATIVE, V_SCALES, V_PACKED, V_GROUPED, V_ROW_ALIGN)
        for t in range(0, n_masked):
            m_i, l_i, acc = _attend_key_tile(
                tl.where(t < n_lead, j_lo + t, u_hi + t - n_lead), q_hi, q_lo, m_i, l_i, acc, q_pos, row_ok,
                s_mult, key_lo, key_hi, window, table_row, kv_head,
                k_ptr, v_ptr, k_tok_ptr, v_tok_ptr, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
                stride_ksb, stride_ksh, stride_kst, stride_vsb, stride_vsh, stride_vst,
                D_PAD, HEAD_DIM, BLOCK_SIZE, TILE_N, TILE_IN_BLOCK, FP8_FMT, NATIVE_FP8, SCALES, USE_WINDOW,
                DOT_DTYPE, Q_SPLIT, KEY_ROWS, True, PACKED, GROUPED, ROW_ALIGN,
                V_FMT, V_NATIVE, V_SCALES, V_PACKED, V_GROUPED, V_ROW_ALIGN)
    else:
        for j in range(j_lo, j_hi):
            m_i, l_i, acc = _attend_key_tile(
                j, q_hi, q_lo, m_i, l_i, acc, q_pos, row_ok, s_mult, key_lo, key_hi, window, table_row, kv_head,
                k_ptr, v_ptr, k_tok_ptr, v_tok_ptr, stride_kb, stride_kh, stride_kt, stride_vb, stride_vh, stride_vt,
                stride_ksb, stride_ksh, stride_kst, stride_vsb, stride_vsh, stride_vst,
                D_PAD, HEAD_DIM, BLOCK_SIZE, TILE_N, TILE_IN_BLOCK, FP8_FMT, NATIVE_FP8, SCALES, USE_WINDOW,
                DOT_DTYPE, Q_SPLIT, KEY_ROWS, True, PACKED, GROUPED, ROW_ALIGN,
                V_FMT, V_NATIVE, V_SCALES, V_PACKED, V_GROUPED, V_ROW_ALIGN)
    if KEY_ROWS:
        acc = tl.trans(acc)                                        # [BLOCK_M, D_PAD]

    if V_SCALES == 1:
        acc = acc * tl.load(v_scale_ptr + kv_head * HEAD_DIM + offs_d, mask=d_ok, other=0.0)[None, :]
    if NUM_SPLITS == 1:
        # l > 0 in every real row (a query always sees its own key); masked rows divide by 1, not 0
        o = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
        tl.store(out_ptr + q_rows[:, None] * stride_ot + q_head[:, None] * stride_oh + offs_d[None, :],
                 cast_rn(o, out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        part = (q_rows * num_q_heads + q_head) * NUM_SPLITS + split    # [BLOCK_M]
        tl.store(part_m_ptr + part, m_i, mask=row_ok)
        tl.store(part_l_ptr + part, l_i, mask=row_ok)
        tl.store(part_acc_ptr + part[:, None] * D_PAD + offs_d[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_acc_ptr, part_m_ptr, part_l_ptr, qsl_ptr,
    num_seqs, num_q_heads, stride_ot, stride_oh,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    """One (token, query head): combine the splits' (m, l, acc) by a log-sum-exp merge (base 2)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    if t >= tl.load(qsl_ptr + num_seqs):                           # padding rows past the batch: left alone
        return
    offs_s = tl.arange(0, SPLITS_PAD)
    s_ok = offs_s < NUM_SPLITS
    offs_d = tl.arange(0, D_PAD)
    d_ok = offs_d < HEAD_DIM
    part = (t.to(tl.int64) * num_q_heads + h) * NUM_SPLITS + offs_s
    m = tl.load(part_m_ptr + part, mask=s_ok, other=float("-inf"))
    l_s = tl.load(part_l_ptr + part, mask=s_ok, other=0.0)
    m_max = tl.reduce(m, 0, max_combine)
    w = tl.exp2(m - tl.where(m_max == float("-inf"), 0.0, m_max))  # empty splits (m = -inf) weigh 0
    acc = tl.load(part_acc_ptr + part[:, None] * D_PAD + offs_d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                  other=0.0)
    o = tl.reduce(acc * w[:, None], 0, add_combine) / tl.reduce(l_s * w, 0, add_combine)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh + offs_d,
             cast_rn(o, out_ptr.dtype.element_ty), mask=d_ok)


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes of one launch (powers of two except ``block_q``; ``block_m >= block_q * group``)."""

    block_q: int          # new tokens per query tile
    block_m: int          # rows of the tile matrix: block_q * group, padded to a power of two >= 16 (tl.dot's M;
    #                       with key_rows >= 8: tl.dot's N)
    tile_n: int           # keys per inner iteration (tl.dot's N for QK and K for PV, >= 16)
    tile_in_block: bool   # tile_n divides block_size: each key tile lies in one block (one table entry per tile)
    d_pad: int            # head_dim padded to a power of two >= 16
    num_warps: int
    num_stages: int       # software-pipelining depth of the key loop (Triton's num_stages)
    key_rows: bool = False  # keys as the products' rows: scores [tile_n, block_m] (module docstring, *Orientation*)
    max_registers: int | None = None   # Triton's maxnreg (ptxas's register cap per thread); None: ptxas's choice

    @property
    def options(self) -> dict[str, int]:
        """The launch's compile options: warps, stages and, where set, the register cap."""
        opts = {"num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.max_registers is not None:
            opts["maxnreg"] = self.max_registers
        return opts


def launch_config(group: int, head_dim: int, max_query_len: int, block_size: int, dot_f32: bool,
                  cache_bytes: int = 2, dynamic_scales: bool = False, packed: bool = False,
                  query_bytes: int = 2) -> LaunchConfig:
    """Tile sizes for a batch whose longest new-token run is ``max_query_len``, ``group`` query heads per KV head,
    over a cache of ``cache_bytes`` per element (1: FP8 or int8 codes, and int4's bytes: ``packed``).

    Rows: 16 when ``max_query_len * group <= 16`` (decode batches: little waste on single-token rows; over FP8
    codes with static or no scales 8 when ``max_query_len * group <= 8``, with the keys as the products' rows,
    ``key_rows``), else 32 or 64 (prefill: more rows share each K/V tile). For ``head_dim <= 128`` with 16-bit
    products (the engine's launches; chosen by their compiled code for sm_90, ``python -m tests.helpers.sm90`` and
    docs/benchmarks.md):

    ==========  ============  ====  =====  ======  ===========================================================
    rows        cache         keys  warps  stages  why
    ==========  ============  ====  =====  ======  ===========================================================
    8, 16       FP8, static   64    1      5       keys as the products' rows (``key_rows``): fewest
    (decode)    scales                             instructions per KB of codes (``cp.async.wait_group 3``)
    16 (decode) int8, FP8     64    2      5       the usual orientation (with ``key_rows`` the token scales'
                dynamic                            and bf16 operands' registers spill 10 KB)
    16 (decode) int4          64    4      5       with 2 warps the unpacked codes spill (8 bytes at 168
                                                   registers; 4 warps: 168, none)
    16 (decode) 16-bit        16    1      5       fewest instructions per KB with the loads pipelined
    32, 64      FP8           64    4      5       one warpgroup, wgmma 64 x 64 for QK, pipelined (32 keys
                                                   with dynamic scales: their loads would spill at 64)
    32, 64      16-bit        32    4      5       64-key tiles of 16-bit K/V would take 113 KB of shared memory
    ==========  ============  ====  =====  ======  ===========================================================

    Otherwise (``head_dim > 128``: at most 32 rows and 16 keys; float32 products, ``dot_f32``, on CUDA cores: 16
    rows and 16 keys) 8 warps from a 64 x 128 (or 32 x 256) accumulator on, and for a float32 query
    (``query_bytes`` 4) at ``head_dim`` 65 .. 128 (on 4 warps its tiles spill 448-660 bytes on sm_90 over every
    cache format at Llama-3.1-8B shapes; 8 warps: 168-186 registers, none), else 4, and Triton's default 3 stages.
    A tile of keys inside one block (``block_size % keys == 0``) reads one table entry; a tile spanning blocks (64
    keys over blocks of 16) reads each key's entry, or with ``key_rows`` in its unmasked loop each block's. All of
    these compile for sm_90 without register spills (ptxas; measured without a GPU, not timed on one).
    """
    d_pad = max(16, triton.next_power_of_2(head_dim))
    need = max(1, max_query_len) * group
    rows = 16 if need <= 16 else 32 if need <= 32 else 64
    fp8 = cache_bytes == 1
    key_rows = False
    if d_pad <= 128 and not dot_f32:
        if rows == 16 and fp8 and not dynamic_scales:
            keys, num_warps, key_rows = 64, 1, True
            rows = 8 if need <= 8 else 16
        elif rows == 16:
            keys, num_warps = (64, 4 if packed else 2) if fp8 else (16, 1)
        else:
            keys, num_warps = (64 if fp8 and not dynamic_scales else 32), 4
        num_stages = 5
    else:
        keys = 16
        if dot_f32:
            rows = 16
        else:
            rows = min(rows, 32)
        num_stages = 3
        num_warps = 0
    block_q = max(1, rows // group)
    block_m = max(8 if key_rows else 16, triton.next_power_of_2(block_q * group))
    if num_warps == 0:
        num_warps = 8 if block_m * d_pad >= 64 * 128 or (query_bytes == 4 and d_pad == 128) else 4
    return LaunchConfig(block_q, block_m, keys, block_size % keys == 0, d_pad, num_warps, num_stages, key_rows)


@dataclass(frozen=True)
class KernelVariant:
    """What selects one compiled specialisation of the attention kernel: its constexprs follow from these fields
    (:meth:`constexprs`) and nothing else, so the wrapper and a compile check build the same kernels."""

    query_dtype: torch.dtype
    cache_dtype: torch.dtype        # torch.uint8 for FP8 codes and packed int4 codes, torch.int8 for int8 codes (K's)
    fp8: KernelFormat | None        # what the kernels need of K's FP8, int8 or int4 format (None: 16/32-bit cache)
    native_fp8: bool                # decode with the GPU's FP8 conversion (else the exact bit path)
    scales: int                     # SCALES_NONE, SCALES_STATIC or SCALES_DYNAMIC
    k_channel_scale: bool           # static K scales vary along head_dim
    sliding_window: bool
    group: int                      # query heads per KV head
    head_dim: int
    block_size: int
    max_query_len: int
    row_align: int = 1              # every K row start is a multiple of this many cache elements (row_alignment)
    # V's side where it differs from K's (a cache of two formats); the defaults are K's: a single-format cache
    v_fp8: KernelFormat | None | SameAsK = SAME_AS_K   # V's code format (None: a 16/32-bit V cache)
    v_cache_dtype: torch.dtype | None = None           # the V cache's dtype
    v_native_fp8: bool | None = None
    v_scales: int | None = None                        # SCALES_NONE or SCALES_DYNAMIC (a pair has no static scales)
    v_row_align: int | None = None

    @property
    def v_side(self) -> tuple[KernelFormat | None, torch.dtype, bool, int, int]:
        """V's ``(format, cache dtype, native FP8 decode, scales, row alignment)``, each K's where not given."""
        return (self.fp8 if self.v_fp8 is SAME_AS_K else self.v_fp8,
                self.cache_dtype if self.v_cache_dtype is None else self.v_cache_dtype,
                self.native_fp8 if self.v_native_fp8 is None else self.v_native_fp8,
                self.scales if self.v_scales is None else self.v_scales,
                self.row_align if self.v_row_align is None else self.v_row_align)

    @property
    def pair(self) -> bool:
        """K and V are stored in different formats (or 16/32-bit dtypes)."""
        v_fmt, v_dtype = self.v_side[:2]
        return (v_fmt, v_dtype) != (self.fp8, self.cache_dtype)

    @property
    def dot_dtype(self) -> tl.dtype:
        """The operand dtype of both products (module docstring): float16 for a 16-bit query over an FP8 cache with
        static or no scales (FP8 codes convert to float16 pairs natively; a bfloat16 query is row-scaled into
        float16, :attr:`row_scale`), the query's 16-bit dtype over dynamic scales or a cache of its own dtype, else
        float32."""
        if self.query_dtype == torch.float32:
            return tl.float32
        if self.pair:
            # two formats (an FP8 side has dynamic scales): each side's values go into the query's 16-bit dtype as a
            # single format's would (codes with a scale per key or group; a 16-bit side of the query's own dtype),
            # else both products are float32
            v_fmt, v_dtype = self.v_side[:2]
            own = all(f is not None or d == self.query_dtype for f, d in ((self.fp8, self.cache_dtype),
                                                                          (v_fmt, v_dtype)))
            return _TL_DTYPES[self.query_dtype] if own else tl.float32
        if self.fp8 is not None:
            per_key = self.scales == SCALES_DYNAMIC or self.fp8.group_size > 0
            return _TL_DTYPES[self.query_dtype] if per_key else tl.float16
        return _TL_DTYPES[self.query_dtype] if self.cache_dtype == self.query_dtype else tl.float32

    @property
    def row_scale(self) -> bool:
        """A bfloat16 query goes into float16 operands: each row scaled by a power of two first."""
        return self.query_dtype == torch.bfloat16 and self.dot_dtype == tl.float16

    @property
    def config(self) -> LaunchConfig:
        """:func:`launch_config` of these fields; the group formats' launches (int4_per_group32, fp4_e2m1) may use
        all 255 registers a thread has: at ptxas's own cap for their 4-warp tiles (168) the decode spills with some
        Triton versions (measured at Llama-3.1-8B shapes: fp4_e2m1 8 bytes with 3.7.1, 32 with 3.9; int4_per_group32
        40 with 3.9), while its ~210 registers leave as many programs per SM (2) as the 176 of 3.6."""
        v_fmt, v_dtype, _, v_scales, _ = self.v_side
        sides = ((self.fp8, self.cache_dtype, self.scales), (v_fmt, v_dtype, v_scales))
        # a cache of two formats takes the tiles of its wider side (1 byte: codes) with the per-key scales, packed
        # codes and register cap of either side's
        cache_bytes = max(1 if f is not None else d.itemsize for f, d, _ in sides)
        grouped = any(f is not None and f.group_size > 0 for f, _, _ in sides)
        cfg = launch_config(self.group, self.head_dim, self.max_query_len, self.block_size,
                            self.dot_dtype == tl.float32, cache_bytes,
                            any(sc == SCALES_DYNAMIC for _, _, sc in sides) or grouped,
                            any(f is not None and f.packed for f, _, _ in sides), self.query_dtype.itemsize)
        return replace(cfg, max_registers=_GROUP_MAX_REGISTERS) if grouped else cfg

    def constexprs(self, num_kv_splits: int, q_len_min: int = 0, q_len_max: int = _MAX_INT32) -> dict[str, object]:
        """The kernel's constexprs; the program of a sequence with fewer than ``q_len_min`` or more than
        ``q_len_max`` new tokens returns at once (a mixed batch's two launches, :func:`plan_launches`)."""
        cfg = self.config
        v_fmt, _, v_native, v_scales, v_row_align = self.v_side
        return dict(
            HEAD_DIM=self.head_dim, D_PAD=cfg.d_pad, BLOCK_SIZE=self.block_size, GROUP=self.group,
            BLOCK_Q=cfg.block_q, BLOCK_M=cfg.block_m, TILE_N=cfg.tile_n, TILE_IN_BLOCK=cfg.tile_in_block,
            NUM_SPLITS=num_kv_splits, FP8_FMT=self.fp8, NATIVE_FP8=self.native_fp8, SCALES=self.scales,
            K_CHANNEL_SCALE=self.k_channel_scale, USE_WINDOW=self.sliding_window, DOT_DTYPE=self.dot_dtype,
            Q_SPLIT=self.k_channel_scale and self.dot_dtype != tl.float32, ROW_SCALE=self.row_scale,
            KEY_ROWS=cfg.key_rows,
            Q_LEN_MIN=q_len_min, Q_LEN_MAX=q_len_max,
            PACKED=self.fp8 is not None and self.fp8.packed,
            GROUPED=self.fp8 is not None and self.fp8.group_size > 0,
            ROW_ALIGN=self.row_align,
            V_FMT=v_fmt, V_NATIVE=v_native, V_SCALES=v_scales,
            V_PACKED=v_fmt is not None and v_fmt.packed,
            V_GROUPED=v_fmt is not None and v_fmt.group_size > 0,
            V_ROW_ALIGN=v_row_align,
        )


def row_alignment(*caches: torch.Tensor, cap_bytes: int = 16) -> int:
    """The alignment, in cache elements, that every row start of every ``[num_blocks, Hkv, bs, W]`` cache in
    ``caches`` provably has: the largest power of two ``A`` (at most ``cap_bytes`` bytes, 16: the widest global
    load) such that the data pointer and the strides of the first three dims, in bytes, are multiples of ``A``
    bytes -- a dim of size 1 contributes no offset, so not its stride -- returned as ``A / element size`` (at
    least 1). The kernel tells Triton that the row offsets are multiples of it (``ROW_ALIGN``), which lets it
    vectorise and pipeline the loads of rows that are not 16-byte multiples (72-byte int4_per_group32 and
    fp4_e2m1 rows at head_dim 128 start at multiples of 8 bytes). Host-side facts only; reads no values."""
    if cap_bytes < 1 or cap_bytes & (cap_bytes - 1):
        raise ValueError(f"row_alignment: cap_bytes={cap_bytes} must be a power of two >= 1")
    item = None
    align = cap_bytes
    for c in caches:
        if item is not None and c.element_size() != item:
            raise ValueError(f"row_alignment: caches of element sizes {item} and {c.element_size()} do not share "
                             "an alignment in elements")
        item = c.element_size()
        terms = [c.data_ptr()] + [c.stride(i) * item for i in range(min(3, c.ndim)) if c.shape[i] > 1]
        for t in terms:
            while t % align:
                align //= 2
    return max(1, align // (item or 1))


def choose_num_kv_splits(num_programs: int, max_query_len: int, max_keys: int, compute_units: int) -> int:
    """The split-K heuristic used when ``num_kv_splits`` is None.

    Split only batches of short query runs (``max_query_len <= 16``: decode rows, speculative chunks) whose
    ``num_programs`` real programs (query tiles that hold tokens, x KV heads; :func:`plan_launches` counts them
    without the grid's surplus) would leave the device short of work: aim for 4 resident programs per compute unit
    (``4 * compute_units``; the decode kernels' registers and shared memory allow 4 per H100 SM, which keeps ~4 x 3
    tiles of K/V loads in flight per SM), but give each split at least 256 keys of the longest context ``max_keys``
    and never more than :data:`MAX_KV_SPLITS`. Prefill-sized batches have the parallelism already (and their
    workspace would be large).
    """
    if max_query_len > _SPLIT_MAX_QUERY_LEN or num_programs >= _WAVES * compute_units:
        return 1
    by_device = -(-(_WAVES * compute_units) // max(1, num_programs))
    by_length = max(1, max_keys // _SPLIT_MIN_KEYS)
    return max(1, min(by_device, by_length, MAX_KV_SPLITS))


def _platform_of(device: torch.device) -> Platform:
    """The platform of tensors on ``device`` when the caller passed none: the CPU's, or the current CUDA GPU's
    (:meth:`kv8.platform.Platform.resolve` probes it on every call; the engine's backend passes its own)."""
    return CPU if device.type != "cuda" else Platform.resolve("cuda")


def _fail(msg: str) -> ValueError:
    return ValueError(f"unified_attention: {msg}")


def _check_index(name: str, t: object, ndim: int, device: torch.device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype not in _INDEX_DTYPES or t.ndim != ndim:
        got = f"{t.dtype} tensor of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise _fail(f"{name} must be a {ndim}-d int32 or int64 tensor, got {got}")
    if t.device != device:
        raise _fail(f"{name} is on {t.device}, query on {device}; all tensors must share one device")
    if t.ndim == 1 and t.numel() > 1 and t.stride(0) != 1:
        raise _fail(f"{name} must be contiguous, got stride {t.stride(0)}")
    return t


def _static_scale(name: str, s: object, num_kv_heads: int, head_dim: int, device: torch.device
                  ) -> tuple[torch.Tensor, bool]:
    """A static scale -> (contiguous float32 [Hkv, D] on ``device``, whether it varies along D)."""
    if not isinstance(s, torch.Tensor) or not s.dtype.is_floating_point:
        raise _fail(f"{name} must be a floating-point tensor broadcastable to [Hkv={num_kv_heads}, D={head_dim}], "
                    f"got {s.dtype if isinstance(s, torch.Tensor) else type(s).__name__}")
    try:
        full = torch.broadcast_to(s.to(device=device, dtype=torch.float32), (num_kv_heads, head_dim))
    except RuntimeError as exc:
        raise _fail(f"{name} of shape {tuple(s.shape)} does not broadcast to [Hkv={num_kv_heads}, D={head_dim}] "
                    f"(allowed: [1, 1], [Hkv, 1], [1, D], [Hkv, D])") from exc
    return full.contiguous(), s.ndim >= 1 and s.shape[-1] != 1


def _check_token_scales(name: str, s: object, cache_shape: torch.Size, device: torch.device) -> torch.Tensor:
    want = tuple(cache_shape[:3])
    if not isinstance(s, torch.Tensor) or s.dtype != torch.float32 or tuple(s.shape) != want:
        got = f"{s.dtype} tensor of shape {tuple(s.shape)}" if isinstance(s, torch.Tensor) else type(s).__name__
        raise _fail(f"{name} must be a float32 tensor of shape [num_blocks, Hkv, bs] = {list(want)}, got {got}")
    if s.device != device:
        raise _fail(f"{name} is on {s.device}, query on {device}; all tensors must share one device")
    return s


def _check_pair_scales(fmt: KernelFormat | None, v_fmt: KernelFormat | None, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, static: bool, k_token_scales: object, v_token_scales: object) -> None:
    """The scales of a cache whose K and V formats differ: no static ones (an FP8 side of a pair has dynamic
    scales); ``k_token_scales`` / ``v_token_scales`` exactly for a side of FP8 or per-token integer codes (a group or
    16/32-bit side keeps none). ``ValueError`` naming the argument, its value and what is allowed."""
    labels = [f.name if f is not None else str(c.dtype) for f, c in ((fmt, k_cache), (v_fmt, v_cache))]
    if static:
        raise _fail(f"k_scale/v_scale given for K {labels[0]} and V {labels[1]}; a cache of two formats takes no "
                    "static scales (an FP8 side has dynamic per-token scales: k_token_scales / v_token_scales)")
    for side, name, side_fmt, label, ts in (("K", "k_token_scales", fmt, labels[0], k_token_scales),
                                             ("V", "v_token_scales", v_fmt, labels[1], v_token_scales)):
        per_token = side_fmt is not None and not side_fmt.group_size
        if per_token and ts is None:
            raise _fail(f"{name}=None, but {side}'s {label} codes need a scale per token and head: pass a float32 "
                        "[num_blocks, Hkv, bs] tensor")
        if not per_token and ts is not None:
            kind = "keeps a scale per group in each row" if side_fmt is not None else "stores plain values"
            raise _fail(f"{name} given, but {side} ({label}) {kind}; allowed: {name}=None")


def unified_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, *,
                      query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                      max_query_len: int, max_seq_len: int, scale: float, sliding_window: int | None,
                      fp8: AnyLayout | None, v_fp8: AnyLayout | None | SameAsK = SAME_AS_K,
                      k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                      k_token_scales: torch.Tensor | None = None,
                      v_token_scales: torch.Tensor | None = None, num_kv_splits: int | None = None,
                      platform: Platform | None = None, min_query_len: int | None = None) -> torch.Tensor:
    """Paged attention of a mixed batch into ``out``; returns ``out``. query/out ``[T, Hq, D]`` (bfloat16, float16 or
    float32, same dtype; already in the stored basis); k_cache/v_cache ``[num_blocks, Hkv, bs, D]``: uint8 FP8 codes
    of format ``fp8`` (a :class:`kv8.quant.formats.FP8Format`), int8 codes with ``fp8``
    :data:`kv8.quant.formats.INT8`, uint8 bytes of two int4 codes (``[..., D / 2]``) with ``fp8``
    :data:`kv8.quant.formats.INT4`, uint8 rows of codes and their group scales with ``fp8``
    :data:`kv8.quant.int4_group.INT4_G32` or :data:`kv8.quant.fp4.FP4_E2M1` (module docstring), or
    bfloat16/float16/float32 values with ``fp8=None``; ``query_start_loc [B +
    1]``, ``seq_lens [B]``, ``block_tables [B, max_blocks]`` int32/int64 as
    :class:`kv8.attention.metadata.AttentionMetadata` describes them (with a window, table entries before a
    sequence's first needed block are never read). ``max_query_len`` / ``max_seq_len`` size the tiles and the split
    heuristic only (results do not depend on them). ``min_query_len``: the shortest run of new tokens among the
    sequences that have any, where the caller knows it (None: unknown); a batch it says has no decode rows makes no
    launch for them (:func:`plan_launches`). Unchecked against the tensors, like ``max_query_len``, but unlike it a
    promise: a sequence with fewer new tokens may be left unattended. FP8 needs either static
    ``k_scale``/``v_scale`` (broadcastable to ``[Hkv, D]``) or dynamic ``k_token_scales``/``v_token_scales``
    ``[num_blocks, Hkv, bs]`` float32; int8 and int4 need the dynamic ones; the group formats and a 16/32-bit cache
    take none. ``v_fp8``: V's format where it differs from K's (``fp8``), with the V cache of its own dtype and row
    width and each side's token scales, given exactly for a side of FP8 (dynamic) or per-token integer codes;
    default :data:`~kv8.kernels.triton.formats.SAME_AS_K`.
    ``num_kv_splits``: key segments per query tile (1 = no split-K; None = :func:`choose_num_kv_splits`).
    ``platform``: the device's facts (its native FP8 conversions, its compute units; :class:`kv8.platform.Platform`,
    resolved once by the engine); None resolves the tensors' device on each call. Output rows of tokens past
    ``query_start_loc[B]`` are left untouched. ``ValueError`` (before any launch) for a bad argument.
    """
    # ---- validation: shapes, dtypes, devices; nothing here reads a tensor's values (no host sync) ----
    if not isinstance(query, torch.Tensor) or query.dtype not in _QUERY_DTYPES or query.ndim != 3:
        raise _fail(f"query must be a [T, Hq, D] bfloat16/float16/float32 tensor, got "
                    f"{query.dtype if isinstance(query, torch.Tensor) else type(query).__name__}"
                    f"{' of shape ' + str(tuple(query.shape)) if isinstance(query, torch.Tensor) else ''}")
    device = query.device
    num_tokens, num_q_heads, head_dim = query.shape
    if not isinstance(out, torch.Tensor) or out.shape != query.shape or out.dtype != query.dtype \
            or out.device != device:
        raise _fail(f"out must match query ({tuple(query.shape)}, {query.dtype}, {device}), got "
                    + (f"({tuple(out.shape)}, {out.dtype}, {out.device})" if isinstance(out, torch.Tensor)
                       else type(out).__name__))
    if query.stride(-1) != 1 or out.stride(-1) != 1:
        raise _fail(f"query and out need a contiguous last dim, got strides {query.stride()} / {out.stride()}")
    if not 1 <= head_dim <= 256:
        raise _fail(f"head_dim={head_dim} is not supported; allowed 1 .. 256")
    try:
        fmt, v_fmt = side_formats(fp8, v_fp8)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    pair = v_fmt != fmt
    for name, c, side, arg, arg_name in (("k_cache", k_cache, fmt, fp8, "fp8"),
                                         ("v_cache", v_cache, v_fmt, fp8 if v_fp8 is SAME_AS_K else v_fp8, "v_fp8")):
        if not isinstance(c, torch.Tensor) or c.ndim != 4:
            raise _fail(f"{name} must be a [num_blocks, Hkv, bs, D] tensor, got "
                        f"{tuple(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__}")
        want = f"{code_dtype(side)} ({side.name} codes)" if side is not None else "bfloat16/float16/float32"
        ok = c.dtype == code_dtype(side) if side is not None else c.dtype in _QUERY_DTYPES
        if not ok:
            raise _fail(f"{name}.dtype={c.dtype} but {'fp8' if not pair else arg_name}="
                        f"{getattr(arg, 'name', None)!r} needs {want}")
        if c.device != device:
            raise _fail(f"{name} is on {c.device}, query on {device}; all tensors must share one device")
        if c.stride(-1) != 1:
            raise _fail(f"{name} needs a contiguous last dim, got strides {c.stride()}")
    if not pair and (k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype):
        raise _fail(f"k_cache {tuple(k_cache.shape)} {k_cache.dtype} and v_cache {tuple(v_cache.shape)} "
                    f"{v_cache.dtype} must match")
    if pair and k_cache.shape[:3] != v_cache.shape[:3]:
        raise _fail(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} must share [num_blocks, Hkv, "
                    "bs] (their row widths are their formats')")
    num_blocks, num_kv_heads, block_size, cache_dim = k_cache.shape
    for name, side, dim in (("k_cache", fmt, cache_dim), ("v_cache", v_fmt, v_cache.shape[3])):
        if side is not None and side.packed and head_dim % 2:
            raise _fail(f"an {side.name} cache packs two codes per byte: it needs an even head_dim, got {head_dim}")
        if side is not None and side.group_size and head_dim % side.head_dim_multiple:
            raise _fail(f"an {side.name} cache has a scale per group of {side.group_size} values: it needs a head_dim "
                        f"that is a multiple of {side.head_dim_multiple}, got {head_dim}")
        if dim != code_width(side, head_dim):
            raise _fail(("cache" if not pair else name) + f" row width={dim} != {code_width(side, head_dim)}, the "
                        + (f"bytes of query head_dim={head_dim} in two codes per byte"
                           if side is not None and side.packed else f"query head_dim={head_dim}")
                        + (f" and {scale_bytes(side)} per group of {side.group_size}'s scale"
                           if side is not None and side.group_size else ""))
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise _fail(f"query heads Hq={num_q_heads} must be a multiple of the cache's KV heads Hkv={num_kv_heads}")
    if block_size < 1:
        raise _fail(f"block_size={block_size} must be >= 1")
    _check_index("query_start_loc", query_start_loc, 1, device)
    _check_index("seq_lens", seq_lens, 1, device)
    _check_index("block_tables", block_tables, 2, device)
    num_seqs = seq_lens.shape[0]
    if query_start_loc.shape[0] != num_seqs + 1 or block_tables.shape[0] != num_seqs:
        raise _fail(f"query_start_loc has {query_start_loc.shape[0]} entries and block_tables "
                    f"{block_tables.shape[0]} rows, seq_lens {num_seqs}: need B + 1 and B")
    if block_tables.stride(-1) != 1:
        raise _fail(f"block_tables needs a contiguous last dim, got strides {block_tables.stride()}")
    try:   # the shared checks (kv8.validators), with this function's name in front
        check_int("max_query_len", max_query_len, 0)
        check_int("max_seq_len", max_seq_len, 0)
        check_number("scale", scale)
        check_int("sliding_window", sliding_window, 1, optional=True)   # None: full causal attention
        check_int("num_kv_splits", num_kv_splits, 1, MAX_KV_SPLITS, optional=True)   # None: the heuristic
        check_int("min_query_len", min_query_len, 0, max(max_query_len, 0), optional=True)   # None: unknown
    except ValueError as e:
        raise _fail(str(e)) from None

    static = k_scale is not None or v_scale is not None
    dynamic = k_token_scales is not None or v_token_scales is not None
    if pair:
        _check_pair_scales(fmt, v_fmt, k_cache, v_cache, static, k_token_scales, v_token_scales)
    elif fmt is None and (static or dynamic):
        raise _fail("scales were given for a 16/32-bit cache (fp8=None); such a cache stores plain values")
    elif fmt is not None and fmt.group_size:
        if static or dynamic:
            raise _fail(f"an {fmt.name} cache keeps a scale per group of {fmt.group_size} values in each row; it "
                        "takes no k_scale/v_scale or k_token_scales/v_token_scales")
    elif fmt is not None and fmt.int_codes and not (dynamic and not static):
        raise _fail(f"an {fmt.name} cache needs its dynamic k_token_scales and v_token_scales (a scale per token and "
                    "head; it has no static scales)" + (" (got static ones)" if static else ""))
    elif fmt is not None and static == dynamic:
        raise _fail("an FP8 cache needs exactly one kind of scales: static k_scale and v_scale, or dynamic "
                    "k_token_scales and v_token_scales" + (" (got both)" if static else " (got none)"))
    if static and (k_scale is None or v_scale is None) or dynamic and not pair and (k_token_scales is None
                                                                                    or v_token_scales is None):
        raise _fail("scales come in pairs: give both k_scale and v_scale, or both k_token_scales and v_token_scales")

    if not interpreter.INTERPRETED:
        try:
            check_compiled_packed_head_dim((fmt, v_fmt), head_dim)
        except ValueError as exc:
            raise _fail(str(exc)) from None
    if device.type != "cuda" and not interpreter.INTERPRETED:
        raise _fail(f"tensors on {device} need Triton's interpreter: set TRITON_INTERPRET=1 before "
                    "kv8.kernels.triton is imported (compiled kernels run on CUDA/ROCm devices)")

    launches = plan_launches(
        query, k_cache, v_cache, out, query_start_loc=query_start_loc, seq_lens=seq_lens, block_tables=block_tables,
        max_query_len=max_query_len, max_seq_len=max_seq_len, scale=scale, sliding_window=sliding_window, fp8=fp8,
        v_fp8=v_fp8, k_scale=k_scale, v_scale=v_scale, k_token_scales=k_token_scales, v_token_scales=v_token_scales,
        num_kv_splits=num_kv_splits, platform=platform or _platform_of(device), min_query_len=min_query_len)
    for launch in launches:
        launch.run()
    return out


def plan_launches(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor, *,
                  query_start_loc: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                  max_query_len: int, max_seq_len: int, scale: float, sliding_window: int | None,
                  fp8: AnyLayout | None, k_scale: torch.Tensor | None,
                  v_scale: torch.Tensor | None, k_token_scales: torch.Tensor | None,
                  v_token_scales: torch.Tensor | None,
                  num_kv_splits: int | None, platform: Platform, min_query_len: int | None = None,
                  v_fp8: AnyLayout | None | SameAsK = SAME_AS_K) -> list[Launch]:
    """The launches :func:`unified_attention` makes for these (already validated) arguments, in order, for the
    device ``platform`` describes (its native FP8 conversions: :func:`~kv8.kernels.triton.dequant.
    native_fp8_supported`; its compute units, for the split) -- so a compile check can build exactly these kernels
    for a GPU it does not have. Allocates the scales' float32 copies and the split workspace on ``query.device``;
    reads no tensor's values and no device property."""
    device = query.device
    num_tokens, num_q_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    num_seqs = seq_lens.shape[0]
    fmt, v_fmt = side_formats(fp8, v_fp8)
    native_fp8 = native_fp8_supported(platform, fmt)
    # the interpreter (a CPU platform) runs programs one after another: splitting only adds work there
    compute_units = platform.compute_units or 1
    static = k_scale is not None
    dynamic = k_token_scales is not None
    v_dynamic = v_token_scales is not None
    dummy = torch.empty(1, dtype=torch.float32, device=device)
    scales_mode, v_scales_mode, k_channel = SCALES_NONE, SCALES_NONE, False
    ks = vs = kts = vts = dummy
    if static:
        ks, k_channel = _static_scale("k_scale", k_scale, num_kv_heads, head_dim, device)
        vs, _ = _static_scale("v_scale", v_scale, num_kv_heads, head_dim, device)
        scales_mode = v_scales_mode = SCALES_STATIC
    if dynamic:   # per side: a cache of two formats may keep token scales for one of them only
        kts = _check_token_scales("k_token_scales", k_token_scales, k_cache.shape, device)
        scales_mode = SCALES_DYNAMIC
    if v_dynamic:
        vts = _check_token_scales("v_token_scales", v_token_scales, v_cache.shape, device)
        v_scales_mode = SCALES_DYNAMIC
    if num_tokens == 0 or num_seqs == 0:
        return []

    group = num_q_heads // num_kv_heads

    # a single-format cache: one claim for K and V rows; two formats: one per side (rows of their own widths, maybe
    # of different element sizes)
    pair = (v_fmt, v_cache.dtype) != (fmt, k_cache.dtype)
    if pair:
        row_align, v_row_align = row_alignment(k_cache), row_alignment(v_cache)
    else:
        row_align = v_row_align = row_alignment(k_cache, v_cache)

    def make_variant(query_len: int) -> KernelVariant:
        variant = KernelVariant(query.dtype, k_cache.dtype, fmt, native_fp8, scales_mode, k_channel,
                                sliding_window is not None, group, head_dim, block_size, query_len, row_align)
        if pair:   # V's own side; a single-format cache's variant leaves V's fields at K's
            variant = replace(variant, v_fp8=v_fmt, v_cache_dtype=v_cache.dtype,
                              v_native_fp8=native_fp8_supported(platform, v_fmt), v_scales=v_scales_mode,
                              v_row_align=v_row_align)
        return variant

    variant = make_variant(max_query_len)
    cfg = variant.config
    num_q_tiles = num_tokens // cfg.block_q + num_seqs
    if num_kv_splits is None:
        max_keys = max_seq_len if sliding_window is None else min(max_seq_len, sliding_window + max_query_len)
        # real tiles: a sequence of L <= max_query_len new tokens holds ceil(L / block_q) of them
        real_tiles = min(num_q_tiles, num_seqs * -(-max(1, max_query_len) // cfg.block_q))
        num_kv_splits = choose_num_kv_splits(real_tiles * num_kv_heads, max_query_len, max_keys, compute_units)
    if num_kv_splits > 1:
        part_acc = torch.empty(num_tokens, num_q_heads, num_kv_splits, cfg.d_pad, dtype=torch.float32, device=device)
        part_m = torch.empty(num_tokens, num_q_heads, num_kv_splits, dtype=torch.float32, device=device)
        part_l = torch.empty_like(part_m)
    else:
        part_acc = part_m = part_l = dummy
    args = (
        out, query, k_cache, v_cache,
        query_start_loc, seq_lens, block_tables,
        ks, vs, kts, vts,
        part_acc, part_m, part_l,
        num_seqs, num_q_heads, float(scale) * _LOG2E, sliding_window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        kts.stride(0) if dynamic else 0, kts.stride(1) if dynamic else 0, kts.stride(2) if dynamic else 0,
        vts.stride(0) if v_dynamic else 0, vts.stride(1) if v_dynamic else 0, vts.stride(2) if v_dynamic else 0,
        block_tables.stride(0),
    )

    # A mixed batch whose decode rows would get other tiles than its prefill chunks (launch_config) runs as two
    # launches over the same arguments: the decode launch's programs serve the sequences of at most decode_len new
    # tokens (a decode row, a short speculative run), the prefill launch's the others; each returns at once for
    # the other's sequences. The host reads no lengths: both grids cover the whole batch. A batch with no decode
    # rows (min_query_len > decode_len: a pure prefill batch) makes only the prefill launch -- the same kernel as a
    # mixed batch's; one with no prefill rows (max_query_len <= decode_len) only the decode-tiled one.
    decode_len = max(1, 16 // group)
    decode = make_variant(decode_len)
    if max_query_len > decode_len and decode.config != cfg:
        dcfg = decode.config
        launches = [
            Launch(_paged_attention_kernel, (num_tokens // dcfg.block_q + num_seqs, num_kv_heads, num_kv_splits),
                   args, dict(**decode.constexprs(num_kv_splits, q_len_max=decode_len), **dcfg.options)),
            Launch(_paged_attention_kernel, (num_q_tiles, num_kv_heads, num_kv_splits), args,
                   dict(**variant.constexprs(num_kv_splits, q_len_min=decode_len + 1), **cfg.options)),
        ]
        if min_query_len is not None and min_query_len > decode_len:
            launches = launches[1:]
    else:
        launches = [Launch(_paged_attention_kernel, (num_q_tiles, num_kv_heads, num_kv_splits), args,
                           dict(**variant.constexprs(num_kv_splits), **cfg.options))]
    if num_kv_splits > 1:
        launches.append(Launch(_merge_splits_kernel, (num_tokens, num_q_heads), (
            out, part_acc, part_m, part_l, query_start_loc,
            num_seqs, num_q_heads, out.stride(0), out.stride(1),
        ), dict(HEAD_DIM=head_dim, D_PAD=cfg.d_pad, NUM_SPLITS=num_kv_splits,
                SPLITS_PAD=max(2, triton.next_power_of_2(num_kv_splits)), num_warps=4)))
    return launches
