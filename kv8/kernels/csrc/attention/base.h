// Shared by every part of the attention library: the dtype and error codes (../common/kv8_abi.h), which fast
// paths the build has, the scalar float conversions, and the FP8 codecs on bits (exact decode, saturating
// round-to-nearest-even encode). Pure scalar C++, no ISA requirement.
#pragma once

#include "../common/kv8_abi.h"

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// The AVX-512 BF16 path (item_tile.h, item_decode.h) is compiled when the target has all of these.
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__) && \
    defined(__AVX512BF16__)
#define KV8_FAST 1
#else
#define KV8_FAST 0
#endif

// AMX-BF16 tiles for the prefill loop (item_tile.h) and decode items (item_decode_amx.h) where the build targets
// them, on top of the fast path.
#include "../common/amx_tiles.h"
#define KV8_ATTN_AMX (KV8_FAST && KV8_AMX)

static inline bool is_fp8(int kv) { return kv <= KV_E5M2; }
static inline int esize_of(int kv) { return is_fp8(kv) ? 1 : (kv == KV_F32 ? 4 : 2); }  // bytes per element
// An FP8 format's mantissa bits, exponent bias and largest finite value (the encoders', scalar and AVX-512).
template <int FMT>
struct Fp8Format {
    static constexpr int MB = FMT == KV_E5M2 ? 2 : 3;
    static constexpr int BIAS = FMT == KV_E4M3 ? 7 : (FMT == KV_E4M3FNUZ ? 8 : 15);
    static constexpr float MAXF = FMT == KV_E4M3 ? 448.0f : (FMT == KV_E4M3FNUZ ? 240.0f : 57344.0f);
};
static inline float fp8_max_finite(int kv) {
    return kv == KV_E4M3 ? Fp8Format<KV_E4M3>::MAXF
                         : (kv == KV_E4M3FNUZ ? Fp8Format<KV_E4M3FNUZ>::MAXF : Fp8Format<KV_E5M2>::MAXF);
}

// ------------------------------------------------------------------------------------------------
// Scalar conversions
// ------------------------------------------------------------------------------------------------

static inline float bits_f(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t f_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }
static inline float bf16_f(uint16_t h) { return bits_f((uint32_t)h << 16); }
static inline uint16_t f_bf16(float f) {  // round to nearest even; NaN -> 0x7FC0 (as c10::BFloat16)
    uint32_t b = f_bits(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    b += 0x7fffu + ((b >> 16) & 1u);
    return (uint16_t)(b >> 16);
}
static inline float f16_f(uint16_t h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
static inline uint16_t f_f16(float f) { _Float16 x = (_Float16)f; uint16_t h; memcpy(&h, &x, 2); return h; }

static inline float load_f(const void* p, int dtype, int64_t i) {
    if (dtype == DT_BF16) return bf16_f(((const uint16_t*)p)[i]);
    if (dtype == DT_F16) return f16_f(((const uint16_t*)p)[i]);
    return ((const float*)p)[i];
}

// Clears DAZ and FTZ for the lifetime of the object (subnormal FP8 values must survive), restores after.
struct FpEnv {
    unsigned saved;
    FpEnv() : saved(_mm_getcsr()) { _mm_setcsr(saved & ~0x8040u); }
    ~FpEnv() { _mm_setcsr(saved); }
};

// Exact value of an FP8 code (for the tables and tests).
static inline float fp8_exact(int fmt, int c) {
    int mag = c & 0x7f;
    float v;
    if (fmt == KV_E4M3) {
        if (mag == 0x7f) return NAN;
        int e = mag >> 3, m = mag & 7;
        v = e ? ldexpf((float)(8 + m), e - 10) : ldexpf((float)m, -9);
    } else if (fmt == KV_E4M3FNUZ) {
        if (c == 0x80) return NAN;
        int e = mag >> 3, m = mag & 7;
        v = e ? ldexpf((float)(8 + m), e - 11) : ldexpf((float)m, -10);
    } else {
        int e = mag >> 2, m = mag & 3;
        if (e == 31) {
            if (m) return NAN;
            v = INFINITY;
        } else {
            v = e ? ldexpf((float)(4 + m), e - 17) : ldexpf((float)m, -16);
        }
    }
    return (c & 0x80) ? -v : v;
}

// FP8 decode on bits (generic path).
template <int FMT>
static inline float fp8_bits(uint32_t c) {
    if (FMT == KV_E5M2) {  // an E5M2 code is the high byte of the fp16 with the same value
        return f16_f((uint16_t)(c << 8));
    }
    uint32_t mag = c & 0x7fu, sign = (c & 0x80u) << 24;
    float v = bits_f(mag << 20) * (FMT == KV_E4M3 ? 0x1p120f : 0x1p119f);  // exponent bias 127 -> 7 or 8
    if (FMT == KV_E4M3 ? mag == 0x7f : c == 0x80) v = NAN;
    return bits_f(f_bits(v) | sign);
}

// FP8 encode: saturate(round_to_nearest_even(x)), NaN -> nan code (sign kept where the format has a
// negative NaN); -0 and negative values rounding to zero keep the sign where there is a negative zero.
template <int FMT>
static inline uint8_t fp8_encode(float x) {
    constexpr int MB = Fp8Format<FMT>::MB, BIAS = Fp8Format<FMT>::BIAS;
    constexpr float MAXF = Fp8Format<FMT>::MAXF;
    uint32_t b = f_bits(x);
    uint32_t sign = b >> 31;
    if ((b & 0x7fffffffu) > 0x7f800000u) {  // NaN
        if (FMT == KV_E4M3) return sign ? 0xff : 0x7f;
        if (FMT == KV_E4M3FNUZ) return 0x80;
        return sign ? 0xfe : 0x7e;
    }
    float a = bits_f(b & 0x7fffffffu);
    a = a < MAXF ? a : MAXF;
    uint32_t code;
    const float min_normal = ldexpf(1.0f, 1 - BIAS);
    if (a < min_normal) {  // subnormal range: multiple of 2^(1 - BIAS - MB), rounded to nearest even
        code = (uint32_t)nearbyintf(a * ldexpf(1.0f, BIAS - 1 + MB));
    } else {
        uint32_t ab = f_bits(a);
        const int shift = 23 - MB;
        ab += ((1u << (shift - 1)) - 1u) + ((ab >> shift) & 1u);
        int e = (int)(ab >> 23) - 127 + BIAS;
        code = ((uint32_t)e << MB) | ((ab >> shift) & ((1u << MB) - 1u));
    }
    if (sign && (code != 0 || FMT != KV_E4M3FNUZ)) code |= 0x80u;
    return (uint8_t)code;
}
