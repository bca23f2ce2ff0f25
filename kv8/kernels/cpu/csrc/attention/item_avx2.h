// The AVX2 item kernel: fp32 arithmetic in 8-lane registers with FMA, every KV format, head dims that are a
// multiple of 8 (up to 1024), any item shape. It serves every item on CPUs without the AVX-512 BF16 path (AMD Zen 2
// and 3, Intel before Ice Lake, x86-64-v3 builds) and, on CPUs with it, the items the fast kernels do not take
// (fp16 / fp32 caches, head dims that are not a multiple of 16). It computes what run_item_generic computes, the
// same fp32 online softmax over the same tiles, with these differences in rounding only:
//   - the query row is multiplied by sm_scale x the K head scale once (generic: each score);
//   - a score is a sum of 8 partial sums (channels d = i mod 8), each an FMA chain (generic: one chain in d order);
//   - exp is exp8_ps below (~1 ulp, 0 below exp(-87)) instead of libm's expf; alpha keeps expf;
//   - P.V accumulates with FMA.
// Masking is the generic kernel's: a key counts for row r when it is one of the tile's n tokens and lies in the
// row's [first_visible, row_limit]; masked keys have weight exactly 0 (never exp(-inf - max) of a row that has seen
// nothing, so a row's NaN can only come from its data).
//
// Integer caches: the per-token K scale multiplies each token's score once and the per-token V scale rides on the
// token's weight (p x V scale), so a row's channels decode to the codes' exact values with no scale per
// channel; int4 rows decode 16 channels at a time in a permuted ("split") channel order that the query rows and
// the accumulators follow (decode16_int4_split), still exact, so int8 and int4 results differ from the reference
// by the rounding above only (a score's 8 partial sums then group channels by split position). Measured and not
// kept: scores as integer dot products (each q row quantized to int16, K codes widened to int16, vpmaddwd), which
// would add an error of up to max|q| x 2^-16 per channel, were no faster than these fp32 FMAs on Zen 3 (decode
// 8 x 4,096, SmolLM2 shapes: int4 within 2%, int8 slower) -- the K side is not what bounds the integer formats.
//
// FP8 E4M3 rows (fn and fnuz) decode through fp16 (half codes, see half_codes below): each value reads as its exact
// value times 2^-(15 - bias), and that power of two rides on the query rows and the softmax weights instead, so the
// products and sums are the exact decode's (results bit for bit those of decoding exactly, barring fp32
// overflow or subnormals of q x 2^8); a tile whose K or V rows hold a NaN code decodes exactly (NaN stays NaN).
//
// Per tile of 16 tokens: decode the 16 K rows to fp32 (pad rows read ZERO_ROW), then per visible row 16 scores
// (8 tokens at a time, 8 FMA chains, one horizontal reduction for 8 scores), the online-softmax step and the
// weights p x V scale; then acc = acc x alpha + p . V for 4 rows x 16 channels at a time (8 accumulators), V rows
// decoded inside that loop where the tile has at most 4 visible rows (decode: each value decoded once, no buffer),
// else once into a buffer.
#pragma once

#include "problem.h"
#include "../common/simd_exp.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define KV8_AVX2 1
#else
#define KV8_AVX2 0
#endif

#if KV8_AVX2
static inline float hsum8(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

static inline float hmax8(__m256 x) {
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_max_ss(s, _mm_movehdup_ps(s)));
}

