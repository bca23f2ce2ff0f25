// Prefill items of the caches whose codes are not bf16 values (K and V in one such format, or each in its own: a
// pair's K tiles are staged from K's format and its V tiles from V's) -- int8 and int4 per token and head, int4_per_group32,
// fp4_e2m1 (kv_staged) -- on the tile kernel (item_tile.h, and for D <= 128 its prefill loop, item_prefill.h): each
// K / V tile the kernel reads is first decoded to bf16 rows in an L1 buffer (stage_tile), which the kernel then reads
// as it reads a bf16 cache's tiles, with the same arithmetic (bf16 x bf16 products, fp32 sums). Decode-sized items
// keep the decode kernel (item_decode.h), or the fp32 kernels where it does not serve them (run_item_coded).
//
//   stored row (D / 2 code bytes [+ group scales])  --row_to_bf16-->  D bf16 (natural channel order)
//   16 such rows = a bf16 tile  -->  decode_k_pairs / decode_k_tile / decode_v_tile / tile_pv_fused of KV_BF16
//
// The tile kernel runs on a view of the problem whose kv is KV_BF16 (staged_view): its register layouts, query
// slots (q_parts16) and output channel order are a bf16 cache's; the row size, the per-token scales and every
// pointer stay the stored format's, so tile_rows walks the real cache and the staged decoders read the real rows.
//
// Values and scales:
// * int8 / int4 per token and head: every code is a bf16 exactly (|code| <= 127); the per-token scales multiply the
//   scores (K: the score factor of each token, ChunkWalk::score_factors) and the softmax weights before they round
//   to bf16 (V: prefill_row), exactly as the decode kernel and FP8 with dynamic scales do.
// * fp4_e2m1: code x its group's E4M3 scale, folded into the bf16 value: exact (an E2M1 value has at most 2
//   significant bits, an E4M3 scale at most 4, and their product lies within bf16's exponent range).
// * int4_per_group32: bf16(code x its group's float16 scale), rounded to nearest even -- the one rounding this path
//   adds (2^-9 relative per value; code x scale has up to 14 significant bits). The decode kernel applies the group
//   scales in fp32 instead. With bf16 compute the output is bf16 (2^-9 relative) anyway; fp16 / fp32 compute
//   promises ~16 significant bits, so those items keep the generic kernel (staged_serves).
//
// Where the call grants AMX (Problem::amx), the prefill loop reads these tiles on AMX tiles (item_prefill_amx.h), as
// it reads a bf16 cache's: the staged tiles are in the same pair and P.V layouts, and the per-token scales ride on
// the score factors and the weights as above.
#pragma once

#include "item_tile.h"

#if KV8_FAST

// Whether the tile kernel reads format kv through bf16 staging: integer codes (per token and head) and the
// group-scaled formats.
static constexpr bool kv_staged(int kv) { return KV_FORMATS[kv].ibits != 0 || KV_FORMATS[kv].group != 0; }

// Whether every staged value of format kv is the exact value of its code times its scale (all but
// int4_per_group32, whose code x float16 scale rounds to bf16).
static constexpr bool kv_staged_exact(int kv) { return kv_staged(kv) && KV_FORMATS[kv].gscale != 2; }

// Whether one side of a K/V pair can be staged: the staged formats, and the bf16-exact ones (FP8: each code's bf16
// value from a table; bf16: a copy) -- a pair of an FP8 or bf16 side with an integer or group-scaled one runs the
// tile kernel on staged tiles of both sides. (A cache of one FP8 or bf16 format reads its tiles directly.)
static constexpr bool kv_pair_stageable(int kv) { return kv_staged(kv) || kv_bf16_exact(kv); }

// Whether staged tiles serve items of P: both sides staged formats (K's and V's, the same one; or a pair of
// kv_pair_stageable formats), and bf16 compute or formats whose staged values are exact.
static inline bool staged_serves(const Problem& P) {
    const bool both = P.vkv == P.kv ? kv_staged(P.kv) : kv_pair_stageable(P.kv) && kv_pair_stageable(P.vkv);
    const bool exact = (kv_staged_exact(P.kv) || kv_bf16_exact(P.kv)) && (kv_staged_exact(P.vkv) ||
                                                                           kv_bf16_exact(P.vkv));
    return both && (exact || P.q_dtype == DT_BF16);
}

