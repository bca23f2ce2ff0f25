// The decode item kernel: the fast path (AVX-512 BF16) for items of <= 4 rows (a GQA group of <= 4 query
// heads of one new token, or <= 4 query tokens of one head) with bf16 compute, blocks of a multiple of 16
// tokens and D = 64 / 128 / 256 -- every decode step of the supported models. Kept apart from the tile
// kernel (item_tile.h) because each of these properties buys speed (~1.4x the tile loop on decode):
//
// * every tile is 16 consecutive rows of one block, read in place through one base pointer (no row
//   pointers, no K buffer: the K decode is fused into the scores);
// * D is a compile-time constant, so every loop over channels unrolls;
// * the online softmax steps once per chunk of CHUNK_TILES tiles: the scores of the whole chunk come
//   first, so the max, the exponentials and the P.V products of its tiles are independent work (one serial
//   max/rescale step per 64 tokens, not per 16);
// * K and V stream into L2 P.stream tiles ahead (the call's stream_tiles, plan.h), one row's prefetch beside each
//   row read (see decode_tile);
// * an item may hold several KV heads of its sequence (Item::nh): chunk by chunk, each head's tiles in turn
//   with its own q, softmax state and output (AvxDecodeHead), so each block's rows of those heads, adjacent in
//   the cache, are read in address order.
//
// Arithmetic as the tile kernel with bf16 compute: the same bf16 products, fp32 accumulation, accumulator
// layout and building blocks (fast_simd.h); the softmax weights are bf16 (the output is bf16), computed by
// exp2_weights as the prefill loop's are.
//
// Integer caches (int8, int4; the tile kernel reads them staged, item_staged.h; int8 also runs item_decode_amx.h's
// kernel, its K decoded as FP8's through the byte table): a code c is a bf16
// exactly (|c| <= 127), so as for FP8 with per-token scales, score = bf16(q) . c (exact products, fp32 sums)
// x softmax scale x the token's K scale, and the token's V scale multiplies its softmax weight before the weight
// rounds to bf16: out = sum_t bf16(p_t vs_t) c_t / sum_t p_t. int4 rows are D / 2 bytes (32 per 64-channel
// chunk), unpacked in registers (int4_k_slots, int4_v_pairs), so a tile reads half an int8 tile's bytes.
// int4 per token and head multiplies in integers instead (kv_int_dot: tile_scores_int, chunk_pv_int): the codes as
// int16 words, q and the weights p_t vs_t as int16 fixed point (one scale per query row; one per row and chunk for
// the weights), vpdpwssd's exact products and int32 sums, then fp32 -- vdpbf16ps issues at a quarter of vpdpwssd's
// rate on the Xeon without AMX, and these products made int4's decode as slow as FP8's there. The fixed point's
// error bounds (fast_simd.h, int4_q_words) are within those of the bf16 q and weights it replaces.
//
// The group-scaled formats: int4_per_group32 (kv_int4_codes, gscale 2: the int4 path's codes and a float16 scale per
// 32 channels of each token) and FP4 (fp4_e2m1, kv_fp4_codes: E2M1 codes in int4's nibble layout, read through a
// word table of their values, each an exact bf16, and an E4M3 scale per 16 channels; fp4_k_scales4 /
// fp4_v_scales16 give them as exact floats). K: slots in group order (group_k_slots: lane k, dword i a channel pair
// of token k's group i / (G / 16) of the chunk; the query slots alike), so a chunk's dot products of 4 tokens sum per
// token and group in one register -- exact products bf16(q) x code, fp32 sums -- multiplied by their tokens' scales
// in fp32 (one fused multiply-add per row, 4 tokens and chunk: each group sum's product with its scale rounds once in
// fp32) before they join the score. V: as for per-token V scales, the scale rides on the softmax weight, per group:
// out = sum_t bf16(p_t s_tg) c_td / sum_t p_t (the weights p in fp32 from decode_weights), so what rounds is the
// weight times the scale to bf16 (relative 2^-9, as FP8's weights round) and the fp32 sums; FP4's V is read one
// group per register in natural channel order (fp4_v_group).
//
// Sliding window: a row's scores outside its [first, limit] positions are masked; the item's first tile
// reads zeros (a zero-padded copy) for its rows before k0, as the last tile does past the context.
//
// K and V in different formats (run_item_decode<KK, VK, D, R>, decode_pair_fn): the scores are K's format's (its row
// bytes, table, query slots and score path), P.V is V's (its row bytes, table, weights and accumulator layout), each
// exactly as in a cache of that format alone; instances for int8 K with int4_per_group32 V ("k8v4") and with int4 V.
#pragma once

