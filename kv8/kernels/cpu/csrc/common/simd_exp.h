// exp of 16 float32 lanes (AVX-512) and of 8 (AVX2 + FMA) for kv8's C++ kernels, shared by the attention library (../attention) and the
// dense library (../dense). kv8/kernels/cpu/build.py hashes the files a source includes with #include "...", so an edit
// here rebuilds both libraries.
#pragma once
#include <immintrin.h>

static const float LOG2E = 1.44269504088896341f;  // log2(e), as float

#if defined(__AVX512F__)
// exp(x) for any float32 x, ~1 ulp (Cephes polynomial, 2^n applied with vscalefps); overflow to +inf above
// ~88.7; exp(-inf) = 0; NaN stays NaN.
//
// Never a subnormal result: below x = -87 (exp(-87) ~ 1.6e-38, just above FLT_MIN) the result is 0. The
// attention kernels run with subnormals on (FpEnv: FP8 subnormals must survive), and there every subnormal
// result costs a microcode assist: softmax weights exp(s - max) of scores spread by more than 87 made an
// FP8 decode call ~1.8x slower (bench_attention's random FP8 codes). No caller can tell the difference:
// a softmax weight below FLT_MIN is flushed to 0 by the bf16 conversion / vdpbf16ps anyway and adds nothing
// to a row sum >= 1 (the max's weight is 1), and 1 + exp(-g) in SiLU is 1 either way.
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));  // NaN: 2nd operand
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(LOG2E)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), r);
    p = _mm512_add_ps(p, _mm512_set1_ps(1.0f));
    // x >= -87 or NaN: here n >= -126, so p * 2^n is normal (or inf, or NaN); else 0.
    const __mmask16 normal = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.0f), _CMP_NLT_UQ);
    return _mm512_maskz_scalef_ps(normal, p, n);
}
#endif

#if defined(__AVX2__) && defined(__FMA__)
// exp(x) of 8 float32 lanes, ~1 ulp: exp_ps's polynomial on 8 lanes, 2^n built in exponent fields. Overflow to +inf above ~88.7, NaN stays NaN, and 0 below x = -87 (no subnormal results: the
// kernels run with subnormals on, and each one costs a microcode assist).
static inline __m256 exp8_ps(__m256 x) {
    x = _mm256_min_ps(_mm256_set1_ps(89.0f), _mm256_max_ps(_mm256_set1_ps(-104.0f), x));  // NaN: 2nd operand
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(LOG2E)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
    __m256 p = _mm256_set1_ps(1.9875691500e-4f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
    p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r);
    p = _mm256_add_ps(p, _mm256_set1_ps(1.0f));
    // x >= -87: n in [-126, 128]; 2^n = 2^h * 2^(n - h) with h = n >> 1, both factors normal, both products exact
    // (p * 2^n is normal or +inf: exp(88.5) = p * 2^128 stays finite).
    const __m256i ni = _mm256_cvtps_epi32(n), h = _mm256_srai_epi32(ni, 1);
    const __m256 two_h = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(h, _mm256_set1_epi32(127)), 23));
    const __m256 two_l = _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_add_epi32(_mm256_sub_epi32(ni, h), _mm256_set1_epi32(127)), 23));
    const __m256 y = _mm256_mul_ps(_mm256_mul_ps(p, two_h), two_l);
    return _mm256_and_ps(y, _mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_NLT_UQ));  // NaN x: kept (p is NaN)
}
#endif
