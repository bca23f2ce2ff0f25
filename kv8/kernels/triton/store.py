"""Quantize-on-store: new K/V of a batch -> their slots in the paged KV cache, in one Triton launch.

The reference is :meth:`kv8.cache.paged_cache.PagedKVCache.store` (through :meth:`kv8.cache.codec.KVCodec.encode`);
:func:`store_kv` writes the same bytes (and, with dynamic scales, the same float32 token scales)::

    key/value  [T, H, D]                      token t, KV head h
    slot_mapping[t] = s  (s < 0: skip t)      block b = s // bs, offset o = s % bs
    k_cache/v_cache [num_blocks, H, bs, W]    row [b, h, o, :] <- encode(key[t, h, :])   (W = D; int4: D / 2;
                                                                                      group formats: below)
    k/v_token_scales [num_blocks, H, bs]      [b, h, o] <- scale of (t, h)      (dynamic scales only)

The codes are FP8 (``uint8``; static or dynamic scales), int8 (``int8``; always dynamic scales: the
``int8_per_token_head`` cache) or int4 (two per ``uint8``, ``W = D / 2``; dynamic scales: ``int4_per_token_head``),
one ``FMT`` constexpr (a :class:`~kv8.kernels.triton.formats.KernelFormat`; ``FMT.int_codes`` and ``FMT.packed``
tell them apart). int4 codes are encoded as int8's (clamped to 7) on the whole ``[BLOCK_H, BLOCK_D]`` tile, then
each thread packs the channel pairs it holds (:func:`~kv8.kernels.triton.quant.pack_nibbles`) and stores
``BLOCK_D / 2`` bytes per head. ``int4_per_group32`` (``FMT.group_size`` 32; ``MODE`` 3, no scale arguments) is
int4 with a scale per 32 values instead of per head, stored in the row after the codes, ``W = D / 2 + 2 D / 32``:
the tile reshaped to ``[BLOCK_H, BLOCK_D / 32, 32]``, each group's float16 scale chosen by
:class:`kv8.quant.int4_group.Int4GroupFormat`'s search for the smallest squared error (16 candidates
``±f16(amax / c)``, ``c = 7 .. 8.75``, then one least-squares refit; ``_group_search``), the codes
``clamp(rne(x * (1 / scale)), -8, 7)``, a group with a NaN or an infinity or only zeros scale 1.0 and its values
rounded as they are, the scale's two bytes little-endian -- the format's encode, byte for byte. Its tile is at most
1024 elements (the search keeps more of it live; compiled for sm_90 that needs no register spills).

``fp4_e2m1`` (``MODE`` 3 with ``FMT.scale_format``, the E4M3 layout of its scales; no scale arguments) has 4-bit
float codes, two per byte as int4's, and one E4M3 scale code per 16 values after them, ``W = D / 2 + ceil(D / 16)``
(``D`` even; the last group shorter when ``D % 16 != 0``: its tile lanes past ``D`` are zeros, as the reference
pads it, and ``BLOCK_D`` is at least 16). :class:`kv8.quant.fp4.FP4GroupFormat`'s encode, byte for byte: each
group's ``s = div_rn(amax, 6)`` (1.0 where ``amax`` is not finite or ``s`` is 0: an all-zero group, or one so
small that the quotient underflows), clamped to ``[2^-9, 448]`` and encoded by the FP8 encode
(:func:`~kv8.kernels.triton.quant.encode_fp8` with ``FMT.scale_format``: nearest even), then decoded again
(:func:`~kv8.kernels.triton.dequant.decode_fp8_bits`, exact); the codes are
:func:`~kv8.kernels.triton.quant.encode_e2m1` of ``div_rn(x, s)`` (nearest even on the E2M1 grid, ties to the even
code, saturating at ±6, NaN -> +0, -0.0 -> code 8). No search: its tile takes up to 4096 elements, as the other
modes'.

K and V may be stored in different formats (``v_fp8``: ``kv_cache_dtype="k8v4"``, int8 K and int4_per_group32 V):
the kernel takes V's own ``V_MODE``, ``V_FMT`` and ``V_OUT`` constexprs beside K's (equal to K's for one format: the
same kernel as a single-format store), each side is encoded by its own format into a cache of its own dtype and
row width, and the tile (``BLOCK_H`` x ``BLOCK_D``) serves both: whole groups of either side's group format, at
most 1024 elements where either side searches int4_per_group32's scales.

    |<--------- block b: H tiles of bs x D --------->|
    | head 0: o=0 [D] o=1 [D] ... | head 1: ... | ... |

Program grid: ``(T, cdiv(H, BLOCK_H))``, one program per token and block of heads, K and V both. A token's
``[H, D]`` row is contiguous in ``key``/``value`` (coalesced loads), its slot is read once, each head's destination
is a contiguous ``D`` row of the cache, and a dynamic scale is a reduction over ``D`` inside one tile row -- no
communication between programs. ``BLOCK_D`` is ``D`` rounded up to a power of two (masked: D = 96 works),
``BLOCK_H`` covers all heads up to 4096 elements per tile, so usually one program per token (few programs also
keep the interpreter fast).

Bit-exactness (interpreter and compiled): the only float operations are IEEE ``div.rn`` divisions
(:func:`kv8.kernels.triton.quant.scaled_rn`) and fp16 <-> float32 conversions (``cvt``: exact widening, RNE
narrowing), and int8's rounding (an IEEE add and subtract, :func:`~kv8.kernels.triton.quant.encode_int8`), and
fp4_e2m1's scale decode (a half times ``2^8``: exact); the FP8 and E2M1 encodes, bf16 conversions, ``|x|``,
``amax`` and the NaN/inf tests are integer operations on the bit patterns.
A dynamic scale is ``div_rn(amax, max_finite)`` with ``amax`` the largest ``|x|`` bit pattern (NaN and inf sort
above every finite value): 1.0 where that pattern is not finite or the quotient is 0 -- the float32
arithmetic of :meth:`KVCodec.token_scales` on the CPU, where ``tensor / float`` is a true division. (On CUDA torch
turns a division by a Python float into a multiplication by its rounded reciprocal, so the reference run on CUDA
tensors can differ from this kernel in the last bit of a scale; the tests compute the reference on the CPU.) NaN
written to a 16/32-bit cache is a NaN, but its payload bits are not part of the contract (torch's own differ by
device and code path).

The group scale search also multiplies, subtracts and adds in float32 (``x * r``, ``x - q d``, the squares and the
products ``x q``, their sums): each an IEEE operation rounded once, as in the reference, because

* every sum of a group is the reference's tree (``Int4GroupFormat.tree_sum``: ``v[j] + v[j + 16]``, then 8, 4, 2,
  1 apart), built from reductions over axes of size 2 (``_tree_sum32``): a reduction's order (unspecified in
  Triton; numpy's in the interpreter) cannot change a sum of two;
* the group store is compiled with ``enable_fp_fusion=False`` (:func:`store_launch`; the other modes have no
  product to fuse): LLVM then emits ``mul.rn``/``add.rn``/``sub.rn``, which ptxas does not contract into an FMA
  either (``--fmad=false``), where a fused ``r * r + s`` would round once instead of twice (fp4_e2m1's store, in
  the same mode, has one product, the scale decode's exact ``half * 2^8``, and nothing to fuse it with);
* ``r = 1 / d`` and the refit's quotient are ``div.rn``, ``q d`` is exact (a 4-bit integer times a float16), and
  the rounding to an integer is the add and subtract of ``1.5 * 2^23``.

Not checked (the launch never synchronizes with the device, so it can be captured in a CUDA graph): slots lie in
``[0, num_blocks * bs)`` or are negative and are distinct; static scales are finite and > 0
(:class:`kv8.quant.scales.KVScales` guarantees it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kv8.kernels.triton import interpreter
from kv8.kernels.triton.dequant import decode_fp8_bits
from kv8.kernels.triton.formats import (
    SAME_AS_K,
    AnyLayout,
    KernelFormat,
    SameAsK,
    code_dtype,
    code_width,
    scale_bytes,
    side_formats,
)
from kv8.kernels.triton.interpreter import add_combine, max_combine
from kv8.kernels.triton.launch import Launch
from kv8.kernels.triton.quant import (
    bf16_bits_to_f32,
    encode_codes,
    encode_e2m1,
    encode_fp8,
    f32_to_bf16_bits,
    pack_nibbles,
    scaled_rn,
)

__all__ = ["CACHE_DTYPES", "INPUT_DTYPES", "store_kv", "store_launch"]

INPUT_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
CACHE_DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)  # 16/32-bit caches
_KIND = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}   # the IN/OUT constexprs
_MODE_CAST, _MODE_STATIC, _MODE_DYNAMIC, _MODE_GROUP = 0, 1, 2, 3
_MAX_TILE = 4096   # elements of one [BLOCK_H, BLOCK_D] tile
_MAX_GROUP_TILE = 1024   # .. for int4_per_group32, whose scale search keeps more of the tile live (no spills)


@triton.jit
def _load_f32(ptrs, mask, IN: tl.constexpr):
    """Values at ``ptrs`` widened to float32 exactly (bf16 through its bits)."""
    if IN == 2:
        x = bf16_bits_to_f32(tl.load(ptrs, mask=mask, other=0.0))
    else:
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    return x


# ---- int4_per_group32: the search for each group's scale (kv8.quant.int4_group's module docstring) -------------

@triton.jit
def _tree_sum32(v):
    """``[R, G, 32]`` float32 -> ``[R, G]``: the sum of each group in :meth:`Int4GroupFormat.tree_sum`'s order,
    ``v[j] + v[j + 16]``, then 8, 4, 2, 1 apart. Each step is a (row-major) reshape that puts the two addends of a
    sum on an axis of size 2 and a reduction over that axis: a sum of two values, whatever order a backend or the
    interpreter reduces in, so every addition rounds the same pair as the reference's."""
    tl.static_assert(v.shape[2] == 32, "the group search sums groups of 32")
    R: tl.constexpr = v.shape[0]
    G: tl.constexpr = v.shape[1]
    v = tl.reduce(tl.reshape(v, [R, G, 2, 16]), 2, add_combine)
    v = tl.reduce(tl.reshape(v, [R, G, 2, 8]), 2, add_combine)
    v = tl.reduce(tl.reshape(v, [R, G, 2, 4]), 2, add_combine)
    v = tl.reduce(tl.reshape(v, [R, G, 2, 2]), 2, add_combine)
    return tl.reduce(v, 2, add_combine)