#include "fast_simd.h"

#if KV8_FAST

static const int CHUNK_TILES = 4;

// Row t's lines of the tile whose rows start at `ahead` (a head's tile P.stream ahead; NULL: none) into L2.
// Issued one row at a time beside the rows being read: a burst of a tile's 16-32 prefetches stalls the core
// until line-fill buffers free, while prefetches spread over the compute overlap it (a streaming read with the
// work of a decode tile per 2 KB: ~1.1x the work alone this way, ~2x with bursts).
template <int RBYTES>
static inline void stream_row(const uint8_t* ahead, int t) {
    if (ahead)
        for (int b = 0; b < RBYTES; b += 64) prefetch_l2(ahead + t * RBYTES + b);
}

// Scores of R rows against the 16 rows of one tile starting at kb (row stride kv_row_bytes(KV, D)).
template <int KV, int D, int R, bool QLO>
static inline void tile_scores_inplace(const uint8_t* kb, const uint8_t* kahead, const Lut& L, const __m512i* qhi,
                                       const __m512i* qlo, __m512* out) {
    constexpr int RBYTES = (int)kv_row_bytes(KV, D), NS = D / 8, CB = chunk_bytes<KV>();
    // group scales after each row's codes: an E4M3 scale per 16 channels (FP4) or a float16 per 32 (int4_per_group32)
    constexpr int G = KV_FORMATS[KV].group;
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
        for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_setzero_ps();
    constexpr int SPC = chunk_channels<KV>() / 8;  // slots per chunk
    for (int z = 0; z < D / chunk_channels<KV>(); ++z) {
        __m512i fs = _mm512_setzero_si512();   // G: the chunk's 4 scale bytes of each of the tile's rows
        if constexpr (G != 0) fs = fp4_tile_scales(kb + D / 2 + 4 * z, RBYTES);
        for (int g = 0; g < 4; ++g) {
            __m512i in[4], slots[8];
            for (int k = 0; k < 4; ++k) {
                if (z == 0) stream_row<RBYTES>(kahead, 4 * g + k);
                if constexpr (!kv_nibble_codes(KV)) in[k] = _mm512_loadu_si512(kb + (4 * g + k) * RBYTES + z * CB);
            }
            if constexpr (G != 0) group_k_slots<G>(kb + 4 * g * RBYTES + z * CB, RBYTES, L, slots);
            else if constexpr (kv_int4_codes(KV)) int4_k_slots(kb + 4 * g * RBYTES + z * CB, RBYTES, L.lo0, slots);
            else k_chunk_slots<KV>(in, L, slots);
            if constexpr (G != 0) {   // lane (k, i) of a slot's products: token 4g + k's group i / (G / 16) of the chunk
                const __m512 sc = G == 16 ? fp4_k_scales4(fs, g) : i4g_k_scales4(fs, g);   // lane 4k + i: its scale
                for (int r = 0; r < R; ++r) {
                    __m512 part = _mm512_setzero_ps();
                    for (int l = 0; l < SPC; ++l) {
                        const int s = r * NS + SPC * z + l;
                        part = _mm512_dpbf16_ps(part, as_bh(qhi[s]), as_bh(slots[l]));
                        if (QLO) part = _mm512_dpbf16_ps(part, as_bh(qlo[s]), as_bh(slots[l]));
                    }
                    acc[r][g] = _mm512_fmadd_ps(part, sc, acc[r][g]);
                }
            } else {
                for (int l = 0; l < SPC; ++l)
                    for (int r = 0; r < R; ++r) {
                        const int s = r * NS + SPC * z + l;
                        acc[r][g] = _mm512_dpbf16_ps(acc[r][g], as_bh(qhi[s]), as_bh(slots[l]));
                        if (QLO) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], as_bh(qlo[s]), as_bh(slots[l]));
                    }
            }
        }
    }
    for (int r = 0; r < R; ++r) out[r] = reduce_scores(acc[r]);
}

