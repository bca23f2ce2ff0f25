// GGUF block-quantized weights (llama.cpp's Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K) multiplied without expanding them,
// included by dense.cpp after elementwise.h (threads_for). Compiled where the build has AVX2 + FMA + F16C (an AVX-512
// build has them too); elsewhere kv8_gguf_linear returns ERR_NO_FAST_PATH and Python uses the torch reference
// (kv8.layers.linear.GGUFLinearMethod: kv8.quant.gguf_blocks.gguf_linear_reference). Not here: the other K-quants
// (Q5_K, Q2_K, ...: the loader dequantizes those tensors) and AMX-INT8 tiles.
//
// Three paths compute the same integer dot products, on the same layout (kv8_gguf_linear_call.path; the build has a
// path where -march gives it its instructions: kv8_gguf_path_available):
//
//   GGUF_PATH_AVX2     "avx2"     8 rows a ymm: _mm256_maddubs_epi16 (pairs of products in int16) then madd to int32
//   GGUF_PATH_VNNI256  "vnni256"  8 rows a ymm: vpdpbusd (AVX-VNNI, or AVX-512 VNNI + VL), products summed in int32
//   GGUF_PATH_VNNI512  "vnni512"  16 rows a zmm (two groups of 8, one 32-byte load of each): AVX-512 VNNI vpdpbusd
//
// Every path computes each (activation row, weight row, block) dot product exactly in int32 and then the same fp32
// operations, in the same order, on it: the paths agree bit for bit (tests/quant/test_gguf_blocks.py checks it), so
// which one runs changes only the speed.
//
// Weights: W [N, K] as the file stores it, row after row, each row K/32 blocks of 32 values (K % 32 == 0):
//
//   Q8_0 (34 B): f16 d | int8 q[32]                 w_j = d * q_j
//   Q4_0 (18 B): f16 d | u8 qs[16]                  w_j = d * (c_j - 8)
//   Q4_1 (20 B): f16 d | f16 m | u8 qs[16]          w_j = d * c_j + m
//   Q5_0 (22 B): f16 d | u32 qh | u8 qs[16]         w_j = d * (c_j + 16 h_j - 16),  h_j = (qh >> j) & 1
//
// with the 4-bit codes c_j = qs[j] & 15 and c_{j+16} = qs[j] >> 4 (j < 16); and the K-quants' super-blocks of 256
// values (K % 256 == 0): Q4_K, 8 sub-blocks s of 32 values, and Q6_K, 16 sub-blocks s of 16:
//
//   Q4_K (144 B): f16 d | f16 dmin | u8 scales[12] | u8 qs[128]     w = d * sc_s * c - dmin * m_s
//   Q6_K (210 B): u8 ql[128] | u8 qh[64] | i8 scales[16] | f16 d    w = d * scales_s * (q - 32)
//
// Q4_K: sc_s, m_s 6 bits each, packed in scales (kv8.quant.gguf_blocks.q4_k_scale_min), c the low (even s) or high
// (odd s) nibbles of qs[32 (s / 2) .. + 31]. Q6_K: q 0..63, a nibble of ql and 2 bits of qh
// (kv8.quant.gguf_blocks.q6_k_codes). GGUF_UNIT counts bytes per weight block (GGUF_BLOCK_VALUES values: 32, or a
// K-quant's 256), so a row has K / GGUF_BLOCK_VALUES * GGUF_UNIT bytes.
//
// Layout (kv8.quant.gguf_blocks.group_blocks, at load: the same number of bytes): the rows in groups of GGUF_ROWS = 8
// (the last group has the rest, g <= 8 rows), each group its weight blocks in order, each weight block the g rows'
// blocks interleaved section by section, a section being the g rows' bytes of one field of the block's canonical
// bytes (gguf_each_section):
//
//   Q8_0: [d x g] [q0..3 x g] [q4..7 x g] .. [q28..31 x g]                    (f16 d of rows 0..g-1, then 4 codes
//   Q4_0: [d x g] [qs0..3 x g] .. [qs12..15 x g]                               of each row at a time)
//   Q4_1: [d x g] [m x g] [qs0..3 x g] .. [qs12..15 x g]
//   Q5_0: [d x g] [qh' x g] [qs0..3 x g] .. [qs12..15 x g]     qh' = qh transposed: bit k of byte i = h_{4k+i}
//   Q4_K: [d x g] [dmin x g] [sc_lo[s] x g] (s < 4) [m_lo[s] x g] [hi[s] x g] [qs0..3 x g] .. [qs124..127 x g]
//         sc_lo[s] = sc_s & 15 | (sc_{s+4} & 15) << 4, m_lo the same for m, and the top 2 bits of sc_s, sc_{s+4},
//         m_s, m_{s+4} in hi[s] (bits 0-1, 2-3, 4-5, 6-7)
//   Q6_K: [d x g] [scales[2b], scales[2b+1] x g] (b < 8), then per block b of 32 values:
//         [lo0..3 x g] .. [lo12..15 x g] [hi0..3 x g] [hi4..7 x g]
//         lo[4k + i] = q(32b + 4k + i) & 15 | (q(32b + 16 + 4k + i) & 15) << 4, and hi[4u + i] the top 2 bits of
//         q(32b + 16u + 4k + i) at bits 2k, 2k + 1 (u < 2, k < 4, i < 4; kv8.quant.gguf_blocks._canonical)
//
// so that in a full group one 32-byte load holds 4 codes of each of the 8 rows (lane r: row r), 8 scales convert
// to float32 in one vcvtph2ps, and every vector lane computes one row: no horizontal sums. The last group (g < 8) is
// widened to 8 rows (zero scales) per call; dequantize gathers a row's blocks back (gguf_gather). vnni512 reads two
// consecutive groups at once, the same section of each into the two 256-bit halves of a zmm (lanes 0-7: the first
// group's rows, 8-15: the second's); an odd last group is paired with itself and its second half dropped. One layout
// serves every path (no repacking per ISA): a zmm costs one 32-byte load more than groups of 16 rows would.
//
// Activations: each row of x is quantized once per call to int8 per block of 32 (a_j = rint(x_j * 127 / amax),
// da = amax / 127, amax the block's largest |x|; a block of zeros has da = 0), kept with da, the codes' sum
// isum = sum_j a_j and sa = da * isum. Then per weight block an exact integer dot product (|a_j| <= 127)
//
//   Q4: dot = sum_j c_j a_j            codes c_j 0..15
//   Q5: dot = sum_j (c_j + 16 h_j) a_j  codes 0..31
//   Q8: dot = sum_j q_j a_j            q_j -128..127
//   Q6_K: dot = sum_{s = 2b, 2b+1} scales_s (sum_{j in s} q_j a_j - 32 hsum_s)    q_j 0..63, hsum_s the sum of the
//         16 activation codes of sub-block s; |dot| <= 2 * 128 * 16 * 32 * 127 < 2^24: exact in int32 and in float
//
// each path its own way, all exact:
//
//   avx2: _mm256_maddubs_epi16 (unsigned codes x signed a) sums pairs of products in int16, which cannot saturate:
//         Q4 |pair| <= 3810 and a lane's 8 pair sums are added in int16 (|.| <= 30480 < 2^15); Q5 |pair| <= 7874,
//         4 of them added; Q8 maddubs of |q| and a with q's sign, |pair| <= 2 * 128 * 127 < 2^15, none added. Then
//         _mm256_madd_epi16 by ones to int32, and int32 adds.
//   vnni256, vnni512: vpdpbusd adds 4 products (unsigned codes x signed a) straight into an int32 lane (|dot| <=
//         32 * 255 * 127 < 2^31). Q8's signed codes as unsigned bytes: q ^ 0x80 = q + 128, and dot = sum_j (q_j +
//         128) a_j - 128 isum (in int32).
//   Q6_K: the codes q (0..63, unsigned) times a, per sub-block of 16: avx2 two maddubs added in int16 (|.| <= 2 *
//         2 * 63 * 127 < 2^15), then madd by the lane's scale (both int16 halves of the lane scales_s) to int32;
//         vnni 4 vpdpbusd, then times scales_s (vpmulld). Both: minus 32 * (madd of the lane's scale pair
//         [scales_2b, scales_2b+1] by the activation block's pair of sub-block sums [hsum_2b, hsum_2b+1]).
//
// converted to float and scaled:
//
//   Q8_0: d da dot   Q4_0: d (da dot - 8 sa)   Q5_0: d (da dot - 16 sa)   Q4_1: d da dot + m sa
//   Q4_K: (d sc_s) da dot - (dmin m_s) sa      Q6_K: d da dot
//
// accumulated in fp32 over the blocks; the bias (fp32) is added and the result rounded to bf16 (nearest-even). Q4_K
// takes each sub-block as a block: its integer dot product with the activation block of the same 32 values, scaled
// by d sc_s; its min term needs that activation block's sum (sa, kept beside da). Q6_K takes each activation block
// of 32 as a block: its two sub-blocks' integer sums, each times its int8 scale, added in int32 (exact; no min term),
// then scaled by d da; its weights d scales_s (q - 32) enter exactly where dequantize_blocks rounds each to float32
// (2^-24 of it, inside the fp32 sums' slack).
//
// Numerics: the only rounding beyond fp32 sums is the activations': |a_j da - x_j| <= da / 2, so each output
// differs from the float32 product of the dequantized weights (kv8.quant.gguf_blocks.gguf_linear_reference) by at
// most sum_blocks da / 2 * sum_j |w_j| plus fp32 summation error, before the one bf16 rounding
// (kv8.quant.gguf_blocks.gguf_activation_bound computes the bound; tests/quant/test_gguf_blocks.py checks it).
//
// Exact: each (row, block) int32 dot product, every path. Rounded in fp32, the same on every path: per weight block
// and activation row, the rows' int32 dot products (gguf_group_tile: 8 rows, gguf_pair_tile: 16), converted and
// multiplied by d da (a vector: the rows' d times the block's da) into one fp32 accumulator, the min terms (m sa,
// -8 d sa, -16 d sa, dmin m_s sa) into another; the row's result is their sum (Q4_K: difference) after the last
// block, plus the bias. Each lane's fp32 operations are the same, in the same order, whatever the path, M, the tile
// of activation rows or the group: a row's bits depend on none of them.
//
// Threads: the groups of 8 rows (vnni512: pairs of groups) are split evenly over the threads (OpenMP, static); each
// thread reads its groups' blocks once per tile of up to 4 activation rows (vnni512: 8, Q4_K and Q6_K 4; one decoded
// weight load feeds each row's dot products).
//
// kv8_gguf_dequantize (gguf_dequantize): the same grouped blocks to float32 W [N, K], exactly
// kv8.quant.gguf_blocks.dequantize_blocks' values; OpenMP over W's rows. GGUFLinearMethod multiplies many activation
// rows with it and a float32 GEMM (the int8 kernel above re-decodes every block per tile of 4 rows; a GEMM on the
// decoded matrix reuses each weight over many rows).

