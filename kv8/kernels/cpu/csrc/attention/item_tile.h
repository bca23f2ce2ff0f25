// The tile item kernel: the fast path (AVX-512 BF16) for every item shape -- prefill blocks of up to
// ROWS_PER_ITEM rows, fp16 / fp32 compute, head dims that are a multiple of 16 up to 1024, any block size.
// Items of decode shape with bf16 compute go to item_decode.h instead (see pick_item_fn). It reads FP8 and bf16
// tiles through their own decoders (tile_decoders), and the prefill items of the integer and group-scaled caches
// through tiles decoded to bf16 (item_staged.h: run_item_tile_with on a bf16 view of the problem). Two loops:
//
// The prefill loop (items of more than 4 rows, D <= 128; run_item_prefill): item_prefill.h, and its blocks on AMX
// tiles: item_prefill_amx.h. What the loops share (the chunk walk, P.V, the rows' start and end): tile_chunk.h.
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
// Precision: q is split into bf16 hi + lo parts (QLO; lo skipped when q is bf16 without a per-channel K
// scale: it is zero), so q keeps ~16 significant bits; so do the softmax weights (PLO) when the output is
// fp32 / fp16, while for a bf16 output they are rounded to bf16 once (as precise as the output itself).
// The softmax scale and per-tensor / per-head K scales multiply the 16 scores of a tile once; per-channel K
// scales fold into q; V scales of any granularity multiply the output once; dynamic per-token scales
// multiply the scores (K) and the softmax weights (V). Blocks are scattered, so K and V rows are
// software-prefetched (the prefill loop: one chunk ahead, V apart from K; the chunked loop: max(CT, 2) tiles).
#pragma once

#include "tile_chunk.h"
#include "item_prefill.h"

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

// How the tile kernel reads a cache's tiles: K in the chunked loop's layout (k) and in the prefill loop's pair
// layout (kp), V in the P.V layout (v), and V fused into the P.V product of a decode step of 1..4 rows (pv_fused).
// The format's own decoders for FP8 and bf16 (tile_decoders); item_staged.h's for the formats it decodes to bf16.
struct TileDecoders {
    TileDecoder k = nullptr, v = nullptr;
    KPairDecoder kp = nullptr;
    PvFused pv_fused[5] = {};
};

template <int KV, bool PLO>
static TileDecoders tile_decoders() {
    TileDecoders d;
    d.k = decode_k_tile<KV>;
    d.v = decode_v_tile<KV>;
    d.kp = decode_k_pairs<KV>;
    pick_pv_fused<KV, PLO>(d.pv_fused);
    return d;
}

// The tile kernel on an item of P, whose tiles `dec` decodes into the layouts of format P.kv (FP8 or bf16).
template <bool QLO, bool PLO>
static int run_item_tile_with(const Problem& P, const Item& it, float* ws, const TileDecoders& dec) {
    const TileDecoder decode_k = dec.k, decode_v = dec.v;
    const KPairDecoder decode_kp = dec.kp;
    const PvFused* pv_fused = dec.pv_fused;
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

// The tile kernel on an item of an FP8 or bf16 cache (kv_bf16_exact: the formats pick_item_fn gives it directly).
template <bool QLO, bool PLO>
static int run_item_tile(const Problem& P, const Item& it, float* ws) {
    TileDecoders dec;
    with_kv_format(P.kv, [&](auto K) {
        constexpr int KV = decltype(K)::value;
        if constexpr (kv_bf16_exact(KV)) dec = tile_decoders<KV, PLO>();
    });
    return run_item_tile_with<QLO, PLO>(P, it, ws, dec);
}

#endif  // KV8_FAST
