// The tile item kernel: the fast path (AVX-512 BF16) for every item shape -- prefill blocks of up to
// ROWS_PER_ITEM rows, fp16 / fp32 compute, head dims that are a multiple of 16 up to 1024, any block size.
// Items of decode shape with bf16 compute go to item_decode.h instead (see pick_item_fn). Two loops:
//
// The prefill loop (run_item_prefill: items of more than 4 rows, D <= 128). Per chunk of CHUNK = 4 tiles of
// 16 tokens: gather each tile's 16 row pointers (tile_rows: pad rows read zeros), decode its K once into the
// pair layout (one register = a channel pair x the 16 tokens, so vdpbf16ps against a broadcast q pair gives
// 16 scores in token order, no reduction) and its V once into the P.V layout, both shared by all rows; then
// per block of 4 rows (prefill_block): the 4 x 4 tile scores as 16 independent accumulators, the
// online-softmax step on them in registers, and tile_pv. Masks are applied only in blocks that need them:
// some row's causal limit inside the chunk (the diagonal), a window's first position after the chunk's start,
// or an item's last tile ending before 16 tokens; elsewhere every token is visible to every row of the block.
//
// Lazy softmax reference (prefill loop): each row keeps a reference ref (its running max when it last
// moved) and weights p = e^(s - ref). ref moves only when a chunk holds a score s > ref + REF_SLACK (8); it
// then becomes the chunk's max and the row's sum and output accumulators are rescaled by e^(old - new) (one
// expf per move, where a per-chunk max costs a reduction, an expf and a rescale every chunk). Contract: ref is
// always a score the row has seen and max - REF_SLACK <= ref <= max, so p <= e^8 ~ 2981 and a row's sum is at
// most e^8 x its tokens: no fp32 overflow, and the output sum(p v) / sum(p) is the softmax with the same
// relative rounding (bf16 weights keep 8 significant bits at any magnitude; weights are e^(s - ref) within ~1e-5
// relative, exp2_weights in fast_simd.h, and a weight below e^-87 is 0, next to the row's largest weight, which
// is >= 1). The partition combine takes
// (ref, sum, acc) as it takes (max, sum, acc): any common reference gives the same quotient. The tests'
// tolerances against reference.py are unchanged (tests/kernels/test_fused_attention.py).
//
// The chunked tile loop (D = 256 and decode-shaped items): per chunk of CT tiles (CT = CHUNK for items of more
// than 4 rows, 1 for decode-shaped items): gather the row pointers and decode K once into a transposed buffer
// (one register = 4 tokens x 8 channels; reduce_scores sums the partials); then, per block of 4 rows, the
// scores of every tile of the chunk and one online-softmax step per row (one max, one rescale factor, and in
// tile_pv one load / rescale / store of the row's output accumulators per chunk, where a tile-at-a-time loop
// pays them per 16 tokens). P.V: a decode step (CT = 1, <= 4 rows left) decodes V straight into the product
// (tile_pv_fused); otherwise each tile of the chunk is decoded once into an L1 buffer used by all rows
// (decode_v_tile + tile_pv). Both P.V routines are kept: buffering costs a store and reload per tile that only
// pays off across many rows.
//
// Both loops walk the item's context with ChunkWalk (the set-up they share: row pointers, scales, prefetch): only
// the rows that see some token of the chunk ([r0, r1): row limits and first positions both ascend) take part;
// tokens outside a row's [first, limit] are masked (score -inf, weight 0).
//
// Precision: q is split into bf16 hi + lo parts (QLO; lo skipped when q is bf16 without a per-channel K
// scale: it is zero), so q keeps ~16 significant bits; so do the softmax weights (PLO) when the output is
// fp32 / fp16, while for a bf16 output they are rounded to bf16 once (as precise as the output itself).
// The softmax scale and per-tensor / per-head K scales multiply the 16 scores of a tile once; per-channel K
// scales fold into q; V scales of any granularity multiply the output once; dynamic per-token scales
// multiply the scores (K) and the softmax weights (V). Blocks are scattered, so K and V rows are
// software-prefetched (the prefill loop: one chunk ahead, V apart from K; the chunked loop: max(CT, 2) tiles).
#pragma once

#include "fast_simd.h"

#if KV8_FAST

// K tile -> kbuf[s * 4 + g]: slot s (channels 8s..8s+7) of tokens 4g..4g+3 (one per 128-bit lane).
template <int KV>
static void decode_k_tile(const uint8_t* const* rows, int D, __m512i* kbuf) {
    const Lut& L = lut_for(KV);
    constexpr int CH = chunk_channels<KV>(), ES = KV_FORMATS[KV].esize;
    for (int z = 0; z * CH < D; ++z) {
        const int rem = D - z * CH, nslots = (rem >= CH ? CH : rem) / 8;
        for (int g = 0; g < 4; ++g) {
            __m512i in[4], slots[8];
            for (int k = 0; k < 4; ++k) in[k] = load_bytes(rows[4 * g + k] + z * 64, chunk_mask(rem * ES));
            k_chunk_slots<KV>(in, L, slots);
            for (int l = 0; l < nslots; ++l) kbuf[(CH / 8 * z + l) * 4 + g] = slots[l];
        }
    }
}

// V tile -> vbuf[u * nvs + v]: bf16 pairs (token 2u, token 2u+1) for the 16 channels of accumulator v.
template <int KV>
static void decode_v_tile(const uint8_t* const* rows, int D, __m512i* vbuf) {
    const Lut& L = lut_for(KV);
    constexpr int CH = chunk_channels<KV>(), NV = chunk_accs<KV>(), ES = KV_FORMATS[KV].esize;
    const int nvs = num_vslots(KV, D);
    for (int u = 0; u < 8; ++u) {
        for (int z = 0; z * CH < D; ++z) {
            const __mmask64 mk = chunk_mask((D - z * CH) * ES);
            v_chunk_pairs<KV>(load_bytes(rows[2 * u] + z * 64, mk), load_bytes(rows[2 * u + 1] + z * 64, mk), L,
                              vbuf + u * nvs + NV * z);
        }
    }
}

