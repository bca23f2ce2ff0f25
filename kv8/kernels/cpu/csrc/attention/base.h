// Shared by every part of the attention library: the dtype and error codes and the KV format table
// (../common/kv8_abi.h) with the dispatch from a format code to its kernel instances, which fast paths the build has,
// the scalar float conversions, and the FP8 codecs on bits (exact decode, saturating round-to-nearest-even encode).
// Pure scalar C++, no ISA requirement.
#pragma once

#include "../common/kv8_abi.h"

#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <type_traits>

// The AVX-512 BF16 path (item_tile.h, item_prefill.h, item_decode.h) is compiled when the target has all of these
// (VNNI: int4's integer products in the decode kernel; every CPU with AVX-512 BF16 has it).
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__) && \
    defined(__AVX512BF16__) && defined(__AVX512VNNI__)
#define KV8_FAST 1
#else
#define KV8_FAST 0
#endif

// AMX-BF16 tiles for the prefill loop (item_prefill_amx.h) and decode items (item_decode_amx.h) where the build
// targets them, on top of the fast path.
#include "../common/amx_tiles.h"
#define KV8_ATTN_AMX (KV8_FAST && KV8_AMX)

// Calls f(std::integral_constant<int, KV>{}) for the KV format code kv (a valid one): the one place where a code
// known at run time picks a compile-time instance. f reads KV_FORMATS[KV] as constants, and instantiates what it
// serves for the formats that need it only (if constexpr); every call of f returns the same type.
template <class F>
static inline decltype(auto) with_kv_format(int kv, F&& f) {
    switch (kv) {
        case KV_E4M3: return f(std::integral_constant<int, KV_E4M3>{});
        case KV_E4M3FNUZ: return f(std::integral_constant<int, KV_E4M3FNUZ>{});
        case KV_E5M2: return f(std::integral_constant<int, KV_E5M2>{});
        case KV_BF16: return f(std::integral_constant<int, KV_BF16>{});
        case KV_F16: return f(std::integral_constant<int, KV_F16>{});
        case KV_I8: return f(std::integral_constant<int, KV_I8>{});
        case KV_I4: return f(std::integral_constant<int, KV_I4>{});
        case KV_FP4: return f(std::integral_constant<int, KV_FP4>{});
        case KV_I4G: return f(std::integral_constant<int, KV_I4G>{});
        default: return f(std::integral_constant<int, KV_F32>{});
    }
}
static_assert(KV_COUNT == 10, "with_kv_format has a case per format");

// Whether the AVX-512 BF16 tile kernels (item_tile.h, item_prefill.h and their AMX forms) read format kv directly:
// every value of it is a bf16 (FP8 through the byte tables). The integer and group-scaled formats reach the tile
// kernel through tiles decoded to bf16 (item_staged.h).
static constexpr bool kv_bf16_exact(int kv) { return KV_FORMATS[kv].fp8 || KV_FORMATS[kv].elem == DT_BF16; }

// Whether the AVX-512 decode kernel (item_decode.h) reads format kv: the bf16-exact formats, and the integer codes
// (|code| <= 127: a bf16 exactly), int8 through a byte table, int4 through a nibble table (fast_simd.h). Items of
// an integer cache that kernel does not serve run the tile kernel on staged bf16 tiles (prefill items,
// item_staged.h) or the fp32 kernels (AVX2 or generic).
// The group-scaled formats too: int4_per_group32 (the same nibble table; each group's float16 scale applied in the
// kernel) and FP4 (the nibble layout with a table of the E2M1 values; each group's E4M3 scale applied in the kernel).
static constexpr bool kv_decode_fast(int kv) {
    return kv_bf16_exact(kv) || KV_FORMATS[kv].ibits != 0 || KV_FORMATS[kv].group != 0;
}

// Whether format kv stores int4 codes two per byte (two's complement), the even channel in the low nibble: int4 per
// token and head (codes -7..7), and int4 per group of 32 (codes -8..7; its float16 group scales, of either sign, after
// the D / 2 code bytes). Every reader of these codes decodes all 16 nibbles ((n ^ 8) - 8) and multiplies by the
// scale as it is, so neither -8 nor a negative scale needs a case of its own.
static constexpr bool kv_int4_codes(int kv) { return KV_FORMATS[kv].ibits == 4 || KV_FORMATS[kv].gscale == 2; }

// Whether format kv is FP4 (fp4_e2m1): E2M1 codes two per byte, the even channel in the low nibble, and an E4M3 scale
// per group of 16 values after the D / 2 code bytes.
static constexpr bool kv_fp4_codes(int kv) { return KV_FORMATS[kv].gscale == 1; }