// The 8 sums of a0 .. a7 (lane i: the sum of ai's lanes).
static inline __m256 hsum8x8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6,
                             __m256 a7) {
    const __m256 s0123 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
    const __m256 s4567 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

// Channels d .. d + 7 of a cache row of format KV, as exact fp32 values (FP8 on bits, as fp8_bits: NaN codes NaN,
// subnormals exact while DAZ is off).
template <int KV>
static inline __m256 decode8_exact(const uint8_t* row, int d) {
    constexpr KvFormat F = KV_FORMATS[KV];
    if constexpr (F.fp8) {
        const __m128i b = _mm_loadl_epi64((const __m128i*)(row + d));
        if constexpr (F.has_inf) {  // an E5M2 code is the high byte of the fp16 with the same value
            return _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), b));
        } else {  // the magnitude's bits where a float's go, times 2^(127 - bias); then the sign and NaN
            constexpr float REBIAS = pow2f(127 - F.bias);
            const __m256i c = _mm256_cvtepu8_epi32(b);
            const __m256i mag = _mm256_and_si256(c, _mm256_set1_epi32(0x7f));
            __m256 v = _mm256_mul_ps(_mm256_castsi256_ps(_mm256_slli_epi32(mag, 23 - F.mbits)),
                                     _mm256_set1_ps(REBIAS));
            v = _mm256_or_ps(v, _mm256_castsi256_ps(
                                    _mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24)));
            const __m256i nan = F.nan_0x80 ? _mm256_cmpeq_epi32(c, _mm256_set1_epi32(0x80))
                                           : _mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7f));
            return _mm256_blendv_ps(v, _mm256_set1_ps(NAN), _mm256_castsi256_ps(nan));
        }
    } else if constexpr (F.ibits == 8) {  // sign-extended to 32 bits, converted exactly
        return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(row + d))));
    } else if constexpr (F.ibits == 4) {  // 4 bytes = 8 nibbles: lane i's at bits 4i..4i+3, moved to the top, sign-shifted
        int32_t word;
        memcpy(&word, row + d / 2, 4);
        const __m256i up = _mm256_sllv_epi32(_mm256_set1_epi32(word), _mm256_setr_epi32(28, 24, 20, 16, 12, 8, 4, 0));
        return _mm256_cvtepi32_ps(_mm256_srai_epi32(up, 28));
    } else if constexpr (F.elem == DT_BF16) {
        const __m128i h = _mm_loadu_si128((const __m128i*)(row + 2 * d));
        return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    } else if constexpr (F.elem == DT_F16) {
        return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(row + 2 * d)));
    } else {
        return _mm256_loadu_ps((const float*)row + d);
    }
}

// int4 rows decode 16 channels at a time in "split" order: within each whole group of 16 channels (d < D16 =
// D rounded down to 16), position 16g + i holds channel 16g + 2i for i < 8 (the low nibbles of the group's 8
// bytes) and channel 16g + 2(i - 8) + 1 for i >= 8 (the high nibbles); a last group of 8 channels (D % 16 == 8)
// keeps the natural order. Scores are dot products, so the kernel permutes each query row the same way once per
// item (to_split); P.V accumulates in split order, put back in natural order before the row finishes (from_split).
// Every decoded value is exact: one sign-extending byte load per 16 channels, the high nibble by an arithmetic
// shift (a byte read as int8 is hi * 16 + lo, 0 <= lo < 16), the low nibble by two shifts; then one conversion
// per 8 values -- where decode8 takes a broadcast, a variable shift, a shift and a conversion per 8.
static inline int split_pos(int d, int D16) {
    return d >= D16 ? d : (d & ~15) + ((d & 1) ? 8 : 0) + ((d & 15) >> 1);
}

// x (D values of a row, natural order) -> split order, in place (tmp: D floats of scratch).
static inline void to_split(float* x, int D, float* tmp) {
    const int D16 = D & ~15;
    memcpy(tmp, x, sizeof(float) * (size_t)D16);
    for (int d = 0; d < D16; ++d) x[split_pos(d, D16)] = tmp[d];
}

// x (D values, split order) -> nat (natural order).
static inline void from_split(const float* x, int D, float* nat) {
    const int D16 = D & ~15;
    for (int d = 0; d < D; ++d) nat[d] = x[split_pos(d, D16)];
}

// Channels 16g .. 16g + 15 (d = 16g) of an int4 row, as exact fp32 in split order: out[d .. d + 7] the even
// channels, out[d + 8 .. d + 15] the odd ones.
static inline void decode16_int4_split(const uint8_t* row, int d, __m256& lo, __m256& hi) {
    const __m256i x = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(row + d / 2)));
    lo = _mm256_cvtepi32_ps(_mm256_srai_epi32(_mm256_slli_epi32(x, 28), 28));
    hi = _mm256_cvtepi32_ps(_mm256_srai_epi32(x, 4));
}

// Whether format KV's rows decode in split order (int4).
template <int KV>
static constexpr bool split_rows() { return KV_FORMATS[KV].ibits == 4; }

