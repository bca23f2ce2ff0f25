// AVX-512 BF16 building blocks shared by the two fast item kernels (item_tile.h with item_prefill.h: any tile
// shape; item_decode.h: decode-sized items). Compiled only when KV8_FAST.
//
// FP8 -> bf16: two in-register 128-entry byte tables (vpermt2b gives the low and the high byte of the bf16
// value, the sign bit is ORed in); every FP8 value is an exact bf16, subnormals and NaN included.
// Integer codes (decode kernel only): int8 as FP8 with tables of the magnitudes 0..127, looked up at |code| with
// the code's sign bit ORed in. int4 (two codes a byte, the even channel in the low nibble) in its own layout: a
// byte permute (vpermt2b / vpermb) puts a row's raw byte under each 16-bit lane, in the order of the transposed K
// slots or of the V token pairs, so it does the K transpose as well; the lane's low nibble (even channel) and,
// shifted by 4, its high nibble (odd channel) index a 32-entry word table (vpermw: bits 0..4, the table repeats
// every 16) of the bf16 values -- one permute per 16 channels and one table look-up per 8 where FP8 takes a
// transpose step and three permutes per 16. The even and the odd channels of 16 land in separate registers, so
// the query slots of an int4 cache hold channels 16p + 2i (slot 2p) and 16p + 2i + 1 (slot 2p + 1) (q_parts16),
// and the V accumulators their own channel map (acc_channel).
// Every code is a bf16 exactly (|code| <= 127); the per-token scales multiply the scores (K) and the softmax
// weights (V), as for FP8 with dynamic scales. int4 per token and head reads the same permutes with a table of int16
// words and multiplies in integers (kv_int_dot, below int4_v_pairs).
// FP4 (E2M1 codes, decode kernel only): int4's nibble layout, its byte permutes and word table with the E2M1 values
// (each an exact bf16), in other orders: K slots whose 128-bit lane k, dword i holds a channel pair of token k's
// group i (group_k_slots), so that the dot products of a chunk sum per token and group in one register, scaled by one
// multiply; V in natural channel order, one register per group of 16 channels (fp4_v_group), so that the group's
// E4M3 scale rides on the weights as int4_per_group32's float16 scale does.
// Products: vdpbf16ps (bf16 x bf16 products are exact in fp32, fp32 accumulation).
//
// Register layouts (a "slot" is 8 channels, 16 bytes of bf16 = one 128-bit lane):
//   q row      qhi[s] / qlo[s]: channels 8s..8s+7 of q (bf16 hi and lo parts), broadcast to the 4 lanes
//   K (scores) one register = 4 tokens x one slot (a 4x4 transpose of 128-bit blocks of 4 rows), so
//              vdpbf16ps gives 4 tokens x 4 partial sums; reduce_scores sums them per token
//   V (P.V)    one register = 16 channels x a pair of tokens (2u, 2u + 1), paired for vdpbf16ps against
//              the broadcast pair of weights; accumulator a holds channel acc_channel(kv, a)
#pragma once

#include "problem.h"
#include "../common/fp8_bf16.h"
#include "../common/simd_exp.h"

#if KV8_FAST

using Lut = Fp8Tables;   // ../common/fp8_bf16.h

// The int8 / 4-bit tables: int8 (the FP8 tables' layout): the bf16 bytes of 0..127 in lo0 / lo1 and hi0 / hi1
// (codes -127..-1 read their magnitude's entry, the sign ORed in); int4: lo0 = 32 words, word i the bf16 of the
// nibble i % 16 ((n ^ 8) - 8, two's complement); FP4: the same with the E2M1 value of nibble i % 16 (exact in bf16).
static Lut int_tables(int kv) {
    alignas(64) uint8_t lo[128] = {0}, hi[128] = {0};
    for (int c = 0; c < 128; ++c) {
        const uint16_t h = f_bf16((float)c);  // exact: |c| <= 127 has at most 7 significant bits
        lo[c] = (uint8_t)(h & 0xFF);
        hi[c] = (uint8_t)(h >> 8);
    }
    alignas(64) uint16_t w4[32];
    for (int i = 0; i < 32; ++i) w4[i] = f_bf16(nibble_value(kv, i & 15));
    Lut t;
    t.lo0 = kv_nibble_codes(kv) ? _mm512_load_si512(w4) : _mm512_load_si512(lo);
    t.lo1 = _mm512_load_si512(lo + 64);
    t.hi0 = _mm512_load_si512(hi);
    t.hi1 = _mm512_load_si512(hi + 64);
    return t;
}