// Scores of RB rows against one K tile: out[r] lane t = q_r . k_t (unscaled), natural token order.
template <int RB, bool QLO>
static inline void tile_scores(const __m512i* kbuf, int nslots, const __m512i* const* qhi,
                               const __m512i* const* qlo, __m512* out) {
    __m512 acc[RB][4];
    for (int r = 0; r < RB; ++r)
        for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_setzero_ps();
    for (int s = 0; s < nslots; ++s) {
        __m512i q[RB];
        for (int r = 0; r < RB; ++r) q[r] = _mm512_load_si512(qhi[r] + s);
        for (int g = 0; g < 4; ++g) {
            __m512i k = _mm512_load_si512(kbuf + s * 4 + g);
            for (int r = 0; r < RB; ++r) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], as_bh(q[r]), as_bh(k));
        }
        if (QLO) {
            for (int r = 0; r < RB; ++r) q[r] = _mm512_load_si512(qlo[r] + s);
            for (int g = 0; g < 4; ++g) {
                __m512i k = _mm512_load_si512(kbuf + s * 4 + g);
                for (int r = 0; r < RB; ++r) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], as_bh(q[r]), as_bh(k));
            }
        }
    }
    for (int r = 0; r < RB; ++r) out[r] = reduce_scores(acc[r]);
}

// out[r] (RB rows x nvs accumulators, in memory) = out * alpha + P . V over the nt decoded V tiles of a chunk
// (tile j at vbuf + j * vstride; P of row r, tile j as bf16 hi + lo dwords at phi[r] + 16 j), 4 accumulators
// at a time: the accumulators are loaded, rescaled and stored once per chunk. alpha == nullptr: no rescale.
template <int RB, bool PLO>
static inline void tile_pv(const __m512i* vbuf, size_t vstride, int nt, int nvs, const uint32_t* const* phi,
                           const uint32_t* const* plo, float* const* obuf, const float* alpha) {
    int v0 = 0;
    for (; v0 + 4 <= nvs; v0 += 4) {
        __m512 acc[RB][4];
        for (int r = 0; r < RB; ++r)
            for (int m = 0; m < 4; ++m) acc[r][m] = _mm512_load_ps(obuf[r] + (v0 + m) * 16);
        if (alpha)
            for (int r = 0; r < RB; ++r)
                for (int m = 0; m < 4; ++m) acc[r][m] = _mm512_mul_ps(acc[r][m], _mm512_set1_ps(alpha[r]));
        for (int j = 0; j < nt; ++j) {
            const __m512i* vb = vbuf + j * vstride;
            for (int u = 0; u < 8; ++u) {
                __m512i v[4];
                for (int m = 0; m < 4; ++m) v[m] = _mm512_load_si512(vb + u * nvs + v0 + m);
                for (int r = 0; r < RB; ++r)
                    pv_accumulate<4, PLO>(acc[r], v, phi[r][16 * j + u], PLO ? plo[r][16 * j + u] : 0);
            }
        }
        for (int r = 0; r < RB; ++r)
            for (int m = 0; m < 4; ++m) _mm512_store_ps(obuf[r] + (v0 + m) * 16, acc[r][m]);
    }
    for (; v0 < nvs; ++v0) {
        for (int r = 0; r < RB; ++r) {
            __m512 acc = _mm512_load_ps(obuf[r] + v0 * 16);
            if (alpha) acc = _mm512_mul_ps(acc, _mm512_set1_ps(alpha[r]));
            for (int j = 0; j < nt; ++j)
                for (int u = 0; u < 8; ++u) {
                    const __m512i v = _mm512_load_si512(vbuf + j * vstride + u * nvs + v0);
                    pv_accumulate<1, PLO>(&acc, &v, phi[r][16 * j + u], PLO ? plo[r][16 * j + u] : 0);
                }
            _mm512_store_ps(obuf[r] + v0 * 16, acc);
        }
    }
}

// tile_pv with the V decode fused in (no V buffer), for the few rows of a decode step. Same accumulator
// layout as decode_v_tile + tile_pv.
template <int KV, int RB, bool PLO>
static void tile_pv_fused(const uint8_t* const* rows, int D, const uint32_t* const* phi, const uint32_t* const* plo,
                          float* const* obuf, const float* alpha) {
    const Lut& L = lut_for(KV);
    constexpr int CH = chunk_channels<KV>(), NV = chunk_accs<KV>(), ES = KV_FORMATS[KV].esize;
    for (int z = 0; z * CH < D; ++z) {
        const __mmask64 mk = chunk_mask((D - z * CH) * ES);
        __m512 acc[RB][NV];
        for (int r = 0; r < RB; ++r) {
            __m512 a = _mm512_set1_ps(alpha[r]);
            for (int m = 0; m < NV; ++m) acc[r][m] = _mm512_mul_ps(_mm512_load_ps(obuf[r] + (z * NV + m) * 16), a);
        }
        for (int u = 0; u < 8; ++u) {
            __m512i v[4];
            v_chunk_pairs<KV>(load_bytes(rows[2 * u] + z * 64, mk), load_bytes(rows[2 * u + 1] + z * 64, mk), L, v);
            for (int r = 0; r < RB; ++r) pv_accumulate<NV, PLO>(acc[r], v, phi[r][u], PLO ? plo[r][u] : 0);
        }
        for (int r = 0; r < RB; ++r)
            for (int m = 0; m < NV; ++m) _mm512_store_ps(obuf[r] + (z * NV + m) * 16, acc[r][m]);
    }
}

typedef void (*PvFused)(const uint8_t* const*, int, const uint32_t* const*, const uint32_t* const*, float* const*,
                        const float*);

template <int KV, bool PLO>
static inline void pick_pv_fused(PvFused* f) {
    f[1] = tile_pv_fused<KV, 1, PLO>;
    f[2] = tile_pv_fused<KV, 2, PLO>;
    f[3] = tile_pv_fused<KV, 3, PLO>;
    f[4] = tile_pv_fused<KV, 4, PLO>;
}

typedef void (*TileDecoder)(const uint8_t* const*, int, __m512i*);

static const int CHUNK = 4;  // tiles per online-softmax step of a prefill item

// ------------------------------------------------------------------------------------------------
// What both loops share: the walk over an item's context, and the start and the end of its rows
// ------------------------------------------------------------------------------------------------