// E4M3 (fn and fnuz) rows decode through fp16 ("half codes"): a code's magnitude bits shifted into an fp16's
// exponent and mantissa fields (its 4 exponent bits the low 4 of the fp16's 5) and the sign into bit 15 make the
// fp16 whose value is the code's times 2^-(15 - bias), subnormals included -- a sign-extending load and 2 integer
// ops per 16 codes, then F16C's vcvtph2ps, where the exact decode takes 9 ops per 8 codes. HALF_SCALE = 2^(15 - bias) (E4M3: 2^8, E4M3FNUZ: 2^7) is
// folded in elsewhere: into the query rows (scores) and the softmax weights (P.V), both exact power-of-two scalings,
// so every product and sum is the one the exact decode gives. The NaN codes (0x7f / 0xff; fnuz: 0x80) would read as
// finite numbers (+-1.875 x 2^8 / -0), so a tile holding one decodes exactly instead (rows_have_nan; a NaN code
// reaches the cache only from a NaN input). Other formats: HALF_SCALE 1, the exact decode.
template <int KV>
static constexpr bool half_codes() { return KV_FORMATS[KV].fp8 && !KV_FORMATS[KV].has_inf; }
template <int KV>
static constexpr float half_scale() { return half_codes<KV>() ? pow2f(15 - KV_FORMATS[KV].bias) : 1.0f; }

// 8 or 16 sign-extended codes (16-bit lanes) -> their half-code fp16 bits: (c << 7) with bit 14 (a copy of the sign)
// cleared.
static inline __m128i half_bits8(__m128i c16) {
    return _mm_and_si128(_mm_slli_epi16(c16, 7), _mm_set1_epi16((short)0xBFFF));
}
static inline __m256i half_bits16(__m256i c16) {
    return _mm256_and_si256(_mm256_slli_epi16(c16, 7), _mm256_set1_epi16((short)0xBFFF));
}

// Channels d .. d + 7 of a row, as the kernel reads them: the exact value times 2^-(15 - bias) for E4M3 formats
// (HALF: through fp16, only for NaN-free codes; else the exact decode scaled), else the exact value.
template <int KV, bool HALF>
static inline __m256 decode8(const uint8_t* row, int d) {
    if constexpr (half_codes<KV>()) {
        if constexpr (HALF)
            return _mm256_cvtph_ps(half_bits8(_mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i*)(row + d)))));
        else
            return _mm256_mul_ps(decode8_exact<KV>(row, d), _mm256_set1_ps(1.0f / half_scale<KV>()));
    } else {
        return decode8_exact<KV>(row, d);
    }
}

// Channels d .. d + 15 as decode8 reads them (int4: in split order, see below): lo = positions d .. d + 7, hi =
// d + 8 .. d + 15.
template <int KV, bool HALF>
static inline void decode16(const uint8_t* row, int d, __m256& lo, __m256& hi) {
    constexpr KvFormat F = KV_FORMATS[KV];
    if constexpr (half_codes<KV>() && HALF) {
        const __m256i h = half_bits16(_mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(row + d))));
        lo = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
        hi = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));
    } else if constexpr (F.fp8 && F.has_inf) {
        const __m128i b = _mm_loadu_si128((const __m128i*)(row + d));
        lo = _mm256_cvtph_ps(_mm_unpacklo_epi8(_mm_setzero_si128(), b));
        hi = _mm256_cvtph_ps(_mm_unpackhi_epi8(_mm_setzero_si128(), b));
    } else if constexpr (F.ibits == 4) {
        decode16_int4_split(row, d, lo, hi);
    } else {
        lo = decode8<KV, HALF>(row, d);
        hi = decode8<KV, HALF>(row, d + 8);
    }
}

// A cache row of format KV as decode16 / decode8 read it (int4: in split order).
template <int KV, bool HALF>
static inline void decode_row8(const uint8_t* row, int D, float* out) {
    int d = 0;
    for (; d + 16 <= D; d += 16) {
        __m256 lo, hi;
        decode16<KV, HALF>(row, d, lo, hi);
        _mm256_storeu_ps(out + d, lo);
        _mm256_storeu_ps(out + d + 8, hi);
    }
    if (d < D) _mm256_storeu_ps(out + d, decode8<KV, HALF>(row, d));
}