// The code -> bf16 tables of KV format kv, built once (a 16/32-bit format's are zeros, never read).
static const Lut& lut_for(int kv) {
    static const struct Luts {
        Lut of[KV_COUNT];
        Luts() {
            for (int k = 0; k < KV_COUNT; ++k)
                of[k] = KV_FORMATS[k].ibits || kv_nibble_codes(k) ? int_tables(k) : fp8_tables(k);
        }
    } luts;
    return luts.of[kv];
}

// Whether a 64-byte chunk of format kv holds a byte per channel (FP8, int8; int4 reads 32 bytes per 64 channels):
// 64 channels per chunk; else bf16 (32 channels per chunk).
static constexpr bool byte_codes(int kv) { return KV_FORMATS[kv].esize == 1; }

// Softmax weights e^(s - ref) of the prefill loop and the decode kernels, as 2^t with t = s * log2(e) - ref2
// (ref2 = ref * log2(e), one fused multiply-subtract): f = t - floor(t) in [0, 1) (vreduceps, exact), 2^f by a
// polynomial fitted for relative error, times 2^floor(t) by vscalefps (which floors its exponent operand itself).
// BF16 (weights that are then rounded to bf16, 2^-9 relative): degree 3, within 7.6e-5 relative, 7 instructions;
// else (weights kept to ~16 bits or in fp32: the PLO hi + lo weights, the fp32 weights of int V codes): degree 5,
// < 2e-7 relative, 9 instructions; exp_ps of s - ref takes 17. On AMX Xeon prefill calls (SmolLM2, D 128 and
// Gemma-3 shapes, alternating calls of both libraries, 2026-12-01) the degree-3 form over [-0.5, 0.5] was 1.0-1.16x
// faster than degree 5, and vreduceps in place of round-and-subtract 1.0-1.10x more. Precision beyond the polynomial:
// t carries the rounding of the product, |t| x 2^-24 absolute, so a weight is within ~1e-5 relative of
// e^(s - ref) from it (weights down to e^-87; ~2e-7 near the row's maximum); ref2's own rounding scales every
// weight of a row alike, so it cancels in sum(p v) / sum(p). Zero where t < -125 (exp_ps gives 0 below e^-87 for
// the same reason: no subnormal results, each costs a microcode assist with subnormals on) and where t is NaN
// (-inf - -inf, lanes the caller masks). Tested against exp: tests/kernels/test_fused_attention.py
// (test_softmax_weights_against_exp, through kv8_test_softmax_weights).
template <bool BF16>
static inline __m512 exp2_weights(__m512 s, __m512 log2e, __m512 ref2) {
    const __m512 t = _mm512_fmsub_ps(s, log2e, ref2);
    const __mmask16 keep = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-125.0f), _CMP_GE_OQ);
    const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);  // t - floor(t), exact
    __m512 p;
    if constexpr (BF16) {
        p = _mm512_set1_ps(7.8025676310e-2f);
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.2606551647e-1f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9583410025e-1f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9992519617e-1f));
    } else {
        p = _mm512_set1_ps(1.8775899662e-3f);
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(8.9893080294e-3f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5826343596e-2f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.4015361071e-1f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.9315308332e-1f));
        p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.9999994040e-1f));
    }
    return _mm512_maskz_scalef_ps(keep, p, t);  // p x 2^floor(t)
}

// 64 codes (FP8, int8) -> 64 bf16: w0 = codes 0..7 of each 128-bit lane, w1 = codes 8..15 (lane order kept).
// int8: the magnitude's table entry with the code's sign; the code -128 (never stored: the encode clamps to
// +-127) would read as -0.
template <int KV>
static inline void fp8_to_bf16(__m512i c, const Lut& L, __m512i& w0, __m512i& w1) {
    if constexpr (KV_FORMATS[KV].ibits == 8) {
        const __m512i a = _mm512_abs_epi8(c);
        const __m512i lo = _mm512_permutex2var_epi8(L.lo0, a, L.lo1);
        __m512i hi = _mm512_permutex2var_epi8(L.hi0, a, L.hi1);
        hi = _mm512_ternarylogic_epi32(hi, c, _mm512_set1_epi8((char)0x80), 0xF8);  // hi | (c & 0x80)
        w0 = _mm512_unpacklo_epi8(lo, hi);
        w1 = _mm512_unpackhi_epi8(lo, hi);
    } else {  // FP8 (int4 reads through int4_k_slots / int4_v_pairs)
        fp8_table_decode<KV_FORMATS[KV].nan_0x80>(c, L, w0, w1);   // E4M3FNUZ: 0x80 is NaN, not -0
    }
}

