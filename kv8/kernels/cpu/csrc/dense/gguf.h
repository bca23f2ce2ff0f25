// GGUF block-quantized weights (llama.cpp's Q8_0, Q4_0, Q4_1, Q5_0, Q4_K) multiplied without expanding them, included
// by dense.cpp after elementwise.h (threads_for). Compiled where the build has AVX2 + FMA + F16C (an AVX-512 build has
// them too); elsewhere kv8_gguf_linear returns ERR_NO_FAST_PATH and Python uses the torch reference
// (kv8.layers.linear.GGUFLinearMethod: kv8.quant.gguf_blocks.gguf_linear_reference). Not here yet: an AVX-512 / VNNI
// (vpdpbusd) path, and the other K-quants (Q5_K, Q6_K, ...: the loader dequantizes those tensors).
//
// Weights: W [N, K] as the file stores it, row after row, each row K/32 blocks of 32 values (K % 32 == 0):
//
//   Q8_0 (34 B): f16 d | int8 q[32]                 w_j = d * q_j
//   Q4_0 (18 B): f16 d | u8 qs[16]                  w_j = d * (c_j - 8)
//   Q4_1 (20 B): f16 d | f16 m | u8 qs[16]          w_j = d * c_j + m
//   Q5_0 (22 B): f16 d | u32 qh | u8 qs[16]         w_j = d * (c_j + 16 h_j - 16),  h_j = (qh >> j) & 1
//
// with the 4-bit codes c_j = qs[j] & 15 and c_{j+16} = qs[j] >> 4 (j < 16); and Q4_K's super-blocks of 256 values
// (K % 256 == 0), 8 sub-blocks s of 32 values:
//
//   Q4_K (144 B): f16 d | f16 dmin | u8 scales[12] | u8 qs[128]     w = d * sc_s * c - dmin * m_s
//
// sc_s, m_s 6 bits each, packed in scales (kv8.quant.gguf_blocks.q4_k_scale_min; unpacked here with 32-bit masks as
// llama.cpp does), c the low (even s) or high (odd s) nibbles of qs[32 (s / 2) .. + 31]. GGUF_BLOCK_BYTES counts bytes
// per 32 values (Q4_K: 18). The kernel reads Q8_0 / Q4_0 / Q4_1 / Q5_0 grouped (the same bytes, reordered at load by
// kv8.quant.gguf_blocks.group_blocks): each row's blocks in groups of GGUF_GROUP = 8 (the row's last group has the
// rest, g <= 8), a group of g blocks being
//
//   [d_0 .. d_{g-1}] [Q4_1: m_0 .. m_{g-1}] [codes of block 0] .. [codes of block g-1]
//
// (codes: the block's bytes after its header; Q5_0: qh then qs), so that 8 scales convert to float32 in one vcvtph2ps.
// A Q4_K super-block is such a group already (its 8 sub-blocks' scales, then their codes): read as the file stores it.
//
// Activations: each row of x is quantized once per call to int8 per block of 32 (a_j = rint(x_j * 127 / amax),
// da = amax / 127, amax the block's largest |x|; a block of zeros has da = 0), kept with da and sa = da * sum_j a_j.
// Then per weight block an exact integer dot product
//
//   Q4: dot = sum_j c_j a_j   (_mm256_maddubs_epi16: unsigned codes x signed a, pairs in int16, |.| <= 3810)
//   Q5: dot = sum_j (c_j + 16 h_j) a_j   (the same, codes 0..31: |pair| <= 7874)
//   Q8: dot = sum_j q_j a_j   (maddubs of |q| and a with q's sign: |.| <= 2 * 128 * 127 < 2^15)
//
// summed to int32 (_mm256_madd_epi16 by ones), converted to float and scaled:
//
//   Q8_0: d da dot   Q4_0: d (da dot - 8 sa)   Q5_0: d (da dot - 16 sa)   Q4_1: d da dot + m sa
//   Q4_K: (d sc_s) da dot - (dmin m_s) sa
//
// accumulated in fp32 over the blocks; the bias (fp32) is added and the result rounded to bf16 (nearest-even). Q4_K
// takes each sub-block as a block: its integer dot product with the activation block of the same 32 values, scaled
// by d sc_s; its min term needs that activation block's sum (sa, kept beside da).
//
// Numerics: the only rounding beyond fp32 sums is the activations': |a_j da - x_j| <= da / 2, so each output
// differs from the float32 product of the dequantized weights (kv8.quant.gguf_blocks.gguf_linear_reference) by at
// most sum_blocks da / 2 * sum_j |w_j| plus fp32 summation error, before the one bf16 rounding
// (kv8.quant.gguf_blocks.gguf_activation_bound computes the bound; tests/quant/test_gguf_blocks.py checks it).
//
// Per group, the activation scales of its 8 blocks multiply the weights' 8 at once (d da, and m sa, -8 d sa or
// -16 d sa summed in a vector); per block the integer dot product is converted and multiplied by its lane of d da.
//
// Threads: output rows are split evenly over the threads (OpenMP, static); each thread reads its rows' blocks once
// per tile of 4 activation rows (one decoded weight block feeds 4 dot products); a row's result does not depend on
// the tile it is in.
//
// kv8_gguf_dequantize (gguf_dequantize): the same grouped blocks to float32 W [N, K], exactly
// kv8.quant.gguf_blocks.dequantize_blocks' values; OpenMP over W's rows. GGUFLinearMethod multiplies many activation
// rows with it and a float32 GEMM (the int8 kernel above re-decodes every block per tile of 4 rows; a GEMM on the
// decoded matrix reuses each weight over many rows).