// Whether one of the n rows (D codes each) holds a NaN code of E4M3 format KV: 0x7f / 0xff (fn: the running
// byte-wise max of c | 0x80 reaches 0xff), 0x80 (fnuz). 2 ops per 32 codes.
template <int KV>
static inline __m256i nan_step(__m256i any, __m256i c) {
    if constexpr (KV_FORMATS[KV].nan_0x80)
        return _mm256_or_si256(any, _mm256_cmpeq_epi8(c, _mm256_set1_epi8((char)0x80)));
    else
        return _mm256_max_epu8(any, _mm256_or_si256(c, _mm256_set1_epi8((char)0x80)));
}
template <int KV>
static inline bool rows_have_nan(const uint8_t* const* rows, int n, int D) {
    static_assert(half_codes<KV>(), "E4M3 formats only");
    __m256i any = _mm256_setzero_si256();
    for (int t = 0; t < n; ++t) {
        const uint8_t* row = rows[t];
        int d = 0;
        for (; d + 32 <= D; d += 32) any = nan_step<KV>(any, _mm256_loadu_si256((const __m256i*)(row + d)));
        for (; d < D; d += 8)  // the zeroed upper bytes are no NaN code
            any = nan_step<KV>(any, _mm256_zextsi128_si256(_mm_loadl_epi64((const __m128i*)(row + d))));
    }
    if constexpr (!KV_FORMATS[KV].nan_0x80) any = _mm256_cmpeq_epi8(any, _mm256_set1_epi8((char)0xff));
    return !_mm256_testz_si256(any, any);
}

// Lanes t (0..7) of 8 tokens starting at tile offset g whose key counts for a row: lo <= g + t <= hi.
static inline __m256 lanes_between(int g, int lo, int hi) {
    const __m256i t = _mm256_add_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(g));
    const __m256i in = _mm256_andnot_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(lo), t),
                                           _mm256_cmpgt_epi32(_mm256_set1_epi32(hi + 1), t));
    return _mm256_castsi256_ps(in);
}

// The scores of one row against 8 decoded K rows k[0..7] (row stride D): lane t = q . k[t].
static inline __m256 scores8(const float* q, const float* k, int D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int d = 0; d < D; d += 8) {
        const __m256 x = _mm256_loadu_ps(q + d);
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 0 * D + d), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 1 * D + d), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 2 * D + d), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 3 * D + d), a3);
        a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 4 * D + d), a4);
        a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 5 * D + d), a5);
        a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 6 * D + d), a6);
        a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 7 * D + d), a7);
    }
    return hsum8x8(a0, a1, a2, a3, a4, a5, a6, a7);
}

// Where P.V reads a tile's V rows: decoded into a buffer once (FloatRows: rows of D floats), or straight from the
// cache rows (CodeRows: decode16 / decode8 per use, no buffer -- each value is read once when all of an item's rows
// are in the same pv_rows call). v16: positions d .. d + 15 of token t's row; v8: d .. d + 7.
struct FloatRows {
    const float* v;
    int D;
    void v16(int t, int d, __m256& lo, __m256& hi) const {
        lo = _mm256_loadu_ps(v + (size_t)t * D + d);
        hi = _mm256_loadu_ps(v + (size_t)t * D + d + 8);
    }
    __m256 v8(int t, int d) const { return _mm256_loadu_ps(v + (size_t)t * D + d); }
};
template <int KV, bool HALF>
struct CodeRows {
    const uint8_t* const* rows;
    void v16(int t, int d, __m256& lo, __m256& hi) const { decode16<KV, HALF>(rows[t], d, lo, hi); }
    __m256 v8(int t, int d) const { return decode8<KV, HALF>(rows[t], d); }
};