// The walk over an item's context in chunks of up to CHUNK tiles, the set-up both loops share. Constructing it sets
// every per-token scale to 1 (what pad tokens and caches without dynamic scales keep) and starts the prefetch of the
// item's first `ahead` tokens; gather() then reads the block table for one chunk. Per chunk: the tiles' K and V row
// pointers and per-token scales (tile_rows: pad rows read zeros), their token counts, the K lines `ahead` tokens on
// prefetched (the V lines are prefetch_v()'s, which the loops call before their V decode: bursts that fit the L1 miss
// buffers; one burst of both measures 2x slower for bf16), and the rows [r0, r1) that see some token of the chunk.
struct ChunkWalk {
    const Problem& P;
    const Item& it;
    const int64_t ahead;                                    // prefetch distance, tokens
    const uint8_t* kr[CHUNK][TILE];                         // row pointers of tile j's tokens
    const uint8_t* vr[CHUNK][TILE];
    alignas(64) float ksc[CHUNK][TILE], vsc[CHUNK][TILE];   // their per-token K and V scales
    int tn[CHUNK];                                          // tokens of each tile (16 but in the item's last tile)
    __m512 sfv[CHUNK];                                      // score factor of each token (softmax scale x K scale)
    int nt = 0;                                             // tiles of the chunk
    int64_t c0 = 0, cend = 0;                               // its first position, one past its last
    int r0 = 0, r1 = 0;                                     // the rows that see some token of it

    ChunkWalk(const Problem& problem, const Item& item, int64_t prefetch_tokens)
        : P(problem), it(item), ahead(prefetch_tokens) {
        for (int j = 0; j < CHUNK; ++j)
            for (int t = 0; t < TILE; ++t) ksc[j][t] = vsc[j][t] = 1.0f;
        for (int64_t p = 0; p < ahead; p += TILE) prefetch_tile(P, it, it.t0 + p);
    }

    // The chunk of up to ct tiles at `at`, for the item's rows (R of them, limits lim and first positions lo, both
    // ascending): ERR_BLOCK_ID for a block id outside the cache, else OK with r1 <= r0 where no row sees the chunk
    // (which the items plan.h makes never have).
    int gather(int64_t at, int ct, const int64_t* lo, const int64_t* lim, int R) {
        c0 = at;
        nt = 0;
        for (int64_t t0 = c0; nt < ct && t0 < it.t1; t0 += TILE, ++nt) {
            tn[nt] = (int)(it.t1 - t0 < TILE ? it.t1 - t0 : TILE);
            prefetch_tile<true, false>(P, it, t0 + ahead);
            if (!tile_rows(P, it, t0, tn[nt], kr[nt], vr[nt], ksc[nt], vsc[nt])) return ERR_BLOCK_ID;
        }
        cend = c0 + (int64_t)(nt - 1) * TILE + tn[nt - 1];
        while (r0 < R && lim[r0] < c0) ++r0;  // rows before r0 see nothing of this chunk (limits ascend)
        while (r1 < R && lo[r1] < cend) ++r1;  // nor do rows from r1 on (their windows start later)
        return OK;
    }

    // The V lines of the chunk `ahead` tokens on.
    void prefetch_v() const {
        for (int j = 0; j < nt; ++j) prefetch_tile<false, true>(P, it, c0 + (int64_t)j * TILE + ahead);
    }

    // The score factors of the chunk's tiles: sfac times their tokens' K scales.
    void score_factors(float sfac) {
        for (int j = 0; j < nt; ++j) sfv[j] = _mm512_mul_ps(_mm512_set1_ps(sfac), _mm512_load_ps(ksc[j]));
    }
};

// R rows that have seen nothing: reference (running max) -inf, their 16 lane-wise partial sums and their nacc
// output accumulators 0.
static inline void start_rows(int R, int nacc, float* ref, float* sum, float* obuf) {
    for (int r = 0; r < R; ++r) {
        ref[r] = -INFINITY;
        _mm512_store_ps(sum + (size_t)r * 16, _mm512_setzero_ps());
    }
    memset(obuf, 0, (size_t)R * nacc * 4);
}

// The end of an item: each of its rows' output accumulators in natural channel order (nat: D floats of scratch),
// finished with the row's reference and the sum of its partial sums.
static inline void finish_rows(const Problem& P, const Item& it, const Rows& w, const float* obuf, int nacc,
                               const float* ref, const float* sum, float* nat, float* ws) {
    for (int r = 0; r < w.R; ++r) {
        natural_order(P.kv, obuf + (size_t)r * nacc, nacc, P.D, nat);
        finish_row(P, it, w, r, nat, ref[r], _mm512_reduce_add_ps(_mm512_load_ps(sum + (size_t)r * 16)), ws);
    }
}

// ------------------------------------------------------------------------------------------------
// The prefill loop: items of more than 4 rows with D <= 128
// ------------------------------------------------------------------------------------------------

// Items of more than 4 rows with D <= 128 take the prefill loop; D = 256 keeps the chunked tile loop (its K
// tile in the pair layout would be 128 registers per 16 tokens).
static inline bool uses_prefill_loop(int D, int R) { return R > 4 && D <= 128; }

static const float REF_SLACK = 8.0f;   // the lazy reference moves when a score exceeds it by more than this

// Registers of one K tile in the pair layout: whole 64-byte chunks of a row, two channels per register.
static inline int num_kpairs(int kv, int D) { return KV_FORMATS[kv].fp8 ? 32 * ((D + 63) / 64) : 16 * ((D + 31) / 32); }