#pragma once

#include <cstdlib>

// The block types of kv8_gguf_linear_call.qtype, by code; their names are the GGUF (gguf.GGMLQuantizationType) names,
// which Python reads from kv8_gguf_type_name (no code copied on the Python side).
enum { GGUF_Q8_0 = 0, GGUF_Q4_0 = 1, GGUF_Q4_1 = 2, GGUF_Q4_K = 3, GGUF_Q5_0 = 4, GGUF_TYPE_COUNT = 5 };
static const char* const GGUF_TYPE_NAMES[GGUF_TYPE_COUNT] = {"Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_0"};
static const int GGUF_BLOCK_BYTES[GGUF_TYPE_COUNT] = {34, 18, 20, 18, 22};         // per 32 values
static const int GGUF_BLOCK_VALUES[GGUF_TYPE_COUNT] = {32, 32, 32, 256, 32};       // per block: K is a multiple
static const int GGUF_BLOCK = 32;
static const int GGUF_GROUP = 8;   // blocks per group of the kernel's layout (Q4_K: sub-blocks per super-block)

// K a positive multiple of the type's block (qtype checked first)
static inline bool gguf_bad_shape(int32_t qtype, int64_t in_features) {
    return qtype < 0 || qtype >= GGUF_TYPE_COUNT || in_features <= 0 || in_features % GGUF_BLOCK_VALUES[qtype];
}

static inline int check_args(const kv8_gguf_linear_call& c) {
    if (c.rows < 0 || gguf_bad_shape(c.qtype, c.in_features) || c.out_features <= 0 || c.num_threads <= 0)
        return ERR_ARGS;
    return c.rows > 0 && (!c.x || !c.blocks || !c.out) ? ERR_ARGS : OK;
}