// obuf (R rows x D accumulators) = obuf * alpha + P . V over the nt tiles of a chunk (V tile j at vb[j], its
// stream ahead at vahead[j]; weights of row r, tile j: dwords (r * CHUNK_TILES + j) * 8 of phi, bf16 pairs of
// tokens 2u, 2u + 1). int4_per_group32: the weights in fp32 instead, row r's tile j at pf + (r * CHUNK_TILES + j)
// * 16, times each group's scales and rounded to bf16 pairs here (registers 0, 1 of a chunk: group 2z; 2, 3: 2z + 1).
// FP4: the same with its E4M3 scales, register q of a chunk (fp4_v_group) group 4z + q.
template <int KV, int D, int R>
static inline void chunk_pv_inplace(const uint8_t* const* vb, const uint8_t* const* vahead, int nt, const Lut& L,
                                    const uint32_t* phi, const float* pf, float* obuf, const float* alpha) {
    constexpr int RBYTES = (int)kv_row_bytes(KV, D), CB = chunk_bytes<KV>();
    constexpr int NV = chunk_accs<KV>();  // accumulators per chunk of a row
    constexpr bool GS = KV_FORMATS[KV].gscale == 2, F4 = kv_fp4_codes(KV);
    constexpr int NG = GS ? 2 : F4 ? 4 : 1;   // weight vectors per row and tile of a chunk: one per group
    for (int z = 0; z < D / chunk_channels<KV>(); ++z) {
        __m512 acc[R][NV];
        for (int r = 0; r < R; ++r) {
            __m512 a = _mm512_set1_ps(alpha[r]);
            for (int m = 0; m < NV; ++m) acc[r][m] = _mm512_mul_ps(_mm512_load_ps(obuf + r * D + (z * NV + m) * 16), a);
        }
        for (int j = 0; j < nt; ++j) {
            const uint8_t* v0 = vb[j] + z * CB;
            alignas(64) uint32_t pw[GS || F4 ? R : 1][NG][8];   // row r's bf16 weight pairs of group h, pair u
            if constexpr (F4) {
                const __m512i x = fp4_tile_scales(vb[j] + D / 2 + 4 * z, RBYTES);
                for (int q = 0; q < 4; q += 2) {   // groups q, q + 1: one conversion
                    const __m512 s0 = fp4_v_scales16(x, q), s1 = fp4_v_scales16(x, q + 1);
                    for (int r = 0; r < R; ++r) {
                        const __m512 p = _mm512_loadu_ps(pf + (r * CHUNK_TILES + j) * 16);
                        _mm512_store_si512((__m512i*)pw[r][q], (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(p, s1),
                                                                                             _mm512_mul_ps(p, s0)));
                    }
                }
            } else if constexpr (GS) {
                for (int h = 0; h < 2; ++h) {
                    alignas(32) uint16_t hs[16];
                    for (int t = 0; t < 16; ++t) memcpy(&hs[t], vb[j] + t * RBYTES + D / 2 + 2 * (2 * z + h), 2);
                    const __m512 sv = _mm512_cvtph_ps(_mm256_load_si256((const __m256i*)hs));
                    for (int r = 0; r < R; ++r)
                        _mm256_store_si256((__m256i*)pw[r][h], (__m256i)_mm512_cvtneps_pbh(
                            _mm512_mul_ps(_mm512_loadu_ps(pf + (r * CHUNK_TILES + j) * 16), sv)));
                }
            }
            for (int u = 0; u < 8; ++u) {
                if (z == 0) {
                    stream_row<RBYTES>(vahead[j], 2 * u);
                    stream_row<RBYTES>(vahead[j], 2 * u + 1);
                }
                __m512i v[4];
                if constexpr (F4) {
                    const __m512i ab = load_rows32(v0 + 2 * u * RBYTES, v0 + (2 * u + 1) * RBYTES);
                    for (int q = 0; q < 4; ++q) v[q] = fp4_v_group(ab, q, L);
                } else if constexpr (kv_int4_codes(KV))
                    int4_v_pairs(v0 + 2 * u * RBYTES, v0 + (2 * u + 1) * RBYTES, L.lo0, v);
                else
                    v_chunk_pairs<KV>(_mm512_loadu_si512(v0 + 2 * u * RBYTES),
                                      _mm512_loadu_si512(v0 + (2 * u + 1) * RBYTES), L, v);
                for (int r = 0; r < R; ++r) {
                    if constexpr (F4) {
                        for (int q = 0; q < 4; ++q) pv_accumulate<1, false>(acc[r] + q, v + q, pw[r][q][u], 0);
                    } else if constexpr (GS) {
                        pv_accumulate<2, false>(acc[r], v, pw[r][0][u], 0);
                        pv_accumulate<2, false>(acc[r] + 2, v + 2, pw[r][1][u], 0);
                    } else {
                        pv_accumulate<NV, false>(acc[r], v, phi[(r * CHUNK_TILES + j) * 8 + u], 0);
                    }
                }
            }
        }
        for (int r = 0; r < R; ++r)
            for (int m = 0; m < NV; ++m) _mm512_store_ps(obuf + r * D + (z * NV + m) * 16, acc[r][m]);
    }
}