// The bf16 bits of each code of FP8 format KV (every FP8 value is a bf16: at most 3 mantissa bits; NaN -> 0x7FC0).
template <int KV>
static const uint16_t* fp8_bf16_bits() {
    static const struct Table {
        uint16_t bits[256];
        Table() {
            for (int c = 0; c < 256; ++c) bits[c] = f_bf16(fp8_value(KV, c));
        }
    } table;
    return table.bits;
}

// The fp32 values of a nibble (0..15, the even channel in a byte's low half): int4 ((n ^ 8) - 8) or E2M1.
template <int KV>
static inline __m512 nibble_values() {
    alignas(64) float t[16];
    for (int i = 0; i < 16; ++i) t[i] = nibble_value(KV, i);
    return _mm512_load_ps(t);
}

// 32 bf16 in natural order from the fp32 values of the even channels (ev lane i: channel 2i) and the odd ones.
static inline __m512i interleave_bf16(__m512 ev, __m512 od) {
    alignas(64) static constexpr uint16_t IDX[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
                                                     8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i h = (__m512i)_mm512_cvtne2ps_pbh(od, ev);  // words 0..15: ev, 16..31: od
    return _mm512_permutexvar_epi16(_mm512_load_si512(IDX), h);
}

// One stored row of format KV (D % 16 == 0) -> its D values as bf16, channel d at out[d]: the codes, times their
// group's scale for the group-scaled formats (rounded to nearest even: exact but for int4_per_group32). The
// per-token scales of int8 / int4 are not applied here (the kernel applies them to the scores and weights).
template <int KV>
static inline void row_to_bf16(const uint8_t* row, int D, uint16_t* out) {
    constexpr KvFormat F = KV_FORMATS[KV];
    if constexpr (F.elem == DT_BF16) {  // a pair's bf16 side: the row as it is
        memcpy(out, row, sizeof(uint16_t) * (size_t)D);
    } else if constexpr (F.fp8) {  // a pair's FP8 side: each code's bf16 value (exact), from a table
        const uint16_t* bits = fp8_bf16_bits<KV>();
        for (int d = 0; d < D; ++d) out[d] = bits[row[d]];
    } else if constexpr (F.ibits == 8) {
        int d = 0;
        for (; d + 32 <= D; d += 32) {
            const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row + d))));
            const __m512 b = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row + d + 16))));
            _mm512_storeu_si512(out + d, (__m512i)_mm512_cvtne2ps_pbh(b, a));
        }
        if (d < D) {  // the last 16 channels
            const __m512 a = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(row + d))));
            _mm256_storeu_si256((__m256i*)(out + d), (__m256i)_mm512_cvtneps_pbh(a));
        }
    } else {  // two nibbles a byte: 32 channels (16 bytes) at a time, the last 16 (8 bytes) apart
        const __m512 T = nibble_values<KV>();
        const uint8_t* scales = row + D / 2;
        for (int d = 0; d < D; d += 32) {
            const bool half = D - d < 32;
            const __m128i bytes = _mm_maskz_loadu_epi8(half ? 0x00FF : 0xFFFF, row + d / 2);
            const __m512i x = _mm512_cvtepu8_epi32(bytes);
            __m512 ev = _mm512_permutexvar_ps(x, T);                          // low nibbles: channels d + 2i
            __m512 od = _mm512_permutexvar_ps(_mm512_srli_epi32(x, 4), T);    // high nibbles: d + 2i + 1
            if constexpr (F.gscale == 2) {  // a float16 scale per 32 channels (D % 32 == 0)
                uint16_t h;
                memcpy(&h, scales + 2 * (d / 32), 2);
                const __m512 s = _mm512_set1_ps(f16_f(h));
                ev = _mm512_mul_ps(ev, s);
                od = _mm512_mul_ps(od, s);
            } else if constexpr (F.gscale == 1) {  // an E4M3 scale per 16 channels: lanes 0..7, then 8..15
                const float s0 = fp8_bits<KV_E4M3>(scales[d / 16]);
                const float s1 = half ? 0.0f : fp8_bits<KV_E4M3>(scales[d / 16 + 1]);
                const __m512 s = _mm512_insertf32x8(_mm512_set1_ps(s0), _mm256_set1_ps(s1), 1);
                ev = _mm512_mul_ps(ev, s);
                od = _mm512_mul_ps(od, s);
            }
            const __m512i v = interleave_bf16(ev, od);
            if (half) _mm256_storeu_si256((__m256i*)(out + d), _mm512_castsi512_si256(v));
            else _mm512_storeu_si512(out + d, v);
        }
    }
}