// K tile -> kp[p]: channel pair p (channels 2p, 2p + 1 as a bf16 pair) of the 16 tokens, token t in dword
// lane t; pairs past D / 2 (to the end of the last 64-byte chunk) are zeros. Per chunk: a 4x4 transpose of
// 128-bit blocks per token residue k (y[k][c] lane L = block c of token 4L + k), then within each lane a
// transpose of 4 tokens x 4 pairs (bf16) or x 8 pairs (FP8: the 16-bit code pairs, then the table decode,
// whose byte interleave puts token 4L + i's pair in dword 4L + i).
template <int KV>
static void decode_k_pairs(const uint8_t* const* rows, int D, __m512i* kp) {
    const Lut& L = lut_for(KV);
    constexpr int CH = chunk_channels<KV>(), ES = KV_FORMATS[KV].esize;
    for (int z = 0; z * CH < D; ++z) {
        const __mmask64 mk = chunk_mask((D - z * CH) * ES);
        __m512i y[4][4];
        for (int k = 0; k < 4; ++k) {
            __m512i in[4];
            for (int g = 0; g < 4; ++g) in[g] = load_bytes(rows[4 * g + k] + z * 64, mk);
            transpose4x128(in, y[k]);
        }
        __m512i* out = kp + z * (CH / 2);
        for (int c = 0; c < 4; ++c) {
            if constexpr (!KV_FORMATS[KV].fp8) {  // bf16: block c holds pairs 4c..4c+3, one dword each
                const __m512i a = _mm512_unpacklo_epi32(y[0][c], y[1][c]), b = _mm512_unpackhi_epi32(y[0][c], y[1][c]);
                const __m512i d = _mm512_unpacklo_epi32(y[2][c], y[3][c]), e = _mm512_unpackhi_epi32(y[2][c], y[3][c]);
                out[4 * c + 0] = _mm512_unpacklo_epi64(a, d);
                out[4 * c + 1] = _mm512_unpackhi_epi64(a, d);
                out[4 * c + 2] = _mm512_unpacklo_epi64(b, e);
                out[4 * c + 3] = _mm512_unpackhi_epi64(b, e);
            } else {  // block c holds pairs 8c..8c+7, one 16-bit word (two codes) each
                const __m512i a = _mm512_unpacklo_epi16(y[0][c], y[1][c]), b = _mm512_unpackhi_epi16(y[0][c], y[1][c]);
                const __m512i d = _mm512_unpacklo_epi16(y[2][c], y[3][c]), e = _mm512_unpackhi_epi16(y[2][c], y[3][c]);
                // lane L: pair 8c + 2m of tokens 4L..4L+3 (8 bytes), then pair 8c + 2m + 1
                fp8_to_bf16<KV>(_mm512_unpacklo_epi32(a, d), L, out[8 * c + 0], out[8 * c + 1]);
                fp8_to_bf16<KV>(_mm512_unpackhi_epi32(a, d), L, out[8 * c + 2], out[8 * c + 3]);
                fp8_to_bf16<KV>(_mm512_unpacklo_epi32(b, e), L, out[8 * c + 4], out[8 * c + 5]);
                fp8_to_bf16<KV>(_mm512_unpackhi_epi32(b, e), L, out[8 * c + 6], out[8 * c + 7]);
            }
        }
    }
}

typedef void (*KPairDecoder)(const uint8_t* const*, int, __m512i*);

// What the row blocks of one chunk share: the walk's chunk, and its K tiles decoded.
struct PrefillChunk : ChunkWalk {
    using ChunkWalk::ChunkWalk;
    const __m512i* kbuf = nullptr;   // K tiles in the pair layout, tile j at kbuf + j * kstride
    int kstride = 0, npairs = 0;     // registers per tile, channel pairs D / 2
    const float* vscale = nullptr;   // dynamic V scales (vsc), TILE per tile, or NULL
    bool masked = false;             // some token of the chunk is hidden from some row of the block
};

// The online-softmax step of one row on its NT raw tile scores (acc[j]: q . k of tile j's 16 tokens, before
// the score factor): scale, mask (only in blocks that need it), the lazy reference check, exp, the weights as
// bf16 (tile j's 16 at ph + j * pstride bytes, and their lo parts at pl + j * pstride when PLO) and the row's
// 16 lane-wise partial sums. alpha: the factor of the row's accumulators (1 unless its reference moved).
// Returns whether the reference moved.
template <int NT, bool PLO>
static inline bool prefill_row(const PrefillChunk& C, const __m512* acc, int64_t lo, int64_t lim, float& ref,
                               float* sum, char* ph, char* pl, size_t pstride, float& alpha) {
    __m512 s[NT];
    __mmask16 valid[NT];
    for (int j = 0; j < NT; ++j) {
        if (C.masked) {  // visible: [first, limit] within the tile's tokens
            const int64_t t0 = C.c0 + (int64_t)j * TILE;
            const int64_t end = lim - t0 + 1 < C.tn[j] ? lim - t0 + 1 : C.tn[j];
            valid[j] = lane_range(lo - t0, end);
            s[j] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid[j], acc[j], C.sfv[j]);
        } else {
            s[j] = _mm512_mul_ps(acc[j], C.sfv[j]);
        }
    }
    __m512 m = s[0];
    for (int j = 1; j < NT; ++j) m = _mm512_max_ps(m, s[j]);
    alpha = 1.0f;
    bool moved = false;
    if (_mm512_cmp_ps_mask(m, _mm512_set1_ps(ref + REF_SLACK), _CMP_GT_OQ)) {
        const float cmax = _mm512_reduce_max_ps(m);
        alpha = expf(ref - cmax);  // 0 at the row's first visible chunk (ref = -inf)
        ref = cmax;
        moved = true;
    }
    // exp(s - ref) <= e^REF_SLACK (exp2_weights). Masked lanes (s = -inf; NaN where ref is still -inf, which
    // only a row with no visible token of the chunk can have) are zeroed.
    const __m512 log2e = _mm512_set1_ps(LOG2E), ref2 = _mm512_set1_ps(ref * LOG2E);
    __m512 psum = _mm512_setzero_ps();
    for (int j = 0; j < NT; ++j) {
        __m512 pj = exp2_weights(s[j], log2e, ref2);
        if (C.masked) pj = _mm512_maskz_mov_ps(valid[j], pj);
        psum = _mm512_add_ps(psum, pj);
        if (C.vscale) pj = _mm512_mul_ps(pj, _mm512_load_ps(C.vscale + j * TILE));  // per-token V scale
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(pj);
        _mm256_storeu_si256((__m256i*)(ph + j * pstride), h);
        if (PLO) {
            const __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            _mm256_storeu_si256((__m256i*)(pl + j * pstride), (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(pj, hf)));
        }
    }
    const __m512 old = _mm512_load_ps(sum);
    _mm512_store_ps(sum, alpha == 1.0f ? _mm512_add_ps(old, psum) : _mm512_fmadd_ps(old, _mm512_set1_ps(alpha), psum));
    return moved;
}

