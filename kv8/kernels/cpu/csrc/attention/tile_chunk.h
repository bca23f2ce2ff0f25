// What the tile item kernels share: the chunked tile loop (item_tile.h), the prefill loop (item_prefill.h) and its
// blocks on AMX tiles (item_prefill_amx.h). The V tile decode and the P.V product of a chunk's tiles (decode_v_tile,
// tile_pv), the walk over an item's context in chunks of tiles (ChunkWalk) and the start and the end of an item's
// rows; then what both forms of the prefill loop share: a chunk with its K tiles decoded (PrefillChunk) and the
// online-softmax step of one row on it (prefill_row).
//
// Both loops walk the item's context with ChunkWalk (the set-up they share: row pointers, scales, prefetch): only
// the rows that see some token of the chunk ([r0, r1): row limits and first positions both ascend) take part;
// tokens outside a row's [first, limit] are masked (score -inf, weight 0).
#pragma once

#include "fast_simd.h"

#if KV8_FAST

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
// The prefill loop's row step, on AVX-512 blocks (item_prefill.h) and AMX blocks (item_prefill_amx.h)
// ------------------------------------------------------------------------------------------------

// Lazy softmax reference (prefill loop): each row keeps a reference ref (its running max when it last
// moved) and weights p = e^(s - ref). ref moves only when a chunk holds a score s > ref + REF_SLACK (8); it
// then becomes the chunk's max and the row's sum and output accumulators are rescaled by e^(old - new) (one
// expf per move, where a per-chunk max costs a reduction, an expf and a rescale every chunk). Contract: ref is
// always a score the row has seen and max - REF_SLACK <= ref <= max, so p <= e^8 ~ 2981 and a row's sum is at
// most e^8 x its tokens: no fp32 overflow, and the output sum(p v) / sum(p) is the softmax with the same
// relative rounding (bf16 weights keep 8 significant bits at any magnitude; weights are e^(s - ref) within ~1e-4
// relative before that rounding, ~1e-5 where PLO keeps 16 bits, exp2_weights in fast_simd.h, and a weight below
// e^-87 is 0, next to the row's largest weight, which is >= 1). The partition combine takes (ref, sum, acc) as it
// takes (max, sum, acc): any common reference gives the same quotient. The tests' tolerances against reference.py
// are unchanged (tests/kernels/test_fused_attention.py).

static const float REF_SLACK = 8.0f;   // the lazy reference moves when a score exceeds it by more than this

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
        __m512 pj = exp2_weights<!PLO>(s[j], log2e, ref2);  // PLO keeps ~16 bits of each weight
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

#endif  // KV8_FAST