// kv_int_dot (int4 per token and head): the scores of R rows against the 16 rows of one tile starting at kb, as
// tile_scores_inplace, in integers: qw (int4_q_words' slots, row r's at qw + r * D / 8) . codes (int4_int_words)
// summed exactly in int32 per 4 tokens and slot, then in fp32 and times the rows' scales qs[r].
template <int D, int R>
static inline void tile_scores_int(const uint8_t* kb, const uint8_t* kahead, __m512i words, const __m512i* qw,
                                   const float* qs, __m512* out) {
    constexpr int RBYTES = (int)kv_row_bytes(KV_I4, D), NS = D / 8;
    __m512i acc[R][4];
    for (int r = 0; r < R; ++r)
        for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_setzero_si512();
    for (int z = 0; z < D / 64; ++z)
        for (int g = 0; g < 4; ++g) {
            if (z == 0)
                for (int k = 0; k < 4; ++k) stream_row<RBYTES>(kahead, 4 * g + k);
            __m512i slots[8];
            int4_k_slots(kb + 4 * g * RBYTES + z * 32, RBYTES, words, slots);
            for (int l = 0; l < 8; ++l)
                for (int r = 0; r < R; ++r) acc[r][g] = _mm512_dpwssd_epi32(acc[r][g], qw[r * NS + 8 * z + l], slots[l]);
        }
    for (int r = 0; r < R; ++r) {
        __m512 f[4];
        for (int g = 0; g < 4; ++g) f[g] = _mm512_cvtepi32_ps(acc[r][g]);
        out[r] = _mm512_mul_ps(reduce_scores(f), _mm512_set1_ps(qs[r]));
    }
}

// kv_int_dot: obuf (R rows x D accumulators) = obuf * alpha + P . V over the nt tiles of a chunk, as
// chunk_pv_inplace, in integers: row r's weights of tile j (fp32, pf + (r * CHUNK_TILES + j) * 16) times the
// tokens' V scales vs[j] as int16 fixed point with one scale per row and chunk (int4_q_words' comment), the codes as
// int16 (int4_int_words), the chunk's products summed exactly in int32, then added to obuf in fp32.
template <int D, int R>
static inline void chunk_pv_int(const uint8_t* const* vb, const uint8_t* const* vahead, int nt, __m512i words,
                                const float* pf, const __m512* vs, bool vscale, float* obuf, const float* alpha) {
    constexpr int RBYTES = (int)kv_row_bytes(KV_I4, D);
    alignas(64) uint32_t pw[R][CHUNK_TILES][8];   // row r's int16 weight pairs (tokens 2u, 2u + 1) of tile j
    float ws[R];                                  // row r's weight scale
    for (int r = 0; r < R; ++r) {
        __m512 w[CHUNK_TILES], m = _mm512_setzero_ps();
        for (int j = 0; j < nt; ++j) {
            w[j] = _mm512_loadu_ps(pf + (r * CHUNK_TILES + j) * 16);
            if (vscale) w[j] = _mm512_mul_ps(w[j], vs[j]);
            m = _mm512_max_ps(m, w[j]);
        }
        const float mx = _mm512_reduce_max_ps(m);   // weights are >= 0 (0: the row sees nothing of the chunk)
        const __m512 inv = _mm512_set1_ps(mx > 0 ? 32767.0f / mx : 0.0f);
        ws[r] = mx / 32767.0f;
        for (int j = 0; j < nt; ++j)
            _mm256_store_si256((__m256i*)pw[r][j], _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(w[j], inv))));
    }
    for (int z = 0; z < D / 64; ++z) {
        __m512i acc[R][4];
        for (int r = 0; r < R; ++r)
            for (int m = 0; m < 4; ++m) acc[r][m] = _mm512_setzero_si512();
        for (int j = 0; j < nt; ++j) {
            const uint8_t* v0 = vb[j] + z * 32;
            for (int u = 0; u < 8; ++u) {
                if (z == 0) {
                    stream_row<RBYTES>(vahead[j], 2 * u);
                    stream_row<RBYTES>(vahead[j], 2 * u + 1);
                }
                __m512i v[4];
                int4_v_pairs(v0 + 2 * u * RBYTES, v0 + (2 * u + 1) * RBYTES, words, v);
                for (int r = 0; r < R; ++r) {
                    const __m512i p = _mm512_set1_epi32((int)pw[r][j][u]);
                    for (int m = 0; m < 4; ++m) acc[r][m] = _mm512_dpwssd_epi32(acc[r][m], v[m], p);
                }
            }
        }
        for (int r = 0; r < R; ++r) {
            const __m512 a = _mm512_set1_ps(alpha[r]), s = _mm512_set1_ps(ws[r]);
            for (int m = 0; m < 4; ++m) {
                float* o = obuf + r * D + (z * 4 + m) * 16;
                _mm512_store_ps(o, _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][m]), s,
                                                   _mm512_mul_ps(_mm512_load_ps(o), a)));
            }
        }
    }
}