// One block of 4 rows x the NT tiles of a chunk: the scores (16 independent vdpbf16ps chains, q pairs
// broadcast from memory), then prefill_row on each row, its weights into phi / plo (row i, tile j at dword
// (i * CHUNK + j) * 16). Returns whether some reference moved.
template <int NT, bool QLO, bool PLO>
static inline bool prefill_block(const PrefillChunk& C, const uint32_t* const* qh, const uint32_t* const* ql,
                                 const int64_t* lo, const int64_t* lim, float* ref, float* sum, uint32_t* phi,
                                 uint32_t* plo, float* alpha) {
    __m512 acc[4][NT];
    for (int i = 0; i < 4; ++i)
        for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_setzero_ps();
    for (int p = 0; p < C.npairs; ++p) {
        __m512i k[NT];
        for (int j = 0; j < NT; ++j) k[j] = _mm512_load_si512(C.kbuf + (size_t)j * C.kstride + p);
        for (int i = 0; i < 4; ++i) {
            const __m512i q = _mm512_set1_epi32((int)qh[i][p]);
            for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], as_bh(k[j]), as_bh(q));
        }
        if (QLO)
            for (int i = 0; i < 4; ++i) {
                const __m512i q = _mm512_set1_epi32((int)ql[i][p]);
                for (int j = 0; j < NT; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], as_bh(k[j]), as_bh(q));
            }
    }
    bool moved = false;
    for (int i = 0; i < 4; ++i)
        moved |= prefill_row<NT, PLO>(C, acc[i], lo[i], lim[i], ref[i], sum + (size_t)i * 16,
                                      (char*)(phi + (size_t)i * CHUNK * 16), (char*)(plo + (size_t)i * CHUNK * 16),
                                      64, alpha[i]);
    return moved;
}

#if KV8_ATTN_AMX
// The AMX form of the prefill loop's blocks (bf16 compute, no per-channel K scale, D % 64 == 0, D <= 256):
// blocks of 16 rows. Tiles (all 16 rows x 64 bytes): 0..3 C (the scores of tile j, then four output
// accumulators), 4 A (32 channels of 16 q rows, or 32 weights of 16 rows), 5 and 6 B (alternating).
// tdpbf16ps sums 16 exact bf16 products per row and column in fp32 per instruction, in k order: the same
// products as the vdpbf16ps blocks, summed in another order.
static inline bool uses_amx_loop(const Problem& P, int R) {
    return P.amx && R > 4 && P.D % 64 == 0 && P.D <= 256 && P.q_dtype == DT_BF16 && !k_per_channel(P);
}

// The calling thread's tiles for the AMX blocks, released when the item ends (the dense library configures
// its own; the two share the OpenMP threads).
struct AmxTiles {
    const bool on;
    explicit AmxTiles(bool use) : on(use) {
        if (on) amx_load_config(16, 0);
    }
    ~AmxTiles() {
        if (on) _tile_release();
    }
};

// BODY(j, b) for tile j < NT of the chunk and its B tile b (5 or 6, alternating), as literals: the tile
// intrinsics take tile numbers as immediates, spelled into the instruction.
#define KV8_AMX_TILES(NT, BODY)    \
    {                              \
        BODY(0, 5)                 \
        if (NT > 1) { BODY(1, 6) } \
        if (NT > 2) { BODY(2, 5) } \
        if (NT > 3) { BODY(3, 6) } \
    }

// One block of 16 rows x the NT tiles of a chunk with AMX tiles:
// * scores S = Q K^T: A = 32 channels of the 16 q rows (qhi, row stride qstride dwords), B = 16 channel pairs
//   of a K tile in the pair layout (decode_k_pairs: pair p of the 16 tokens in one 64-byte row -- the pair order
//   tdpbf16ps wants) -> C tile j = the 16 x 16 scores of tile j, stored to sbuf (row i: 64 scores);
// * prefill_row on each row, its bf16 weights into pbuf (row i: 64 tokens, 128 bytes; an absent 4th tile's
//   weights are zeros, so they meet the zeroed V tile the caller leaves there);
// * O += P V, four accumulators at a time: C tiles loaded from obuf (accumulator layout, row stride nacc;
//   rows whose reference moved are rescaled in memory first), A = 32 weights of each row, B = the decoded V of
//   those 32 tokens for one accumulator (decode_v_tile: token pair u of the two tiles in row u, stride nvs
//   registers), stored back.
template <int NT>
static inline void amx_block(const PrefillChunk& C, const uint32_t* q, int qstride, const int64_t* lo,
                             const int64_t* lim, float* ref, float* sum, const __m512i* vbuf, size_t vstride,
                             int nvs, float* obuf) {
    alignas(64) float sbuf[16 * 64];
    alignas(64) uint16_t pbuf[16 * 64];
    alignas(64) float alpha[16];
    const int nacc = nvs * 16;
#define KV8_ZERO(J, B) _tile_zero(J);
    KV8_AMX_TILES(NT, KV8_ZERO)
#undef KV8_ZERO
    for (int c = 0; c < C.npairs / 16; ++c) {
        _tile_loadd(4, q + 16 * c, qstride * 4);
        const __m512i* kb = C.kbuf + 16 * c;
#define KV8_SCORES(J, B)                                \
        _tile_loadd(B, kb + (size_t)J * C.kstride, 64); \
        _tile_dpbf16ps(J, 4, B);
        KV8_AMX_TILES(NT, KV8_SCORES)
#undef KV8_SCORES
    }
#define KV8_STORE(J, B) _tile_stored(J, sbuf + 16 * J, 256);
    KV8_AMX_TILES(NT, KV8_STORE)
#undef KV8_STORE
    bool moved = false;
    for (int i = 0; i < 16; ++i) {
        __m512 acc[NT];
        for (int j = 0; j < NT; ++j) acc[j] = _mm512_load_ps(sbuf + i * 64 + 16 * j);
        moved |= prefill_row<NT, false>(C, acc, lo[i], lim[i], ref[i], sum + (size_t)i * 16, (char*)(pbuf + i * 64),
                                        nullptr, 32, alpha[i]);
        if (NT % 2) _mm256_store_si256((__m256i*)(pbuf + i * 64 + 16 * NT), _mm256_setzero_si256());
    }
    if (moved)
        for (int i = 0; i < 16; ++i)
            if (alpha[i] != 1.0f) {
                const __m512 a = _mm512_set1_ps(alpha[i]);
                for (int v = 0; v < nacc; v += 16)
                    _mm512_store_ps(obuf + i * nacc + v, _mm512_mul_ps(_mm512_load_ps(obuf + i * nacc + v), a));
            }
    for (int g = 0; g < nvs; g += 4) {
        float* o = obuf + 16 * g;
        _tile_loadd(0, o, nacc * 4);
        _tile_loadd(1, o + 16, nacc * 4);
        _tile_loadd(2, o + 32, nacc * 4);
        _tile_loadd(3, o + 48, nacc * 4);
        for (int h = 0; h < (NT + 1) / 2; ++h) {
            _tile_loadd(4, pbuf + 32 * h, 128);
            const __m512i* vb = vbuf + 2 * h * vstride + g;
            _tile_loadd(5, vb, nvs * 64);
            _tile_dpbf16ps(0, 4, 5);
            _tile_loadd(6, vb + 1, nvs * 64);
            _tile_dpbf16ps(1, 4, 6);
            _tile_loadd(5, vb + 2, nvs * 64);
            _tile_dpbf16ps(2, 4, 5);
            _tile_loadd(6, vb + 3, nvs * 64);
            _tile_dpbf16ps(3, 4, 6);
        }
        _tile_stored(0, o, nacc * 4);
        _tile_stored(1, o + 16, nacc * 4);
        _tile_stored(2, o + 32, nacc * 4);
        _tile_stored(3, o + 48, nacc * 4);
    }
}
#undef KV8_AMX_TILES
#endif