// Bytes of one chunk (chunk_channels) of a cache row: 64, or 32 for 4-bit codes (int4, FP4: 64 channels).
template <int KV> constexpr int chunk_bytes() { return kv_nibble_codes(KV) ? 32 : 64; }

// The int4 byte permutes: k: lane k, word i <- byte 32k + i of four 32-byte rows (add 8p for channels 16p..16p+15);
// v[h]: dword i <- byte 16h + i of row a (low word) and of row b (high word) of two 32-byte rows.
struct Int4Index {
    uint8_t k[64], v[2][64];
};
static constexpr Int4Index make_int4_index() {
    Int4Index x{};
    for (int b = 0; b < 64; ++b) {
        x.k[b] = (uint8_t)(32 * (b / 16) + (b % 16) / 2);
        x.v[0][b] = (uint8_t)(32 * ((b / 2) % 2) + b / 4);
        x.v[1][b] = (uint8_t)(32 * ((b / 2) % 2) + 16 + b / 4);
    }
    return x;
}
alignas(64) static constexpr Int4Index INT4_INDEX = make_int4_index();

// Two 32-byte rows in one register (a in the low half).
static inline __m512i load_rows32(const uint8_t* a, const uint8_t* b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a)),
                              _mm256_loadu_si256((const __m256i*)b), 1);
}

// K, int4: one 64-channel chunk (32 bytes) of 4 token rows (row k at p + k * stride) -> 8 slots, token k in lane k:
// slot 2s holds channels 16s + 2i (i = 0..7), slot 2s + 1 channels 16s + 2i + 1. `words`: the word table of the
// codes' values (32 words, word i the value of nibble i % 16): bf16 (Lut::lo0) or int16 (int4_int_words).
static inline void int4_k_slots(const uint8_t* p, int stride, __m512i words, __m512i* slots) {
    const __m512i r01 = load_rows32(p, p + stride), r23 = load_rows32(p + 2 * stride, p + 3 * stride);
    const __m512i idx = _mm512_load_si512(INT4_INDEX.k);
    for (int s = 0; s < 4; ++s) {
        const __m512i x = _mm512_permutex2var_epi8(r01, _mm512_add_epi8(idx, _mm512_set1_epi8((char)(8 * s))), r23);
        slots[2 * s] = _mm512_permutexvar_epi16(x, words);                             // low nibbles
        slots[2 * s + 1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(x, 4), words);   // high nibbles
    }
}

// V, int4: one 64-channel chunk (32 bytes) of the rows of tokens 2u (a) and 2u + 1 (b) -> 4 registers of token
// pairs (words: as int4_k_slots'); register 2h + o, dword i: channel 32h + 2i + o (acc_channel).
static inline void int4_v_pairs(const uint8_t* a, const uint8_t* b, __m512i words, __m512i* v) {
    const __m512i ab = load_rows32(a, b);
    for (int h = 0; h < 2; ++h) {
        const __m512i x = _mm512_permutexvar_epi8(_mm512_load_si512(INT4_INDEX.v[h]), ab);
        v[2 * h] = _mm512_permutexvar_epi16(x, words);
        v[2 * h + 1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(x, 4), words);
    }
}

// ---- int4 per token and head in integers (the decode kernel, kv_int_dot) ----------------------------------------
//
// vdpbf16ps issues at about a quarter of vpdpwssd's rate on the Xeon without AMX (12 independent ones: ~11 ns
// against ~3 ns, the same 32 products each), so int4's decode kernel multiplies its codes as int16 words
// (int4_int_words in int4_k_slots / int4_v_pairs) with vpdpwssd: exact products, exact int32 sums.
// The other operand is a fixed-point form of the float it replaces:
//   q row:   q_d = qs x qi_d, qi_d = round(q_d / qs) with qs = max_d |q_d| / 32767 (one scale per row, int4_q_words);
//            |error| <= qs / 2 per channel, so a score's error is <= 2^-16 max|q| x sum_d |c_d|: under half the
//            bf16 rounding of q's bound (2^-9 sum_d |q_d c_d| >= 2^-9 max|q| |c|, |c| <= 8).
//   weights: w_t = p_t vs_t = ws x wi_t, wi_t = round(w_t / ws), ws = max over a chunk's tokens / 32767 (per row
//            and chunk); |error| <= ws / 2 per token: over the chunk's 64 tokens <= 2^-10 of its largest weight,
//            which the denominator sum_t p_t holds, where bf16 weights err by up to 2^-9 of each.
// A score sum is at most 32767 x 8 x D (< 2^31 for D <= 256) and a chunk's P.V sum 32767 x 8 x 64.
static constexpr bool kv_int_dot(int kv) { return KV_FORMATS[kv].ibits == 4 && KV_FORMATS[kv].group == 0; }

