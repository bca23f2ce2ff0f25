// int4_per_group32's encoder (kv8.quant.int4_group, bit for bit; its module docstring is the rule): one group of 32
// values -> 16 code bytes (channel 2j in byte j's low nibble, 2j + 1 in its high one; two's complement codes -8..7)
// and the bits of the group's float16 scale s (either sign; decode is code x s).
//
// The scale is searched for: candidates d = +-f16(clamp(amax / c, 2^-24, 65504)), c = 7, 7.25, ..., 8.75, in the
// order (7, +), (7, -), (7.25, +), ... (candidate k: c = 7 + floor(k / 2) / 4, sign - for odd k); each quantizes with
// r = 1 / d (one float32 division), q = clamp(rne(x r), -8, 7), and scores err(d) = tsum((x - q d)^2); the first
// strict minimum wins; then one least-squares refit d' = f16(tsum(x q) / tsum(q q)) (magnitude clamped, sign kept)
// replaces it where err(d') is strictly smaller. A group with a NaN or an infinity, or all zeros, gets s = 1.0 and
// codes clamp(rne(x), -8, 7), NaN -> 0.
//
// tsum is the sum of 32 values in one fixed order, v[j] + v[j + 16], then j + 8, 4, 2, 1 -- what a 16-lane
// register's halving reduction gives -- so that this kernel, the torch reference and the Triton store round the same
// sums. What else keeps the bits the reference's:
// * every product that feeds an addition (the squares (x - q d)^2, the refit's x q and q q) passes through
//   unfused(): g++ contracts a * b + c into one FMA by default (-ffp-contract=fast, also for the vector operators the
//   intrinsics lower to), which rounds once where the reference rounds the product and then the sum. q d needs no
//   barrier: a 4-bit integer times a float16 is exact in float32, so x - q d rounds once either way;
// * true float32 divisions for amax / c, 1 / d and the refit's quotient, and float16 conversions that round to
//   nearest even (f_f16; vcvtps2ph with an explicit round-to-nearest);
// * no DAZ/FTZ (run_store's FpEnv): squares of small residuals may be float32 subnormals, as in torch.
//
// i4g_group_ref is the plain reference, a transcription of the rule (and the store of builds with neither path
// below: x86-64-v2); i4g_groups_avx512 is the fast path (KV8_FAST): a group is two 16-lane registers, the 16
// candidates' errors come out of one batched reduction (i4g_tsum16x16) in the same tree order, and a row's groups are
// searched two at a time (their dependency chains overlap); i4g_group_avx2 (AVX2 + F16C builds without the fast
// path: x86-64-v3) holds a group in four 8-lane registers, one candidate at a time. The store tests compare the bytes
// of all three (the native, x86-64-v3 and x86-64-v2 builds) with kv8.quant.int4_group.INT4_G32.encode; without
// unfused() the native build's bytes differ from it on those tests.
#pragma once

#include "base.h"

static_assert(KV_FORMATS[KV_I4G].group == 32 && KV_FORMATS[KV_I4G].gscale == 2, "int4_per_group32: float16 per 32");

static const int I4G_GROUP = 32;        // values per group
static const int I4G_CANDIDATES = 16;   // scales tried per group before the refit
static const uint16_t I4G_ONE = 0x3C00; // float16 1.0: the scale of a group with a NaN, an infinity or only zeros

// v as computed: an empty asm the optimizer cannot see through, so that a product feeding an addition is rounded
// as a product (see the top of this file).
static inline float unfused(float v) {
    asm("" : "+x"(v));
    return v;
}

// The candidates' divisors c = 7 + (k / 2) / 4, candidate k = 0..15 (the sign: odd k negative).
static inline float i4g_divisor(int k) { return 7.0f + 0.25f * (float)(k / 2); }

// The float16 bits of scale s with its magnitude clamped to [2^-24, 65504] and its sign kept (+ for a zero):
// Int4GroupFormat.encode_scale.
static inline uint16_t i4g_scale_bits(float s) {
    const float a = fabsf(s);
    const uint16_t h = f_f16(a < 0x1p-24f ? 0x1p-24f : a > 65504.0f ? 65504.0f : a);
    return s < 0.0f ? (uint16_t)(h | 0x8000u) : h;
}