// pad = the tile at src with its rows outside [lead, n) zeroed (RBYTES bytes per row); returns pad.
template <int RBYTES>
static inline const uint8_t* pad_tile(uint8_t* pad, const uint8_t* src, int lead, int n) {
    memset(pad, 0, (size_t)lead * RBYTES);
    memcpy(pad + lead * RBYTES, src + lead * RBYTES, (size_t)(n - lead) * RBYTES);
    memset(pad + n * RBYTES, 0, (size_t)(TILE - n) * RBYTES);
    return pad;
}

// prefetch_tile for this kernel's tiles, which never cross a block (blocks of a multiple of TILE tokens): one
// block-table read, then the tile's rows from the item's k0 on -- a few instructions where the general loop
// walks the table per run of rows.
template <int KRB, int VRB, bool K, bool V, bool L2>
static inline void prefetch_block_tile(const Problem& P, const Item& it, const int64_t* table, int64_t t0) {
    if (t0 >= it.t1) return;
    const int64_t row0 = head_row(P, it, table, t0);
    if (row0 < 0) return;
    const int lead = it.k0 > t0 ? (int)(it.k0 - t0) : 0;
    const int n = (int)(it.t1 - t0 < TILE ? it.t1 - t0 : TILE);
    prefetch_rows<K, V, L2>(P, row0 + lead, n - lead, KRB, VRB);
}

// Tiles of the chunk at c0: CHUNK_TILES but at the item's end.
static inline int chunk_tiles(const Item& it, int64_t c0) {
    const int64_t left = (it.t1 - c0 + TILE - 1) / TILE;
    return left < CHUNK_TILES ? (int)left : CHUNK_TILES;
}

// The item's row of block table, once the K and V of its heads' first P.stream tiles are on their way into
// L1 (decode_tile's stream goes on from there). K rows of KRB bytes, V rows of VRB.
template <int KRB, int VRB>
static inline const int64_t* item_table(const Problem& P, const Item& it) {
    const int64_t* table = P.bt + (int64_t)it.seq * P.bt_stride;
    for (int p = 0; p < P.stream; ++p)
        for (int h = 0; h < it.nh; ++h) {
            Item one = it;
            one.kvh += h;
            prefetch_block_tile<KRB, VRB, true, true, false>(P, one, table, it.t0 + p * TILE);
        }
    return table;
}

// One tile of a decode item (16 rows of one block): where its K and V rows start, the rows the item reads
// (have = [lead, n)), the factor of its scores (the score factor, times the per-token K scales where the cache
// has them: kf) and the per-token V scales (vs, only then); ka / va: the rows of the same head's tile
// P.stream ahead, for the kernel to stream (stream_row) as it reads this tile (NULL past the item, or where
// that block id is outside the cache: decode_tile reports it when the kernel gets there).
struct DecodeTile {
    const uint8_t* k;
    const uint8_t* v;
    const uint8_t* ka;
    const uint8_t* va;
    int lead, n;
    __mmask16 have;
    __m512 kf, vs;
};

// The tile at t0 of one head's item `it`. ERR_BLOCK_ID for a block id outside the cache. The kernels' only
// prefetches past item_table's are the stream: each block's rows of one head are adjacent, and an item of several
// heads reads their rows of a block in address order. K rows of KRB bytes, V rows of VRB.
template <int KRB, int VRB>
static inline int decode_tile(const Problem& P, const Item& it, const int64_t* table, int64_t t0, float sfac,
                              DecodeTile& T) {
    T.ka = T.va = nullptr;
    const int64_t ta = t0 + (int64_t)P.stream * TILE;
    const int64_t ra = ta < it.t1 ? head_row(P, it, table, ta) : -1;
    if (ra >= 0) {
        T.ka = P.kc + ra * KRB;
        T.va = P.vc + ra * VRB;
        if (P.kts) prefetch_l2(P.kts + ra);  // the tile's per-token scales: one line each
        if (P.vts) prefetch_l2(P.vts + ra);
    }
    const int64_t row0 = head_row(P, it, table, t0);
    if (row0 < 0) return ERR_BLOCK_ID;
    T.k = P.kc + row0 * KRB;
    T.v = P.vc + row0 * VRB;
    T.n = (int)(it.t1 - t0 < TILE ? it.t1 - t0 : TILE);
    T.lead = it.k0 > t0 ? (int)(it.k0 - t0) : 0;  // rows before k0 (first tile only)
    T.have = lane_range(T.lead, T.n);
    T.kf = _mm512_set1_ps(sfac);
    T.vs = _mm512_set1_ps(1.0f);
    if (P.kts) T.kf = _mm512_mul_ps(T.kf, _mm512_maskz_loadu_ps(T.have, P.kts + row0));
    if (P.vts) T.vs = _mm512_maskz_loadu_ps(T.have, P.vts + row0);
    return OK;
}