// The prefill item loop (R > 4, D <= 128; with AMX D % 64 == 0, D <= 256). Per chunk of CHUNK tiles: gather
// the row pointers, decode K into the pair layout and V into the P.V layout once for all rows, then per block
// of RB rows (blocks aligned to RB; rows R..R4-1 are pad rows, q = 0, limits of row R - 1, never finished):
// prefill_block and tile_pv (RB = 4), or amx_block (AMX: RB = 16).
template <bool QLO, bool PLO, bool AMX = false>
static int run_item_prefill(const Problem& P, const Item& it, float* ws, KPairDecoder decode_k, TileDecoder decode_v) {
    constexpr int RB = AMX ? 16 : 4;
    const Rows w = rows_of(P, it);
    const int D = P.D, R = w.R, R4 = (R + RB - 1) / RB * RB;
    const int kstride = num_kpairs(P.kv, D), npairs = D / 2;
    const int nvs = num_vslots(P.kv, D), nacc = nvs * 16;
    const size_t vstride = (size_t)8 * nvs;
    const size_t qbytes = up64((size_t)R4 * kstride * 4);
    const size_t bytes = 2 * qbytes + CHUNK * ((size_t)kstride + vstride) * 64 + (size_t)R4 * nacc * 4 +
                         up64((size_t)R4 * 4) + (size_t)R4 * 64 + up64((size_t)D * 4) * 2 + up64((size_t)R4 * 8) * 2;
    char* mem = (char*)tl_scratch.get(bytes);
    if (!mem) return ERR_OOM;
    uint32_t* qhi = (uint32_t*)mem; mem += qbytes;  // row r: its bf16 channel pairs at r * kstride
    uint32_t* qlo = (uint32_t*)mem; mem += qbytes;
    __m512i* kbuf = (__m512i*)mem; mem += CHUNK * (size_t)kstride * 64;
    __m512i* vbuf = (__m512i*)mem; mem += CHUNK * vstride * 64;
    float* obuf = (float*)mem; mem += (size_t)R4 * nacc * 4;
    float* ref = (float*)mem; mem += up64((size_t)R4 * 4);
    float* sum = (float*)mem; mem += (size_t)R4 * 64;  // per row: 16 lane-wise partial sums
    float* kscale = (float*)mem; mem += up64((size_t)D * 4);
    float* nat = (float*)mem; mem += up64((size_t)D * 4);
    int64_t* lim = (int64_t*)mem; mem += up64((size_t)R4 * 8);
    int64_t* lo = (int64_t*)mem;

    const bool kch = k_per_channel(P);
    if (kch)
        for (int d = 0; d < D; ++d) kscale[d] = P.ks[it.kvh * P.ks_hs + d * P.ks_ds];
    for (int r = 0; r < R4; ++r) {
        uint32_t* h = qhi + (size_t)r * kstride;
        uint32_t* l = qlo + (size_t)r * kstride;
        if (r >= R) {
            memset(h, 0, (size_t)npairs * 4);
            memset(l, 0, (size_t)npairs * 4);
            lim[r] = lim[R - 1];
            lo[r] = lo[R - 1];
            continue;
        }
        const int64_t src = ((w.qrow0 + r / P.G) * P.Hq + it.kvh * P.G + r % P.G) * (int64_t)D;
        for (int d = 0; d < D; d += 16) {
            __m256i hv, lv;
            q_parts16(P, src, d, kch ? kscale : nullptr, hv, lv);
            _mm256_storeu_si256((__m256i*)(h + d / 2), hv);
            _mm256_storeu_si256((__m256i*)(l + d / 2), lv);
        }
        lim[r] = row_limit(P, it, w, r);
        lo[r] = first_visible(P, lim[r]);
    }
    const float sfac = P.sm_scale * (kch ? 1.0f : k_head_scale(P, it.kvh));
    start_rows(R4, nacc, ref, sum, obuf);

    alignas(64) uint32_t phi[4 * CHUNK * 16], plo[4 * CHUNK * 16];
    alignas(64) float alpha[4];
    const uint32_t* qh[4];
    const uint32_t* ql[4];
    const uint32_t* ph[4];
    const uint32_t* pl[4];
    float* ob[4];
    for (int i = 0; i < 4; ++i) {
        ph[i] = phi + i * CHUNK * 16;
        pl[i] = plo + i * CHUNK * 16;
    }
#if KV8_ATTN_AMX
    const AmxTiles tiles(AMX);  // configured for this item, released when it returns
#endif
    PrefillChunk C(P, it, (int64_t)CHUNK * TILE);  // prefetch distance: one chunk
    C.kbuf = kbuf;
    C.kstride = kstride;
    C.npairs = npairs;
    C.vscale = P.vts ? &C.vsc[0][0] : nullptr;
    for (int64_t c0 = it.t0; c0 < it.t1; c0 += C.ahead) {
        if (C.gather(c0, CHUNK, lo, lim, R) != OK) return ERR_BLOCK_ID;
        const int nt = C.nt, r1 = C.r1;
        if (r1 <= C.r0) continue;
        for (int j = 0; j < nt; ++j) decode_k(C.kr[j], D, kbuf + (size_t)j * kstride);
        C.prefetch_v();
        for (int j = 0; j < nt; ++j) decode_v(C.vr[j], D, vbuf + j * vstride);
        // AMX multiplies V 32 tokens at a time: the tile after an odd last one is zeros (no stale NaN meets
        // its zero weights).
        if (AMX && nt % 2) memset(vbuf + nt * vstride, 0, vstride * 64);
        C.score_factors(sfac);
        const bool whole = C.cend == c0 + (int64_t)nt * TILE;  // no tile ends early
        for (int rb = C.r0 / RB * RB; rb < r1; rb += RB) {
            // Unmasked: every row of the block sees every token of the chunk (first rows' limits reach the
            // chunk's end, last rows' windows start at or before its start).
            C.masked = !whole || lim[rb] < C.cend - 1 || lo[rb + RB - 1] > c0;
#if KV8_ATTN_AMX
            if constexpr (AMX) {
                const uint32_t* q = qhi + (size_t)rb * kstride;
                float* o = obuf + (size_t)rb * nacc;
                float* sm = sum + (size_t)rb * 16;
                switch (nt) {
                    case 4: amx_block<4>(C, q, kstride, lo + rb, lim + rb, ref + rb, sm, vbuf, vstride, nvs, o); break;
                    case 3: amx_block<3>(C, q, kstride, lo + rb, lim + rb, ref + rb, sm, vbuf, vstride, nvs, o); break;
                    case 2: amx_block<2>(C, q, kstride, lo + rb, lim + rb, ref + rb, sm, vbuf, vstride, nvs, o); break;
                    default: amx_block<1>(C, q, kstride, lo + rb, lim + rb, ref + rb, sm, vbuf, vstride, nvs, o); break;
                }
                continue;
            }
#endif
            for (int i = 0; i < 4; ++i) {
                qh[i] = qhi + (size_t)(rb + i) * kstride;
                ql[i] = qlo + (size_t)(rb + i) * kstride;
                ob[i] = obuf + (size_t)(rb + i) * nacc;
            }
            float* rf = ref + rb;
            float* sm = sum + (size_t)rb * 16;
            bool moved;
            const int64_t *blo = lo + rb, *blim = lim + rb;
            switch (nt) {
                case 4: moved = prefill_block<4, QLO, PLO>(C, qh, ql, blo, blim, rf, sm, phi, plo, alpha); break;
                case 3: moved = prefill_block<3, QLO, PLO>(C, qh, ql, blo, blim, rf, sm, phi, plo, alpha); break;
                case 2: moved = prefill_block<2, QLO, PLO>(C, qh, ql, blo, blim, rf, sm, phi, plo, alpha); break;
                default: moved = prefill_block<1, QLO, PLO>(C, qh, ql, blo, blim, rf, sm, phi, plo, alpha); break;
            }
            tile_pv<4, PLO>(vbuf, vstride, nt, nvs, ph, pl, ob, moved ? alpha : nullptr);
        }
    }
    finish_rows(P, it, w, obuf, nacc, ref, sum, nat, ws);
    return OK;
}