// acc[r] = acc[r] * alpha[r] + sum_t p[r][t] v[t] for NR rows (acc and p of consecutive rows, strides D and TILE),
// n tokens, 16 channels at a time (then 8 where D % 16 == 8).
template <int NR, class V>
static inline void pv_rows(float* acc, const float* alpha, const float* p, const V& v, int n, int D) {
    int d = 0;
    for (; d + 16 <= D; d += 16) {
        __m256 lo[NR], hi[NR];
        for (int i = 0; i < NR; ++i) {
            const __m256 a = _mm256_set1_ps(alpha[i]);
            lo[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + (size_t)i * D + d), a);
            hi[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + (size_t)i * D + d + 8), a);
        }
        for (int t = 0; t < n; ++t) {
            __m256 v0, v1;
            v.v16(t, d, v0, v1);
            for (int i = 0; i < NR; ++i) {
                const __m256 w = _mm256_broadcast_ss(p + i * TILE + t);
                lo[i] = _mm256_fmadd_ps(w, v0, lo[i]);
                hi[i] = _mm256_fmadd_ps(w, v1, hi[i]);
            }
        }
        for (int i = 0; i < NR; ++i) {
            _mm256_storeu_ps(acc + (size_t)i * D + d, lo[i]);
            _mm256_storeu_ps(acc + (size_t)i * D + d + 8, hi[i]);
        }
    }
    if (d < D) {  // D % 16 == 8
        __m256 x[NR];
        for (int i = 0; i < NR; ++i)
            x[i] = _mm256_mul_ps(_mm256_loadu_ps(acc + (size_t)i * D + d), _mm256_set1_ps(alpha[i]));
        for (int t = 0; t < n; ++t) {
            const __m256 v0 = v.v8(t, d);
            for (int i = 0; i < NR; ++i) x[i] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + i * TILE + t), v0, x[i]);
        }
        for (int i = 0; i < NR; ++i) _mm256_storeu_ps(acc + (size_t)i * D + d, x[i]);
    }
}

// P.V of rows [r0, r1): 4 rows per pv_rows call, then the 1-3 left.
template <class V>
static inline void pv_all(float* acc, const float* alpha, const float* prob, const V& v, int r0, int r1, int n,
                          int D) {
    int r = r0;
    for (; r + 4 <= r1; r += 4) pv_rows<4>(acc + (size_t)r * D, alpha + r, prob + (size_t)r * TILE, v, n, D);
    const float* pr = prob + (size_t)r * TILE;
    float* ar = acc + (size_t)r * D;
    switch (r1 - r) {
        case 3: pv_rows<3>(ar, alpha + r, pr, v, n, D); break;
        case 2: pv_rows<2>(ar, alpha + r, pr, v, n, D); break;
        case 1: pv_rows<1>(ar, alpha + r, pr, v, n, D); break;
        default: break;
    }
}