#pragma once

#include <cstdlib>
#include <type_traits>

// The block types of kv8_gguf_linear_call.qtype, by code; their names are the GGUF (gguf.GGMLQuantizationType) names,
// which Python reads from kv8_gguf_type_name (no code copied on the Python side).
enum { GGUF_Q8_0 = 0, GGUF_Q4_0 = 1, GGUF_Q4_1 = 2, GGUF_Q4_K = 3, GGUF_Q5_0 = 4, GGUF_Q6_K = 5, GGUF_TYPE_COUNT = 6 };
static const char* const GGUF_TYPE_NAMES[GGUF_TYPE_COUNT] = {"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_0", "Q6_K"};
static const int GGUF_BLOCK_VALUES[GGUF_TYPE_COUNT] = {32, 32, 32, 256, 32, 256};   // per block: K is a multiple
static const int GGUF_BLOCK = 32;
static const int GGUF_ROWS = 8;    // weight rows per group of the kernel's layout: the 8 float lanes of a vector
static const int GGUF_UNIT[GGUF_TYPE_COUNT] = {34, 18, 20, 144, 22, 210};          // bytes per weight block and row
static const int GGUF_UNIT_MAX = 210;
// Software prefetch distance of gguf_group_tile's weight stream, bytes ahead of the block being read. Measured on an
// AMD EPYC Zen 3, 30 SmolLM2-shaped Q4_1 layers (66 MB, from DRAM), one thread's CPU time: 4096 B ~20% faster than
// none, 8192 ~10%, 1024 ~15%.
static const int GGUF_PREFETCH = 4096;

// K a positive multiple of the type's block (qtype checked first)
static inline bool gguf_bad_shape(int32_t qtype, int64_t in_features) {
    return qtype < 0 || qtype >= GGUF_TYPE_COUNT || in_features <= 0 || in_features % GGUF_BLOCK_VALUES[qtype];
}

// The paths of kv8_gguf_linear_call.path, by code (see the top of this file); Python reads their names from
// kv8_gguf_path_name and which of them this build has from kv8_gguf_path_available (gguf_path_available).
enum { GGUF_PATH_AVX2 = 0, GGUF_PATH_VNNI256 = 1, GGUF_PATH_VNNI512 = 2, GGUF_PATH_COUNT = 3 };
static const char* const GGUF_PATH_NAMES[GGUF_PATH_COUNT] = {"avx2", "vnni256", "vnni512"};

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KV8_GGUF_AVX2 1
#else
#define KV8_GGUF_AVX2 0
#endif
// vpdpbusd on ymm: AVX-512 VNNI + VL (EVEX) or AVX-VNNI (VEX; Alder Lake, Sierra Forest, Zen 5 have it too)
#if KV8_GGUF_AVX2 && ((defined(__AVX512VNNI__) && defined(__AVX512VL__)) || defined(__AVXVNNI__))
#define KV8_GGUF_VNNI256 1
#else
#define KV8_GGUF_VNNI256 0
#endif
#if KV8_GGUF_AVX2 && defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VNNI__)
#define KV8_GGUF_VNNI512 1
#else
#define KV8_GGUF_VNNI512 0
#endif

static inline bool gguf_path_available(int32_t path) {
    return path == GGUF_PATH_AVX2 ? KV8_GGUF_AVX2 : path == GGUF_PATH_VNNI256 ? KV8_GGUF_VNNI256
         : path == GGUF_PATH_VNNI512 ? KV8_GGUF_VNNI512 : false;
}

// A path out of range is ERR_ARGS; one this build does not have, ERR_NO_FAST_PATH (gguf_linear).
static inline int check_args(const kv8_gguf_linear_call& c) {
    if (c.rows < 0 || gguf_bad_shape(c.qtype, c.in_features) || c.out_features <= 0 || c.num_threads <= 0 ||
        c.path < 0 || c.path >= GGUF_PATH_COUNT)
        return ERR_ARGS;
    return c.rows > 0 && (!c.x || !c.blocks || !c.out) ? ERR_ARGS : OK;
}

static inline int check_args(const kv8_gguf_dequantize_call& c) {
    if (c.rows < 0 || gguf_bad_shape(c.qtype, c.in_features) || c.num_threads <= 0) return ERR_ARGS;
    return c.rows > 0 && (!c.blocks || !c.out) ? ERR_ARGS : OK;
}

#if KV8_GGUF_AVX2
#include <immintrin.h>

static inline float gguf_half(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

static inline uint16_t gguf_round_bf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);   // NaN stays NaN
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// One call's activation rows quantized (gguf_quantize_row), nb blocks of 32 per row: qa [M, K] int8 codes, and per
// row and block da [M, nb] the scale, isum [M, nb] the sum of the codes, sa [M, nb] = da * isum, hsum [M, nb] the
// sums of its two halves of 16 codes as two int16 (the first in the low half; Q6_K's sub-blocks).
struct GGUFActs {
    const int8_t* qa;
    const float* da;
    const float* sa;
    const int32_t* isum;
    const int32_t* hsum;
    int64_t nb;
};

static inline int32_t gguf_sum_epi32(__m256i v) {   // the 8 lanes' sum
    __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
    s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
    return _mm_cvtsi128_si32(s);
}

// One row of K bf16 values -> K/32 blocks of int8 codes qa, their scales da, the codes' sums isum, da * isum sa and
// the halves' sums hsum.
static inline void gguf_quantize_row(const uint16_t* x, int64_t K, int8_t* qa, float* da, float* sa, int32_t* isum,
                                     int32_t* hsum) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    for (int64_t b = 0; b < K / GGUF_BLOCK; ++b) {
        __m256 v[4];
        __m256 amax = _mm256_setzero_ps();
        for (int i = 0; i < 4; ++i) {
            const __m128i h = _mm_loadu_si128((const __m128i*)(x + b * GGUF_BLOCK + 8 * i));
            v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
            amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
        }
        __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
        m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        m = _mm_max_ss(m, _mm_movehdup_ps(m));
        const float am = _mm_cvtss_f32(m);
        const float inv = am > 0.0f ? 127.0f / am : 0.0f;
        const __m256 vinv = _mm256_set1_ps(inv), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
        __m256i q[4];
        for (int i = 0; i < 4; ++i) {
            const __m256 r = _mm256_round_ps(_mm256_mul_ps(v[i], vinv), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            q[i] = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(r, lo), hi));
        }
        const int32_t first = gguf_sum_epi32(_mm256_add_epi32(q[0], q[1]));   // codes 0..15 (|.| <= 2032)
        const int32_t second = gguf_sum_epi32(_mm256_add_epi32(q[2], q[3]));  // codes 16..31
        // int32 x 32 -> int8 x 32 in order: packs interleave the 128-bit lanes, the permute puts them back
        const __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
        const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        const __m256i ordered = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i*)(qa + b * GGUF_BLOCK), ordered);
        da[b] = am / 127.0f;
        isum[b] = first + second;
        hsum[b] = (int32_t)(((uint32_t)second << 16) | ((uint32_t)first & 0xffffu));
        sa[b] = da[b] * (float)isum[b];
    }
}

