// Quantize-on-store: the new key/value rows of one step -> their slots in one layer's caches.
//
//   key/value [T, H, D] (in_dtype)  --slot_mapping[t] = block * bs + offset-->  cache[block, h, offset, :]
//
// A negative slot skips its token (the padded rows of kv8.engine.cuda_graphs), as the reference store does.
// FP8 with static scales: code = saturate(rne(x / scale)) with the layer's K/V scales (strides over head and
// channel). FP8 with dynamic scales, and int8 (always): each (token, head) gets scale amax|x| / max_finite (1.0
// when that is 0 or not finite; int8: max 127, int4: 7), written beside its codes; integer codes are
// clamp(rne(x / scale), -max, max) with NaN -> 0 (base.h), int4 two per byte (the even channel in the low nibble).
// FP4 (fp4_e2m1): E2M1 codes two per byte and an E4M3 scale per group of 16 values in the row (store_row_fp4);
// int4_per_group32: int4 codes -8..7 two per byte and a float16 scale of either sign per group of 32 values, found by
// a search for the smallest squared error (store_row_int4_group, store_int4_group.h).
// 16/32-bit caches store the value converted (round to nearest even). Bit-exact with
// kv8.cache.paged_cache.PagedKVCache.store, NaN rule included (base.h). K and V may be in different formats (a pair:
// kv8_layer.kv_dtype for K, v_kv_dtype for V): each row is encoded by its side's rule, into rows of its side's size,
// with its side's token scales where that side has them.
//
// Where the fast path is compiled, FP8 rows (D a multiple of 16; dynamic scales, or static ones with a channel
// stride of 0 or 1) are encoded 16 values at a time by fp8_encode16, which gives fp8_encode's bits (the tests
// sweep every float32 sign/exponent/high-mantissa pattern against the reference); int4_per_group32 rows are converted
// to float 16 values at a time and searched by i4g_groups_avx512 (store_int4_group.h). A step's rows land one per
// block, scattered over the cache: each row's lines are prefetched for writing STORE_PREFETCH_ROWS rows ahead, so
// their misses overlap instead of stalling the stores one row at a time.
#pragma once

#include "base.h"
#include "abi.h"
#include "store_int4_group.h"

#if KV8_FAST
// fp8_encode<FMT> of 16 values at once, bit for bit (round to nearest even -- the subnormal range by the default
// rounding of the conversion, as nearbyintf -- saturation, the NaN codes and the sign rules).
template <int FMT>
static inline __m128i fp8_encode16(__m512 x) {
    constexpr KvFormat F = KV_FORMATS[FMT];
    constexpr int MB = F.mbits, BIAS = F.bias, SHIFT = 23 - MB;
    const __m512i b = _mm512_castps_si512(x);
    const __m512i absb = _mm512_and_si512(b, _mm512_set1_epi32(0x7fffffff));
    const __mmask16 nan = _mm512_cmpgt_epi32_mask(absb, _mm512_set1_epi32(0x7f800000));
    const __mmask16 neg = _mm512_cmplt_epi32_mask(b, _mm512_setzero_si512());
    // NaN lanes: replaced below
    const __m512 a = _mm512_min_ps(_mm512_castsi512_ps(absb), _mm512_set1_ps(F.max_finite));
    const __mmask16 sub = _mm512_cmp_ps_mask(a, _mm512_set1_ps(ldexpf(1.0f, 1 - BIAS)), _CMP_LT_OQ);
    const __m512i code_sub = _mm512_cvt_roundps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(ldexpf(1.0f, BIAS - 1 + MB))),
                                                      _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512i ab = _mm512_castps_si512(a);
    ab = _mm512_add_epi32(ab, _mm512_add_epi32(_mm512_set1_epi32((1 << (SHIFT - 1)) - 1),
                                               _mm512_and_si512(_mm512_srli_epi32(ab, SHIFT), _mm512_set1_epi32(1))));
    const __m512i e = _mm512_sub_epi32(_mm512_srli_epi32(ab, 23), _mm512_set1_epi32(127 - BIAS));
    __m512i code = _mm512_or_si512(_mm512_slli_epi32(e, MB),
                                   _mm512_and_si512(_mm512_srli_epi32(ab, SHIFT), _mm512_set1_epi32((1 << MB) - 1)));
    code = _mm512_mask_mov_epi32(code, sub, code_sub);
    const __mmask16 signed_ = F.nan_0x80 ? (__mmask16)(neg & _mm512_test_epi32_mask(code, code)) : neg;
    code = _mm512_mask_or_epi32(code, signed_, code, _mm512_set1_epi32(0x80));
    const __m512i nan_code = F.nan_0x80 ? _mm512_set1_epi32(F.nan_code)
        : _mm512_mask_blend_epi32(neg, _mm512_set1_epi32(F.nan_code), _mm512_set1_epi32(F.nan_code | 0x80));
    return _mm512_cvtepi32_epi8(_mm512_mask_mov_epi32(code, nan, nan_code));
}