// The online-softmax step of one row on the scores s[j] of a chunk's nt tiles (-inf where masked: valid[j]):
// the chunk's max moves the row's max mx (alpha: the factor of its output accumulators and of sum), the weights
// e^(s - mx) (exp2_weights) add to sum and are written as bf16 -- times the per-token V scales vs[j] when
// vscale -- tile j's 16 at dst + (j / 2) * pair_stride + (j % 2) * 16, and in fp32 (unscaled) at pf + 16 j where
// pf is not NULL. A row that sees nothing of the chunk keeps its max and gets zero weights. Returns alpha.
static inline float decode_weights(const __m512* s, const __mmask16* valid, const __m512* vs, bool vscale, int nt,
                                   float& mx, __m512& sum, uint16_t* dst, int pair_stride, float* pf = nullptr) {
    __m512 m = s[0];
    for (int j = 1; j < nt; ++j) m = _mm512_max_ps(m, s[j]);
    const float cm = _mm512_reduce_max_ps(m);
    if (cm == -INFINITY) {  // the row sees nothing of this chunk (a multi-token item's early rows)
        for (int j = 0; j < nt; ++j) _mm256_store_si256((__m256i*)(dst + (j / 2) * pair_stride + (j % 2) * 16),
                                                        _mm256_setzero_si256());
        if (pf)
            for (int j = 0; j < nt; ++j) _mm512_storeu_ps(pf + 16 * j, _mm512_setzero_ps());
        return 1.0f;
    }
    const float mnew = cm > mx ? cm : mx;
    const float alpha = mnew == mx ? 1.0f : expf(mx - mnew);
    mx = mnew;
    const __m512 log2e = _mm512_set1_ps(LOG2E), m2 = _mm512_set1_ps(mnew * LOG2E);
    __m512 psum = _mm512_setzero_ps();
    for (int j = 0; j < nt; ++j) {
        // fp32 weights (pf) multiply int V codes: the 16-bit-precise form there
        __m512 p = _mm512_maskz_mov_ps(valid[j], pf ? exp2_weights<false>(s[j], log2e, m2)
                                                    : exp2_weights<true>(s[j], log2e, m2));
        psum = _mm512_add_ps(psum, p);
        if (pf) _mm512_storeu_ps(pf + 16 * j, p);
        if (vscale) p = _mm512_mul_ps(p, vs[j]);  // per-token V scale rides on the weight
        _mm256_store_si256((__m256i*)(dst + (j / 2) * pair_stride + (j % 2) * 16), (__m256i)_mm512_cvtneps_pbh(p));
    }
    sum = _mm512_fmadd_ps(sum, _mm512_set1_ps(alpha), psum);
    return alpha;
}

// What one KV head of a decode item carries from chunk to chunk, in both decode kernels: its one-head item,
// score factor, the rows' running max and sum, and the output accumulators (each kernel adds its form of q).
template <int D, int R>
struct DecodeHeadState {
    Item it;
    alignas(64) float obuf[R * D];
    float sfac, mx[R];
    __m512 sum[R];

    // Head hd of `item`, nothing seen yet (sfac is the kernel's to set).
    void start(const Item& item, int hd) {
        it = head_item(item, hd, R, D);
        for (int r = 0; r < R; ++r) {
            mx[r] = -INFINITY;
            sum[r] = _mm512_setzero_ps();
        }
        memset(obuf, 0, sizeof(obuf));
    }

    // The head's rows, finished (nat: D floats of scratch).
    template <int KV>
    void finish(const Problem& P, const Rows& w, float* nat, float* ws) const {
        for (int r = 0; r < R; ++r) {
            natural_order(KV, obuf + r * D, D, D, nat);
            finish_row(P, it, w, r, nat, mx[r], _mm512_reduce_add_ps(sum[r]), ws);
        }
    }
};