// The 32 4-bit codes of a block's qs[16] as bytes 0..15 in element order.
static inline __m256i gguf_nibbles(const uint8_t* qs) {
    const __m128i q = _mm_loadu_si128((const __m128i*)qs), mask = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
}

// The 32 5-bit codes of a Q5_0 block's qh[4] qs[16] (at p, the file's order) as bytes 0..31 in element order: the
// nibbles, plus 16 where bit j of qh is set (llama.cpp's bytes_from_bits_32: byte j gets qh's byte j / 8, all of
// whose bits but j % 8 are then set, so it is all ones exactly where bit j is).
static inline __m256i gguf_q5_codes(const uint8_t* p) {
    uint32_t qh;
    std::memcpy(&qh, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bits = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                           _mm256_set1_epi64x(-1));
    return _mm256_or_si256(gguf_nibbles(p + 4), _mm256_and_si256(bits, _mm256_set1_epi8(16)));
}

static inline __m256 gguf_bytes_ps(const uint8_t* p) {   // 8 unsigned bytes -> 8 floats
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

static inline __m256i gguf_bcast4(const int8_t* p) {   // 4 activation codes, in every 32-bit lane
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// A Q4_K group block's 6-bit scales and mins (sc_lo[32] m_lo[32] hi[32] at p: 4 sub-blocks x 8 rows each, see the
// header) -> out[128]: the scales of sub-block s for rows 0..7 at out + 8 s, the mins at out + 64 + 8 s.
static inline void gguf_q4k_unpack(const uint8_t* p, uint8_t* out) {
    const __m256i sl = _mm256_loadu_si256((const __m256i*)p), ml = _mm256_loadu_si256((const __m256i*)(p + 32));
    const __m256i h = _mm256_loadu_si256((const __m256i*)(p + 64));
    const __m256i low = _mm256_set1_epi8(0x0f), top = _mm256_set1_epi8(0x30);   // bits 0-3, bits 4-5
    // 16-bit shifts: the bits a mask keeps never crossed a byte
    _mm256_storeu_si256((__m256i*)out, _mm256_or_si256(_mm256_and_si256(sl, low),
                                                       _mm256_and_si256(_mm256_slli_epi16(h, 4), top)));
    _mm256_storeu_si256((__m256i*)(out + 32), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(sl, 4), low),
                                                              _mm256_and_si256(_mm256_slli_epi16(h, 2), top)));
    _mm256_storeu_si256((__m256i*)(out + 64), _mm256_or_si256(_mm256_and_si256(ml, low), _mm256_and_si256(h, top)));
    _mm256_storeu_si256((__m256i*)(out + 96), _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(ml, 4), low),
                                                              _mm256_and_si256(_mm256_srli_epi16(h, 2), top)));
}

// Q5_0: the fifth bits of the codes 4k .. 4k+3 of each lane (bit k of the lane's transposed qh bytes, h) at bit 4 of
// their bytes (16-bit shifts: bit k of a byte moves to bit 4 of the same byte).
static inline __m256i gguf_q5_high(__m256i h, int k) {
    const __m256i sh = k < 4 ? _mm256_sll_epi16(h, _mm_cvtsi32_si128(4 - k))
                             : _mm256_srl_epi16(h, _mm_cvtsi32_si128(k - 4));
    return _mm256_and_si256(sh, _mm256_set1_epi8(0x10));
}

// Q6_K: the top 2 bits of the codes 4k .. 4k+3 of a sub-block in each lane (bits 2k, 2k+1 of the lane's hi bytes, h)
// at bits 4-5 of their bytes (16-bit shifts: the bits the mask keeps never crossed a byte).
static inline __m256i gguf_q6_high(__m256i h, int k) {
    const __m256i sh = k < 2 ? _mm256_sll_epi16(h, _mm_cvtsi32_si128(4 - 2 * k))
                             : _mm256_srl_epi16(h, _mm_cvtsi32_si128(2 * k - 4));
    return _mm256_and_si256(sh, _mm256_set1_epi8(0x30));
}

#if KV8_GGUF_VNNI256
static inline __m256i gguf_dpbusd256(__m256i acc, __m256i u, __m256i s) {   // acc + 4 products u8 x s8 per lane
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
    return _mm256_dpbusd_epi32(acc, u, s);
#else
    return _mm256_dpbusd_avx_epi32(acc, u, s);
#endif
}
#else
template <class V>   // no path of this build calls it (gguf_group_tile<..., true> is never instantiated)
static inline V gguf_dpbusd256(V acc, V, V) {
    static_assert(sizeof(V) == 0, "this build has no vpdpbusd on ymm");
    return acc;
}
#endif