static inline int check_args(const kv8_gguf_dequantize_call& c) {
    if (c.rows < 0 || gguf_bad_shape(c.qtype, c.in_features) || c.num_threads <= 0) return ERR_ARGS;
    return c.rows > 0 && (!c.blocks || !c.out) ? ERR_ARGS : OK;
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KV8_GGUF_AVX2 1
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

static inline float gguf_hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// One row of K bf16 values -> K/32 blocks of int8 codes qa, their scales da and da * sum(codes) sa.
static inline void gguf_quantize_row(const uint16_t* x, int64_t K, int8_t* qa, float* da, float* sa) {
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
        const __m256i sum32 = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
        __m128i s = _mm_add_epi32(_mm256_castsi256_si128(sum32), _mm256_extracti128_si256(sum32, 1));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4e));
        s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xb1));
        // int32 x 32 -> int8 x 32 in order: packs interleave the 128-bit lanes, the permute puts them back
        const __m256i p16a = _mm256_packs_epi32(q[0], q[1]), p16b = _mm256_packs_epi32(q[2], q[3]);
        const __m256i p8 = _mm256_packs_epi16(p16a, p16b);
        const __m256i ordered = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i*)(qa + b * GGUF_BLOCK), ordered);
        da[b] = am / 127.0f;
        sa[b] = da[b] * (float)_mm_cvtsi128_si32(s);
    }
}

// The 32 4-bit codes of a block's qs[16] as bytes 0..15 in element order.
static inline __m256i gguf_nibbles(const uint8_t* qs) {
    const __m128i q = _mm_loadu_si128((const __m128i*)qs), mask = _mm_set1_epi8(0x0f);
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), mask), _mm_and_si128(q, mask));
}

// The 32 5-bit codes of a Q5_0 block's qh[4] qs[16] (at p) as bytes 0..31 in element order: the nibbles, plus 16
// where bit j of qh is set (llama.cpp's bytes_from_bits_32: byte j gets qh's byte j / 8, all of whose bits but j % 8
// are then set, so it is all ones exactly where bit j is).
static inline __m256i gguf_q5_codes(const uint8_t* p) {
    uint32_t qh;
    std::memcpy(&qh, p, 4);
    const __m256i spread = _mm256_shuffle_epi8(_mm256_set1_epi32((int)qh),
        _mm256_set_epi64x(0x0303030303030303, 0x0202020202020202, 0x0101010101010101, 0));
    const __m256i bits = _mm256_cmpeq_epi8(_mm256_or_si256(spread, _mm256_set1_epi64x(0x7fbfdfeff7fbfdfe)),
                                           _mm256_set1_epi64x(-1));
    return _mm256_or_si256(gguf_nibbles(p + 4), _mm256_and_si256(bits, _mm256_set1_epi8(16)));
}

static inline __m256 gguf_dot(__m256i u, __m256i s) {   // 32 u8 x s8 products -> 8 fp32 partial sums (exact)
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
}