@triton.jit
def _reciprocal(d):
    """``1 / d`` per group, one IEEE division (``div.rn``): what the codes multiply by."""
    return tl.math.div_rn(tl.full(d.shape, 1.0, tl.float32), d)


@triton.jit
def _rne_int4(y):
    """float32 ``y`` (not NaN) -> ``clamp(round_half_even(y), -8, 7)`` as float32: the clamp, then the add and
    subtract of ``1.5 * 2^23`` that :func:`~kv8.kernels.triton.quant.encode_int8` rounds with."""
    y = tl.minimum(tl.maximum(y, -8.0), 7.0)
    return (y + 12582912.0) - 12582912.0


@triton.jit
def _int4_codes(y):
    """float32 ``y`` -> ``int32`` codes ``clamp(round_half_even(y), -8, 7)``, NaN -> 0, ``+inf`` -> 7, ``-inf``
    -> -8 (:meth:`Int4GroupFormat.encode_int4`)."""
    is_nan = (y.to(tl.int32, bitcast=True) & 0x7FFFFFFF) > 0x7F800000
    return _rne_int4(tl.where(is_nan, 0.0, y)).to(tl.int32)


@triton.jit
def _group_error(xs, d):
    """Squared error ``[R, G]`` of finite groups ``xs [R, G, 32]`` coded with scales ``d [R, G]`` (nonzero
    float16 values): ``tsum((x - q d)^2)``, ``q = clamp(rne(x * (1 / d)), -8, 7)``. ``q d`` is exact (a 4-bit
    integer times a float16); the kernel is compiled without FMA contraction (:func:`store_launch`), so ``x * r``
    and every square round once, as in the reference."""
    q = _rne_int4(xs * _reciprocal(d)[:, :, None])
    e = xs - q * d[:, :, None]
    return _tree_sum32(e * e)