// One group of 8 weight rows (its first weight block at grp, nwb blocks) times MR activation rows (x at row m0):
// out[m] = the 8 rows' results, lane r = weight row r, before the bias. Per weight block, each 32-byte load holds 4
// codes of each of the 8 rows, each 4-byte broadcast 4 activation codes. VNNI = false (avx2): maddubs gives, per
// lane, that row's products summed in pairs; the pairs add up in int16 (Q4: 8 of them, |.| <= 8 * 3810; Q5: 4, <= 4
// * 7874) or int32 (Q8_0), then madd by ones to the row's exact int32 dot product. VNNI = true (vnni256): vpdpbusd
// adds each lane's 4 products to its int32 sum (Q8_0: the codes + 128, then - 128 isum). The scales of the 8 rows
// convert 8 at a time; every lane does the same float32 operations, block after block, whatever MR or VNNI.
template <int QT, int MR, bool VNNI>
static inline void gguf_group_tile(const uint8_t* grp, int64_t nwb, const GGUFActs& x, int64_t m0, __m256* out) {
    const int64_t nb = x.nb, K = nb * GGUF_BLOCK;
    const __m256i ones = _mm256_set1_epi16(1), low = _mm256_set1_epi8(0x0f);
    __m256 acc[MR], corr[MR];
    for (int m = 0; m < MR; ++m) { acc[m] = _mm256_setzero_ps(); corr[m] = _mm256_setzero_ps(); }
    const int8_t* a0 = x.qa + m0 * K;
    const float* da0 = x.da + m0 * nb;
    const float* sa0 = x.sa + m0 * nb;
    if constexpr (QT == GGUF_Q6_K) {
        // avx2: each lane's scale of the first (dup_lo) or second (dup_hi) sub-block in both its int16 halves
        const __m256i dup_lo = _mm256_setr_epi8(0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13,
                                                0, 1, 0, 1, 4, 5, 4, 5, 8, 9, 8, 9, 12, 13, 12, 13);
        const __m256i dup_hi = _mm256_add_epi8(dup_lo, _mm256_set1_epi8(2));
        const int32_t* hs0 = x.hsum + m0 * nb;
        for (int64_t w = 0; w < nwb; ++w) {
            const uint8_t* p = grp + w * (GGUF_ROWS * 210);
            for (int o = 0; o < GGUF_ROWS * 210; o += 64) _mm_prefetch((const char*)p + GGUF_PREFETCH + o, _MM_HINT_T0);
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
            for (int c = 0; c < 8; ++c) {   // activation block b: sub-blocks 2c (lo codes) and 2c + 1 (hi codes)
                const int64_t b = 8 * w + c;
                // lane r: row r's [scales_2c, scales_2c+1] as two int16
                const __m256i sc = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(p + 16 + 16 * c)));
                const uint8_t* q = p + 144 + 192 * c;
                const __m256i h0 = _mm256_loadu_si256((const __m256i*)(q + 128));
                const __m256i h1 = _mm256_loadu_si256((const __m256i*)(q + 160));
                __m256i lo[4], hi[4];   // codes 4k.. of sub-block 2c (lo) and 2c + 1 (hi), 0..63
                for (int k = 0; k < 4; ++k) {
                    const __m256i v = _mm256_loadu_si256((const __m256i*)(q + 32 * k));
                    lo[k] = _mm256_or_si256(_mm256_and_si256(v, low), gguf_q6_high(h0, k));
                    hi[k] = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low), gguf_q6_high(h1, k));
                }
                const __m256i sc_lo = VNNI ? _mm256_srai_epi32(_mm256_slli_epi32(sc, 16), 16)
                                           : _mm256_shuffle_epi8(sc, dup_lo);
                const __m256i sc_hi = VNNI ? _mm256_srai_epi32(sc, 16) : _mm256_shuffle_epi8(sc, dup_hi);
                for (int m = 0; m < MR; ++m) {
                    const int8_t* a = a0 + m * K + b * GGUF_BLOCK;
                    __m256i dot;
                    if constexpr (VNNI) {
                        __m256i dl = _mm256_setzero_si256(), dh = _mm256_setzero_si256();
                        for (int k = 0; k < 4; ++k) {
                            dl = gguf_dpbusd256(dl, lo[k], gguf_bcast4(a + 4 * k));
                            dh = gguf_dpbusd256(dh, hi[k], gguf_bcast4(a + 16 + 4 * k));
                        }
                        dot = _mm256_add_epi32(_mm256_mullo_epi32(dl, sc_lo), _mm256_mullo_epi32(dh, sc_hi));
                    } else {   // two maddubs added in int16 (|.| <= 2 * 2 * 63 * 127), then times the scale in madd
                        __m256i s16[4];
                        for (int t = 0; t < 2; ++t) {
                            s16[t] = _mm256_add_epi16(_mm256_maddubs_epi16(lo[2 * t], gguf_bcast4(a + 8 * t)),
                                                      _mm256_maddubs_epi16(lo[2 * t + 1], gguf_bcast4(a + 8 * t + 4)));
                            s16[2 + t] = _mm256_add_epi16(
                                _mm256_maddubs_epi16(hi[2 * t], gguf_bcast4(a + 16 + 8 * t)),
                                _mm256_maddubs_epi16(hi[2 * t + 1], gguf_bcast4(a + 16 + 8 * t + 4)));
                        }
                        dot = _mm256_add_epi32(
                            _mm256_add_epi32(_mm256_madd_epi16(s16[0], sc_lo), _mm256_madd_epi16(s16[1], sc_lo)),
                            _mm256_add_epi32(_mm256_madd_epi16(s16[2], sc_hi), _mm256_madd_epi16(s16[3], sc_hi)));
                    }
                    // - 32 (scales_2c hsum_2c + scales_2c+1 hsum_2c+1): the codes' offset, in int32
                    const __m256i offset = _mm256_madd_epi16(sc, _mm256_set1_epi32(hs0[m * nb + b]));
                    dot = _mm256_sub_epi32(dot, _mm256_slli_epi32(offset, 5));
                    const __m256 scale = _mm256_mul_ps(d, _mm256_broadcast_ss(da0 + m * nb + b));
                    acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[m]);
                }
            }
        }
        for (int m = 0; m < MR; ++m) out[m] = acc[m];
        return;
    } else if constexpr (QT == GGUF_Q4_K) {
        for (int64_t w = 0; w < nwb; ++w) {
            const uint8_t* p = grp + w * (GGUF_ROWS * 144);
            for (int o = 0; o < GGUF_ROWS * 144; o += 64) _mm_prefetch((const char*)p + GGUF_PREFETCH + o, _MM_HINT_T0);
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
            const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)));
            alignas(32) uint8_t scm[128];
            gguf_q4k_unpack(p + 32, scm);
            const uint8_t* q = p + 128;
            for (int c = 0; c < 4; ++c) {   // sub-blocks 2c (low nibbles) and 2c + 1 (high)
                const int64_t b = 8 * w + 2 * c;   // activation block of sub-block 2c
                __m256i s_lo[MR], s_hi[MR];   // avx2: int16 sums of pairs; vnni256: the int32 dot products
                for (int m = 0; m < MR; ++m) { s_lo[m] = _mm256_setzero_si256(); s_hi[m] = _mm256_setzero_si256(); }
                for (int k = 0; k < 8; ++k) {
                    const __m256i v = _mm256_loadu_si256((const __m256i*)(q + 32 * (8 * c + k)));
                    const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    for (int m = 0; m < MR; ++m) {
                        const int8_t* a = a0 + m * K + b * GGUF_BLOCK + 4 * k;
                        if constexpr (VNNI) {
                            s_lo[m] = gguf_dpbusd256(s_lo[m], lo, gguf_bcast4(a));
                            s_hi[m] = gguf_dpbusd256(s_hi[m], hi, gguf_bcast4(a + GGUF_BLOCK));
                        } else {
                            s_lo[m] = _mm256_add_epi16(s_lo[m], _mm256_maddubs_epi16(lo, gguf_bcast4(a)));
                            s_hi[m] = _mm256_add_epi16(s_hi[m], _mm256_maddubs_epi16(hi, gguf_bcast4(a + GGUF_BLOCK)));
                        }
                    }
                }
                for (int h = 0; h < 2; ++h) {
                    const int s = 2 * c + h;
                    const __m256 sc = _mm256_mul_ps(d, gguf_bytes_ps(scm + 8 * s));        // exact products
                    const __m256 mn = _mm256_mul_ps(dmin, gguf_bytes_ps(scm + 64 + 8 * s));
                    for (int m = 0; m < MR; ++m) {
                        const __m256i dot = VNNI ? (h ? s_hi[m] : s_lo[m])
                                                 : _mm256_madd_epi16(h ? s_hi[m] : s_lo[m], ones);
                        const __m256 scale = _mm256_mul_ps(sc, _mm256_broadcast_ss(da0 + m * nb + b + h));
                        acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), scale, acc[m]);
                        corr[m] = _mm256_fmadd_ps(mn, _mm256_broadcast_ss(sa0 + m * nb + b + h), corr[m]);
                    }
                }
            }
        }
        for (int m = 0; m < MR; ++m) out[m] = _mm256_sub_ps(acc[m], corr[m]);
        return;
    } else {
        constexpr int UNIT = QT == GGUF_Q8_0 ? 34 : QT == GGUF_Q4_0 ? 18 : QT == GGUF_Q4_1 ? 20 : 22;
        constexpr int CODES = QT == GGUF_Q8_0 ? 16 : QT == GGUF_Q4_1 ? 32 : QT == GGUF_Q5_0 ? 48 : 16;
        constexpr float OFFSET = QT == GGUF_Q5_0 ? -16.0f : -8.0f;   // Q4_0, Q5_0: the codes' offset
        for (int64_t b = 0; b < nwb; ++b) {
            const uint8_t* p = grp + b * (GGUF_ROWS * UNIT);
            for (int o = 0; o < GGUF_ROWS * UNIT; o += 64)
                _mm_prefetch((const char*)p + GGUF_PREFETCH + o, _MM_HINT_T0);
            const uint8_t* q = p + CODES;
            const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
            __m256i dot[MR];
            for (int m = 0; m < MR; ++m) dot[m] = _mm256_setzero_si256();
            const int8_t* a = a0 + b * GGUF_BLOCK;
            if constexpr (QT == GGUF_Q8_0 && VNNI) {   // q + 128 as unsigned bytes, then - 128 isum
                for (int k = 0; k < 8; ++k) {
                    const __m256i v = _mm256_xor_si256(_mm256_loadu_si256((const __m256i*)(q + 32 * k)),
                                                       _mm256_set1_epi8((char)0x80));
                    for (int m = 0; m < MR; ++m) dot[m] = gguf_dpbusd256(dot[m], v, gguf_bcast4(a + m * K + 4 * k));
                }
                for (int m = 0; m < MR; ++m)
                    dot[m] = _mm256_sub_epi32(dot[m], _mm256_set1_epi32(128 * x.isum[(m0 + m) * nb + b]));
            } else if constexpr (QT == GGUF_Q8_0) {   // |q| as unsigned, a with q's sign: |pair| <= 2 * 128 * 127
                for (int k = 0; k < 8; ++k) {
                    const __m256i v = _mm256_loadu_si256((const __m256i*)(q + 32 * k)), av = _mm256_abs_epi8(v);
                    for (int m = 0; m < MR; ++m) {
                        const __m256i sa_ = _mm256_sign_epi8(gguf_bcast4(a + m * K + 4 * k), v);
                        const __m256i pr = _mm256_maddubs_epi16(av, sa_);
                        dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(pr, ones));
                    }
                }
            } else if constexpr (QT == GGUF_Q5_0) {
                const __m256i h = _mm256_loadu_si256((const __m256i*)(p + 16));
                __m256i s16[MR];
                for (int t = 0; t < 4; ++t) {   // as Q4 below, plus the fifth bits; avx2: pairs of t summed in int16
                    const __m256i v = _mm256_loadu_si256((const __m256i*)(q + 32 * t));
                    const __m256i lo = _mm256_or_si256(_mm256_and_si256(v, low), gguf_q5_high(h, t));
                    const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(v, 4), low),
                                                       gguf_q5_high(h, 4 + t));
                    for (int m = 0; m < MR; ++m) {
                        const int8_t* am = a + m * K + 4 * t;
                        if constexpr (VNNI) {
                            dot[m] = gguf_dpbusd256(gguf_dpbusd256(dot[m], lo, gguf_bcast4(am)), hi,
                                                    gguf_bcast4(am + 16));
                            continue;
                        }
                        const __m256i y = _mm256_add_epi16(_mm256_maddubs_epi16(lo, gguf_bcast4(am)),
                                                           _mm256_maddubs_epi16(hi, gguf_bcast4(am + 16)));
                        if (t % 2 == 0)
                            s16[m] = y;
                        else
                            dot[m] = _mm256_add_epi32(dot[m], _mm256_madd_epi16(_mm256_add_epi16(s16[m], y), ones));
                    }
                }
            } else {   // Q4_0, Q4_1: load t holds bytes 4t .. 4t+3 of each row's qs: codes 4t.., and 16 + 4t..
                __m256i s16[MR];
                for (int m = 0; m < MR; ++m) s16[m] = _mm256_setzero_si256();
                for (int t = 0; t < 4; ++t) {
                    const __m256i v = _mm256_loadu_si256((const __m256i*)(q + 32 * t));
                    const __m256i lo = _mm256_and_si256(v, low), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), low);
                    for (int m = 0; m < MR; ++m) {
                        const int8_t* am = a + m * K + 4 * t;
                        if constexpr (VNNI) {
                            dot[m] = gguf_dpbusd256(gguf_dpbusd256(dot[m], lo, gguf_bcast4(am)), hi,
                                                    gguf_bcast4(am + 16));
                        } else {
                            s16[m] = _mm256_add_epi16(s16[m], _mm256_maddubs_epi16(lo, gguf_bcast4(am)));
                            s16[m] = _mm256_add_epi16(s16[m], _mm256_maddubs_epi16(hi, gguf_bcast4(am + 16)));
                        }
                    }
                }
                if constexpr (!VNNI)
                    for (int m = 0; m < MR; ++m) dot[m] = _mm256_madd_epi16(s16[m], ones);
            }
            __m256 mn = d;   // the min term's weight: Q4_1 m, Q4_0 -8 d, Q5_0 -16 d (exact)
            if constexpr (QT == GGUF_Q4_1) mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(p + 16)));
            else if constexpr (QT != GGUF_Q8_0) mn = _mm256_mul_ps(d, _mm256_set1_ps(OFFSET));
            for (int m = 0; m < MR; ++m) {
                const __m256 scale = _mm256_mul_ps(d, _mm256_broadcast_ss(da0 + m * nb + b));
                acc[m] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[m]), scale, acc[m]);
                if constexpr (QT != GGUF_Q8_0)
                    corr[m] = _mm256_fmadd_ps(mn, _mm256_broadcast_ss(sa0 + m * nb + b), corr[m]);
            }
        }
        for (int m = 0; m < MR; ++m) out[m] = _mm256_add_ps(acc[m], corr[m]);
    }
}