// The AVX-512 kernel's head: q as prep_rows' slots (the per-channel K scales folded in).
template <int D, int R>
struct AvxDecodeHead : DecodeHeadState<D, R> {
    static constexpr int NS = D / 8;
    alignas(64) __m512i qhi[R * NS], qlo[R * NS];
    float qs[R];   // kv_int_dot: qhi holds int4_q_words' slots, row r's scale qs[r] (qlo unused)
};

// The decode kernel on K rows of format KK and V rows of format VK (KK == VK: a cache of one format; else a pair,
// decode_pair_fn): each side read by its own format's code -- K's row bytes, table and score path, V's row bytes,
// table and P.V path.
template <int KK, int VK, int D, int R>
static int run_item_decode(const Problem& P, const Item& item, float* ws) {
    constexpr int KRB = (int)kv_row_bytes(KK, D), VRB = (int)kv_row_bytes(VK, D), CT = CHUNK_TILES;
    if (item.nh < 1 || item.nh > MAX_ITEM_HEADS) return ERR_ARGS;
    // the call's formats: formats of one decode class share the code (kv_decode_class)
    const Lut& L = lut_for(P.kv);
    const Lut& VL = lut_for(P.vkv);
    const Rows w = rows_of(P, item);
    alignas(64) float nat[D], kscale[D];
    alignas(64) uint32_t phi[R * CT * 8];
    constexpr bool GS = KV_FORMATS[VK].group != 0;   // V's group scales (int4_per_group32, FP4): on the weights per group
    // int4 per token and head: integer products (tile_scores_int for K, chunk_pv_int for V)
    constexpr bool KINT = kv_int_dot(KK), VINT = kv_int_dot(VK);
    alignas(64) float pf[GS || VINT ? R * CT * 16 : 1];   // the weights in fp32 there (chunk_pv_inplace, chunk_pv_int)
    const __m512i kwords = KINT ? int4_int_words() : L.lo0;
    const __m512i vwords = VINT ? int4_int_words() : VL.lo0;
    // Zero-padded copies of partial tiles. V is read after the chunk's scores, and the first tile (rows before
    // k0) and the last (rows past the context) can share a chunk, so each has its own V copy.
    alignas(64) uint8_t pad_k[TILE * KRB], pad_v_first[TILE * VRB], pad_v_last[TILE * VRB];
    AvxDecodeHead<D, R> heads[MAX_ITEM_HEADS];
    float alpha[R];
    int64_t lo[R], lim[R];  // the same for every head (positions)

    const bool kch = k_per_channel(P);
    for (int hd = 0; hd < item.nh; ++hd) {
        AvxDecodeHead<D, R>& H = heads[hd];
        H.start(item, hd);
        H.sfac = prep_rows(P, H.it, w, kscale, H.qhi, H.qlo, lo, lim);
        if constexpr (KINT)   // the rows again, as int16 slots
            for (int r = 0; r < R; ++r)
                H.qs[r] = int4_q_words(P, q_row_src(P, H.it, w, r), kch ? kscale : nullptr, H.qhi + r * (D / 8));
    }

    const int64_t* table = item_table<KRB, VRB>(P, item);
    for (int64_t c0 = item.t0; c0 < item.t1; c0 += CT * TILE) {
        const int nt = chunk_tiles(item, c0);
        for (int hd = 0; hd < item.nh; ++hd) {  // the heads' rows of a block lie together: read in order
            AvxDecodeHead<D, R>& H = heads[hd];
            const uint8_t *vb[CT], *vahead[CT];
            __m512 s[R][CT], vsv[CT];
            __mmask16 valid[R][CT];
            for (int j = 0; j < nt; ++j) {
                const int64_t t0 = c0 + j * TILE;
                DecodeTile T;
                if (decode_tile<KRB, VRB>(P, H.it, table, t0, H.sfac, T) != OK) return ERR_BLOCK_ID;
                const uint8_t* kb = T.k;
                vb[j] = T.v;
                vahead[j] = T.va;
                vsv[j] = T.vs;
                if (T.n < TILE || T.lead > 0) {  // rows past the sequence or before the window: read zeros instead
                    kb = pad_tile<KRB>(pad_k, kb, T.lead, T.n);
                    vb[j] = pad_tile<VRB>(T.lead > 0 ? pad_v_first : pad_v_last, vb[j], T.lead, T.n);
                }
                __m512 sc[R];
                if constexpr (KINT) tile_scores_int<D, R>(kb, T.ka, kwords, H.qhi, H.qs, sc);
                else if (kch) tile_scores_inplace<KK, D, R, true>(kb, T.ka, L, H.qhi, H.qlo, sc);
                else tile_scores_inplace<KK, D, R, false>(kb, T.ka, L, H.qhi, H.qlo, sc);
                for (int r = 0; r < R; ++r) {  // visible tokens of this tile: [first - t0, limit - t0] within have
                    valid[r][j] = T.have & lane_range(lo[r] - t0, lim[r] - t0 + 1);
                    s[r][j] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid[r][j], sc[r], T.kf);
                }
            }
            for (int r = 0; r < R; ++r)  // row r's weights: tile j's at dwords (r * CT + j) * 8 of phi
                alpha[r] = decode_weights(s[r], valid[r], vsv, P.vts != nullptr, nt, H.mx[r], H.sum[r],
                                          (uint16_t*)(phi + r * CT * 8), 32, GS || VINT ? pf + r * CT * 16 : nullptr);
            if constexpr (VINT) chunk_pv_int<D, R>(vb, vahead, nt, vwords, pf, vsv, P.vts != nullptr, H.obuf, alpha);
            else chunk_pv_inplace<VK, D, R>(vb, vahead, nt, VL, phi, pf, H.obuf, alpha);
        }
    }
    for (int hd = 0; hd < item.nh; ++hd) heads[hd].template finish<VK>(P, w, nat, ws);
    return OK;
}