template <int KV>
static int run_item_avx2(const Problem& P, const Item& it, float* ws) {
    const Rows w = rows_of(P, it);
    const int D = P.D, R = w.R;
    constexpr float HS = half_scale<KV>();  // E4M3: rows read as value / HS; HS rides on q and on the weights
    F32Scratch S;  // q rows times sm_scale x the K head scale: each score is one dot product
    if (!S.init(P, it, w, P.sm_scale * (k_per_channel(P) ? 1.0f : k_head_scale(P, it.kvh)) * HS)) return ERR_OOM;
    float *qf = S.qf, *acc = S.acc, *kf = S.kf, *vf = S.vf, *mx = S.mx, *sum = S.sum, *alpha = S.alpha, *prob = S.prob;
    const int64_t *lim = S.lim, *lo = S.lo;
    alignas(32) float nat[1024];  // one row in natural order (D <= 1024: avx2_serves)
    if constexpr (split_rows<KV>())
        for (int r = 0; r < R; ++r) to_split(qf + (size_t)r * D, D, nat);

    const uint8_t* kr[TILE];
    const uint8_t* vr[TILE];
    alignas(32) float ksc[TILE], vsc[TILE];
    for (int t = 0; t < TILE; ++t) ksc[t] = vsc[t] = 1.0f;
    int r0 = 0, r1 = 0;
    // One tile: K rows decoded into kf, scores and the softmax step per visible row, then P.V (V decoded once into
    // vf for more than 4 rows, else read from the codes inside P.V). HALF: E4M3 rows through fp16 (no NaN code in
    // the tile's rows).
    auto tile = [&](auto half, int64_t t0, int n) {
        constexpr bool HALF = decltype(half)::value;
        for (int t = 0; t < TILE; ++t) decode_row8<KV, HALF>(kr[t], D, kf + (size_t)t * D);
        const __m256 ks0 = _mm256_load_ps(ksc), ks1 = _mm256_load_ps(ksc + 8);
        const __m256 hs = _mm256_set1_ps(HS);
        const __m256 vs0 = _mm256_mul_ps(_mm256_load_ps(vsc), hs), vs1 = _mm256_mul_ps(_mm256_load_ps(vsc + 8), hs);
        for (int r = r0; r < r1; ++r) {
            // the row's keys in this tile: tile offsets [a, b] (both within [0, n - 1]: the row sees one at least)
            const int a = lo[r] > t0 ? (int)(lo[r] - t0) : 0;
            const int b = lim[r] - t0 < n - 1 ? (int)(lim[r] - t0) : n - 1;
            const __m256 in0 = lanes_between(0, a, b), in1 = lanes_between(8, a, b);
            const float* qr = qf + (size_t)r * D;
            const __m256 s0 = _mm256_mul_ps(scores8(qr, kf, D), ks0);
            const __m256 s1 = _mm256_mul_ps(scores8(qr, kf + (size_t)8 * D, D), ks1);
            const __m256 ninf = _mm256_set1_ps(-INFINITY);
            const float tmax = hmax8(_mm256_max_ps(_mm256_blendv_ps(ninf, s0, in0), _mm256_blendv_ps(ninf, s1, in1)));
            const float mnew = tmax > mx[r] ? tmax : mx[r];
            alpha[r] = mnew == mx[r] ? 1.0f : expf(mx[r] - mnew);
            mx[r] = mnew;
            const __m256 m = _mm256_set1_ps(mnew);
            const __m256 seen = _mm256_set1_ps(mnew == -INFINITY ? 0.0f : 1.0f);  // -inf scores only: weights 0
            const __m256 p0 = _mm256_mul_ps(_mm256_and_ps(exp8_ps(_mm256_sub_ps(s0, m)), in0), seen);
            const __m256 p1 = _mm256_mul_ps(_mm256_and_ps(exp8_ps(_mm256_sub_ps(s1, m)), in1), seen);
            sum[r] = sum[r] * alpha[r] + hsum8(_mm256_add_ps(p0, p1));
            _mm256_storeu_ps(prob + (size_t)r * TILE, _mm256_mul_ps(p0, vs0));
            _mm256_storeu_ps(prob + (size_t)r * TILE + 8, _mm256_mul_ps(p1, vs1));
        }
        if (r1 - r0 <= 4) {
            pv_all(acc, alpha, prob, CodeRows<KV, HALF>{vr}, r0, r1, n, D);
        } else {
            for (int t = 0; t < n; ++t) decode_row8<KV, HALF>(vr[t], D, vf + (size_t)t * D);
            pv_all(acc, alpha, prob, FloatRows{vf, D}, r0, r1, n, D);
        }
    };
    for (int p = 0; p < PREFETCH_TILES; ++p) prefetch_tile(P, it, it.t0 + p * TILE);
    for (int64_t t0 = it.t0; t0 < it.t1; t0 += TILE) {
        const int n = (int)(it.t1 - t0 < TILE ? it.t1 - t0 : TILE);
        prefetch_tile(P, it, t0 + PREFETCH_TILES * TILE);
        if (!tile_rows(P, it, t0, n, kr, vr, ksc, vsc)) return ERR_BLOCK_ID;
        while (r0 < R && lim[r0] < t0) ++r0;     // rows before r0 see nothing of this tile (limits ascend)
        while (r1 < R && lo[r1] < t0 + n) ++r1;  // nor do rows from r1 on (their windows start later)
        if constexpr (half_codes<KV>()) {
            if (rows_have_nan<KV>(kr, n, D) || rows_have_nan<KV>(vr, n, D)) tile(std::false_type{}, t0, n);
            else tile(std::true_type{}, t0, n);
        } else {
            tile(std::true_type{}, t0, n);
        }
    }
    for (int r = 0; r < R; ++r) {
        const float* ar = acc + (size_t)r * D;
        if constexpr (split_rows<KV>()) {
            from_split(ar, D, nat);
            ar = nat;
        }
        finish_row(P, it, w, r, ar, mx[r], sum[r], ws);
    }
    return OK;
}

// Whether the AVX2 kernel serves a problem's items.
// (FP4 rows keep a scale per 16 values after their codes, which the 8-channel decode does not read: the generic
// kernel serves the items the AVX-512 decode kernel does not take. A pair of formats -- K and V in different ones --
// is the generic kernel's too.)
static inline bool avx2_serves(const Problem& P) {
    return P.D % 8 == 0 && P.D <= 1024 && !KV_FORMATS[P.kv].group && P.vkv == P.kv;
}

static ItemFn avx2_item_fn(const Problem& P) {
    return with_kv_format(P.kv, [](auto K) -> ItemFn { return run_item_avx2<decltype(K)::value>; });
}
#endif
