// The decode item kernel on AMX tiles: decode_fn's items (<= 4 rows, bf16 compute, blocks of a multiple of 16
// tokens, D = 64 / 128 / 256) where the call grants AMX (Problem::amx) and the K scales are not per channel. The
// loop of run_item_decode (item_decode.h): chunks of CHUNK_TILES tiles of 16 tokens, one online-softmax step per
// chunk with the same arithmetic (exp2_weights, bf16 weights), the same stream of prefetches (stream_row: FP8 / int8 K as
// it is decoded, a bf16 cache's K beside its S^T tiles, V as its pairs are built); the two products move to
// tdpbf16ps. Why: vdpbf16ps retires ~1.8 G/s per core on the Xeon kv8 is measured on (a microbenchmark of 12
// independent chains), and the AVX-512 kernel issues ~190 per tile of 16 tokens (R = 3, D = 64).
//
// * Scores, transposed: S^T (16 tokens x R rows) = K (A: 16 decoded K rows x 32 channels) x Q^T (B: 16 channel
//   pairs x R rows), over D / 32 steps. K needs only the row-wise table decode (no transposes): its lane order
//   (fp8_to_bf16: w0 = channels 16L..16L+7 of each 128-bit lane L, w1 = 16L+8..16L+15) is applied to q instead
//   when Q^T is built. A bf16 cache's K rows are the A tiles in place. Row r's 16 scores are gathered from the
//   stored S^T (column r).
// * P.V: O (R rows x 16 channels) = P (A: R rows x 32 tokens of bf16 weights) x V (B: 16 token pairs x 16
//   channels: v_chunk_pairs' registers are the pair layout tdpbf16ps wants), per chunk and channel group into a
//   zeroed C tile, then obuf = obuf x alpha + O (the accumulator layout: natural_order as the AVX-512 kernel).
// * Order within a chunk, so that memory round trips overlap other work: K of every tile decoded, then the
//   S^T tiles stored, then V decoded while those stores complete, then the gathers and the softmax, then P.V.
// * Rows outside the item's [k0, t1) are zeros in the decoded K and V (pad_tile for a bf16 cache), masked in
//   the scores, and weigh 0.
// * An item may hold several KV heads of its sequence (Item::nh, item_heads_of in attention.cpp): chunk by
//   chunk, each head's tiles in turn with its own Q^T, scale, softmax state and output (DecodeHead), so the
//   item reads each block's rows of those heads -- adjacent in the cache -- in address order.
// * D = 64: both Q^T steps stay in tiles 1 and 7 for a head's whole chunk (QT_RESIDENT), O uses tiles 5, 6.
// Tiles (configured per item, released when it returns): 0 = K (A) or V (B), 16 x 64 bytes; 1 = Q^T (B) and
// 2 = S^T (C), 16 x 4R bytes; 3, 4 = P (A) of the chunk's two 32-token halves and 5, 6, 7 = O (C), R x 64 bytes
// (7: Q^T's second step where QT_RESIDENT).
// The sums run in another order than the AVX-512 kernel's: KernelLibrary.amx is fixed for an engine's life.
#pragma once

#include "item_decode.h"

#if KV8_ATTN_AMX

struct DecodeTiles {
    DecodeTiles(int R, bool qt_resident) {
        const int rows[8] = {16, 16, 16, R, R, R, R, qt_resident ? 16 : R};
        const int colsb[8] = {64, 4 * R, 4 * R, 64, 64, 64, 64, qt_resident ? 4 * R : 64};
        amx_configure(rows, colsb);
    }
    ~DecodeTiles() { _tile_release(); }
};

// One channel group g of the chunk's P.V into O tile OT: zeroed, the np 32-token halves multiplied, stored as
// R rows of 16 fp32 at cbuf + 16 g (row stride D floats). A macro: the tile intrinsics take literal tile numbers.
#define KV8_PV_GROUP(OT, g)                                                   \
    do {                                                                      \
        _tile_zero(OT);                                                       \
        _tile_loadd(0, vbuf + (size_t)(g) * 16, 64);                          \
        _tile_dpbf16ps(OT, 3, 0);                                             \
        if (np > 1) {                                                         \
            _tile_loadd(0, vbuf + (size_t)(NG + (g)) * 16, 64);               \
            _tile_dpbf16ps(OT, 4, 0);                                         \
        }                                                                     \
        _tile_stored(OT, cbuf + 16 * (g), D * 4);                             \
    } while (0)

