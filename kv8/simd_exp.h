// exp of 16 float32 lanes for kv8's C++ kernels (AVX-512), shared by kv8/attention/cpu_kernels.cpp and
// kv8/layers/dense_kernels.cpp. kv8/native.py hashes the files a source includes with #include "...", so an
// edit here rebuilds both libraries.
#pragma once
#include <immintrin.h>

#if defined(__AVX512F__)
// exp(x) for any float32 x, ~1 ulp (Cephes polynomial, 2^n applied with vscalefps: exact underflow to 0
// below ~-103, overflow to +inf above ~88.7); exp(-inf) = 0; NaN stays NaN.
static inline __m512 exp_ps(__m512 x) {
    x = _mm512_min_ps(_mm512_set1_ps(89.0f), _mm512_max_ps(_mm512_set1_ps(-104.0f), x));  // NaN: 2nd operand
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
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
    return _mm512_scalef_ps(p, n);
}
#endif