#if KV8_GGUF_VNNI512
// vnni512's operands: the same 32 bytes of two groups (at a and b) in one zmm, lanes 0-7 a's rows, 8-15 b's.
static inline __m512i gguf_load2(const uint8_t* a, const uint8_t* b) {
    return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)a)),
                              _mm256_loadu_si256((const __m256i*)b), 1);
}

static inline __m512 gguf_half2(const uint8_t* a, const uint8_t* b) {   // 8 f16 at a, 8 at b -> 16 floats
    return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)a)),
                                                   _mm_loadu_si128((const __m128i*)b), 1));
}

static inline __m512i gguf_bcast4x16(const int8_t* p) {   // 4 activation codes, in every 32-bit lane
    int32_t v;
    std::memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

static inline __m512 gguf_bytes16_ps(const uint8_t* p) {   // 16 unsigned bytes -> 16 floats
    return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p)));
}

// gguf_q4k_unpack for two groups' blocks (at a and b): out[256], the scales of sub-block s for rows 0..7 of a then
// rows 0..7 of b at out + 16 s, the mins at out + 128 + 16 s (the 8-row unpack's bit operations on both halves, then
// the 8-byte rows of the two halves interleaved).
static inline void gguf_q4k_unpack2(const uint8_t* a, const uint8_t* b, uint8_t* out) {
    const __m512i sl = gguf_load2(a, b), ml = gguf_load2(a + 32, b + 32), h = gguf_load2(a + 64, b + 64);
    const __m512i low = _mm512_set1_epi8(0x0f), top = _mm512_set1_epi8(0x30);
    const __m512i order = _mm512_setr_epi64(0, 4, 1, 5, 2, 6, 3, 7);   // qword s of a, then qword s of b
    const __m512i part[4] = {
        _mm512_or_si512(_mm512_and_si512(sl, low), _mm512_and_si512(_mm512_slli_epi16(h, 4), top)),
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(sl, 4), low), _mm512_and_si512(_mm512_slli_epi16(h, 2), top)),
        _mm512_or_si512(_mm512_and_si512(ml, low), _mm512_and_si512(h, top)),
        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(ml, 4), low), _mm512_and_si512(_mm512_srli_epi16(h, 2), top)),
    };
    for (int i = 0; i < 4; ++i) _mm512_storeu_si512(out + 64 * i, _mm512_permutexvar_epi64(order, part[i]));
}

static inline __m512i gguf_q6_high2(__m512i h, int k) {   // gguf_q6_high on both halves
    const __m512i sh = k < 2 ? _mm512_sll_epi16(h, _mm_cvtsi32_si128(4 - 2 * k))
                             : _mm512_srl_epi16(h, _mm_cvtsi32_si128(2 * k - 4));
    return _mm512_and_si512(sh, _mm512_set1_epi8(0x30));
}

static inline __m512i gguf_q5_high2(__m512i h, int k) {   // gguf_q5_high on both halves
    const __m512i sh = k < 4 ? _mm512_sll_epi16(h, _mm_cvtsi32_si128(4 - k))
                             : _mm512_srl_epi16(h, _mm_cvtsi32_si128(k - 4));
    return _mm512_and_si512(sh, _mm512_set1_epi8(0x10));
}