// Blocks b .. b+g-1 of a group (g <= GGUF_GROUP) times MR_ activation rows from m0 (mr of them valid): the group's
// scales decoded 8 at a time (vcvtph2ps), then one integer dot product per block and row.
template <int QT, int MR_>
static inline void gguf_group(const uint8_t* grp, int g, int64_t b, int64_t nb, const int8_t* qa, const float* da,
                              const float* sa, int64_t m0, int mr, __m256* acc, __m256* corr) {
    constexpr int CODE_BYTES = QT == GGUF_Q8_0 ? 32 : QT == GGUF_Q5_0 ? 20 : 16;
    constexpr int HEAD = QT == GGUF_Q4_1 ? 4 : 2;
    constexpr float OFFSET = QT == GGUF_Q5_0 ? -16.0f : -8.0f;   // Q4_0, Q5_0: the codes' offset
    alignas(32) float scale[MR_][GGUF_GROUP];
    __m256 d, m;
    if (g == GGUF_GROUP) {
        d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)grp));
        m = QT == GGUF_Q4_1 ? _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(grp + 2 * GGUF_GROUP)))
                            : _mm256_mul_ps(d, _mm256_set1_ps(OFFSET));
    } else {   // the row's last, partial group: g scales (the other lanes zero, never used)
        alignas(16) uint16_t hd[GGUF_GROUP] = {0}, hm[GGUF_GROUP] = {0};
        std::memcpy(hd, grp, 2 * g);
        if (QT == GGUF_Q4_1) std::memcpy(hm, grp + 2 * g, 2 * g);
        d = _mm256_cvtph_ps(_mm_load_si128((const __m128i*)hd));
        m = QT == GGUF_Q4_1 ? _mm256_cvtph_ps(_mm_load_si128((const __m128i*)hm))
                            : _mm256_mul_ps(d, _mm256_set1_ps(OFFSET));
    }
    const __m256i lanes = _mm256_cmpgt_epi32(_mm256_set1_epi32(g), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    for (int r = 0; r < MR_; ++r) {
        if (r >= mr) break;
        const int64_t i = (m0 + r) * nb + b;
        const bool full = g == GGUF_GROUP;
        const __m256 a_scale = full ? _mm256_loadu_ps(da + i) : _mm256_maskload_ps(da + i, lanes);
        _mm256_store_ps(scale[r], _mm256_mul_ps(d, a_scale));
        if (QT != GGUF_Q8_0)
            corr[r] = _mm256_fmadd_ps(m, full ? _mm256_loadu_ps(sa + i) : _mm256_maskload_ps(sa + i, lanes), corr[r]);
    }
    const uint8_t* codes = grp + HEAD * g;
    for (int j = 0; j < g; ++j) {
        const uint8_t* c = codes + j * CODE_BYTES;
        if (QT == GGUF_Q8_0) {
            const __m256i w = _mm256_loadu_si256((const __m256i*)c);
            const __m256i wa = _mm256_abs_epi8(w);
            for (int r = 0; r < MR_; ++r) {
                if (r >= mr) break;
                const __m256i a = _mm256_loadu_si256((const __m256i*)(qa + ((m0 + r) * nb + b + j) * GGUF_BLOCK));
                acc[r] = _mm256_fmadd_ps(gguf_dot(wa, _mm256_sign_epi8(a, w)), _mm256_broadcast_ss(&scale[r][j]),
                                         acc[r]);
            }
        } else {
            const __m256i w = QT == GGUF_Q5_0 ? gguf_q5_codes(c) : gguf_nibbles(c);
            for (int r = 0; r < MR_; ++r) {
                if (r >= mr) break;
                const __m256i a = _mm256_loadu_si256((const __m256i*)(qa + ((m0 + r) * nb + b + j) * GGUF_BLOCK));
                acc[r] = _mm256_fmadd_ps(gguf_dot(w, a), _mm256_broadcast_ss(&scale[r][j]), acc[r]);
            }
        }
    }
}

// A Q4_K super-block's 6-bit scales and mins (12 bytes at p) -> sc[0..7] and m[0..7] as bytes: llama.cpp's masks
// on 32-bit words (bytes 0-3: sc0-3 and the top bits of sc4-7, 4-7: the same for m, 8-11: the low nibbles of
// sc4-7 / m4-7).
static inline void gguf_q4k_scales(const uint8_t* p, uint8_t sc[8], uint8_t m[8]) {
    uint32_t u[3], out[4];
    std::memcpy(u, p, 12);
    out[0] = u[0] & 0x3f3f3f3fu;
    out[1] = (u[2] & 0x0f0f0f0fu) | (((u[0] >> 6) & 0x03030303u) << 4);
    out[2] = u[1] & 0x3f3f3f3fu;
    out[3] = ((u[2] >> 4) & 0x0f0f0f0fu) | (((u[1] >> 6) & 0x03030303u) << 4);
    std::memcpy(sc, out, 8);
    std::memcpy(m, out + 2, 8);
}

