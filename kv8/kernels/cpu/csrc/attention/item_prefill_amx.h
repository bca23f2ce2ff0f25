// The prefill loop (item_prefill.h) on AMX tiles: run_item_prefill<false, false, true> runs its chunks in blocks of
// 16 rows (amx_block) where the call grants AMX (Problem::amx) for items of more than 4 rows with bf16 compute, no
// per-channel K scale and D % 64 == 0, D <= 256 (uses_amx_loop; run_item_tile in item_tile.h picks it). The chunk
// walk, K in the pair layout, V in the P.V layout and the row step (prefill_row, tile_chunk.h) are the AVX-512
// loop's; Q.K^T and P.V move to tdpbf16ps. The decode items' AMX kernel is item_decode_amx.h.
#pragma once

#include "tile_chunk.h"

#if KV8_ATTN_AMX
// The AMX form of the prefill loop's blocks (bf16 compute, no per-channel K scale, D % 64 == 0, D <= 256):
// blocks of 16 rows. Tiles (all 16 rows x 64 bytes): 0..3 C (the scores of tile j, then four output
// accumulators), 4 A (32 channels of 16 q rows, or 32 weights of 16 rows), 5 and 6 B (alternating).
// tdpbf16ps sums 16 exact bf16 products per row and column in fp32 per instruction, in k order: the same
// products as the vdpbf16ps blocks, summed in another order. Which items take it: uses_amx_loop (problem.h).

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
#endif  // KV8_ATTN_AMX