// The int16 word table of the int4 codes: word i = (i % 16 ^ 8) - 8.
static inline __m512i int4_int_words() {
    alignas(64) int16_t w[32];
    for (int i = 0; i < 32; ++i) w[i] = (int16_t)nibble_value(KV_I4, i & 15);
    return _mm512_load_si512(w);
}

// Query row at element src (channels permuted as q_parts16 does for int4; per-channel K scales kscale folded in
// where given) as int16 slots qw[D / 8] (int4_k_slots' channel order, broadcast to the 4 lanes); returns its scale
// qs (q ~= qs x words; NaN where q holds a NaN or an infinity, so that the row's output is NaN as the reference's).
static inline float int4_q_words(const Problem& P, int64_t src, const float* kscale, __m512i* qw) {
    alignas(64) float x[1024];
    __m512 mx = _mm512_setzero_ps();
    __mmask16 bad = 0;   // lanes that held a NaN or an infinity
    for (int d = 0; d < P.D; d += 16) {
        __m512 v;
        if (P.q_dtype == DT_BF16)
            v = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)P.q + src + d))), 16));
        else if (P.q_dtype == DT_F16)
            v = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)P.q + src + d)));
        else
            v = _mm512_loadu_ps((const float*)P.q + src + d);
        if (kscale) v = _mm512_mul_ps(v, _mm512_loadu_ps(kscale + d));
        v = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15), v);
        _mm512_store_ps(x + d, v);
        mx = _mm512_max_ps(mx, _mm512_abs_ps(v));
        bad |= _mm512_fpclass_ps_mask(v, 0x99);   // QNaN, +inf, -inf, SNaN
    }
    const float m = bad ? 0.0f : _mm512_reduce_max_ps(mx);
    const float inv = m > 0 ? 32767.0f / m : 0.0f;
    for (int d = 0; d < P.D; d += 16) {
        const __m256i h = _mm512_cvtepi32_epi16(_mm512_cvtps_epi32(_mm512_mul_ps(_mm512_load_ps(x + d),
                                                                                 _mm512_set1_ps(inv))));
        qw[d / 8] = _mm512_broadcast_i32x4(_mm256_castsi256_si128(h));
        qw[d / 8 + 1] = _mm512_broadcast_i32x4(_mm256_extracti128_si256(h, 1));
    }
    return bad ? NAN : m / 32767.0f;
}

// ---- FP4 (fp4_e2m1) in the decode kernel: the E4M3 group scales, and V one group at a time ----------------------

// The E4M3 codes in bits 24..31 of each dword of t (bits 0..23 zero) -> their values as floats. Exact for every code:
// the magnitude's bits where a float's go, times 2^(127 - 7) (a subnormal code is a float subnormal there, a normal
// after the product: needs DAZ off, FpEnv), the sign bit kept, NaN for magnitudes 0x7f.
static inline __m512 e4m3_top_f32(__m512i t) {
    const __m512i m = _mm512_srli_epi32(_mm512_add_epi32(t, t), 5);   // magnitude << 20
    const __m512 f = _mm512_mul_ps(_mm512_castsi512_ps(m), _mm512_set1_ps(0x1p120f));
    const __m512i sf = _mm512_ternarylogic_epi32(_mm512_castps_si512(f), t, _mm512_set1_epi32(INT32_MIN), 0xF8);
    return _mm512_mask_mov_ps(_mm512_castsi512_ps(sf), _mm512_cmpeq_epi32_mask(m, _mm512_set1_epi32(0x7f << 20)),
                              _mm512_set1_ps(NAN));
}