// The group's 16 code bytes from its 32 codes q (-8..7, as floats).
static inline void i4g_pack(const float* q, uint8_t* codes) {
    for (int j = 0; j < I4G_GROUP / 2; ++j)
        codes[j] = (uint8_t)(((int)q[2 * j] & 0xF) | (((int)q[2 * j + 1] & 0xF) << 4));
}

// ---- the reference ----------------------------------------------------------------------------------------------

// tsum of v[0..31] (overwritten): v[j] + v[j + 16], then j + 8, 4, 2, 1.
static inline float i4g_tree_sum(float* v) {
    for (int n = I4G_GROUP / 2; n >= 1; n /= 2)
        for (int j = 0; j < n; ++j) v[j] = v[j] + v[j + n];
    return v[0];
}

// quant(d) of a finite group x into q, and err(d); d a nonzero float16 value.
static inline float i4g_quantize_ref(const float* x, float d, float* q) {
    const float r = 1.0f / d;
    float sq[I4G_GROUP];
    for (int j = 0; j < I4G_GROUP; ++j) {
        const float c = x[j] * r;
        q[j] = nearbyintf(c < -8.0f ? -8.0f : c > 7.0f ? 7.0f : c);
        const float e = x[j] - q[j] * d;
        sq[j] = unfused(e * e);
    }
    return i4g_tree_sum(sq);
}

// One group of 32 values x -> its 16 code bytes; returns its scale's float16 bits. The rule, one step at a time.
static inline uint16_t i4g_group_ref(const float* x, uint8_t* codes) {
    float amax = 0.0f;
    bool nan = false;
    for (int j = 0; j < I4G_GROUP; ++j) {
        const float a = fabsf(x[j]);
        nan |= a != a;
        amax = a > amax ? a : amax;
    }
    float best_q[I4G_GROUP];
    if (nan || !(amax > 0.0f) || amax == INFINITY) {
        for (int j = 0; j < I4G_GROUP; ++j)
            best_q[j] = x[j] != x[j] ? 0.0f : nearbyintf(x[j] < -8.0f ? -8.0f : x[j] > 7.0f ? 7.0f : x[j]);
        i4g_pack(best_q, codes);
        return I4G_ONE;
    }
    uint16_t best_h = 0;
    float best_e = 0.0f, q[I4G_GROUP];
    for (int k = 0; k < I4G_CANDIDATES; ++k) {
        const uint16_t mag = i4g_scale_bits(amax / i4g_divisor(k));
        const uint16_t h = k % 2 ? (uint16_t)(mag ^ 0x8000u) : mag;
        const float e = i4g_quantize_ref(x, f16_f(h), q);
        if (k == 0 || e < best_e) {
            best_h = h;
            best_e = e;
            memcpy(best_q, q, sizeof(q));
        }
    }
    float xq[I4G_GROUP], qq[I4G_GROUP];
    for (int j = 0; j < I4G_GROUP; ++j) {
        xq[j] = unfused(x[j] * best_q[j]);
        qq[j] = unfused(best_q[j] * best_q[j]);
    }
    const float num = i4g_tree_sum(xq), den = i4g_tree_sum(qq);
    const float fit = den > 0.0f ? num / den : 0.0f;
    if (isfinite(fit) && fit != 0.0f) {
        const uint16_t h = i4g_scale_bits(fit);
        if (i4g_quantize_ref(x, f16_f(h), q) < best_e) {
            best_h = h;
            memcpy(best_q, q, sizeof(q));
        }
    }
    i4g_pack(best_q, codes);
    return best_h;
}

// ---- the fast path ----------------------------------------------------------------------------------------------
#if KV8_FAST

static inline __m512 unfused(__m512 v) {
    asm("" : "+v"(v));
    return v;
}