// 16 values of src (in_dtype) from element i, as float (exact).
static inline __m512 load16_f(const void* src, int in_dtype, int64_t i) {
    if (in_dtype == DT_BF16)
        return _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)src + i))), 16));
    if (in_dtype == DT_F16) return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)src + i)));
    return _mm512_loadu_ps((const float*)src + i);
}

// One (token, head) row of D values (D % 16 == 0) into FP8 codes at dst: divided by its scales sc[d * ds] (ds 0
// or 1), or by a dynamic scale it gets from its amax (written to *token_scale); the scalar loop's arithmetic.
template <int FMT>
static inline void store_row_fp8(const void* src, int in_dtype, int64_t s0, int D, const float* sc, int64_t ds,
                                 float* token_scale, float maxf, uint8_t* dst) {
    if (token_scale) {
        __m512 amax = _mm512_setzero_ps();
        __mmask16 nan = 0;
        for (int d = 0; d < D; d += 16) {
            const __m512 a = _mm512_abs_ps(load16_f(src, in_dtype, s0 + d));
            nan |= _mm512_cmp_ps_mask(a, a, _CMP_UNORD_Q);
            amax = _mm512_max_ps(a, amax);   // a NaN lane keeps amax (and sets nan)
        }
        float sc1 = _mm512_reduce_max_ps(amax) / maxf;
        if (nan || !(sc1 > 0.0f) || sc1 == INFINITY) sc1 = 1.0f;
        *token_scale = sc1;
        const __m512 s = _mm512_set1_ps(sc1);
        for (int d = 0; d < D; d += 16)
            _mm_storeu_si128((__m128i*)(dst + d), fp8_encode16<FMT>(_mm512_div_ps(load16_f(src, in_dtype, s0 + d), s)));
        return;
    }
    for (int d = 0; d < D; d += 16) {
        const __m512 s = ds ? _mm512_loadu_ps(sc + d) : _mm512_set1_ps(sc[0]);
        _mm_storeu_si128((__m128i*)(dst + d), fp8_encode16<FMT>(_mm512_div_ps(load16_f(src, in_dtype, s0 + d), s)));
    }
}
#endif

static const int STORE_PREFETCH_ROWS = 8;  // rows ahead whose cache lines are prefetched for writing

// A prefetch for writing (prefetchw where the target has it, else into L1) that the optimizer cannot delete.
static inline void prefetch_for_write(const void* p) {
#if defined(__PRFCHW__)
    asm volatile("prefetchw %0" : : "m"(*(const char*)p));
#else
    asm volatile("prefetcht0 %0" : : "m"(*(const char*)p));
#endif
}

// The scale of the group x[g0, g1) for codes whose largest magnitude is qmax (FP4's, below):
// amax / qmax, 1.0 where the group holds a NaN or amax / qmax is zero or not finite, then clamped to [lo, hi] (the
// scale format's range); the caller rounds it to that format.
static inline float group_scale(const float* x, int g0, int g1, float qmax, float lo, float hi) {
    float amax = 0.0f;
    bool nan = false;
    for (int d = g0; d < g1; ++d) {
        const float a = fabsf(x[d]);
        nan |= a != a;
        amax = a > amax ? a : amax;
    }
    float s = amax / qmax;
    if (nan || !(s > 0.0f) || s == INFINITY) s = 1.0f;
    return s < lo ? lo : s > hi ? hi : s;
}

// One FP4 row (kv8.quant.fp4, bit for bit): per group of G values (the last one shorter when G does not divide D) the
// E4M3 scale s = e4m3(clamp(amax / 6, 2^-9, 448)), 1.0 where amax / 6 is zero or not finite; codes e2m1(x / s), two
// per byte; the scales' bytes after the D / 2 code bytes. x: the row in float32 (overwritten).
static inline void store_row_fp4(float* x, int D, int G, uint8_t* dst) {
    for (int g0 = 0; g0 < D; g0 += G) {
        const int g1 = g0 + G < D ? g0 + G : D;
        const uint8_t sc = fp8_encode<KV_E4M3>(group_scale(x, g0, g1, 6.0f, 0x1p-9f, 448.0f));
        const float sv = fp8_bits<KV_E4M3>(sc);
        dst[D / 2 + g0 / G] = sc;
        for (int d = g0; d < g1; ++d) x[d] = x[d] / sv;
    }
    for (int d = 0; d < D; d += 2) dst[d / 2] = (uint8_t)(e2m1_encode(x[d]) | (e2m1_encode(x[d + 1]) << 4));
}