@triton.jit
def _f16_magnitude(v, SMIN: tl.constexpr, SMAX: tl.constexpr):
    """float32 ``v >= 0`` clamped to ``[SMIN, SMAX]`` (float16's smallest subnormal, largest value) and rounded to
    float16 (``cvt.rn``, nearest even), back in float32: :meth:`Int4GroupFormat.encode_scale` of a magnitude."""
    return tl.minimum(tl.maximum(v, SMIN), SMAX).to(tl.float16).to(tl.float32)


@triton.jit
def _group_search(xs, amax, C0: tl.constexpr, SMIN: tl.constexpr, SMAX: tl.constexpr):
    """Each group's scale ``[R, G]`` (float16 values in float32, nonzero, either sign) for finite groups
    ``xs [R, G, 32]`` with ``amax [R, G] > 0`` their largest ``|x|``: :meth:`Int4GroupFormat.group_codes`'s search.

    The candidates ``±f16(amax / c)``, ``c = C0, C0 + 0.25, .., C0 + 1.75`` (``C0`` the format's ``max_finite``, 7:
    the first candidate is the symmetric rule; ``div.rn``), ``+`` then ``-``, the first smallest
    error kept (``<``); then the least-squares refit ``f16(tsum(x q) / tsum(q q))`` (sign kept, magnitude clamped),
    taken if its error is smaller. The codes ``q`` of the winner are recomputed rather than carried through the
    loop (the same operations give the same codes). ``best_e`` starts at ``+inf`` and ``best_d`` at the first
    candidate: a first candidate whose error is finite replaces them, one whose error overflowed to ``inf`` leaves
    the same state -- the reference's."""
    best_d = _f16_magnitude(tl.math.div_rn(amax, C0), SMIN, SMAX)
    best_e = tl.full(amax.shape, float("inf"), tl.float32)
    for k in range(8):
        mag = _f16_magnitude(tl.math.div_rn(amax, C0 + 0.25 * k), SMIN, SMAX)
        e = _group_error(xs, mag)
        take = e < best_e
        best_d = tl.where(take, mag, best_d)
        best_e = tl.where(take, e, best_e)
        e = _group_error(xs, -mag)
        take = e < best_e
        best_d = tl.where(take, -mag, best_d)
        best_e = tl.where(take, e, best_e)
    q = _rne_int4(xs * _reciprocal(best_d)[:, :, None])
    den = _tree_sum32(q * q)                                          # an exact integer, < 2^12
    fit = tl.math.div_rn(_tree_sum32(xs * q), tl.where(den > 0.0, den, 1.0))
    fit_ok = (den > 0.0) & ((fit.to(tl.int32, bitcast=True) & 0x7FFFFFFF) < 0x7F800000) & (fit != 0.0)
    mag = _f16_magnitude(tl.abs(fit), SMIN, SMAX)
    d2 = tl.where(fit_ok, tl.where(fit < 0.0, -mag, mag), best_d)
    return tl.where(fit_ok & (_group_error(xs, d2) < best_e), d2, best_d)