// quant(d) of 16 values with r = 1 / d: clamp(rne(x r), -8, 7).
static inline __m512 i4g_codes16(__m512 x, __m512 r) {
    const __m512 q = _mm512_roundscale_ps(_mm512_mul_ps(x, r), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_min_ps(_mm512_max_ps(q, _mm512_set1_ps(-8.0f)), _mm512_set1_ps(7.0f));
}

// The first level of tsum(a b) over a group whose channels j, j + 16 are lane j of (a0, b0), (a1, b1).
static inline __m512 i4g_products16(__m512 a0, __m512 b0, __m512 a1, __m512 b1) {
    return _mm512_add_ps(unfused(_mm512_mul_ps(a0, b0)), unfused(_mm512_mul_ps(a1, b1)));
}

// The first level of err(d) of a group (x0: channels 0..15, x1: 16..31) with codes q0, q1: lane j = (x_j - q_j d)^2
// + (x_{j+16} - q_{j+16} d)^2.
static inline __m512 i4g_sq16(__m512 x0, __m512 x1, __m512 q0, __m512 q1, __m512 d) {
    const __m512 e0 = _mm512_sub_ps(x0, _mm512_mul_ps(q0, d)), e1 = _mm512_sub_ps(x1, _mm512_mul_ps(q1, d));
    return i4g_products16(e0, e0, e1, e1);
}

// The rest of tsum for one first level u (lane j: the sum of channels j, j + 16): j + 8, then 4, 2, 1.
static inline float i4g_tsum16(__m512 u) {
    const __m256 a = _mm256_add_ps(_mm512_castps512_ps256(u), _mm512_extractf32x8_ps(u, 1));
    const __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    const __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));   // lanes 0, 1: b0 + b2, b1 + b3
    return _mm_cvtss_f32(_mm_add_ss(c, _mm_movehdup_ps(c)));
}