// Two groups of 8 weight rows (their first weight blocks at ga and gb, nwb blocks each) times MR activation rows (x
// at row m0): out[m] = the 16 rows' results, lanes 0-7 ga's rows, 8-15 gb's, before the bias. gguf_group_tile's
// vnni256 path on 16 lanes: each operand two 32-byte loads (one per group), each activation broadcast feeds 16 rows;
// the same integer dot products and, lane by lane, the same float32 operations in the same order.
template <int QT, int MR>
static inline void gguf_pair_tile(const uint8_t* ga, const uint8_t* gb, int64_t nwb, const GGUFActs& x, int64_t m0,
                                  __m512* out) {
    const int64_t nb = x.nb, K = nb * GGUF_BLOCK;
    const __m512i low = _mm512_set1_epi8(0x0f);
    __m512 acc[MR], corr[MR];
    for (int m = 0; m < MR; ++m) { acc[m] = _mm512_setzero_ps(); corr[m] = _mm512_setzero_ps(); }
    const int8_t* a0 = x.qa + m0 * K;
    const float* da0 = x.da + m0 * nb;
    const float* sa0 = x.sa + m0 * nb;
    if constexpr (QT == GGUF_Q6_K) {
        const int32_t* hs0 = x.hsum + m0 * nb;
        for (int64_t w = 0; w < nwb; ++w) {
            const uint8_t* pa = ga + w * (GGUF_ROWS * 210);
            const uint8_t* pb = gb + w * (GGUF_ROWS * 210);
            for (int o = 0; o < GGUF_ROWS * 210; o += 64) {
                _mm_prefetch((const char*)pa + GGUF_PREFETCH + o, _MM_HINT_T0);
                _mm_prefetch((const char*)pb + GGUF_PREFETCH + o, _MM_HINT_T0);
            }
            const __m512 d = gguf_half2(pa, pb);
            for (int c = 0; c < 8; ++c) {   // activation block b: sub-blocks 2c (lo codes) and 2c + 1 (hi codes)
                const int64_t b = 8 * w + c;
                const __m512i sc = _mm512_cvtepi8_epi16(_mm256_inserti128_si256(
                    _mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)(pa + 16 + 16 * c))),
                    _mm_loadu_si128((const __m128i*)(pb + 16 + 16 * c)), 1));
                const __m512i sc_lo = _mm512_srai_epi32(_mm512_slli_epi32(sc, 16), 16);
                const __m512i sc_hi = _mm512_srai_epi32(sc, 16);
                const int off = 144 + 192 * c;
                const __m512i h0 = gguf_load2(pa + off + 128, pb + off + 128);
                const __m512i h1 = gguf_load2(pa + off + 160, pb + off + 160);
                __m512i lo[4], hi[4];
                for (int k = 0; k < 4; ++k) {
                    const __m512i v = gguf_load2(pa + off + 32 * k, pb + off + 32 * k);
                    lo[k] = _mm512_or_si512(_mm512_and_si512(v, low), gguf_q6_high2(h0, k));
                    hi[k] = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(v, 4), low), gguf_q6_high2(h1, k));
                }
                for (int m = 0; m < MR; ++m) {
                    const int8_t* a = a0 + m * K + b * GGUF_BLOCK;
                    __m512i dl = _mm512_setzero_si512(), dh = _mm512_setzero_si512();
                    for (int k = 0; k < 4; ++k) {
                        dl = _mm512_dpbusd_epi32(dl, lo[k], gguf_bcast4x16(a + 4 * k));
                        dh = _mm512_dpbusd_epi32(dh, hi[k], gguf_bcast4x16(a + 16 + 4 * k));
                    }
                    __m512i dot = _mm512_add_epi32(_mm512_mullo_epi32(dl, sc_lo), _mm512_mullo_epi32(dh, sc_hi));
                    const __m512i offset = _mm512_madd_epi16(sc, _mm512_set1_epi32(hs0[m * nb + b]));
                    dot = _mm512_sub_epi32(dot, _mm512_slli_epi32(offset, 5));
                    const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(da0[m * nb + b]));
                    acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), scale, acc[m]);
                }
            }
        }
        for (int m = 0; m < MR; ++m) out[m] = acc[m];
        return;
    } else if constexpr (QT == GGUF_Q4_K) {
        for (int64_t w = 0; w < nwb; ++w) {
            const uint8_t* pa = ga + w * (GGUF_ROWS * 144);
            const uint8_t* pb = gb + w * (GGUF_ROWS * 144);
            for (int o = 0; o < GGUF_ROWS * 144; o += 64) {
                _mm_prefetch((const char*)pa + GGUF_PREFETCH + o, _MM_HINT_T0);
                _mm_prefetch((const char*)pb + GGUF_PREFETCH + o, _MM_HINT_T0);
            }
            const __m512 d = gguf_half2(pa, pb), dmin = gguf_half2(pa + 16, pb + 16);
            alignas(64) uint8_t scm[256];
            gguf_q4k_unpack2(pa + 32, pb + 32, scm);
            for (int c = 0; c < 4; ++c) {   // sub-blocks 2c (low nibbles) and 2c + 1 (high)
                const int64_t b = 8 * w + 2 * c;
                __m512i s_lo[MR], s_hi[MR];
                for (int m = 0; m < MR; ++m) { s_lo[m] = _mm512_setzero_si512(); s_hi[m] = _mm512_setzero_si512(); }
                for (int k = 0; k < 8; ++k) {
                    const int off = 128 + 32 * (8 * c + k);
                    const __m512i v = gguf_load2(pa + off, pb + off);
                    const __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                    for (int m = 0; m < MR; ++m) {
                        const int8_t* a = a0 + m * K + b * GGUF_BLOCK + 4 * k;
                        s_lo[m] = _mm512_dpbusd_epi32(s_lo[m], lo, gguf_bcast4x16(a));
                        s_hi[m] = _mm512_dpbusd_epi32(s_hi[m], hi, gguf_bcast4x16(a + GGUF_BLOCK));
                    }
                }
                for (int h = 0; h < 2; ++h) {
                    const int s = 2 * c + h;
                    const __m512 sc = _mm512_mul_ps(d, gguf_bytes16_ps(scm + 16 * s));        // exact products
                    const __m512 mn = _mm512_mul_ps(dmin, gguf_bytes16_ps(scm + 128 + 16 * s));
                    for (int m = 0; m < MR; ++m) {
                        const __m512 scale = _mm512_mul_ps(sc, _mm512_set1_ps(da0[m * nb + b + h]));
                        acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(h ? s_hi[m] : s_lo[m]), scale, acc[m]);
                        corr[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sa0[m * nb + b + h]), corr[m]);
                    }
                }
            }
        }
        for (int m = 0; m < MR; ++m) out[m] = _mm512_sub_ps(acc[m], corr[m]);
        return;
    } else {
        constexpr int UNIT = QT == GGUF_Q8_0 ? 34 : QT == GGUF_Q4_0 ? 18 : QT == GGUF_Q4_1 ? 20 : 22;
        constexpr int CODES = QT == GGUF_Q8_0 ? 16 : QT == GGUF_Q4_1 ? 32 : QT == GGUF_Q5_0 ? 48 : 16;
        constexpr float OFFSET = QT == GGUF_Q5_0 ? -16.0f : -8.0f;   // Q4_0, Q5_0: the codes' offset
        for (int64_t b = 0; b < nwb; ++b) {
            const uint8_t* pa = ga + b * (GGUF_ROWS * UNIT);
            const uint8_t* pb = gb + b * (GGUF_ROWS * UNIT);
            for (int o = 0; o < GGUF_ROWS * UNIT; o += 64) {
                _mm_prefetch((const char*)pa + GGUF_PREFETCH + o, _MM_HINT_T0);
                _mm_prefetch((const char*)pb + GGUF_PREFETCH + o, _MM_HINT_T0);
            }
            const __m512 d = gguf_half2(pa, pb);
            __m512i dot[MR];
            for (int m = 0; m < MR; ++m) dot[m] = _mm512_setzero_si512();
            const int8_t* a = a0 + b * GGUF_BLOCK;
            if constexpr (QT == GGUF_Q8_0) {   // q + 128 as unsigned bytes, then - 128 isum
                for (int k = 0; k < 8; ++k) {
                    const __m512i v = _mm512_xor_si512(gguf_load2(pa + CODES + 32 * k, pb + CODES + 32 * k),
                                                       _mm512_set1_epi8((char)0x80));
                    for (int m = 0; m < MR; ++m)
                        dot[m] = _mm512_dpbusd_epi32(dot[m], v, gguf_bcast4x16(a + m * K + 4 * k));
                }
                for (int m = 0; m < MR; ++m)
                    dot[m] = _mm512_sub_epi32(dot[m], _mm512_set1_epi32(128 * x.isum[(m0 + m) * nb + b]));
            } else {   // Q4_0, Q4_1, Q5_0: load t holds bytes 4t .. 4t+3 of each row's qs: codes 4t.., and 16 + 4t..
                __m512i h = _mm512_setzero_si512();
                if constexpr (QT == GGUF_Q5_0) h = gguf_load2(pa + 16, pb + 16);
                for (int t = 0; t < 4; ++t) {
                    const __m512i v = gguf_load2(pa + CODES + 32 * t, pb + CODES + 32 * t);
                    __m512i lo = _mm512_and_si512(v, low), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), low);
                    if constexpr (QT == GGUF_Q5_0) {
                        lo = _mm512_or_si512(lo, gguf_q5_high2(h, t));
                        hi = _mm512_or_si512(hi, gguf_q5_high2(h, 4 + t));
                    }
                    for (int m = 0; m < MR; ++m) {
                        const int8_t* am = a + m * K + 4 * t;
                        dot[m] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(dot[m], lo, gguf_bcast4x16(am)), hi,
                                                     gguf_bcast4x16(am + 16));
                    }
                }
            }
            __m512 mn = d;   // the min term's weight: Q4_1 m, Q4_0 -8 d, Q5_0 -16 d (exact)
            if constexpr (QT == GGUF_Q4_1) mn = gguf_half2(pa + 16, pb + 16);
            else if constexpr (QT != GGUF_Q8_0) mn = _mm512_mul_ps(d, _mm512_set1_ps(OFFSET));
            for (int m = 0; m < MR; ++m) {
                const __m512 scale = _mm512_mul_ps(d, _mm512_set1_ps(da0[m * nb + b]));
                acc[m] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[m]), scale, acc[m]);
                if constexpr (QT != GGUF_Q8_0) corr[m] = _mm512_fmadd_ps(mn, _mm512_set1_ps(sa0[m * nb + b]), corr[m]);
            }
        }
        for (int m = 0; m < MR; ++m) out[m] = _mm512_add_ps(acc[m], corr[m]);
    }
}
#endif  // KV8_GGUF_VNNI512

// Calls f(offset, width) for each section of a QT weight block, in order: its offset in the block's canonical bytes
// and its width (kv8.quant.gguf_blocks._SECTIONS): in a group of g rows the section starts at g * offset.
template <int QT, class F>
static inline void gguf_each_section(F f) {
    int off = 0;
    const auto section = [&](int width) { f(off, width); off += width; };
    section(2);                                                                    // d
    if (QT == GGUF_Q6_K)
        for (int i = 0; i < 8; ++i) section(2);                                    // pairs of scales
    if (QT == GGUF_Q4_1 || QT == GGUF_Q4_K) section(2);                            // m, dmin
    if (QT == GGUF_Q5_0) section(4);                                               // qh, transposed
    if (QT == GGUF_Q4_K)
        for (int i = 0; i < 12; ++i) section(1);                                   // sc_lo, m_lo, hi
    const int codes = QT == GGUF_Q8_0 ? 8 : QT == GGUF_Q4_K ? 32 : QT == GGUF_Q6_K ? 48 : 4;
    for (int i = 0; i < codes; ++i) section(4);                                    // 4 codes (bytes)
}

static inline void gguf_copy(uint8_t* dst, const uint8_t* src, int width) {   // 1, 2 or 4 bytes
    if (width == 4) std::memcpy(dst, src, 4);
    else if (width == 2) std::memcpy(dst, src, 2);
    else *dst = *src;
}