@triton.jit
def _store_one(x_ptr, stride_xt, stride_xh, c_ptr, stride_cb, stride_ch, stride_cs,
               scale_ptr, stride_sh, stride_sd, ts_ptr, stride_tb, stride_th, stride_ts,
               t, block, off, heads, dims, h_end, D, max_finite,
               MODE: tl.constexpr, FMT: tl.constexpr, IN: tl.constexpr, OUT: tl.constexpr, BLOCK_D: tl.constexpr):
    """Store token ``t``'s rows ``heads`` x ``dims`` of one of K/V into cache row ``[block, heads, off, dims]``
    (packed 4-bit codes: bytes ``dims / 2``); heads from ``h_end`` on are left alone."""
    hmask = heads < h_end
    mask = hmask[:, None] & (dims < D)[None, :]
    src = x_ptr + t * stride_xt + heads[:, None] * stride_xh + dims[None, :]
    dst = c_ptr + block * stride_cb + heads[:, None] * stride_ch + off * stride_cs + dims[None, :]
    if MODE == 0:   # 16/32-bit cache: a plain cast (round to nearest even), or a copy of the bits
        if IN == OUT:
            tl.store(dst, tl.load(src, mask=mask), mask=mask)
        elif OUT == 2:
            bits = f32_to_bf16_bits(_load_f32(src, mask, IN))
            tl.store(dst, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
        elif OUT == 1:
            tl.store(dst, _load_f32(src, mask, IN).to(tl.float16), mask=mask)
        else:
            tl.store(dst, _load_f32(src, mask, IN), mask=mask)
    elif MODE == 3:   # a scale per FMT.group_size values, stored after the row's D / 2 bytes of 4-bit codes
        GS: tl.constexpr = FMT.group_size
        NG: tl.constexpr = BLOCK_D // GS
        x = _load_f32(src, mask, IN)                                  # [BLOCK_H, BLOCK_D], 0 where masked
        xg = tl.reshape(x, [x.shape[0], NG, GS])                      # [BLOCK_H, NG, GS]
        amax = tl.reduce(xg.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 2, max_combine)    # [BLOCK_H, NG] bits
        nib = tl.arange(0, BLOCK_D // 2)
        row = c_ptr + block * stride_cb + heads[:, None] * stride_ch + off * stride_cs
        if FMT.scale_format is not None:
            # fp4_e2m1: 4-bit float codes, an FP8 scale code (E4M3) per group; the last group maybe shorter (its
            # tile lanes past D are zeros, as the reference pads it)
            SCALE_FMT: tl.constexpr = FMT.scale_format
            s = tl.math.div_rn(amax.to(tl.float32, bitcast=True), FMT.max_finite)         # amax / 6
            s = tl.where((amax < 0x7F800000) & (s > 0.0), s, 1.0)    # zero (or underflowed) / non-finite: 1.0
            s_code = encode_fp8(tl.minimum(tl.maximum(s, FMT.group_scale_min), FMT.group_scale_max), SCALE_FMT)
            s_val = decode_fp8_bits(s_code, SCALE_FMT, tl.float32)    # the scale the codes divide by, exact
            codes = encode_e2m1(tl.math.div_rn(xg, s_val[:, :, None]), FMT)             # x / 1.0 = x where 1.0
            tl.store(row + nib[None, :], pack_nibbles(tl.reshape(codes, [x.shape[0], BLOCK_D])),
                     mask=hmask[:, None] & (nib < D // 2)[None, :])
            g = tl.arange(0, NG)
            tl.store(row + D // 2 + g[None, :], s_code, mask=hmask[:, None] & (g < (D + GS - 1) // GS)[None, :])
        else:
            # int4_per_group32: int4 codes, a float16 scale per group chosen by the search
            ok = (amax < 0x7F800000) & (amax > 0)                     # finite and not all zeros
            xs = tl.where(ok[:, :, None], xg, 0.0)                    # what the search sees
            d = _group_search(xs, tl.where(ok, amax.to(tl.float32, bitcast=True), 1.0), FMT.max_finite,
                              FMT.group_scale_min, FMT.group_scale_max)
            d = tl.where(ok, d, 1.0)                                  # [BLOCK_H, NG] float16 values, nonzero
            gs16 = d.to(tl.float16)                                   # exact
            codes = _int4_codes(xg * _reciprocal(d)[:, :, None])      # x * 1.0 = x where not ok: NaN, inf as is
            tl.store(row + nib[None, :], pack_nibbles(tl.reshape(codes, [x.shape[0], BLOCK_D])),
                     mask=hmask[:, None] & (nib < D // 2)[None, :])
            bits = gs16.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF              # little-endian bytes
            f16_bytes = tl.reshape(tl.join(bits & 0xFF, bits >> 8), [x.shape[0], 2 * NG]).to(tl.uint8)
            sb = tl.arange(0, 2 * NG)
            tl.store(row + D // 2 + sb[None, :], f16_bytes, mask=hmask[:, None] & (sb < 2 * (D // GS))[None, :])
    else:
        x = _load_f32(src, mask, IN)                                  # [BLOCK_H, BLOCK_D], 0 where masked
        if MODE == 1:   # static scales, [H, D] through (maybe zero) strides
            s = tl.load(scale_ptr + heads[:, None] * stride_sh + dims[None, :] * stride_sd, mask=mask, other=1.0)
            y = scaled_rn(x, s)
        else:           # dynamic: one scale per (token, head), = KVCodec.token_scales
            # [BLOCK_H] largest |x| bit pattern (tl.reduce with kv8's combine: kv8.kernels.triton.interpreter)
            amax = tl.reduce(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 1, max_combine)
            ts = tl.math.div_rn(amax.to(tl.float32, bitcast=True), max_finite)
            ts = tl.where((amax < 0x7F800000) & (ts > 0.0), ts, 1.0)
            tl.store(ts_ptr + block * stride_tb + heads * stride_th + off * stride_ts, ts, mask=hmask)
            y = scaled_rn(x, ts[:, None])
        if FMT.packed:   # int4: two codes per byte, the row's D / 2 bytes
            nib = tl.arange(0, BLOCK_D // 2)
            dst = c_ptr + block * stride_cb + heads[:, None] * stride_ch + off * stride_cs + nib[None, :]
            tl.store(dst, pack_nibbles(encode_codes(y, FMT)), mask=hmask[:, None] & (nib < D // 2)[None, :])
        else:
            tl.store(dst, encode_codes(y, FMT), mask=mask)   # FP8 or int8 codes, by FMT.int_codes


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     k_scale_ptr, v_scale_ptr, k_ts_ptr, v_ts_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_kcb, stride_kch, stride_kcs, stride_vcb, stride_vch, stride_vcs,
                     stride_ksh, stride_ksd, stride_vsh, stride_vsd,
                     stride_ktb, stride_kth, stride_kts, stride_vtb, stride_vth, stride_vts,
                     H, D, block_size, max_finite,
                     MODE: tl.constexpr, FMT: tl.constexpr, IN: tl.constexpr, OUT: tl.constexpr,
                     BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                     V_MODE: tl.constexpr, V_FMT: tl.constexpr, V_OUT: tl.constexpr):
    """Program (t, hb): token t, heads [hb * BLOCK_H, (hb + 1) * BLOCK_H), K (``MODE``, ``FMT``, ``OUT``) then V
    (``V_MODE``, ``V_FMT``, ``V_OUT``: K's for a single-format cache). ``max_finite`` is K's format's; V's dynamic
    scales divide by it too where V's format is K's (the same kernel as a single-format store), else by V's own
    (a constant of ``V_FMT``)."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    slot = tl.load(slot_ptr + t)
    # negative slot: a padding row, no head is written. (Folded into the heads' bound: a scalar comparison ANDed
    # with a block fails in Triton 3.9's interpreter, "mask has unsupported dtype".)
    h_end = tl.where(slot >= 0, H, 0)
    slot = tl.maximum(slot, 0)
    block = slot // block_size
    off = slot % block_size
    _store_one(key_ptr, stride_kt, stride_kh, k_cache_ptr, stride_kcb, stride_kch, stride_kcs,
               k_scale_ptr, stride_ksh, stride_ksd, k_ts_ptr, stride_ktb, stride_kth, stride_kts,
               t, block, off, heads, dims, h_end, D, max_finite, MODE, FMT, IN, OUT, BLOCK_D)
    if V_FMT == FMT:
        v_max_finite = max_finite
    elif V_FMT is None:
        v_max_finite = max_finite               # a 16/32-bit V side: a plain cast, no scale
    else:
        v_max_finite = V_FMT.max_finite
    _store_one(value_ptr, stride_vt, stride_vh, v_cache_ptr, stride_vcb, stride_vch, stride_vcs,
               v_scale_ptr, stride_vsh, stride_vsd, v_ts_ptr, stride_vtb, stride_vth, stride_vts,
               t, block, off, heads, dims, h_end, D, v_max_finite, V_MODE, V_FMT, IN, V_OUT, BLOCK_D)


def _describe(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"a {t.dtype} tensor of shape {list(t.shape)} on {t.device}"
    return f"a {type(t).__name__}"


def _check_tensor(name: str, t: object, ndim: int, dtypes: tuple[torch.dtype, ...], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.ndim != ndim or t.dtype not in dtypes or t.device != device:
        raise ValueError(f"store_kv: {name} must be a {ndim}-D tensor of dtype {' or '.join(map(str, dtypes))} on "
                         f"{device}; got {_describe(t)}")


def _check_last_contiguous(name: str, t: torch.Tensor) -> None:
    if t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"store_kv: {name}'s last dim must be contiguous (stride 1), got strides {t.stride()}; "
                         "pass a .contiguous() tensor")


def store_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, *, fp8: AnyLayout | None, v_fp8: AnyLayout | None | SameAsK = SAME_AS_K,
             k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
             k_token_scales: torch.Tensor | None = None, v_token_scales: torch.Tensor | None = None) -> None:
    """Write ``key``/``value`` ``[T, H, D]`` (stored basis) into their slots of ``k_cache``/``v_cache``.

    * ``key``, ``value``: bf16/fp16/fp32, one dtype, any strides with a contiguous last dim.
    * ``k_cache``, ``v_cache``: ``[num_blocks, H, bs, D]`` (views as :meth:`PagedKVCache.layer` returns), one dtype:
      ``uint8`` codes when ``fp8`` is an FP8 format (a :class:`kv8.quant.formats.FP8Format`), ``int8`` codes when it
      is :data:`kv8.quant.formats.INT8`, else bf16/fp16/fp32 (``fp8=None``: a plain cast, round to nearest even).
    * ``slot_mapping``: ``[T]`` int64; token ``t`` goes to block ``s // bs``, offset ``s % bs``; ``s < 0`` skips it
      (its bytes and scales stay as they were).
    * FP8, static scales: ``k_scale``, ``v_scale`` float32, broadcastable to ``[H, D]`` (``[1, 1]``, ``[H, 1]``,
      ``[1, D]``, ``[H, D]``); codes equal ``quantize(x, scale, fmt)``.
    * FP8, dynamic scales: ``k_token_scales``, ``v_token_scales`` ``[num_blocks, H, bs]`` float32 (views as
      :meth:`PagedKVCache.layer_token_scales` returns) receive each (token, head)'s scale, as
      :meth:`KVCodec.token_scales` computes it, and the codes are ``quantize(x, scale, fmt)``.
    * int8 (``fp8`` an integer format): dynamic scales as for FP8 (the only kind an int8 cache has), ``amax /
      max_finite`` (127).
    * int4 (``fp8`` :data:`kv8.quant.formats.INT4`): the same with 7, two codes per ``uint8`` (``k_cache`` /
      ``v_cache`` ``[num_blocks, H, bs, D / 2]``; ``D`` even), as :func:`kv8.quant.formats.pack_int4` packs them.
    * int4_per_group32 (``fp8`` :data:`kv8.quant.int4_group.INT4_G32`): no scale arguments; rows of ``D / 2`` code
      bytes and a float16 scale per 32 values (``[num_blocks, H, bs, D / 2 + 2 D / 32]``; ``D`` a multiple of 32),
      as :meth:`Int4GroupFormat.encode` writes them.
    * fp4_e2m1 (``fp8`` :data:`kv8.quant.fp4.FP4_E2M1`): no scale arguments; rows of ``D / 2`` bytes of two E2M1
      codes and an E4M3 scale code per 16 values, the last group shorter when ``D % 16 != 0`` (``[num_blocks, H,
      bs, D / 2 + ceil(D / 16)]``; ``D`` even), as :meth:`FP4GroupFormat.encode` writes them.

    * K and V in different formats (``v_fp8`` V's, ``fp8`` K's; default :data:`~kv8.kernels.triton.formats.
      SAME_AS_K`: one format): each side as above by its own format, ``k_cache`` and ``v_cache`` each of its own
      dtype and row width (int8 K: ``D`` int8 codes; int4_per_group32 V: ``D / 2 + D / 16`` bytes; bfloat16 V:
      ``D`` values), same ``[num_blocks, H, bs]``; a side of FP8 or per-token integer codes takes its token scales
      (an FP8 side of a pair has dynamic scales), a group or 16/32-bit side none (``k_token_scales`` given with
      ``v_token_scales=None``, or the other way round); no static scales.

    All tensors on one device: CUDA, or the CPU when the kernels run in Triton's interpreter. ``ValueError`` names
    the argument, what it was and what is allowed.
    """
    # ---- validate (no device synchronization) ------------------------------------------------------------------
    if not isinstance(key, torch.Tensor):
        raise ValueError(f"store_kv: key must be a [T, H, D] tensor, got {_describe(key)}")
    device = key.device
    if device.type == "cpu" and not interpreter.INTERPRETED:
        raise ValueError("store_kv: CPU tensors need Triton's interpreter: set TRITON_INTERPRET=1 before "
                         "kv8.kernels.triton is imported (or pass CUDA tensors)")
    _check_tensor("key", key, 3, INPUT_DTYPES, device)
    _check_tensor("value", value, 3, (key.dtype,), device)
    if value.shape != key.shape:
        raise ValueError(f"store_kv: value has shape {list(value.shape)}, key {list(key.shape)}: they must be equal")
    num_tokens, num_heads, head_dim = key.shape
    try:
        fmt, v_fmt = side_formats(fp8, v_fp8)
    except ValueError as exc:
        raise ValueError(f"store_kv: {exc}") from None
    pair = v_fmt != fmt
    cache_dtypes = CACHE_DTYPES if fmt is None else (code_dtype(fmt),)
    _check_tensor("k_cache", k_cache, 4, cache_dtypes, device)
    v_dtypes = ((CACHE_DTYPES if v_fmt is None else (code_dtype(v_fmt),)) if pair else (k_cache.dtype,))
    _check_tensor("v_cache", v_cache, 4, v_dtypes, device)
    for side in dict.fromkeys((fmt, v_fmt)):   # each distinct format once
        if side is not None and side.packed and head_dim % 2:
            raise ValueError(f"store_kv: an {side.name} cache packs two codes per byte: key/value need an even head "
                             f"dim, got {list(key.shape)}")
        if side is not None and side.group_size and head_dim % side.head_dim_multiple:
            raise ValueError(f"store_kv: an {side.name} cache has a scale per group of {side.group_size} values: "
                             f"key/value need a head dim that is a multiple of {side.head_dim_multiple}, got "
                             f"{list(key.shape)}")
    num_blocks, cache_heads, block_size, cache_dim = k_cache.shape
    width = code_width(fmt, head_dim)
    if not pair and ((cache_heads, cache_dim) != (num_heads, width) or v_cache.shape != k_cache.shape):
        raise ValueError(f"store_kv: k_cache {list(k_cache.shape)} and v_cache {list(v_cache.shape)} must both be "
                         f"[num_blocks, H={num_heads}, block_size, {_width_text(fmt, head_dim)}] for key/value "
                         f"{list(key.shape)}")
    for name, c, side in (("k_cache", k_cache, fmt), ("v_cache", v_cache, v_fmt)):
        want = [num_blocks, num_heads, block_size, code_width(side, head_dim)]
        if pair and list(c.shape) != want:
            raise ValueError(f"store_kv: {name} has shape {list(c.shape)}, must be [num_blocks, H={num_heads}, "
                             f"block_size, {_width_text(side, head_dim)}] = {want} for key/value {list(key.shape)} "
                             f"(K {_label(fmt, k_cache)}, V {_label(v_fmt, v_cache)})")
    for name, t in (("key", key), ("value", value), ("k_cache", k_cache), ("v_cache", v_cache)):
        _check_last_contiguous(name, t)
    _check_tensor("slot_mapping", slot_mapping, 1, (torch.int64,), device)
    if slot_mapping.shape[0] != num_tokens:
        raise ValueError(f"store_kv: slot_mapping has {slot_mapping.shape[0]} entries for {num_tokens} tokens")

    if pair:
        k_mode, v_mode = _pair_modes(fmt, v_fmt, k_cache, v_cache, k_scale, v_scale, k_token_scales, v_token_scales)
    else:
        k_mode = v_mode = _single_mode(fmt, k_cache, k_scale, v_scale, k_token_scales, v_token_scales)

    k_sc = v_sc = k_ts = v_ts = slot_mapping   # placeholders for pointers the mode does not read
    ks_strides: tuple[int, ...] = (0, 0)
    vs_strides: tuple[int, ...] = (0, 0)
    kt_strides: tuple[int, ...] = (0, 0, 0)
    vt_strides: tuple[int, ...] = (0, 0, 0)
    if k_mode == _MODE_STATIC:   # static scales: a single FP8 format, both sides
        k_sc, ks_strides = _scale_view("k_scale", k_scale, num_heads, head_dim, device)
        v_sc, vs_strides = _scale_view("v_scale", v_scale, num_heads, head_dim, device)
    want_ts = (num_blocks, num_heads, block_size)
    if k_mode == _MODE_DYNAMIC:
        k_ts = _token_scales("k_token_scales", k_token_scales, want_ts, device)
        kt_strides = k_ts.stride()
    if v_mode == _MODE_DYNAMIC:
        v_ts = _token_scales("v_token_scales", v_token_scales, want_ts, device)
        vt_strides = v_ts.stride()

    if num_tokens == 0:
        return
    store_launch(key, value, k_cache, v_cache, slot_mapping, k_sc, v_sc, k_ts, v_ts, (*ks_strides, *vs_strides),
                 (*kt_strides, *vt_strides), mode=k_mode, fmt=fmt, v_mode=v_mode, v_fmt=v_fmt).run()


def _width_text(fmt: KernelFormat | None, head_dim: int) -> str:
    """The last dim of a cache row of ``fmt`` as the shape errors name it."""
    width = code_width(fmt, head_dim)
    return (f"D={head_dim}" if fmt is None or width == head_dim else
            f"W={width} (D / 2 bytes)" if not fmt.group_size else
            f"W={width} (D / 2 bytes of codes, {scale_bytes(fmt)} per group's scale)")


def _label(fmt: KernelFormat | None, cache: torch.Tensor) -> str:
    """A side's format as the errors name it: its code format, or the dtype of a 16/32-bit side."""
    return fmt.name if fmt is not None else str(cache.dtype)


def _single_mode(fmt: KernelFormat | None, k_cache: torch.Tensor, k_scale: torch.Tensor | None,
                 v_scale: torch.Tensor | None, k_token_scales: torch.Tensor | None,
                 v_token_scales: torch.Tensor | None) -> int:
    """The store's mode for K and V of one format, from the scales given (``ValueError`` naming them)."""
    given = [n for n, t in zip(("k_scale", "v_scale", "k_token_scales", "v_token_scales"),
                               (k_scale, v_scale, k_token_scales, v_token_scales)) if t is not None]
    if fmt is None:
        if given:
            raise ValueError(f"store_kv: {', '.join(given)} given for a {k_cache.dtype} cache (fp8=None); "
                             "scales exist only for FP8 and integer caches")
        return _MODE_CAST
    if fmt.group_size:
        if given:
            raise ValueError(f"store_kv: an {fmt.name} cache keeps a scale per group of {fmt.group_size} values in "
                             f"each row; it takes no {', '.join(given)}")
        return _MODE_GROUP
    if fmt.int_codes and sorted(given) != ["k_token_scales", "v_token_scales"]:
        raise ValueError(f"store_kv: an {fmt.name} cache needs k_token_scales and v_token_scales (a scale per "
                         f"token and head; it has no static scales); got {given or 'none'}")
    if sorted(given) == ["k_scale", "v_scale"]:
        return _MODE_STATIC
    if sorted(given) == ["k_token_scales", "v_token_scales"]:
        return _MODE_DYNAMIC
    raise ValueError(f"store_kv: an FP8 cache needs either k_scale and v_scale (static scales) or "
                     f"k_token_scales and v_token_scales (dynamic scales); got {given or 'none'}")


def _pair_modes(fmt: KernelFormat | None, v_fmt: KernelFormat | None, k_cache: torch.Tensor,
                v_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None,
                k_token_scales: torch.Tensor | None, v_token_scales: torch.Tensor | None) -> tuple[int, int]:
    """K's and V's store modes when their formats differ: a side of FP8 or per-token integer codes takes its
    dynamic token scales (``k_token_scales`` / ``v_token_scales``), a group or 16/32-bit side none; static scales
    belong to single-format FP8 caches only. ``ValueError`` naming the argument, its value and what is allowed."""
    static = [n for n, t in (("k_scale", k_scale), ("v_scale", v_scale)) if t is not None]
    if static:
        raise ValueError(f"store_kv: {', '.join(static)} given for K {_label(fmt, k_cache)} and V "
                         f"{_label(v_fmt, v_cache)}; a cache of two formats takes no static scales (an FP8 side "
                         "has dynamic per-token scales: k_token_scales / v_token_scales)")
    modes = []
    for side, name, side_fmt, cache, ts in (("K", "k_token_scales", fmt, k_cache, k_token_scales),
                                             ("V", "v_token_scales", v_fmt, v_cache, v_token_scales)):
        per_token = side_fmt is not None and not side_fmt.group_size
        if per_token and ts is None:
            raise ValueError(f"store_kv: {name}=None, but {side}'s {side_fmt.name} codes need a scale per token "  # type: ignore[union-attr]
                             f"and head: pass a float32 [num_blocks, H, block_size] tensor")
        if not per_token and ts is not None:
            kind = ("keeps a scale per group in each row" if side_fmt is not None else "stores plain values")
            raise ValueError(f"store_kv: {name} given, but {side} ({_label(side_fmt, cache)}) {kind}; allowed: "
                             f"{name}=None")
        modes.append(_MODE_DYNAMIC if per_token else _MODE_GROUP if side_fmt is not None else _MODE_CAST)
    return modes[0], modes[1]


def store_launch(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor,
                 k_token_scales: torch.Tensor, v_token_scales: torch.Tensor, scale_strides: tuple[int, ...],
                 token_scale_strides: tuple[int, ...], *, mode: int, fmt: KernelFormat | None,
                 v_mode: int | None = None, v_fmt: KernelFormat | None | SameAsK = SAME_AS_K) -> Launch:
    """The one launch :func:`store_kv` makes for its validated arguments (unused scale pointers are placeholders,
    their strides 0; ``fmt`` None for a 16/32-bit cache; ``v_mode`` / ``v_fmt`` V's where it differs from K's,
    default K's), as a value a compile check can build for a GPU it does not have. The tile (``BLOCK_H`` x
    ``BLOCK_D``) and the warps serve both sides: whole groups of either side's group format, the smaller tile of
    int4_per_group32's search where either side searches."""
    v_mode = mode if v_mode is None else v_mode
    v_fmt = fmt if v_fmt is SAME_AS_K else v_fmt
    num_tokens, num_heads, head_dim = key.shape
    block_size = k_cache.shape[2]
    block_d = triton.next_power_of_2(head_dim)
    for side in (fmt, v_fmt):
        if side is not None and side.group_size:
            block_d = max(block_d, side.group_size)   # whole groups in the tile (fp4_e2m1's D = 8: one group of 16)
    searched = any(m == _MODE_GROUP and f is not None and f.scale_format is None for m, f in ((mode, fmt),
                                                                                              (v_mode, v_fmt)))
    block_h = min(triton.next_power_of_2(num_heads), max(1, (_MAX_GROUP_TILE if searched else _MAX_TILE) // block_d))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    return Launch(_store_kv_kernel, grid, (
        key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale, k_token_scales, v_token_scales,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        *scale_strides, *token_scale_strides,
        num_heads, head_dim, block_size, 1.0 if fmt is None else fmt.max_finite,
    ), dict(MODE=mode, FMT=fmt, IN=_KIND[key.dtype], OUT=_KIND.get(k_cache.dtype, 0),
            BLOCK_H=block_h, BLOCK_D=block_d, num_warps=4 if block_h * block_d >= 1024 else 2,
            V_MODE=v_mode, V_FMT=v_fmt, V_OUT=_KIND.get(v_cache.dtype, 0),
            **_compile_options(mode, v_mode)))


def _compile_options(mode: int, v_mode: int) -> dict[str, object]:
    """Compile options of a store launch of K's ``mode`` and V's ``v_mode`` beyond its warps:
    ``enable_fp_fusion=False`` where either side is a group store (int4_per_group32's squares and products must
    each round once, as the reference's: no FMA; module docstring; fp4_e2m1 has nothing to fuse either way), none
    otherwise (no float product there to fuse)."""
    return {"enable_fp_fusion": False} if _MODE_GROUP in (mode, v_mode) else {}


def _scale_view(name: str, scale: torch.Tensor | None, num_heads: int, head_dim: int,
                device: torch.device) -> tuple[torch.Tensor, tuple[int, ...]]:
    """A static scale as an ``[H, D]`` view (zero strides where it broadcasts; no copy) and its strides."""
    if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.device != device:
        raise ValueError(f"store_kv: {name} must be a float32 tensor on {device} broadcastable to [H, D] = "
                         f"{[num_heads, head_dim]}; got {_describe(scale)}")
    if scale.ndim > 2 or any(n not in (1, want) for n, want in zip(scale.shape[::-1], (head_dim, num_heads))):
        raise ValueError(f"store_kv: {name} of shape {list(scale.shape)} does not broadcast to [H, D] = "
                         f"{[num_heads, head_dim]}; allowed: [1, 1], [H, 1], [1, D], [H, D]")
    view = scale.expand(num_heads, head_dim)
    return view, (view.stride(0), view.stride(1))


def _token_scales(name: str, ts: torch.Tensor | None, shape: tuple[int, int, int],
                  device: torch.device) -> torch.Tensor:
    """A dynamic-scales tensor, checked: float32 ``[num_blocks, H, block_size]`` (any strides) on ``device``."""
    _check_tensor(name, ts, 3, (torch.float32,), device)
    assert isinstance(ts, torch.Tensor)
    if tuple(ts.shape) != shape:
        raise ValueError(f"store_kv: {name} has shape {list(ts.shape)}, must be [num_blocks, H, block_size] = "
                         f"{list(shape)}")
    return ts