// The 4 scale bytes of one 64-channel chunk of a tile's 16 rows (row t's at p + t * stride) in dword t.
static inline __m512i fp4_tile_scales(const uint8_t* p, int stride) {
    const __m512i t = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    return _mm512_i32gather_epi32(_mm512_mullo_epi32(t, _mm512_set1_epi32(stride)), p, 1);
}

// K: the scales of tokens 4g..4g+3 (x: fp4_tile_scales) as floats, lane 4k + q = token 4g + k's group q (the lane of
// group_k_slots<16>' sums): byte q of dword 4g + k into the top byte of dword 4k + q.
static inline __m512 fp4_k_scales4(__m512i x, int g) {
    const __m512i idx = _mm512_add_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(16 * g));
    return e4m3_top_f32(_mm512_maskz_permutexvar_epi8(0x8888888888888888ull, _mm512_slli_epi32(idx, 24), x));
}

// V: the scales of group q of one 64-channel chunk of a tile's 16 rows (x: fp4_tile_scales) as floats, lane t =
// token t.
static inline __m512 fp4_v_scales16(__m512i x, int q) {
    return e4m3_top_f32(_mm512_and_si512(_mm512_sllv_epi32(x, _mm512_set1_epi32(24 - 8 * q)),
                                         _mm512_set1_epi32((int)0xFF000000u)));
}

// int4_per_group32's K scales of tokens 4g..4g+3 (x: fp4_tile_scales, row t's two float16 scales of the chunk in
// dword t) as floats, lane 4k + i = token 4g + k's scale of group i / 2 (the lane of group_k_slots<32>' sums).
static inline __m512 i4g_k_scales4(__m512i x, int g) {
    const __m512i idx = _mm512_add_epi16(
        _mm512_set_epi16(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0),
        _mm512_set1_epi16((short)(8 * g)));
    return _mm512_cvtph_ps(_mm512_castsi512_si256(_mm512_permutexvar_epi16(idx, x)));
}

// K slots of the group-scaled formats (group G = 16: FP4's 4 groups per 64 channels; 32: int4_per_group32's 2), in
// group order: lane k, dword i of a slot holds a channel pair of token k's group i / (G / 16) of the chunk, so that a
// chunk's dot products sum per token and group in one register. Slot 2j + n, word 2i + e: the low (n = 0) or high
// nibble of chunk byte group_k_byte<G>(i, j, e), channel 2 x that byte + n.
template <int G>
static constexpr int group_k_byte(int i, int j, int e) {
    return 8 * (G / 16) * (i / (G / 16)) + 2 * (G / 16) * j + 2 * (i % (G / 16)) + e;
}

// The byte permutes: k16[j] / k32[j], lane k, word 2i + e <- byte group_k_byte(i, j, e) of four 32-byte rows (row
// k's at 32k; the same byte in both of a word's bytes); v[q] (FP4 V), dword i <- byte 8q + i / 2 of row a (low word)
// and of row b (high word) of two 32-byte rows.
struct GroupIndex {
    uint8_t k16[4][64], k32[4][64], v[4][64];
};
static constexpr GroupIndex make_group_index() {
    GroupIndex x{};
    for (int q = 0; q < 4; ++q)
        for (int b = 0; b < 64; ++b) {
            const int w = (b % 16) / 2;   // word of the 128-bit lane b / 16
            x.k16[q][b] = (uint8_t)(32 * (b / 16) + group_k_byte<16>(w / 2, q, w % 2));
            x.k32[q][b] = (uint8_t)(32 * (b / 16) + group_k_byte<32>(w / 2, q, w % 2));
            x.v[q][b] = (uint8_t)(32 * ((b / 2) % 2) + 8 * q + b / 8);
        }
    return x;
}
alignas(64) static constexpr GroupIndex GROUP_INDEX = make_group_index();

// K, group-scaled: one 64-channel chunk (32 bytes) of 4 token rows (row k at p + k * stride) -> 8 slots in group
// order, token k in lane k.
template <int G>
static inline void group_k_slots(const uint8_t* p, int stride, const Lut& L, __m512i* slots) {
    const __m512i r01 = load_rows32(p, p + stride), r23 = load_rows32(p + 2 * stride, p + 3 * stride);
    for (int j = 0; j < 4; ++j) {
        const __m512i x = _mm512_permutex2var_epi8(
            r01, _mm512_load_si512(G == 16 ? GROUP_INDEX.k16[j] : GROUP_INDEX.k32[j]), r23);
        slots[2 * j] = _mm512_permutexvar_epi16(x, L.lo0);                             // low nibbles
        slots[2 * j + 1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(x, 4), L.lo0);   // high nibbles
    }
}