template <bool QLO, bool PLO>
static int run_item_tile(const Problem& P, const Item& it, float* ws) {
    TileDecoder decode_k = nullptr, decode_v = nullptr;
    KPairDecoder decode_kp = nullptr;
    PvFused pv_fused[5] = {};
    with_kv_format(P.kv, [&](auto K) {
        constexpr int KV = decltype(K)::value;
        if constexpr (kv_bf16_exact(KV)) {  // the formats pick_item_fn gives this kernel
            decode_k = decode_k_tile<KV>;
            decode_v = decode_v_tile<KV>;
            decode_kp = decode_k_pairs<KV>;
            pick_pv_fused<KV, PLO>(pv_fused);
        }
    });
    const Rows w = rows_of(P, it);
    const int D = P.D, R = w.R;
#if KV8_ATTN_AMX
    if (!QLO && !PLO && uses_amx_loop(P, R))
        return run_item_prefill<false, false, true>(P, it, ws, decode_kp, decode_v);
#endif
    if (uses_prefill_loop(D, R)) return run_item_prefill<QLO, PLO>(P, it, ws, decode_kp, decode_v);
    // Tiles per online-softmax step: prefill items take CHUNK tiles at once (one max, one rescale of the
    // output per row and chunk); items of decode shape keep one tile (and the fused V decode below).
    const int CT = R > 4 ? CHUNK : 1;
    const int nslots = D / 8, nvs = num_vslots(P.kv, D), nacc = nvs * 16;
    const size_t kstride = (size_t)nslots * 4, vstride = (size_t)8 * nvs;   // registers per decoded tile
    size_t qbytes = (size_t)R * nslots * 64;
    size_t bytes = 2 * qbytes + CT * (kstride + vstride) * 64 + (size_t)R * nacc * 4 + up64((size_t)R * 4) * 2 +
                   (size_t)R * 64 * (1 + 2 * CT) + up64((size_t)D * 4) * 2 + up64((size_t)R * 8) * 2;
    char* mem = (char*)tl_scratch.get(bytes);
    if (!mem) return ERR_OOM;
    __m512i* qhi = (__m512i*)mem; mem += qbytes;
    __m512i* qlo = (__m512i*)mem; mem += qbytes;
    __m512i* kbuf = (__m512i*)mem; mem += CT * kstride * 64;
    __m512i* vbuf = (__m512i*)mem; mem += CT * vstride * 64;
    float* obuf = (float*)mem; mem += (size_t)R * nacc * 4;
    float* mx = (float*)mem; mem += up64((size_t)R * 4);
    float* sum = (float*)mem; mem += (size_t)R * 64;  // per row: 16 lane-wise partial sums
    float* alpha = (float*)mem; mem += up64((size_t)R * 4);
    uint32_t* phi = (uint32_t*)mem; mem += (size_t)R * 64 * CT;  // per row and tile: 8 used dwords of 16
    uint32_t* plo = (uint32_t*)mem; mem += (size_t)R * 64 * CT;
    float* kscale = (float*)mem; mem += up64((size_t)D * 4);
    int64_t* lim = (int64_t*)mem; mem += up64((size_t)R * 8);
    int64_t* lo = (int64_t*)mem; mem += up64((size_t)R * 8);
    float* nat = (float*)mem;

    const float sfac = prep_rows(P, it, w, kscale, qhi, qlo, lo, lim);
    start_rows(R, nacc, mx, sum, obuf);

    const __m512i* qh[4];
    const __m512i* ql[4];
    const uint32_t* ph[4];
    const uint32_t* pl[4];
    float* ob[4];
    __m512 sc[4][CHUNK];
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    ChunkWalk W(P, it, (int64_t)(CT > PREFETCH_TILES ? CT : PREFETCH_TILES) * TILE);  // prefetch distance
    for (int64_t c0 = it.t0; c0 < it.t1; c0 += (int64_t)CT * TILE) {
        if (W.gather(c0, CT, lo, lim, R) != OK) return ERR_BLOCK_ID;
        const int nt = W.nt, r0 = W.r0, r1 = W.r1;
        if (r1 <= r0) continue;
        for (int j = 0; j < nt; ++j) decode_k(W.kr[j], D, kbuf + j * kstride);
        W.score_factors(sfac);
        for (int rb = r0; rb < r1; rb += 4) {
            int nb = r1 - rb < 4 ? r1 - rb : 4;
            for (int i = 0; i < nb; ++i) {
                qh[i] = qhi + (size_t)(rb + i) * nslots;
                ql[i] = qlo + (size_t)(rb + i) * nslots;
            }
            for (int j = 0; j < nt; ++j) {
                __m512 tsc[4];
                switch (nb) {
                    case 4: tile_scores<4, QLO>(kbuf + j * kstride, nslots, qh, ql, tsc); break;
                    case 3: tile_scores<3, QLO>(kbuf + j * kstride, nslots, qh, ql, tsc); break;
                    case 2: tile_scores<2, QLO>(kbuf + j * kstride, nslots, qh, ql, tsc); break;
                    default: tile_scores<1, QLO>(kbuf + j * kstride, nslots, qh, ql, tsc); break;
                }
                for (int i = 0; i < nb; ++i) sc[i][j] = tsc[i];
            }
            for (int i = 0; i < nb; ++i) {
                const int r = rb + i;
                // visible tokens of each tile (the row sees at least one of the chunk): [first - t0, limit - t0]
                // within [0, n)
                __m512 s[CHUNK];
                __mmask16 valid[CHUNK];
                __m512 m = _mm512_set1_ps(-INFINITY);
                for (int j = 0; j < nt; ++j) {
                    const int64_t t0 = c0 + (int64_t)j * TILE;
                    const int64_t nv = lim[r] - t0 + 1 < W.tn[j] ? lim[r] - t0 + 1 : W.tn[j];
                    valid[j] = nv <= 0 ? 0 : (__mmask16)_mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32((int)nv));
                    if (lo[r] > t0) valid[j] &= lo[r] - t0 >= TILE ? 0 : (__mmask16)(0xffffu << (lo[r] - t0));
                    s[j] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid[j], sc[i][j], W.sfv[j]);
                    m = _mm512_max_ps(m, s[j]);
                }
                const float cmax = _mm512_reduce_max_ps(m);
                const float mnew = cmax > mx[r] ? cmax : mx[r];
                alpha[r] = mnew == mx[r] ? 1.0f : expf(mx[r] - mnew);
                mx[r] = mnew;
                const __m512 mv = _mm512_set1_ps(mnew);
                __m512 psum = _mm512_setzero_ps();
                for (int j = 0; j < nt; ++j) {
                    __m512 pj = _mm512_maskz_mov_ps(valid[j], exp_ps(_mm512_sub_ps(s[j], mv)));
                    psum = _mm512_add_ps(psum, pj);
                    if (P.vts) pj = _mm512_mul_ps(pj, _mm512_load_ps(W.vsc[j]));  // per-token V scale on the weight
                    __m256i h = (__m256i)_mm512_cvtneps_pbh(pj);
                    _mm256_store_si256((__m256i*)(phi + ((size_t)r * CT + j) * 16), h);
                    if (PLO) {
                        __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                        _mm256_store_si256((__m256i*)(plo + ((size_t)r * CT + j) * 16),
                                           (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(pj, hf)));
                    }
                }
                float* sr = sum + (size_t)r * 16;
                _mm512_store_ps(sr, _mm512_fmadd_ps(_mm512_load_ps(sr), _mm512_set1_ps(alpha[r]), psum));
            }
        }
        W.prefetch_v();
        if (CT == 1 && r1 - r0 <= 4) {  // decode step: decode V straight into the P.V product
            int nb = r1 - r0;
            for (int i = 0; i < nb; ++i) {
                ph[i] = phi + (size_t)(r0 + i) * 16;
                pl[i] = plo + (size_t)(r0 + i) * 16;
                ob[i] = obuf + (size_t)(r0 + i) * nacc;
            }
            pv_fused[nb](W.vr[0], D, ph, pl, ob, alpha + r0);
            continue;
        }
        for (int j = 0; j < nt; ++j) decode_v(W.vr[j], D, vbuf + j * vstride);
        for (int rb = r0; rb < r1; rb += 4) {
            int nb = r1 - rb < 4 ? r1 - rb : 4;
            for (int i = 0; i < nb; ++i) {
                ph[i] = phi + (size_t)(rb + i) * CT * 16;
                pl[i] = plo + (size_t)(rb + i) * CT * 16;
                ob[i] = obuf + (size_t)(rb + i) * nacc;
            }
            switch (nb) {
                case 4: tile_pv<4, PLO>(vbuf, vstride, nt, nvs, ph, pl, ob, alpha + rb); break;
                case 3: tile_pv<3, PLO>(vbuf, vstride, nt, nvs, ph, pl, ob, alpha + rb); break;
                case 2: tile_pv<2, PLO>(vbuf, vstride, nt, nvs, ph, pl, ob, alpha + rb); break;
                default: tile_pv<1, PLO>(vbuf, vstride, nt, nvs, ph, pl, ob, alpha + rb); break;
            }
        }
    }
    finish_rows(P, it, w, obuf, nacc, mx, sum, nat, ws);
    return OK;
}

#endif  // KV8_FAST