// Whether one side (K or V) of format kv can be stored with these scales: FP8 with per-token scales or static ones,
// integer codes with per-token scales (whole bytes for int4), a group-scaled format with neither (whole code bytes,
// whole groups of 32 for int4_per_group32), a 16/32-bit one without per-token scales.
static inline bool store_side_usable(int kv, int D, const float* static_scale, const float* token_scales) {
    const KvFormat& F = KV_FORMATS[kv];
    return !(token_scales && !F.fp8 && !F.ibits) && !(F.fp8 && !token_scales && !static_scale) &&
           !(F.ibits && !token_scales) && !(F.ibits == 4 && D % 2) && !(F.group && (D % 2 || static_scale)) &&
           !(F.gscale == 2 && D % F.group);
}

// K rows are encoded with kv_dtype, V rows with v_kv_dtype (each bit-exact with its side's KVCodec.encode); a cache
// of one format keeps per-token scales on both sides or neither, and a group-scaled one no static scales.
static int run_store(const kv8_layer& L, const kv8_store_call& C) {
    const int64_t T = C.num_tokens, num_blocks = L.num_blocks;
    const int H = L.num_kv_heads, D = L.head_dim, bs = L.block_size, kv = L.kv_dtype, vkv = L.v_kv_dtype;
    const int in_dtype = C.in_dtype;
    const int nthreads = C.num_threads;
    const void *key = C.key, *value = C.value;
    const int64_t* slots = C.slot_mapping;
    void *k_cache = L.k_cache, *v_cache = L.v_cache;
    const float *k_scale = L.k_scale, *v_scale = L.v_scale;
    const int64_t ks_hs = L.k_scale_head_stride, ks_ds = L.k_scale_dim_stride;
    const int64_t vs_hs = L.v_scale_head_stride, vs_ds = L.v_scale_dim_stride;
    float *k_token_scales = L.k_token_scales, *v_token_scales = L.v_token_scales;
    if (H <= 0 || D <= 0 || bs <= 0 || T < 0 || kv < 0 || kv >= KV_COUNT || vkv < 0 || vkv >= KV_COUNT ||
        in_dtype < 0 || in_dtype >= DT_COUNT || nthreads <= 0 ||
        !store_side_usable(kv, D, k_scale, k_token_scales) || !store_side_usable(vkv, D, v_scale, v_token_scales) ||
        (kv == vkv && ((k_token_scales == nullptr) != (v_token_scales == nullptr) ||
                       (KV_FORMATS[kv].fp8 && !k_token_scales && (!k_scale || !v_scale)) ||
                       (KV_FORMATS[kv].group && (k_scale || v_scale)))))
        return ERR_ARGS;
    const int64_t nslots = num_blocks * bs;
    for (int64_t t = 0; t < T; ++t)   // a negative slot: a padded row (a decode graph's), stored nowhere
        if (slots[t] >= nslots) return ERR_SLOT;
    const int64_t rbytes[2] = {kv_row_bytes(kv, D), kv_row_bytes(vkv, D)};  // K's row, V's
    const int64_t work = T * H * D;
    int nt = work >= 65536 ? nthreads : 1;
    // Work row th (K rows, then V rows; token-major, head-minor): its row of the cache, (block, head, offset)
    // flattened -- its codes start at row * that side's row bytes, its dynamic scale (if any) is entry row -- and
    // that start in the K (which = 0) or V cache.
    auto cache_row = [&](int64_t th) {
        const int64_t slot = slots[(th % (T * H)) / H];
        return (slot / bs * H + th % H) * bs + slot % bs;
    };
    auto row_dst = [&](int which, int64_t row) {
        return (uint8_t*)(which ? v_cache : k_cache) + row * rbytes[which];
    };
#pragma omp parallel num_threads(nt)
    {
        FpEnv env;
        float* buf = (float*)tl_scratch.get((size_t)D * 4);
#pragma omp for schedule(static)
        for (int64_t th = 0; th < 2 * T * H; ++th) {
            if (slots[(th % (T * H)) / H] < 0) continue;
            if (th + STORE_PREFETCH_ROWS < 2 * T * H && slots[((th + STORE_PREFETCH_ROWS) % (T * H)) / H] >= 0) {
                // the rows' cache lines are scattered (one per block): their misses overlap this way
                const int64_t ta = th + STORE_PREFETCH_ROWS;
                const int wa = (int)(ta / (T * H));
                const uint8_t* ahead = row_dst(wa, cache_row(ta));
                for (int64_t b = 0; b < rbytes[wa]; b += 64) prefetch_for_write(ahead + b);
            }
            int which = (int)(th / (T * H));  // 0 = K, 1 = V
            const int fk = which ? vkv : kv;  // this side's format
            const KvFormat& fmt = KV_FORMATS[fk];
            const float maxf = fmt.max_finite;
            const int es = fmt.esize;
            int64_t t = (th % (T * H)) / H;
            int h = (int)(th % H);
            const void* src = which ? value : key;
            const float* sc = which ? v_scale : k_scale;
            int64_t hs = which ? vs_hs : ks_hs, ds = which ? vs_ds : ks_ds;
            const int64_t row = cache_row(th);
            uint8_t* dst = row_dst(which, row);
            float* const side_ts = which ? v_token_scales : k_token_scales;
            float* ts = side_ts ? side_ts + row : nullptr;
            int64_t s0 = (t * H + h) * (int64_t)D;
            if (fmt.elem == in_dtype) {  // a 16/32-bit cache of the input's type: a copy
                memcpy(dst, (const uint8_t*)src + s0 * es, (size_t)D * es);
                continue;
            }
#if KV8_FAST
            if (fmt.fp8 && D % 16 == 0 && (ts || ds <= 1)) {
                const float* hsc = ts ? nullptr : sc + h * hs;
                with_kv_format(fk, [&](auto K) {
                    if constexpr (KV_FORMATS[decltype(K)::value].fp8)
                        store_row_fp8<decltype(K)::value>(src, in_dtype, s0, D, hsc, ds, ts, maxf, dst);
                });
                continue;
            }
            if (fmt.gscale == 2) {   // int4_per_group32 (D % 32 == 0): the row converted 16 values at a time
                for (int d = 0; d < D; d += 16) _mm512_storeu_ps(buf + d, load16_f(src, in_dtype, s0 + d));
                store_row_int4_group(buf, D, dst);
                continue;
            }
#endif
            for (int d = 0; d < D; ++d) buf[d] = load_f(src, in_dtype, s0 + d);
            if (fmt.group && fmt.gscale == 2) {
                store_row_int4_group(buf, D, dst);
            } else if (fmt.group) {
                store_row_fp4(buf, D, fmt.group, dst);
            } else if (fmt.fp8 || fmt.ibits) {
                if (ts) {
                    float amax = 0.0f;
                    bool nan = false;
                    for (int d = 0; d < D; ++d) {
                        float a = fabsf(buf[d]);
                        nan |= a != a;
                        amax = a > amax ? a : amax;
                    }
                    float sc1 = amax / maxf;
                    if (nan || !(sc1 > 0.0f) || sc1 == INFINITY) sc1 = 1.0f;
                    *ts = sc1;
                    for (int d = 0; d < D; ++d) buf[d] = buf[d] / sc1;
                } else {
                    for (int d = 0; d < D; ++d) buf[d] = buf[d] / sc[h * hs + d * ds];
                }
                if (fmt.ibits == 8) {
                    for (int d = 0; d < D; ++d) dst[d] = (uint8_t)int_encode(buf[d], maxf);
                } else if (fmt.ibits == 4) {
                    for (int d = 0; d < D; d += 2)
                        dst[d / 2] = (uint8_t)((int_encode(buf[d], maxf) & 0xF) | (int_encode(buf[d + 1], maxf) << 4));
                } else {
                    with_kv_format(fk, [&](auto K) {
                        if constexpr (KV_FORMATS[decltype(K)::value].fp8)
                            for (int d = 0; d < D; ++d) dst[d] = fp8_encode<decltype(K)::value>(buf[d]);
                    });
                }
            } else if (fmt.elem == DT_BF16) {
                for (int d = 0; d < D; ++d) ((uint16_t*)dst)[d] = f_bf16(buf[d]);
            } else if (fmt.elem == DT_F16) {
                for (int d = 0; d < D; ++d) ((uint16_t*)dst)[d] = f_f16(buf[d]);
            } else {
                memcpy(dst, buf, (size_t)D * 4);
            }
        }
    }
    return OK;
}