// The 16 rows of a tile (rows[t]; pad rows are ZERO_ROW) -> bf16 rows in buf (row t at buf + t * D), their pointers
// in out[t]; pad rows stay ZERO_ROW (zeros in every format, D * 2 <= its 4096 bytes).
template <int KV>
static inline void stage_tile(const uint8_t* const* rows, int D, uint16_t* buf, const uint8_t** out) {
    for (int t = 0; t < TILE; ++t) {
        if (rows[t] == ZERO_ROW) {
            out[t] = ZERO_ROW;
            continue;
        }
        row_to_bf16<KV>(rows[t], D, buf + (size_t)t * D);
        out[t] = (const uint8_t*)(buf + (size_t)t * D);
    }
}

static const int STAGE_MAX_D = 1024;  // the tile kernel's largest head dim (pick_item_fn)

// The tile kernel's decoders for format KV: each stages its tile, then runs the bf16 decoder on it.
template <int KV>
struct Staged {
    static void k_tile(const uint8_t* const* rows, int D, __m512i* kbuf) {
        alignas(64) uint16_t buf[TILE * STAGE_MAX_D];
        const uint8_t* b[TILE];
        stage_tile<KV>(rows, D, buf, b);
        decode_k_tile<KV_BF16>(b, D, kbuf);
    }
    static void k_pairs(const uint8_t* const* rows, int D, __m512i* kp) {
        alignas(64) uint16_t buf[TILE * STAGE_MAX_D];
        const uint8_t* b[TILE];
        stage_tile<KV>(rows, D, buf, b);
        decode_k_pairs<KV_BF16>(b, D, kp);
    }
    static void v_tile(const uint8_t* const* rows, int D, __m512i* vbuf) {
        alignas(64) uint16_t buf[TILE * STAGE_MAX_D];
        const uint8_t* b[TILE];
        stage_tile<KV>(rows, D, buf, b);
        decode_v_tile<KV_BF16>(b, D, vbuf);
    }
    template <int RB, bool PLO>
    static void pv_fused(const uint8_t* const* rows, int D, const uint32_t* const* phi, const uint32_t* const* plo,
                         float* const* obuf, const float* alpha) {
        alignas(64) uint16_t buf[TILE * STAGE_MAX_D];
        const uint8_t* b[TILE];
        stage_tile<KV>(rows, D, buf, b);
        tile_pv_fused<KV_BF16, RB, PLO>(b, D, phi, plo, obuf, alpha);
    }

    template <bool PLO>
    static TileDecoders decoders() {
        TileDecoders d;
        d.k = k_tile;
        d.v = v_tile;
        d.kp = k_pairs;
        d.pv_fused[1] = pv_fused<1, PLO>;
        d.pv_fused[2] = pv_fused<2, PLO>;
        d.pv_fused[3] = pv_fused<3, PLO>;
        d.pv_fused[4] = pv_fused<4, PLO>;
        return d;
    }
};

// The problem the tile kernel sees for a staged format: its K and V tiles are bf16 (kv, vkv, esize, vesize); the rows
// (each side's row bytes), scales, pointers and the AMX grant are P's.
static inline Problem staged_view(const Problem& P) {
    Problem V = P;
    V.kv = V.vkv = KV_BF16;
    V.esize = V.vesize = 2;
    return V;
}

// The tile kernel on an item of staged formats (staged_serves(P)): K tiles staged from K's format (k, kp), V tiles
// from V's (v, pv_fused) -- for a cache of one format, all four from it.
template <bool QLO, bool PLO>
static int run_item_staged(const Problem& P, const Item& it, float* ws) {
    TileDecoders dec;
    with_kv_format(P.kv, [&](auto K) {
        constexpr int KV = decltype(K)::value;
        if constexpr (kv_pair_stageable(KV)) dec = Staged<KV>::template decoders<PLO>();
    });
    if (P.vkv != P.kv)
        with_kv_format(P.vkv, [&](auto K) {
            constexpr int KV = decltype(K)::value;
            if constexpr (kv_pair_stageable(KV)) {
                const TileDecoders v = Staged<KV>::template decoders<PLO>();
                dec.v = v.v;
                for (int i = 0; i < 5; ++i) dec.pv_fused[i] = v.pv_fused[i];
            }
        });
    const Problem V = staged_view(P);
    return run_item_tile_with<QLO, PLO>(V, it, ws, dec);
}

#endif  // KV8_FAST
