// FP8 -> bf16 in registers, shared by the attention library (the KV cache's codes) and the dense library (FP8
// weights): two in-register 128-entry byte tables give the low and the high byte of each code's bf16
// magnitude (vpermt2b), the code's sign bit is ORed into the high byte, and the two bytes interleave into
// 16-bit values. Every value of the three FP8 formats is a bf16 exactly (at most 3 mantissa bits), subnormals
// included, so the decode is exact. Included where AVX-512 VBMI is compiled in (both libraries' fast paths).
#pragma once

#include "kv8_abi.h"

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

struct Fp8Tables {
    __m512i lo0, lo1, hi0, hi1;  // low / high byte of the bf16 value of codes 0..127
};

// The tables of KV format kv (KV_FORMATS; zeros for a 16/32-bit format): the bf16 bits of its codes 0..127 (the
// positive half), NaN as 0x7FC0.
static inline Fp8Tables fp8_tables(int kv) {
    alignas(64) uint8_t lo[128] = {0}, hi[128] = {0};
    for (int c = 0; KV_FORMATS[kv].fp8 && c < 128; ++c) {
        const float v = fp8_value(kv, c);
        uint32_t bits;
        memcpy(&bits, &v, 4);
        const uint16_t h = isnan(v) ? 0x7FC0 : (uint16_t)(bits >> 16);   // exact: at most 3 mantissa bits
        lo[c] = (uint8_t)(h & 0xFF);
        hi[c] = (uint8_t)(h >> 8);
    }
    Fp8Tables t;
    t.lo0 = _mm512_load_si512(lo);
    t.lo1 = _mm512_load_si512(lo + 64);
    t.hi0 = _mm512_load_si512(hi);
    t.hi1 = _mm512_load_si512(hi + 64);
    return t;
}

// 64 FP8 codes -> 64 bf16: w0 = codes 0..7 of each 128-bit lane, w1 = codes 8..15 (lane order kept).
// NEG_ZERO_NAN: code 0x80 is NaN (E4M3FNUZ), not -0.
template <bool NEG_ZERO_NAN>
static inline void fp8_table_decode(__m512i c, const Fp8Tables& L, __m512i& w0, __m512i& w1) {
    __m512i lo = _mm512_permutex2var_epi8(L.lo0, c, L.lo1);
    __m512i hi = _mm512_permutex2var_epi8(L.hi0, c, L.hi1);
    hi = _mm512_ternarylogic_epi32(hi, c, _mm512_set1_epi8((char)0x80), 0xF8);  // hi | (c & 0x80)
    if (NEG_ZERO_NAN) {
        const __mmask64 nan = _mm512_cmpeq_epi8_mask(c, _mm512_set1_epi8((char)0x80));
        hi = _mm512_mask_mov_epi8(hi, nan, _mm512_set1_epi8(0x7f));
        lo = _mm512_mask_mov_epi8(lo, nan, _mm512_set1_epi8((char)0xc0));
    }
    w0 = _mm512_unpacklo_epi8(lo, hi);
    w1 = _mm512_unpackhi_epi8(lo, hi);
}