static inline __m256 gguf_bytes_ps(const uint8_t* p) {   // 8 unsigned bytes -> 8 floats
    return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

// One Q4_K super-block (activation blocks b .. b+7) times MR_ activation rows from m0 (mr valid): the 8 sub-block
// scales d sc_s times the rows' da (8 lanes), the mins' term -dmin m_s sa into corr, then per pair of sub-blocks one
// 32-byte load whose low and high nibbles are the two sub-blocks' codes.
template <int MR_>
static inline void gguf_q4k_superblock(const uint8_t* sb, int64_t b, int64_t nb, const int8_t* qa, const float* da,
                                       const float* sa, int64_t m0, int mr, __m256* acc, __m256* corr) {
    alignas(8) uint8_t sc[8], mn[8];
    gguf_q4k_scales(sb + 4, sc, mn);
    const __m256 d = _mm256_mul_ps(_mm256_set1_ps(gguf_half(sb)), gguf_bytes_ps(sc));           // exact products
    const __m256 m = _mm256_mul_ps(_mm256_set1_ps(-gguf_half(sb + 2)), gguf_bytes_ps(mn));
    alignas(32) float scale[MR_][GGUF_GROUP];
    for (int r = 0; r < MR_; ++r) {
        if (r >= mr) break;
        const int64_t i = (m0 + r) * nb + b;
        _mm256_store_ps(scale[r], _mm256_mul_ps(d, _mm256_loadu_ps(da + i)));
        corr[r] = _mm256_fmadd_ps(m, _mm256_loadu_ps(sa + i), corr[r]);
    }
    const __m256i low = _mm256_set1_epi8(0x0f);
    for (int c = 0; c < 4; ++c) {
        const __m256i q = _mm256_loadu_si256((const __m256i*)(sb + 16 + 32 * c));
        const __m256i lo = _mm256_and_si256(q, low), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), low);
        for (int r = 0; r < MR_; ++r) {
            if (r >= mr) break;
            const int8_t* a = qa + ((m0 + r) * nb + b + 2 * c) * GGUF_BLOCK;
            acc[r] = _mm256_fmadd_ps(gguf_dot(lo, _mm256_loadu_si256((const __m256i*)a)),
                                     _mm256_broadcast_ss(&scale[r][2 * c]), acc[r]);
            acc[r] = _mm256_fmadd_ps(gguf_dot(hi, _mm256_loadu_si256((const __m256i*)(a + GGUF_BLOCK))),
                                     _mm256_broadcast_ss(&scale[r][2 * c + 1]), acc[r]);
        }
    }
}

// Output row n (its grouped blocks at wrow) of MR_ activation rows starting at m0 (mr <= MR_ of them valid).
template <int QT, int MR_>
static inline void gguf_row_tile(const uint8_t* wrow, int64_t nb, const int8_t* qa, const float* da, const float* sa,
                                 int64_t m0, int mr, float* result) {
    __m256 acc[MR_], corr[MR_];
    for (int r = 0; r < MR_; ++r) { acc[r] = _mm256_setzero_ps(); corr[r] = _mm256_setzero_ps(); }
    const int64_t group_bytes = (int64_t)GGUF_GROUP * GGUF_BLOCK_BYTES[QT];
    int64_t b = 0;
    if constexpr (QT == GGUF_Q4_K) {   // nb % 8 == 0: whole super-blocks
        for (; b < nb; b += GGUF_GROUP)
            gguf_q4k_superblock<MR_>(wrow + b / GGUF_GROUP * group_bytes, b, nb, qa, da, sa, m0, mr, acc, corr);
    } else {
        for (; b + GGUF_GROUP <= nb; b += GGUF_GROUP)
            gguf_group<QT, MR_>(wrow + b / GGUF_GROUP * group_bytes, GGUF_GROUP, b, nb, qa, da, sa, m0, mr, acc, corr);
        if (b < nb)
            gguf_group<QT, MR_>(wrow + b / GGUF_GROUP * group_bytes, (int)(nb - b), b, nb, qa, da, sa, m0, mr, acc,
                                corr);
    }
    for (int r = 0; r < mr; ++r) result[r] = gguf_hsum(acc[r]) + gguf_hsum(corr[r]);
}