// The query slots of group_k_slots<G>, in place: from natural order (slot s: channels 8s..8s+7 in each 128-bit
// lane) to group order (slot 8z + 2j + n, word 2i + e: channel 64z + 2 group_k_byte<G>(i, j, e) + n). D <= 1024.
template <int G>
static inline void group_q_slots(int D, __m512i* x) {
    alignas(64) uint16_t nat[1024];
    for (int s = 0; s < D / 8; ++s) _mm_store_si128((__m128i*)(nat + 8 * s), _mm512_castsi512_si128(x[s]));
    for (int s = 0; s < D / 8; ++s) {
        alignas(16) uint16_t w[8];
        const int z = s / 8, j = (s % 8) / 2, n = s % 2;
        for (int i = 0; i < 4; ++i)
            for (int e = 0; e < 2; ++e) w[2 * i + e] = nat[64 * z + 2 * group_k_byte<G>(i, j, e) + n];
        x[s] = _mm512_broadcast_i32x4(_mm_load_si128((const __m128i*)w));
    }
}

// V, FP4: group q (channels 16q..16q+15) of one 64-channel chunk (32 bytes) of the rows of tokens 2u and 2u + 1
// (ab: load_rows32) -> one register of bf16 token pairs, dword i = channel 16q + i (natural order: the odd
// channels' words shifted to their high nibble before the table look-up).
static inline __m512i fp4_v_group(__m512i ab, int q, const Lut& L) {
    const __m512i x = _mm512_permutexvar_epi8(_mm512_load_si512(GROUP_INDEX.v[q]), ab);
    return _mm512_permutexvar_epi16(_mm512_mask_srli_epi16(x, 0xCCCCCCCCu, x, 4), L.lo0);
}

// 4x4 transpose of 128-bit blocks: out[c] lane k = in[k] lane c.
static inline void transpose4x128(const __m512i in[4], __m512i out[4]) {
    __m512i a = _mm512_shuffle_i64x2(in[0], in[1], 0x44);
    __m512i b = _mm512_shuffle_i64x2(in[0], in[1], 0xEE);
    __m512i c = _mm512_shuffle_i64x2(in[2], in[3], 0x44);
    __m512i d = _mm512_shuffle_i64x2(in[2], in[3], 0xEE);
    out[0] = _mm512_shuffle_i64x2(a, c, 0x88);
    out[1] = _mm512_shuffle_i64x2(a, c, 0xDD);
    out[2] = _mm512_shuffle_i64x2(b, d, 0x88);
    out[3] = _mm512_shuffle_i64x2(b, d, 0xDD);
}

// 64-byte loads of cache rows; masked only for the tail chunk of a head dim that is not a multiple of 64 bytes.
static inline __m512i load_bytes(const uint8_t* p, __mmask64 mk) {
    return mk == ~(__mmask64)0 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(mk, p);
}
// The mask of the first `rem` bytes of a 64-byte chunk (all when rem >= 64).
static inline __mmask64 chunk_mask(int rem) { return rem >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << rem) - 1); }

static inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// Channels of one chunk of a cache row: 64 (FP8, int8, int4) or 32 (bf16); accumulators (16 channels) per chunk.
template <int KV> constexpr int chunk_channels() { return 64 / KV_FORMATS[KV].esize; }
template <int KV> constexpr int chunk_accs() { return chunk_channels<KV>() / 16; }

// K: one chunk of 4 token rows (in[k] = row of token k, load_chunk) -> the chunk's slots, each holding the
// slot's 8 channels of the 4 tokens (token k in lane k): 8 slots (byte codes) or 4 (bf16).
template <int KV>
static inline void k_chunk_slots(const __m512i in[4], const Lut& L, __m512i* slots) {
    __m512i t[4];
    transpose4x128(in, t);
    for (int c = 0; c < 4; ++c) {
        if constexpr (byte_codes(KV)) fp8_to_bf16<KV>(t[c], L, slots[2 * c], slots[2 * c + 1]);
        else slots[c] = t[c];
    }
}