// A weight block of a group of g rows (at blk) -> the same block of a group of 8 rows (at out), rows g.. zero.
template <int QT>
static inline void gguf_widen(const uint8_t* blk, int g, uint8_t* out) {
    gguf_each_section<QT>([&](int off, int width) {
        std::memcpy(out + GGUF_ROWS * off, blk + g * off, (size_t)(g * width));
        std::memset(out + GGUF_ROWS * off + g * width, 0, (size_t)((GGUF_ROWS - g) * width));
    });
}

// Row r's weight block of a group of g rows (at blk) in the canonical order (kv8.quant.gguf_blocks._canonical).
template <int QT>
static inline void gguf_gather(const uint8_t* blk, int g, int r, uint8_t* canon) {
    gguf_each_section<QT>([&](int off, int width) { gguf_copy(canon + off, blk + g * off + r * width, width); });
}

// Tiles of MR_MAX activation rows and the rest: the tile kernel for mr rows (1 .. MR_MAX).
template <int QT, bool VNNI>
static inline void gguf_tile(int mr, const uint8_t* grp, int64_t nwb, const GGUFActs& x, int64_t m0, __m256* out) {
    switch (mr) {
        case 1: gguf_group_tile<QT, 1, VNNI>(grp, nwb, x, m0, out); break;
        case 2: gguf_group_tile<QT, 2, VNNI>(grp, nwb, x, m0, out); break;
        case 3: gguf_group_tile<QT, 3, VNNI>(grp, nwb, x, m0, out); break;
        default: gguf_group_tile<QT, 4, VNNI>(grp, nwb, x, m0, out); break;
    }
}

#if KV8_GGUF_VNNI512
template <int QT>
static inline void gguf_tile2(int mr, const uint8_t* ga, const uint8_t* gb, int64_t nwb, const GGUFActs& x,
                              int64_t m0, __m512* out) {
    switch (mr) {
        case 1: gguf_pair_tile<QT, 1>(ga, gb, nwb, x, m0, out); break;
        case 2: gguf_pair_tile<QT, 2>(ga, gb, nwb, x, m0, out); break;
        case 3: gguf_pair_tile<QT, 3>(ga, gb, nwb, x, m0, out); break;
        case 4: gguf_pair_tile<QT, 4>(ga, gb, nwb, x, m0, out); break;
        case 5: gguf_pair_tile<QT, 5>(ga, gb, nwb, x, m0, out); break;
        case 6: gguf_pair_tile<QT, 6>(ga, gb, nwb, x, m0, out); break;
        case 7: gguf_pair_tile<QT, 7>(ga, gb, nwb, x, m0, out); break;
        default: gguf_pair_tile<QT, 8>(ga, gb, nwb, x, m0, out); break;
    }
}
#endif

// Group G's blocks as the kernels read them: in place for a full group, else (the last group, g < 8 rows) widened to
// 8 rows (zero rows) into *wide (malloc'ed; the caller frees it). nullptr when that allocation fails.
template <int QT>
static inline const uint8_t* gguf_group(const kv8_gguf_linear_call& call, int64_t G, int64_t row_bytes,
                                        uint8_t** wide) {
    const int64_t n0 = G * GGUF_ROWS, N = call.out_features, nwb = row_bytes / GGUF_UNIT[QT];
    const uint8_t* grp = call.blocks + n0 * row_bytes;
    const int g = (int)(N - n0 < GGUF_ROWS ? N - n0 : GGUF_ROWS);
    if (g == GGUF_ROWS) return grp;
    *wide = (uint8_t*)std::malloc((size_t)(GGUF_ROWS * row_bytes));
    if (!*wide) return nullptr;
    for (int64_t w = 0; w < nwb; ++w)
        gguf_widen<QT>(grp + w * g * GGUF_UNIT[QT], g, *wide + w * GGUF_ROWS * GGUF_UNIT[QT]);
    return *wide;
}

// rows results of a tile's activation row m (lanes: the tile's weight rows from n0) + bias, rounded to bf16 into out.
static inline void gguf_store(const float* lane, int rows, const kv8_gguf_linear_call& call, int64_t m, int64_t n0) {
    uint16_t* o = call.out + m * call.out_features + n0;
    const float* bias = call.bias ? call.bias + n0 : nullptr;
    for (int r = 0; r < rows; ++r) o[r] = gguf_round_bf16(lane[r] + (bias ? bias[r] : 0.0f));
}

// The avx2 (VNNI = false) and vnni256 paths: OpenMP over the groups of 8 rows.
template <int QT, bool VNNI>
static int gguf_linear_rows(const kv8_gguf_linear_call& call, const GGUFActs& x) {
    constexpr int MR = 4;
    const int64_t M = call.rows, N = call.out_features;
    const int64_t nwb = call.in_features / GGUF_BLOCK_VALUES[QT], row_bytes = nwb * GGUF_UNIT[QT];
    const int64_t groups = (N + GGUF_ROWS - 1) / GGUF_ROWS;
    const int threads = threads_for(N * call.in_features * (M < MR ? 1 : MR), call.num_threads);
    int rc = OK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t G = 0; G < groups; ++G) {
        uint8_t* wide = nullptr;
        const uint8_t* grp = gguf_group<QT>(call, G, row_bytes, &wide);
        if (!grp) {
#pragma omp atomic write
            rc = ERR_OOM;
            continue;
        }
        const int64_t n0 = G * GGUF_ROWS;
        const int g = (int)(N - n0 < GGUF_ROWS ? N - n0 : GGUF_ROWS);
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int mr = (int)(M - m0 < MR ? M - m0 : MR);
            __m256 res[MR];
            gguf_tile<QT, VNNI>(mr, grp, nwb, x, m0, res);
            for (int m = 0; m < mr; ++m) {
                alignas(32) float lane[GGUF_ROWS];
                _mm256_store_ps(lane, res[m]);
                gguf_store(lane, g, call, m0 + m, n0);
            }
        }
        std::free(wide);
    }
    return rc;
}

#if KV8_GGUF_VNNI512
// The vnni512 path: OpenMP over pairs of groups (16 rows); a last, odd group is paired with itself. Tiles of 8
// activation rows (Q4_K, Q6_K: 4, whose two sub-blocks' sums per row would not fit the 32 registers): 1.07-1.31x faster
// than tiles of 4 in 23 of 24 cells at M = 5 and 8 (Q8_0 / Q4_0 / Q4_1 / Q5_0, 576x576, 1536x576, 640x2048, one
// thread; the Xeon of docs/benchmarks.md's "The int8 kernel's VNNI paths", 2026-11-29, an A/B of the two builds in
// one process, load ~4); Q4_K one sub-block at a time in tiles of 8 was slower at 1-2 rows (0.82-0.86x).
template <int QT>
static int gguf_linear_pairs(const kv8_gguf_linear_call& call, const GGUFActs& x) {
    constexpr int MR = QT == GGUF_Q4_K || QT == GGUF_Q6_K ? 4 : 8;
    const int64_t M = call.rows, N = call.out_features;
    const int64_t nwb = call.in_features / GGUF_BLOCK_VALUES[QT], row_bytes = nwb * GGUF_UNIT[QT];
    const int64_t groups = (N + GGUF_ROWS - 1) / GGUF_ROWS, pairs = (groups + 1) / 2;
    const int threads = threads_for(N * call.in_features * (M < MR ? 1 : MR), call.num_threads);
    int rc = OK;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t P = 0; P < pairs; ++P) {
        uint8_t *wide_a = nullptr, *wide_b = nullptr;
        const uint8_t* ga = gguf_group<QT>(call, 2 * P, row_bytes, &wide_a);
        const uint8_t* gb = 2 * P + 1 < groups ? gguf_group<QT>(call, 2 * P + 1, row_bytes, &wide_b) : ga;
        if (!ga || !gb) {
            std::free(wide_a);
            std::free(wide_b);
#pragma omp atomic write
            rc = ERR_OOM;
            continue;
        }
        const int64_t n0 = 2 * P * GGUF_ROWS;
        const int rows = (int)(N - n0 < 2 * GGUF_ROWS ? N - n0 : 2 * GGUF_ROWS);
        for (int64_t m0 = 0; m0 < M; m0 += MR) {
            const int mr = (int)(M - m0 < MR ? M - m0 : MR);
            __m512 res[MR];
            gguf_tile2<QT>(mr, ga, gb, nwb, x, m0, res);
            for (int m = 0; m < mr; ++m) {
                alignas(64) float lane[2 * GGUF_ROWS];
                _mm512_store_ps(lane, res[m]);
                gguf_store(lane, rows, call, m0 + m, n0);
            }
        }
        std::free(wide_a);
        std::free(wide_b);
    }
    return rc;
}
#endif

template <int QT>
static int gguf_linear_path(const kv8_gguf_linear_call& call, const GGUFActs& x) {
#if KV8_GGUF_VNNI512
    if (call.path == GGUF_PATH_VNNI512) return gguf_linear_pairs<QT>(call, x);
#endif
#if KV8_GGUF_VNNI256
    if (call.path == GGUF_PATH_VNNI256) return gguf_linear_rows<QT, true>(call, x);
#endif
    return gguf_linear_rows<QT, false>(call, x);
}

