// The prefill loop of the tile item kernel (run_item_prefill: items of more than 4 rows, D <= 128; run_item_tile in
// item_tile.h sends them here). Per chunk of CHUNK = 4 tiles of 16 tokens: gather each tile's 16 row pointers
// (tile_rows: pad rows read zeros), decode its K once into the pair layout (one register = a channel pair x the 16
// tokens, so vdpbf16ps against a broadcast q pair gives 16 scores in token order, no reduction) and its V once into
// the P.V layout, both shared by all rows; then per block of 4 rows (prefill_block): the 4 x 4 tile scores as 16
// independent accumulators, the online-softmax step on them in registers, and tile_pv. Masks are applied only in
// blocks that need them: some row's causal limit inside the chunk (the diagonal), a window's first position after
// the chunk's start, or an item's last tile ending before 16 tokens; elsewhere every token is visible to every row
// of the block.
//
// With AMX tiles (item_prefill_amx.h) the same loop runs blocks of 16 rows (amx_block) instead of 4. The lazy
// softmax reference its rows keep and the chunk walk: tile_chunk.h.
#pragma once

#include "tile_chunk.h"
#include "item_prefill_amx.h"

#if KV8_FAST

// Items of more than 4 rows with D <= 128 take the prefill loop; D = 256 keeps the chunked tile loop (its K
// tile in the pair layout would be 128 registers per 16 tokens).
static inline bool uses_prefill_loop(int D, int R) { return R > 4 && D <= 128; }

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

// One block of 4 rows x the NT tiles of a chunk: the scores (16 independent vdpbf16ps chains, q pairs
// broadcast from memory), then prefill_row on each row, its weights into phi / plo (row i, tile j at dword
// (i * CHUNK + j) * 16). Returns whether some reference moved.
template <int NT, bool QLO, bool PLO>
static inline bool prefill_block(const PrefillChunk& C, const uint32_t* const* qh, const uint32_t* const* ql,
                                 const int64_t* lo, const int64_t* lim, float* ref, float* sum, uint32_t* phi,
                                 uint32_t* plo, float* alpha) {
    // The sums run in `a`, which nothing takes the address of: with its loops unrolled the compiler keeps it in
    // registers. Written straight into `acc` (whose rows prefill_row reads through a pointer), GCC 12 stored all
    // 16 accumulators to the stack after every channel pair: 16 stores per 16 vdpbf16ps, which bound the loop
    // (half the speed of the P.V product on the AMD EPYC Zen 5).
    __m512 a[4][NT];
#pragma GCC unroll 4
    for (int i = 0; i < 4; ++i)
#pragma GCC unroll 4
        for (int j = 0; j < NT; ++j) a[i][j] = _mm512_setzero_ps();
    for (int p = 0; p < C.npairs; ++p) {
        __m512i k[NT];
#pragma GCC unroll 4
        for (int j = 0; j < NT; ++j) k[j] = _mm512_load_si512(C.kbuf + (size_t)j * C.kstride + p);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) {
            const __m512i q = _mm512_set1_epi32((int)qh[i][p]);
#pragma GCC unroll 4
            for (int j = 0; j < NT; ++j) a[i][j] = _mm512_dpbf16_ps(a[i][j], as_bh(k[j]), as_bh(q));
        }
        if (QLO)
#pragma GCC unroll 4
            for (int i = 0; i < 4; ++i) {
                const __m512i q = _mm512_set1_epi32((int)ql[i][p]);
#pragma GCC unroll 4
                for (int j = 0; j < NT; ++j) a[i][j] = _mm512_dpbf16_ps(a[i][j], as_bh(k[j]), as_bh(q));
            }
    }
    __m512 acc[4][NT];
    for (int i = 0; i < 4; ++i)
        for (int j = 0; j < NT; ++j) acc[i][j] = a[i][j];
    bool moved = false;
    for (int i = 0; i < 4; ++i)
        moved |= prefill_row<NT, PLO>(C, acc[i], lo[i], lim[i], ref[i], sum + (size_t)i * 16,
                                      (char*)(phi + (size_t)i * CHUNK * 16), (char*)(plo + (size_t)i * CHUNK * 16),
                                      64, alpha[i]);
    return moved;
}

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

#endif  // KV8_FAST