// V: one chunk of the rows of tokens 2u (a) and 2u + 1 (b) (load_chunk) -> chunk_accs<KV>() registers of bf16
// token pairs, register m holding accumulator m of the chunk.
template <int KV>
static inline void v_chunk_pairs(__m512i a, __m512i b, const Lut& L, __m512i* v) {
    if constexpr (byte_codes(KV)) {
        fp8_to_bf16<KV>(_mm512_unpacklo_epi8(a, b), L, v[0], v[1]);
        fp8_to_bf16<KV>(_mm512_unpackhi_epi8(a, b), L, v[2], v[3]);
    } else {
        v[0] = _mm512_unpacklo_epi16(a, b);
        v[1] = _mm512_unpackhi_epi16(a, b);
    }
}

// acc[m] += V pair m x the row's weights of that token pair (bf16 hi, and lo when PLO).
template <int NV, bool PLO>
static inline void pv_accumulate(__m512* acc, const __m512i* v, uint32_t phi, uint32_t plo) {
    const __m512i p = _mm512_set1_epi32((int)phi);
    for (int m = 0; m < NV; ++m) acc[m] = _mm512_dpbf16_ps(acc[m], as_bh(v[m]), as_bh(p));
    if (PLO) {
        const __m512i pl = _mm512_set1_epi32((int)plo);
        for (int m = 0; m < NV; ++m) acc[m] = _mm512_dpbf16_ps(acc[m], as_bh(v[m]), as_bh(pl));
    }
}

// V accumulators per row. Channel maps: byte codes: v = 4z + m, lane 4k + j -> d = 64z + 16k + 4m + j;
//                                       int4:       v = 4z + m, lane i      -> d = 64z + 32(m / 2) + 2i + m % 2;
//                                       FP4:        v,          lane i      -> d = 16v + i (natural);
//                                       bf16:       v = 2z + h, lane 4k + j -> d = 32z + 8k + 4h + j.
static inline int num_vslots(int kv, int D) { return byte_codes(kv) ? 4 * ((D + 63) / 64) : 2 * ((D + 31) / 32); }

static inline int acc_channel(int kv, int a) {
    int v = a >> 4, k = (a >> 2) & 3, j = a & 3;
    if (kv_fp4_codes(kv)) return a;
    if (kv_int4_codes(kv)) return 64 * (v >> 2) + 32 * ((v & 3) >> 1) + 2 * (a & 15) + (v & 1);
    if (byte_codes(kv)) return 64 * (v >> 2) + 16 * k + 4 * (v & 3) + j;
    return 32 * (v >> 1) + 8 * k + 4 * (v & 1) + j;
}

// The nacc accumulators of one row (accumulator layout) -> channels 0..D-1 in natural order. With whole
// 64-byte chunks (D a multiple of 64 for FP8, of 32 for bf16) this is a shuffle of 128-bit blocks: FP8's
// natural register n of chunk z holds block n of accumulators 4z..4z+3 (a 4x4 block transpose); bf16's
// natural registers of chunk z interleave blocks of accumulators 2z and 2z+1; FP4's are in natural order. Otherwise
// element by element.
static inline void natural_order(int kv, const float* acc, int nacc, int D, float* nat) {
    if (kv_fp4_codes(kv)) {   // already natural (acc_channel)
        memcpy(nat, acc, sizeof(float) * (size_t)(nacc < D ? nacc : D));
        return;
    }
    if (byte_codes(kv) && !kv_int4_codes(kv) && D % 64 == 0) {
        for (int z = 0; z < D / 64; ++z) {
            __m512i in[4], out[4];
            for (int m = 0; m < 4; ++m) in[m] = _mm512_loadu_si512(acc + (4 * z + m) * 16);
            transpose4x128(in, out);
            for (int n = 0; n < 4; ++n) _mm512_storeu_si512(nat + 64 * z + 16 * n, out[n]);
        }
        return;
    }
    if (!byte_codes(kv) && D % 32 == 0) {
        const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 2, 3, 10, 11);
        const __m512i hi = _mm512_setr_epi64(4, 5, 12, 13, 6, 7, 14, 15);
        for (int z = 0; z < D / 32; ++z) {
            const __m512i a = _mm512_loadu_si512(acc + (2 * z) * 16), b = _mm512_loadu_si512(acc + (2 * z + 1) * 16);
            _mm512_storeu_si512(nat + 32 * z, _mm512_permutex2var_epi64(a, lo, b));
            _mm512_storeu_si512(nat + 32 * z + 16, _mm512_permutex2var_epi64(a, hi, b));
        }
        return;
    }
    for (int i = 0; i < nacc; ++i) {
        const int d = acc_channel(kv, i);
        if (d < D) nat[d] = acc[i];
    }
}