// One canonical weight block (kv8.quant.gguf_blocks._canonical's bytes) -> its 32 (Q4_K: 256) float32 values, as
// kv8.quant.gguf_blocks.dequantize_blocks computes them, bit for bit: float32 d * code, Q4_0 d * (c - 8), Q5_0
// d * (c - 16), Q4_1 d * c then + m (a multiply and an add, never fused: the build's -std=c++17 keeps GCC from
// contracting them), Q4_K (d * sc) * c - dmin * m (both products exact, then one rounding of the subtraction), Q6_K
// (d * scales_s) * (q - 32) (the first product exact).
template <int QT>
static inline void gguf_dequantize_block(const uint8_t* c, float* o) {
    const __m256 d = _mm256_set1_ps(gguf_half(c));
    if constexpr (QT == GGUF_Q6_K) {
        const float dd = gguf_half(c);
        for (int b = 0; b < 8; ++b) {   // block b of 32 values: lo[16] hi[8] at c + 18 + 24 b
            const uint8_t* lo = c + 18 + 24 * b;
            const uint8_t* hi = lo + 16;
            for (int u = 0; u < 2; ++u) {   // sub-block 2b + u
                const float scale = dd * (float)(int8_t)c[2 + 2 * b + u];
                for (int k = 0; k < 4; ++k)
                    for (int i = 0; i < 4; ++i) {
                        const int q = ((lo[4 * k + i] >> (4 * u)) & 15) | (((hi[4 * u + i] >> (2 * k)) & 3) << 4);
                        o[32 * b + 16 * u + 4 * k + i] = scale * (float)(q - 32);
                    }
            }
        }
    } else if constexpr (QT == GGUF_Q4_K) {
        const float dm = gguf_half(c + 2);
        uint8_t sc[8], mn[8];
        for (int s = 0; s < 4; ++s) {
            const uint8_t sl = c[4 + s], ml = c[8 + s], h = c[12 + s];
            sc[s] = (uint8_t)((sl & 15) | ((h & 3) << 4));
            sc[s + 4] = (uint8_t)((sl >> 4) | (((h >> 2) & 3) << 4));
            mn[s] = (uint8_t)((ml & 15) | (((h >> 4) & 3) << 4));
            mn[s + 4] = (uint8_t)((ml >> 4) | ((h >> 6) << 4));
        }
        const float dd = gguf_half(c);
        for (int p = 0; p < 4; ++p) {
            const __m256 d_lo = _mm256_set1_ps(dd * (float)sc[2 * p]), d_hi = _mm256_set1_ps(dd * (float)sc[2 * p + 1]);
            const __m256 m_lo = _mm256_set1_ps(dm * (float)mn[2 * p]), m_hi = _mm256_set1_ps(dm * (float)mn[2 * p + 1]);
            const uint8_t* q = c + 16 + 32 * p;
            for (int i = 0; i < 4; ++i) {
                const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + 8 * i)));
                const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
                const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
                _mm256_storeu_ps(o + 64 * p + 8 * i, _mm256_sub_ps(_mm256_mul_ps(d_lo, lo), m_lo));
                _mm256_storeu_ps(o + 64 * p + 32 + 8 * i, _mm256_sub_ps(_mm256_mul_ps(d_hi, hi), m_hi));
            }
        }
    } else if constexpr (QT == GGUF_Q8_0) {
        for (int i = 0; i < 4; ++i) {
            const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(c + 2 + 8 * i)));
            _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
        }
    } else {
        __m256i w;
        if constexpr (QT == GGUF_Q5_0) {   // the file's qh from its transposed bytes, then the file's decoding
            uint8_t file[20];
            uint32_t qh = 0;
            for (int i = 0; i < 4; ++i) {   // bit k of byte i -> bit 4k + i: the byte's bits spread 4 apart
                uint32_t v = c[2 + i];
                v = (v | v << 12) & 0x000f000fu;
                v = (v | v << 6) & 0x03030303u;
                v = (v | v << 3) & 0x11111111u;
                qh |= v << i;
            }
            std::memcpy(file, &qh, 4);
            std::memcpy(file + 4, c + 6, 16);
            w = gguf_q5_codes(file);
        } else {
            w = gguf_nibbles(c + (QT == GGUF_Q4_1 ? 4 : 2));
        }
        const __m256 m = QT == GGUF_Q4_1 ? _mm256_set1_ps(gguf_half(c + 2)) : _mm256_setzero_ps();
        const __m128i lo = _mm256_castsi256_si128(w), hi = _mm256_extracti128_si256(w, 1);
        const __m128i part[4] = {lo, _mm_srli_si128(lo, 8), hi, _mm_srli_si128(hi, 8)};
        for (int i = 0; i < 4; ++i) {
            __m256i q = _mm256_cvtepu8_epi32(part[i]);
            if (QT == GGUF_Q4_0) q = _mm256_sub_epi32(q, _mm256_set1_epi32(8));   // c - 8: exact in float
            if (QT == GGUF_Q5_0) q = _mm256_sub_epi32(q, _mm256_set1_epi32(16));
            __m256 v = _mm256_mul_ps(d, _mm256_cvtepi32_ps(q));
            if (QT == GGUF_Q4_1) v = _mm256_add_ps(v, m);
            _mm256_storeu_ps(o + 8 * i, v);
        }
    }
}

template <int QT>
static void gguf_dequantize_rows(const kv8_gguf_dequantize_call& call) {
    const int64_t N = call.rows, K = call.in_features, values = GGUF_BLOCK_VALUES[QT];   // per weight block
    const int64_t unit = GGUF_UNIT[QT], nwb = K / values, row_bytes = nwb * unit;
    const int threads = threads_for(N * K, call.num_threads);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; ++n) {
        const int64_t n0 = n / GGUF_ROWS * GGUF_ROWS;
        const int g = (int)(N - n0 < GGUF_ROWS ? N - n0 : GGUF_ROWS), r = (int)(n - n0);
        const uint8_t* grp = call.blocks + n0 * row_bytes;
        alignas(32) uint8_t canon[GGUF_UNIT_MAX];
        for (int64_t w = 0; w < nwb; ++w) {
            gguf_gather<QT>(grp + w * g * unit, g, r, canon);
            gguf_dequantize_block<QT>(canon, call.out + n * K + w * values);
        }
    }
}

// f(std::integral_constant<int, QT>{}) for block type code qtype (checked by the caller's check_args; any other code is
// Q4_K's): one dispatch from a call's type to the kernels' templates.
template <typename F>
static inline auto gguf_by_type(int32_t qtype, F&& f) {
    switch (qtype) {
        case GGUF_Q8_0: return f(std::integral_constant<int, GGUF_Q8_0>{});
        case GGUF_Q4_0: return f(std::integral_constant<int, GGUF_Q4_0>{});
        case GGUF_Q4_1: return f(std::integral_constant<int, GGUF_Q4_1>{});
        case GGUF_Q5_0: return f(std::integral_constant<int, GGUF_Q5_0>{});
        case GGUF_Q6_K: return f(std::integral_constant<int, GGUF_Q6_K>{});
        default: return f(std::integral_constant<int, GGUF_Q4_K>{});
    }
}

static int gguf_dequantize(const kv8_gguf_dequantize_call& call) {
    gguf_by_type(call.qtype, [&](auto qt) { gguf_dequantize_rows<decltype(qt)::value>(call); });
    return OK;
}

static int gguf_linear(const kv8_gguf_linear_call& call) {
    if (!gguf_path_available(call.path)) return ERR_NO_FAST_PATH;
    const int64_t M = call.rows, K = call.in_features, nb = K / GGUF_BLOCK;
    int8_t* qa = (int8_t*)std::malloc((size_t)(M * K));
    float* scales = (float*)std::malloc(sizeof(float) * (size_t)(2 * M * nb));
    int32_t* isum = (int32_t*)std::malloc(sizeof(int32_t) * (size_t)(2 * M * nb));   // and hsum
    if (!qa || !scales || !isum) {
        std::free(qa);
        std::free(scales);
        std::free(isum);
        return ERR_OOM;
    }
    const GGUFActs x{qa, scales, scales + M * nb, isum, isum + M * nb, nb};
    const int qthreads = threads_for(M * K * 8, call.num_threads);
#pragma omp parallel for schedule(static) num_threads(qthreads)
    for (int64_t m = 0; m < M; ++m)
        gguf_quantize_row(call.x + m * K, K, qa + m * K, scales + m * nb, scales + (M + m) * nb, isum + m * nb,
                          isum + (M + m) * nb);
    const int rc = gguf_by_type(call.qtype, [&](auto qt) { return gguf_linear_path<decltype(qt)::value>(call, x); });
    std::free(qa);
    std::free(scales);
    std::free(isum);
    return rc;
}
#endif  // KV8_GGUF_AVX2