// A decode kernel family (AvxDecode here, AmxDecode in item_decode_amx.h): Family::fn<KV, D, R>() is its
// instance for those parameters, Family::serves(kv) whether it reads format kv.
struct AvxDecode {
    template <int KV, int D, int R>
    static ItemFn fn() { return run_item_decode<KV, KV, D, R>; }
    static constexpr bool serves(int kv) { return kv_decode_fast(kv); }
};

// The AVX-512 kernel's instances for K of format KV and V of format VK (a pair; see decode_pair_fn).
template <int VK>
struct AvxDecodeV {
    template <int KV, int D, int R>
    static ItemFn fn() { return run_item_decode<KV, VK, D, R>; }
};

// The family's instance for the problem's cache format, D and item rows R, or NULL where it has none (D other
// than 64 / 128 / 256, more than 4 rows, blocks not a multiple of 16 tokens, compute other than bf16).
template <class Family, int KV>
static ItemFn decode_instance(int D, int R) {
#define KV8_ROWS(DD)                                                   \
    switch (R) {                                                       \
        case 1: return Family::template fn<KV, DD, 1>();               \
        case 2: return Family::template fn<KV, DD, 2>();               \
        case 3: return Family::template fn<KV, DD, 3>();               \
        case 4: return Family::template fn<KV, DD, 4>();               \
        default: return nullptr;                                       \
    }
    switch (D) {
        case 64: KV8_ROWS(64)
        case 128: KV8_ROWS(128)
        case 256: KV8_ROWS(256)
        default: return nullptr;
    }
#undef KV8_ROWS
}

// A cache of one format (P.vkv == P.kv; decode_pair_fn has the pairs).
template <class Family>
static ItemFn decode_family_fn(const Problem& P, int R) {
    if (P.bs % TILE != 0 || P.q_dtype != DT_BF16 || P.vkv != P.kv) return nullptr;
    return with_kv_format(P.kv, [&](auto K) -> ItemFn {
        constexpr int KV = kv_decode_class(decltype(K)::value);  // an instance per class, the tables per format
        if constexpr (Family::serves(KV)) return decode_instance<Family, KV>(P.D, R);
        else return nullptr;
    });
}

// The decode kernel's instance for a pair of formats (K in P.kv, V in P.vkv), or NULL. Instances exist for the pairs
// of an int8 K (per token and head) with a 4-bit V -- int4_per_group32 ("k8v4") or int4 per token and head --
// measured faster than their decode items on staged tiles (docs/benchmarks.md, "K and V in different formats");
// other pairs' decode items run staged (both sides staged formats) or on the generic kernel.
static ItemFn decode_pair_fn(const Problem& P, int R) {
    if (P.bs % TILE != 0 || P.q_dtype != DT_BF16) return nullptr;
    if (P.kv == KV_I8 && P.vkv == KV_I4G) return decode_instance<AvxDecodeV<KV_I4G>, KV_I8>(P.D, R);
    if (P.kv == KV_I8 && P.vkv == KV_I4) return decode_instance<AvxDecodeV<KV_I4>, KV_I8>(P.D, R);
    return nullptr;
}

// The decode item kernel (AVX-512) for this problem and item rows, or NULL where the tile kernel serves.
static ItemFn decode_fn(const Problem& P, int R) {
    return P.vkv == P.kv ? decode_family_fn<AvxDecode>(P, R) : decode_pair_fn(P, R);
}

#endif  // KV8_FAST