// acc[g] lane (k, i): token 4g + k, partial i (the layout of a transposed K tile). Sums the partials;
// result lane t = token t.
static inline __m512 reduce_scores(const __m512* acc) {
    const __m512i nat = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m512 x01 = _mm512_add_ps(_mm512_unpacklo_ps(acc[0], acc[1]), _mm512_unpackhi_ps(acc[0], acc[1]));
    __m512 x23 = _mm512_add_ps(_mm512_unpacklo_ps(acc[2], acc[3]), _mm512_unpackhi_ps(acc[2], acc[3]));
    __m512d a = _mm512_castps_pd(x01), b = _mm512_castps_pd(x23);
    __m512 y = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    return _mm512_permutexvar_ps(nat, y);  // lane 4k + j held token 4j + k
}

// Channels d..d+15 of the query at element src (per-channel K scales kscale[d..] folded in when given) as
// bf16 hi and lo parts (lo = bf16 of what hi leaves over).
static inline void q_parts16(const Problem& P, int64_t src, int d, const float* kscale, __m256i& h, __m256i& l) {
    __m512 x;
    if (P.q_dtype == DT_BF16)
        x = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)P.q + src + d))), 16));
    else if (P.q_dtype == DT_F16)
        x = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)P.q + src + d)));
    else
        x = _mm512_loadu_ps((const float*)P.q + src + d);
    if (kscale) x = _mm512_mul_ps(x, _mm512_loadu_ps(kscale + d));
    if (KV_FORMATS[P.kv].ibits == 4)  // int4's slots: the even channels, then the odd (int4_k_slots)
        x = _mm512_permutexvar_ps(_mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15), x);
    h = (__m256i)_mm512_cvtneps_pbh(x);
    __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    l = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(x, hf));
}

static inline void prep_q(const Problem& P, int64_t src, const float* kscale, __m512i* hi, __m512i* lo) {
    for (int d = 0; d < P.D; d += 16) {
        __m256i h, l;
        q_parts16(P, src, d, kscale, h, l);
        int s = d / 8;
        hi[s] = _mm512_broadcast_i32x4(_mm256_castsi256_si128(h));
        hi[s + 1] = _mm512_broadcast_i32x4(_mm256_extracti128_si256(h, 1));
        lo[s] = _mm512_broadcast_i32x4(_mm256_castsi256_si128(l));
        lo[s + 1] = _mm512_broadcast_i32x4(_mm256_extracti128_si256(l, 1));
    }
    if (KV_FORMATS[P.kv].group == 16) {   // the group-scaled formats' slots (group_k_slots)
        group_q_slots<16>(P.D, hi);
        group_q_slots<16>(P.D, lo);
    } else if (KV_FORMATS[P.kv].group == 32) {
        group_q_slots<32>(P.D, hi);
        group_q_slots<32>(P.D, lo);
    }
}

// The element where row r of item `it` starts in q (query head kvh * G + r % G of query token qrow0 + r / G).
static inline int64_t q_row_src(const Problem& P, const Item& it, const Rows& w, int r) {
    const int h = it.kvh * P.G + r % P.G;
    return ((w.qrow0 + r / P.G) * P.Hq + h) * (int64_t)P.D;
}

// Per item: the query rows as bf16 hi / lo slots (D / 8 per row; per-channel K scales folded in, kscale
// [D] filled then), each row's first and last visible positions; returns the factor of the scores (softmax
// scale times a per-tensor / per-head K scale).
static float prep_rows(const Problem& P, const Item& it, const Rows& w, float* kscale, __m512i* qhi,
                       __m512i* qlo, int64_t* lo, int64_t* lim) {
    const int D = P.D, nslots = D / 8;
    const bool kch = k_per_channel(P);
    if (kch)
        for (int d = 0; d < D; ++d) kscale[d] = P.ks[it.kvh * P.ks_hs + d * P.ks_ds];
    for (int r = 0; r < w.R; ++r) {
        const int64_t src = q_row_src(P, it, w, r);
        prep_q(P, src, kch ? kscale : nullptr, qhi + (size_t)r * nslots, qlo + (size_t)r * nslots);
        lim[r] = row_limit(P, it, w, r);
        lo[r] = first_visible(P, lim[r]);
    }
    return P.sm_scale * (kch ? 1.0f : k_head_scale(P, it.kvh));
}

#endif  // KV8_FAST