// The rest of tsum for 16 first levels at once: lane k of the result is the sum of u[k] in i4g_tsum16's order.
// Each step adds two shuffles of a pair of registers, halving what every lane stands for:
//   pair(a, b)      [a j + a j+8 | b j + b j+8]                      (j < 8; 256-bit halves)
//   quad(v, w)      128-bit lane l: the 4 sums j + j+4 of lane l's source ([v's two candidates | w's two])
//   half(p, q)      lane l: [p's z0, z1 | q's z0, z1], z_j = y_j + y_j+2
//   last(p, q)      lane l: [p's two sums | q's two sums], z0 + z1
// with the pairing below, candidate k ends in lane k: quad m (m < 4) holds candidates m, m + 4, m + 8, m + 12 in its
// 128-bit lanes, and the last step interleaves quads 0..3 within each lane.
static inline __m512 i4g_tsum16x16(const __m512* u) {
    auto pair = [](__m512 a, __m512 b) {
        return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
    };
    auto quad = [](__m512 v, __m512 w) {
        return _mm512_add_ps(_mm512_shuffle_f32x4(v, w, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_f32x4(v, w, _MM_SHUFFLE(3, 1, 3, 1)));
    };
    auto half = [](__m512 p, __m512 q) {
        return _mm512_add_ps(_mm512_shuffle_ps(p, q, _MM_SHUFFLE(1, 0, 1, 0)),
                             _mm512_shuffle_ps(p, q, _MM_SHUFFLE(3, 2, 3, 2)));
    };
    auto last = [](__m512 p, __m512 q) {
        return _mm512_add_ps(_mm512_shuffle_ps(p, q, _MM_SHUFFLE(2, 0, 2, 0)),
                             _mm512_shuffle_ps(p, q, _MM_SHUFFLE(3, 1, 3, 1)));
    };
    __m512 w[4];
    for (int m = 0; m < 4; ++m) w[m] = quad(pair(u[m], u[m + 4]), pair(u[m + 8], u[m + 12]));
    return last(half(w[0], w[1]), half(w[2], w[3]));
}

// i4g_group_ref's results, bit for bit, for the N consecutive groups at x (codes: 16 bytes each, scales: one
// each). Every step runs for all N groups before the next, so that the groups' chains of dependent steps (a
// group's search is one long chain: amax, two divisions, the candidates, the reduction, the refit's sums and
// division) overlap. A group with a NaN or an infinity, or all zeros, goes to the reference (the others of its N
// one at a time).
template <int N>
static inline void i4g_groups_avx512(const float* x, uint8_t* codes, uint16_t* scales) {
    __m512 x0[N], x1[N];
    float amax[N];
    bool finite = true;
    for (int g = 0; g < N; ++g) {
        x0[g] = _mm512_loadu_ps(x + I4G_GROUP * g);
        x1[g] = _mm512_loadu_ps(x + I4G_GROUP * g + 16);
        const __mmask16 nan = _mm512_cmp_ps_mask(x0[g], x0[g], _CMP_UNORD_Q) |
                              _mm512_cmp_ps_mask(x1[g], x1[g], _CMP_UNORD_Q);
        amax[g] = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(x0[g]), _mm512_abs_ps(x1[g])));
        finite = finite && !nan && amax[g] > 0.0f && amax[g] != INFINITY;
    }
    if (!finite) {
        for (int g = 0; g < N; ++g) {
            if constexpr (N == 1) scales[g] = i4g_group_ref(x, codes);
            else i4g_groups_avx512<1>(x + I4G_GROUP * g, codes + I4G_GROUP / 2 * g, scales + g);
        }
        return;
    }

    // the candidates: lane k = candidate k (its divisor, then the odd lanes' sign bit flipped in float16)
    alignas(64) static const float DIVISORS[I4G_CANDIDATES] = {7.0f,  7.0f,  7.25f, 7.25f, 7.5f,  7.5f,
                                                               7.75f, 7.75f, 8.0f,  8.0f,  8.25f, 8.25f,
                                                               8.5f,  8.5f,  8.75f, 8.75f};
    alignas(64) float d[N][I4G_CANDIDATES], r[N][I4G_CANDIDATES], err[N][I4G_CANDIDATES];
    alignas(32) uint16_t h[N][I4G_CANDIDATES];
    for (int g = 0; g < N; ++g) {
        __m512 m = _mm512_div_ps(_mm512_set1_ps(amax[g]), _mm512_load_ps(DIVISORS));
        m = _mm512_min_ps(_mm512_max_ps(m, _mm512_set1_ps(0x1p-24f)), _mm512_set1_ps(65504.0f));
        const __m256i hv = _mm256_xor_si256(_mm512_cvtps_ph(m, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
                                            _mm256_set1_epi32((int)0x80000000u));   // odd words: negative
        const __m512 dv = _mm512_cvtph_ps(hv);
        _mm512_store_ps(d[g], dv);
        _mm512_store_ps(r[g], _mm512_div_ps(_mm512_set1_ps(1.0f), dv));
        _mm256_store_si256((__m256i*)h[g], hv);
    }
    int k[N];
    for (int g = 0; g < N; ++g) {
        __m512 u[I4G_CANDIDATES];
        for (int c = 0; c < I4G_CANDIDATES; ++c) {
            const __m512 rc = _mm512_set1_ps(r[g][c]);
            u[c] = i4g_sq16(x0[g], x1[g], i4g_codes16(x0[g], rc), i4g_codes16(x1[g], rc), _mm512_set1_ps(d[g][c]));
        }
        const __m512 e = i4g_tsum16x16(u);
        _mm512_store_ps(err[g], e);
        // the first strict minimum: the lowest lane holding the least error (never NaN: x is finite)
        k[g] = __builtin_ctz(_mm512_cmp_ps_mask(e, _mm512_set1_ps(_mm512_reduce_min_ps(e)), _CMP_EQ_OQ));
    }
    __m512 q0[N], q1[N];
    float fit[N];
    for (int g = 0; g < N; ++g) {
        scales[g] = h[g][k[g]];
        q0[g] = i4g_codes16(x0[g], _mm512_set1_ps(r[g][k[g]]));
        q1[g] = i4g_codes16(x1[g], _mm512_set1_ps(r[g][k[g]]));
        const float den = i4g_tsum16(i4g_products16(q0[g], q0[g], q1[g], q1[g]));
        fit[g] = den > 0.0f ? i4g_tsum16(i4g_products16(x0[g], q0[g], x1[g], q1[g])) / den : 0.0f;
    }
    for (int g = 0; g < N; ++g) {
        if (!isfinite(fit[g]) || fit[g] == 0.0f) continue;
        const uint16_t h2 = i4g_scale_bits(fit[g]);
        const float d2 = f16_f(h2);
        const __m512 r2 = _mm512_set1_ps(1.0f / d2);
        const __m512 p0 = i4g_codes16(x0[g], r2), p1 = i4g_codes16(x1[g], r2);
        if (i4g_tsum16(i4g_sq16(x0[g], x1[g], p0, p1, _mm512_set1_ps(d2))) < err[g][k[g]]) {
            scales[g] = h2;
            q0[g] = p0;
            q1[g] = p1;
        }
    }
    // byte j = (q_2j & 15) | (q_2j+1 & 15) << 4: the codes as bytes in channel order, word j = channels 2j, 2j + 1
    for (int g = 0; g < N; ++g) {
        const __m256i b = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q0[g]))),
            _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(q1[g])), 1);
        const __m256i w = _mm256_or_si256(_mm256_and_si256(b, _mm256_set1_epi16(0x000F)),
                                          _mm256_and_si256(_mm256_srli_epi16(b, 4), _mm256_set1_epi16(0x00F0)));
        _mm_storeu_si128((__m128i*)(codes + I4G_GROUP / 2 * g), _mm256_cvtepi16_epi8(w));
    }
}
#endif