template <int QT>
static void gguf_linear_rows(const kv8_gguf_linear_call& call, const int8_t* qa, const float* da, const float* sa) {
    constexpr int MR_ = 4;
    const int64_t M = call.rows, N = call.out_features, nb = call.in_features / GGUF_BLOCK;
    const int64_t row_bytes = nb * GGUF_BLOCK_BYTES[QT];
    const uint8_t* blocks = call.blocks;
    const int threads = threads_for(N * call.in_features * (M < MR_ ? 1 : MR_), call.num_threads);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; ++n) {
        const uint8_t* wrow = blocks + n * row_bytes;
        const float bias = call.bias ? call.bias[n] : 0.0f;
        float result[MR_];
        for (int64_t m0 = 0; m0 < M; m0 += MR_) {
            const int mr = (int)(M - m0 < MR_ ? M - m0 : MR_);
            if (mr == 1)
                gguf_row_tile<QT, 1>(wrow, nb, qa, da, sa, m0, 1, result);
            else
                gguf_row_tile<QT, MR_>(wrow, nb, qa, da, sa, m0, mr, result);
            for (int r = 0; r < mr; ++r) call.out[(m0 + r) * N + n] = gguf_round_bf16(result[r] + bias);
        }
    }
}

// One row of Q4_K super-blocks in float32, as gguf.quants computes it: (d * sc) * c - dmin * m (both products exact,
// then one rounding of the subtraction).
static inline void gguf_dequantize_row_q4k(const uint8_t* wrow, int64_t nb, float* out) {
    for (int64_t s = 0; s < nb / GGUF_GROUP; ++s) {
        const uint8_t* sb = wrow + s * 144;
        alignas(8) uint8_t sc[8], mn[8];
        gguf_q4k_scales(sb + 4, sc, mn);
        const float d = gguf_half(sb), dmin = gguf_half(sb + 2);
        float* o = out + s * 256;
        for (int c = 0; c < 4; ++c) {
            const __m256 d_lo = _mm256_set1_ps(d * (float)sc[2 * c]), d_hi = _mm256_set1_ps(d * (float)sc[2 * c + 1]);
            const __m256 m_lo = _mm256_set1_ps(dmin * (float)mn[2 * c]);
            const __m256 m_hi = _mm256_set1_ps(dmin * (float)mn[2 * c + 1]);
            const uint8_t* q = sb + 16 + 32 * c;
            for (int i = 0; i < 4; ++i) {
                const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(q + 8 * i)));
                const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(bytes, _mm256_set1_epi32(15)));
                const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4));
                _mm256_storeu_ps(o + 64 * c + 8 * i, _mm256_sub_ps(_mm256_mul_ps(d_lo, lo), m_lo));
                _mm256_storeu_ps(o + 64 * c + 32 + 8 * i, _mm256_sub_ps(_mm256_mul_ps(d_hi, hi), m_hi));
            }
        }
    }
}