// Whether format kv stores 4-bit codes two per byte, the even channel in the low nibble (int4's and FP4's layout:
// the decode kernel reads both through one byte permute and a word table of the codes' bf16 values).
static constexpr bool kv_nibble_codes(int kv) { return kv_int4_codes(kv) || kv_fp4_codes(kv); }

// The first format whose kernel instances serve kv as well: the same element size, and the same decode to bf16
// (FP8 or not, the same 0x80 rule). The decode kernels are instantiated once per such class and read the FP8
// tables of the call's format at run time (E5M2 runs E4M3's instances).
static constexpr int kv_decode_class(int kv) {
    for (int k = 0; k < kv; ++k) {
        const KvFormat &a = KV_FORMATS[k], &b = KV_FORMATS[kv];
        if (a.esize == b.esize && a.elem == b.elem && a.fp8 == b.fp8 && a.ibits == b.ibits &&
            a.nan_0x80 == b.nan_0x80 && a.group == b.group && a.gscale == b.gscale)
            return k;
    }
    return kv;
}

// 2^n as a float, at compile time.
static constexpr float pow2f(int n) {
    float v = 1.0f;
    for (; n > 0; --n) v *= 2.0f;
    for (; n < 0; ++n) v *= 0.5f;
    return v;
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

// FP8 decode on bits (generic path).
template <int FMT>
static inline float fp8_bits(uint32_t c) {
    constexpr KvFormat F = KV_FORMATS[FMT];
    static_assert(!F.has_inf || (F.mbits == 2 && F.bias == 15), "an IEEE-style FP8 code is an fp16's high byte");
    if constexpr (F.has_inf) {  // an E5M2 code is the high byte of the fp16 with the same value
        return f16_f((uint16_t)(c << 8));
    } else {
        // the magnitude's bits where a float's go, times 2^(127 - bias): the float exponent's bias becomes the format's
        constexpr float REBIAS = pow2f(127 - F.bias);
        uint32_t mag = c & 0x7fu, sign = (c & 0x80u) << 24;
        float v = bits_f(mag << (23 - F.mbits)) * REBIAS;
        if (F.nan_0x80 ? c == 0x80 : mag == 0x7f) v = NAN;
        return bits_f(f_bits(v) | sign);
    }
}

// Integer encode (kv8.quant.formats.IntFormat): clamp(round_to_nearest_even(x), -max, max), NaN -> 0 (the clamp
// comes first, so +-inf saturate and nearbyintf never sees a value out of int range); max is 127 or 7.
static inline int8_t int_encode(float x, float max) {
    if (x != x) return 0;
    const float c = x < -max ? -max : x > max ? max : x;
    return (int8_t)nearbyintf(c);
}

// Value of channel d of a row of 4-bit codes (two per byte, the even channel in the low nibble, two's complement).
static inline int int4_at(const uint8_t* row, int d) {
    const int nib = (row[d >> 1] >> ((d & 1) * 4)) & 0xF;
    return (nib ^ 8) - 8;
}

// FP4 E2M1 (kv8.quant.fp4): the value of code c (0..15: sign bit 3, magnitude index 0..7), and the code of x (already
// divided by its group's scale): the nearest of 0, 0.5, 1, 1.5, 2, 3, 4, 6, a tie to the even index, saturating at
// 6 (inf included), NaN -> 0, the sign kept for values that round to 0.
static constexpr float E2M1_VALUES[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                          -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
// The value of 4-bit code n (0..15) of a format with nibble codes (kv_nibble_codes): E2M1 for FP4, two's complement
// int4 ((n ^ 8) - 8) for int4 per token and head and int4_per_group32.
static constexpr float nibble_value(int kv, int n) { return kv_fp4_codes(kv) ? E2M1_VALUES[n] : (float)((n ^ 8) - 8); }
static inline uint8_t e2m1_encode(float x) {
    if (x != x) return 0;
    const float a = fabsf(x);
    const int m = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
    return (uint8_t)(m | (signbit(x) ? 8 : 0));
}

// FP8 encode: saturate(round_to_nearest_even(x)), NaN -> nan code (sign kept where the format has a
// negative NaN); -0 and negative values rounding to zero keep the sign where there is a negative zero.
template <int FMT>
static inline uint8_t fp8_encode(float x) {
    constexpr KvFormat F = KV_FORMATS[FMT];
    constexpr int MB = F.mbits, BIAS = F.bias;
    constexpr float MAXF = F.max_finite;
    uint32_t b = f_bits(x);
    uint32_t sign = b >> 31;
    if ((b & 0x7fffffffu) > 0x7f800000u)  // NaN
        return F.nan_0x80 ? F.nan_code : (uint8_t)(F.nan_code | sign << 7);
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
    if (sign && (code != 0 || !F.nan_0x80)) code |= 0x80u;
    return (uint8_t)code;
}