// ---- AVX2 (builds without the AVX-512 path: x86-64-v3) ----------------------------------------------------------
#if !KV8_FAST && defined(__AVX2__) && defined(__F16C__)
#define KV8_I4G_AVX2 1

static inline __m256 unfused(__m256 v) {
    asm("" : "+x"(v));
    return v;
}

// quant(d) of 8 values with r = 1 / d: clamp(rne(x r), -8, 7).
static inline __m256 i4g_codes8(__m256 x, __m256 r) {
    const __m256 q = _mm256_round_ps(_mm256_mul_ps(x, r), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm256_min_ps(_mm256_max_ps(q, _mm256_set1_ps(-8.0f)), _mm256_set1_ps(7.0f));
}

// tsum(a b) of a group in four registers (register i: channels 8i .. 8i + 7): lanes j of registers 0, 2 (channels
// j, j + 16) and 1, 3 (j + 8, j + 24), then those two sums (j + 8), then 4, 2, 1.
static inline float i4g_tsum_products8(const __m256* a, const __m256* b) {
    __m256 p[4];
    for (int i = 0; i < 4; ++i) p[i] = unfused(_mm256_mul_ps(a[i], b[i]));
    const __m256 t = _mm256_add_ps(_mm256_add_ps(p[0], p[2]), _mm256_add_ps(p[1], p[3]));
    const __m128 u = _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
    const __m128 v = _mm_add_ps(u, _mm_movehl_ps(u, u));   // lanes 0, 1: u0 + u2, u1 + u3
    return _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)));
}

// quant(d) of a finite group x (four registers) into q, and err(d); r = 1 / d.
static inline float i4g_quantize8(const __m256* x, float d, float r, __m256* q) {
    const __m256 dv = _mm256_set1_ps(d), rv = _mm256_set1_ps(r);
    __m256 e[4];
    for (int i = 0; i < 4; ++i) {
        q[i] = i4g_codes8(x[i], rv);
        e[i] = _mm256_sub_ps(x[i], _mm256_mul_ps(q[i], dv));
    }
    return i4g_tsum_products8(e, e);
}