// One output row of W in float32 from its grouped blocks: as kv8.quant.gguf_blocks.dequantize_blocks computes it,
// bit for bit (float32 d * code, Q4_0 d * (c - 8), Q5_0 d * (c - 16), Q4_1 d * c then + m: a multiply and an add,
// never fused; the build's -std=c++17 keeps GCC from contracting them).
template <int QT>
static inline void gguf_dequantize_row(const uint8_t* wrow, int64_t nb, float* out) {
    constexpr int CODE_BYTES = QT == GGUF_Q8_0 ? 32 : QT == GGUF_Q5_0 ? 20 : 16;
    constexpr int HEAD = QT == GGUF_Q4_1 ? 4 : 2;
    const int64_t group_bytes = (int64_t)GGUF_GROUP * GGUF_BLOCK_BYTES[QT];
    for (int64_t b0 = 0; b0 < nb; b0 += GGUF_GROUP) {
        const uint8_t* grp = wrow + b0 / GGUF_GROUP * group_bytes;
        const int g = (int)(nb - b0 < GGUF_GROUP ? nb - b0 : GGUF_GROUP);
        const uint8_t* codes = grp + HEAD * g;
        for (int j = 0; j < g; ++j) {
            const __m256 d = _mm256_set1_ps(gguf_half(grp + 2 * j));
            const __m256 m = QT == GGUF_Q4_1 ? _mm256_set1_ps(gguf_half(grp + 2 * g + 2 * j)) : _mm256_setzero_ps();
            const uint8_t* c = codes + j * CODE_BYTES;
            float* o = out + (b0 + j) * GGUF_BLOCK;
            if (QT == GGUF_Q8_0) {
                for (int i = 0; i < 4; ++i) {
                    const __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(c + 8 * i)));
                    _mm256_storeu_ps(o + 8 * i, _mm256_mul_ps(d, _mm256_cvtepi32_ps(q)));
                }
            } else {
                const __m256i w = QT == GGUF_Q5_0 ? gguf_q5_codes(c) : gguf_nibbles(c);   // in element order
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
    }
}

template <int QT>
static void gguf_dequantize_rows(const kv8_gguf_dequantize_call& call) {
    const int64_t N = call.rows, K = call.in_features, nb = K / GGUF_BLOCK;
    const int64_t row_bytes = nb * GGUF_BLOCK_BYTES[QT];
    const int threads = threads_for(N * K, call.num_threads);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t n = 0; n < N; ++n) {
        if constexpr (QT == GGUF_Q4_K)
            gguf_dequantize_row_q4k(call.blocks + n * row_bytes, nb, call.out + n * K);
        else
            gguf_dequantize_row<QT>(call.blocks + n * row_bytes, nb, call.out + n * K);
    }
}

static int gguf_dequantize(const kv8_gguf_dequantize_call& call) {
    switch (call.qtype) {
        case GGUF_Q8_0: gguf_dequantize_rows<GGUF_Q8_0>(call); break;
        case GGUF_Q4_0: gguf_dequantize_rows<GGUF_Q4_0>(call); break;
        case GGUF_Q4_1: gguf_dequantize_rows<GGUF_Q4_1>(call); break;
        case GGUF_Q5_0: gguf_dequantize_rows<GGUF_Q5_0>(call); break;
        default: gguf_dequantize_rows<GGUF_Q4_K>(call); break;
    }
    return OK;
}

static int gguf_linear(const kv8_gguf_linear_call& call) {
    const int64_t M = call.rows, K = call.in_features, nb = K / GGUF_BLOCK;
    int8_t* qa = (int8_t*)std::malloc((size_t)(M * K));
    float* scales = (float*)std::malloc(sizeof(float) * (size_t)(2 * M * nb));
    if (!qa || !scales) {
        std::free(qa);
        std::free(scales);
        return ERR_OOM;
    }
    float *da = scales, *sa = scales + M * nb;
    const int qthreads = threads_for(M * K * 8, call.num_threads);
#pragma omp parallel for schedule(static) num_threads(qthreads)
    for (int64_t m = 0; m < M; ++m) gguf_quantize_row(call.x + m * K, K, qa + m * K, da + m * nb, sa + m * nb);
    switch (call.qtype) {
        case GGUF_Q8_0: gguf_linear_rows<GGUF_Q8_0>(call, qa, da, sa); break;
        case GGUF_Q4_0: gguf_linear_rows<GGUF_Q4_0>(call, qa, da, sa); break;
        case GGUF_Q4_1: gguf_linear_rows<GGUF_Q4_1>(call, qa, da, sa); break;
        case GGUF_Q5_0: gguf_linear_rows<GGUF_Q5_0>(call, qa, da, sa); break;
        default: gguf_linear_rows<GGUF_Q4_K>(call, qa, da, sa); break;
    }
    std::free(qa);
    std::free(scales);
    return OK;
}
#else
#define KV8_GGUF_AVX2 0
#endif