// The AMX kernel's head (DecodeHeadState, item_decode.h): q as Q^T.
template <int D, int R>
struct DecodeHead : DecodeHeadState<D, R> {
    static constexpr int STEPS = D / 32;
    alignas(64) uint32_t qt[STEPS * 16 * R];  // Q^T: step s, channel pair k, row r at (s * 16 + k) R + r
};

template <int KV, int D, int R>
static int run_item_decode_amx(const Problem& P, const Item& item, float* ws) {
    constexpr bool coded = byte_codes(KV);  // FP8 or int8: K decoded through the byte table
    constexpr int RBYTES = D * KV_FORMATS[KV].esize, CT = CHUNK_TILES, STEPS = D / 32, NG = D / 16;
    constexpr int NV = chunk_accs<KV>();  // V accumulators (channel groups) per 64-byte chunk of a row
    constexpr bool QT_RESIDENT = STEPS == 2;  // D = 64: both Q^T steps stay in tiles 1 and 7 (O in 5, 6)
    static_assert(CT == 4, "P tiles hold two 32-token halves of a chunk");
    if (item.nh < 1 || item.nh > MAX_ITEM_HEADS) return ERR_ARGS;
    const Lut& L = lut_for(P.kv);
    const Rows w = rows_of(P, item);
    alignas(64) __m512i kbuf[CT][coded ? STEPS * 16 : 1];  // decoded K (coded): tile j, step s, row t at [j][s 16 + t]
    alignas(64) __m512i vbuf[2 * NG * 16];         // decoded V: half h, group g, token pair u at (h NG + g) 16 + u
    alignas(64) float sbuf[CT * 16 * 4];           // S^T of tile j: token t, row r at (j * 16 + t) * 4 + r
    alignas(64) uint16_t pbuf[2 * R * 32];         // weights: half h, row r, token i at (h R + r) 32 + i
    alignas(64) float cbuf[R * D], nat[D];
    alignas(64) uint8_t pad_k_first[coded ? 1 : TILE * RBYTES], pad_k_last[coded ? 1 : TILE * RBYTES];
    alignas(64) uint8_t pad_v_first[TILE * RBYTES], pad_v_last[TILE * RBYTES];
    DecodeHead<D, R> heads[MAX_ITEM_HEADS];
    float alpha[R];
    int64_t lo[R], lim[R];  // the same for every head (positions)

    for (int r = 0; r < R; ++r) {
        lim[r] = row_limit(P, item, w, r);
        lo[r] = first_visible(P, lim[r]);
    }
    for (int hd = 0; hd < item.nh; ++hd) {
        DecodeHead<D, R>& H = heads[hd];
        H.start(item, hd);
        for (int r = 0; r < R; ++r) {
            const int64_t src = ((w.qrow0 + r / P.G) * P.Hq + H.it.kvh * P.G + r % P.G) * (int64_t)D;
            const uint16_t* q = (const uint16_t*)P.q + src;
            for (int s = 0; s < STEPS; ++s)
                for (int k = 0; k < 16; ++k) {
                    // the channel pair at position k of step s's A rows: fp8_to_bf16's lane order, or natural
                    const int c = coded ? 64 * (s / 2) + 16 * (k / 4) + 8 * (s % 2) + 2 * (k % 4) : 32 * s + 2 * k;
                    memcpy(H.qt + (s * 16 + k) * R + r, q + c, 4);  // bf16 channels c, c + 1
                }
        }
        H.sfac = P.sm_scale * k_head_scale(P, H.it.kvh);
    }
    const __m512i gather_rows = _mm512_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28, 32, 36, 40, 44, 48, 52, 56, 60);

    const DecodeTiles tiles(R, QT_RESIDENT);
    const int64_t* table = item_table<RBYTES, RBYTES>(P, item);
    for (int64_t c0 = item.t0; c0 < item.t1; c0 += CT * TILE) {
        const int nt = chunk_tiles(item, c0);
        for (int hd = 0; hd < item.nh; ++hd) {  // the heads' rows of a block lie together: read in order
            DecodeHead<D, R>& H = heads[hd];
            const Item& it = H.it;
            const uint8_t* vb[CT];
            __m512 s[R][CT], vsv[CT];
            __mmask16 valid[R][CT], have[CT];
            // Per tile: the block, K decoded for the A tiles (a bf16 cache's rows are read in place).
            const void* ka[CT];
            const uint8_t *kahead[CT], *vahead[CT];
            __m512 kf[CT];
            for (int j = 0; j < nt; ++j) {
                DecodeTile T;
                if (decode_tile<RBYTES, RBYTES>(P, it, table, c0 + j * TILE, H.sfac, T) != OK) return ERR_BLOCK_ID;
                kahead[j] = coded ? nullptr : T.ka;  // coded: streamed as K is decoded; bf16: beside its S^T tiles
                vahead[j] = T.va;
                const uint8_t* kb = T.k;
                const int lead = T.lead, n = T.n;
                have[j] = T.have;
                kf[j] = T.kf;
                vsv[j] = T.vs;
                const bool partial = n < TILE || lead > 0;
                vb[j] = partial ? pad_tile<RBYTES>(lead > 0 ? pad_v_first : pad_v_last, T.v, lead, n) : T.v;
                if (coded) {
                    __m512i* kd = kbuf[j];
                    for (int t = 0; t < TILE; ++t) {
                        stream_row<RBYTES>(T.ka, t);
                        const bool in = t >= lead && t < n;
                        for (int z = 0; z < D / 64; ++z) {
                            __m512i w0 = _mm512_setzero_si512(), w1 = _mm512_setzero_si512();
                            if (in) fp8_to_bf16<KV>(_mm512_loadu_si512(kb + t * RBYTES + z * 64), L, w0, w1);
                            _mm512_store_si512(kd + (2 * z) * 16 + t, w0);
                            _mm512_store_si512(kd + (2 * z + 1) * 16 + t, w1);
                        }
                    }
                    ka[j] = kd;
                } else {
                    ka[j] = partial ? pad_tile<RBYTES>(lead > 0 ? pad_k_first : pad_k_last, kb, lead, n) : kb;
                }
            }
            // S^T of each tile (A steps 64 bytes apart in a row of RA bytes), stored for the gathers below.
            constexpr int RA = coded ? 64 : RBYTES;
            if (QT_RESIDENT) {
                _tile_loadd(1, H.qt, 4 * R);
                _tile_loadd(7, H.qt + 16 * R, 4 * R);
            }
            for (int j = 0; j < nt; ++j) {
                const char* a = (const char*)ka[j];
                for (int i = 0; i < TILE; ++i) stream_row<RBYTES>(kahead[j], i);
                _tile_zero(2);
                if (QT_RESIDENT) {
                    _tile_loadd(0, a, RA);
                    _tile_dpbf16ps(2, 0, 1);
                    _tile_loadd(0, a + (coded ? 16 * 64 : 64), RA);
                    _tile_dpbf16ps(2, 0, 7);
                } else {
                    for (int st = 0; st < STEPS; ++st) {
                        _tile_loadd(0, a + (coded ? st * 16 * 64 : st * 64), RA);
                        _tile_loadd(1, H.qt + st * 16 * R, 4 * R);
                        _tile_dpbf16ps(2, 0, 1);
                    }
                }
                _tile_stored(2, sbuf + j * 64, 16);
            }
            const int np = (nt + 1) / 2;
            // V of the chunk in the pair layout: half h, group g = z NV + m, pair u = tokens 2u, 2u + 1 of the half.
            for (int h = 0; h < np; ++h)
                for (int u = 0; u < 16; ++u) {
                    const int j = 2 * h + u / 8;
                    __m512i* dst = vbuf + (size_t)h * NG * 16 + u;
                    if (j >= nt) {
                        for (int g = 0; g < NG; ++g) _mm512_store_si512(dst + g * 16, _mm512_setzero_si512());
                        continue;
                    }
                    const int row = 2 * (u % 8);
                    const uint8_t* a = vb[j] + row * RBYTES;
                    for (int i = row; i < row + 2; ++i) stream_row<RBYTES>(vahead[j], i);
                    for (int z = 0; z < RBYTES / 64; ++z) {
                        __m512i v[4];
                        v_chunk_pairs<KV>(_mm512_loadu_si512(a + z * 64), _mm512_loadu_si512(a + RBYTES + z * 64),
                                          L, v);
                        for (int m = 0; m < NV; ++m) _mm512_store_si512(dst + (z * NV + m) * 16, v[m]);
                    }
                }
            for (int j = 0; j < nt; ++j) {
                const int64_t t0 = c0 + j * TILE;
                for (int r = 0; r < R; ++r) {  // visible tokens of this tile: [first - t0, limit - t0] within have
                    valid[r][j] = have[j] & lane_range(lo[r] - t0, lim[r] - t0 + 1);
                    const __m512 sc = _mm512_i32gather_ps(_mm512_add_epi32(gather_rows, _mm512_set1_epi32(r)),
                                                          sbuf + j * 64, 4);
                    s[r][j] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid[r][j], sc, kf[j]);
                }
            }
            // Weights (bf16) of each row into its P rows; tokens past the chunk's last tile weigh 0.
            for (int r = 0; r < R; ++r) {  // row r's weights: half h at pbuf + (h R + r) 32
                alpha[r] = decode_weights(s[r], valid[r], vsv, P.vts != nullptr, nt, H.mx[r], H.sum[r],
                                          pbuf + r * 32, R * 32);
                if (nt % 2)
                    _mm256_store_si256((__m256i*)(pbuf + ((nt / 2) * R + r) * 32 + 16), _mm256_setzero_si256());
            }
            _tile_loadd(3, pbuf, 64);
            if (np > 1) _tile_loadd(4, pbuf + R * 32, 64);
            if (QT_RESIDENT) {
                for (int g = 0; g < NG; g += 2) {
                    KV8_PV_GROUP(5, g);
                    KV8_PV_GROUP(6, g + 1);
                }
            } else {
                for (int g = 0; g < NG; g += 3) {
                    KV8_PV_GROUP(5, g);
                    if (g + 1 < NG) KV8_PV_GROUP(6, g + 1);
                    if (g + 2 < NG) KV8_PV_GROUP(7, g + 2);
                }
            }
            for (int r = 0; r < R; ++r) {
                const __m512 a = _mm512_set1_ps(alpha[r]);
                float* o = H.obuf + r * D;
                for (int d = 0; d < D; d += 16)
                    _mm512_store_ps(o + d, _mm512_fmadd_ps(_mm512_load_ps(o + d), a, _mm512_load_ps(cbuf + r * D + d)));
            }
        }
    }
    for (int hd = 0; hd < item.nh; ++hd) heads[hd].template finish<KV>(P, w, nat, ws);
    return OK;
}
#undef KV8_PV_GROUP

struct AmxDecode {
    template <int KV, int D, int R>
    static ItemFn fn() { return run_item_decode_amx<KV, D, R>; }
    // FP8, bf16 and int8 (|code| <= 127: a bf16 exactly; its per-token scales as FP8's dynamic ones). 4-bit codes
    // keep the AVX-512 kernel.
    static constexpr bool serves(int kv) { return kv_bf16_exact(kv) || KV_FORMATS[kv].ibits == 8; }
};

// The AMX decode item kernel for this problem and item rows, or NULL where it does not serve (decode_fn's
// items, P.amx, K scales not per channel).
static ItemFn decode_amx_fn(const Problem& P, int R) {
    return P.amx && !k_per_channel(P) ? decode_family_fn<AmxDecode>(P, R) : nullptr;
}

#endif  // KV8_ATTN_AMX