// i4g_group_ref's result, bit for bit, in 8-lane registers; a group with a NaN or an infinity, or all zeros, goes to
// the reference. The negative candidates reuse the positive ones' divisions: 1 / -d = -(1 / d) exactly.
static inline uint16_t i4g_group_avx2(const float* x, uint8_t* codes) {
    __m256 xv[4], amax8 = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
        xv[i] = _mm256_loadu_ps(x + 8 * i);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(xv[i], xv[i], _CMP_UNORD_Q));
        amax8 = _mm256_max_ps(amax8, _mm256_andnot_ps(_mm256_set1_ps(-0.0f), xv[i]));
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, amax8);
    float amax = 0.0f;
    for (int i = 0; i < 8; ++i) amax = lanes[i] > amax ? lanes[i] : amax;
    if (_mm256_movemask_ps(nan) || !(amax > 0.0f) || amax == INFINITY) return i4g_group_ref(x, codes);

    alignas(32) static const float DIVISORS[8] = {7.0f, 7.25f, 7.5f, 7.75f, 8.0f, 8.25f, 8.5f, 8.75f};
    __m256 m = _mm256_div_ps(_mm256_set1_ps(amax), _mm256_load_ps(DIVISORS));
    m = _mm256_min_ps(_mm256_max_ps(m, _mm256_set1_ps(0x1p-24f)), _mm256_set1_ps(65504.0f));
    const __m128i hv = _mm256_cvtps_ph(m, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256 dv = _mm256_cvtph_ps(hv);
    alignas(32) float d[8], r[8];
    alignas(16) uint16_t h[8];
    _mm256_store_ps(d, dv);
    _mm256_store_ps(r, _mm256_div_ps(_mm256_set1_ps(1.0f), dv));
    _mm_store_si128((__m128i*)h, hv);

    __m256 q[4], best_q[4];
    uint16_t best_h = 0;
    float best_e = 0.0f;
    for (int k = 0; k < I4G_CANDIDATES; ++k) {   // candidate k: divisor k / 2, negative for odd k
        const float sign = k % 2 ? -1.0f : 1.0f;
        const float e = i4g_quantize8(xv, sign * d[k / 2], sign * r[k / 2], q);
        if (k == 0 || e < best_e) {
            best_e = e;
            best_h = k % 2 ? (uint16_t)(h[k / 2] ^ 0x8000u) : h[k / 2];
            for (int i = 0; i < 4; ++i) best_q[i] = q[i];
        }
    }
    const float den = i4g_tsum_products8(best_q, best_q);
    const float fit = den > 0.0f ? i4g_tsum_products8(xv, best_q) / den : 0.0f;
    if (isfinite(fit) && fit != 0.0f) {
        const uint16_t h2 = i4g_scale_bits(fit);
        const float d2 = f16_f(h2);
        if (i4g_quantize8(xv, d2, 1.0f / d2, q) < best_e) {
            best_h = h2;
            for (int i = 0; i < 4; ++i) best_q[i] = q[i];
        }
    }
    alignas(32) float qf[I4G_GROUP];
    for (int i = 0; i < 4; ++i) _mm256_store_ps(qf + 8 * i, best_q[i]);
    i4g_pack(qf, codes);
    return best_h;
}
#endif

// One int4_per_group32 row of D values x (D % 32 == 0) -> dst: the D / 2 code bytes, then each group's float16 scale
// (two bytes, low first). The fast path takes the groups two at a time.
static inline void store_row_int4_group(const float* x, int D, uint8_t* dst) {
    const int G = D / I4G_GROUP;
    uint16_t h[2];
    for (int g = 0; g < G;) {
#if KV8_FAST
        const int n = G - g >= 2 ? 2 : 1;
        if (n == 2) i4g_groups_avx512<2>(x + I4G_GROUP * g, dst + I4G_GROUP / 2 * g, h);
        else i4g_groups_avx512<1>(x + I4G_GROUP * g, dst + I4G_GROUP / 2 * g, h);
#elif defined(KV8_I4G_AVX2)
        const int n = 1;
        h[0] = i4g_group_avx2(x + I4G_GROUP * g, dst + I4G_GROUP / 2 * g);
#else
        const int n = 1;
        h[0] = i4g_group_ref(x + I4G_GROUP * g, dst + I4G_GROUP / 2 * g);
#endif
        for (int i = 0; i < n; ++i, ++g) {
            dst[D / 2 + 2 * g] = (uint8_t)(h[i] & 0xFF);
            dst[D / 2 + 2 * g + 1] = (uint8_t)(h[i] >> 8);
        }
    }
}
