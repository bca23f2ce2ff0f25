// The AVX2 + FMA + F16C path of the dense library: every kernel of elementwise.h, linear.h and argmax.h for CPUs
// without AVX-512 BF16 + VBMI (AMD Zen 2 and 3, Intel before Cooper Lake, any x86-64-v3 build). Included once, by
// dense.cpp, after linear.h (packed_size, pack, PANEL, PARALLEL_MIN); compiled only where dense.cpp sets
// KV8_LINEAR_AVX2 (the AVX-512 path not compiled in). The entry points keep the AVX-512 kernels' names
// (linear<FP8>, rmsnorm, silu_mul, rope_qkv, argmax_rows), so dense.cpp's C ABI serves whichever path the build has.
//
// Numerics: the AVX-512 path's contract, in 8-lane fp32 registers. Products of bf16 values are exact in fp32 and
// are summed with FMA in fp32; every rounding to bf16 is to nearest-even as torch's float -> bfloat16 conversion
// does it (subnormals kept, NaN -> 0x7FC0), where the AVX-512 path's vcvtneps2bf16 differs only on subnormal and
// NaN values. What differs from the AVX-512 kernels is the order of fp32 additions (8 lanes, not 16; a linear's
// k pairs as two FMAs, even k first) and exp (exp8_ps, ~1 ulp): results agree with them and with torch up to
// those roundings (tests/layers/test_layers.py, tests/quant/test_fp8_weights.py).
//
// Linear (the packed bf16 layout of dense.cpp). Within a pair-row kk of a panel, the 8 bf16 pairs of columns
// 8g..8g+7 (group g, 32 bytes) are 8 32-bit lanes whose low half is W[c, 2kk] and high half W[c, 2kk+1]: `lane << 16`
// and `lane & 0xffff0000` are the two fp32 weights, multiplied with x[2kk] and x[2kk+1] broadcast from an fp32
// copy of the rows (a thread converts each chunk of rows once). A row's column sum runs in k order, even k first:
// sum = fma(w[c,2kk+1], x[2kk+1], fma(w[c,2kk], x[2kk], sum)), the same order on every path and batch size, so a
// row's bits never depend on the batch.
//
// FP8 weights (kv8_linear_fp8): the same panels with one E4M3 code per value, in the bf16 layout's order (DenseKernels.
// pack_fp8): group g of a pair-row is 16 bytes, the codes of W[c, 2kk] and W[c, 2kk+1] for its columns c in turn.
// vpmovsxbw widens them to words, so dword lane c holds the even-k code in its low word and the odd-k code in its high
// word; a dword shift puts a code's 7 exponent and mantissa bits at fp32 bits 26..20 with copies of its sign above
// them, and a mask keeps bit 31 and bits 26..20: the fp32 of exactly the E4M3 value times 2^-120 (subnormal codes
// become fp32 subnormals, exactly). Two integer operations per 8 weights and no conversion (an fp16 decode through
// vcvtph2ps took 4.9 ns per pair-row of 64 codes in a 1-row C++ loop over L2-resident panels on Zen 3, this one 3.1
// ns, a bf16 pair-row 2.8 ns).
// To keep every product and sum in the normal range, x is widened times 2^112 (X_FP8; exact), so each product is
// x * w * 2^-8, and the 2^8 goes into the row's scale in the epilogue (acc * (scale * 256) + bias: the same value as
// the exact weights' acc * scale + bias, bit for bit, since scaling by a power of two commutes with every fp32
// rounding of the sum outside the subnormal range). A chunk of rows with some |x| >= 2^16 (x * 2^112 would overflow)
// keeps x as it is and multiplies the decoded weights by 2^112 instead (W_FP8_WIDE): the same products, so the same
// bits. The NaN codes 0x7F / 0xFF, which the quantizer never writes (it saturates), decode to +-480 here (the AVX-512
// table decode: NaN).
#pragma once

#if KV8_LINEAR_AVX2

// ---- 8-lane bf16 helpers -------------------------------------------------------------------------------------------
static inline __m256 bf16x8_to_f32(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
// The first n (0..8) values at p, the rest 0 (nothing read past p + n).
static inline __m256 bf16x8_to_f32_n(const uint16_t* p, int64_t n) {
    if (n >= 8) return bf16x8_to_f32(p);
    alignas(16) uint16_t tmp[8] = {0};
    memcpy(tmp, p, (size_t)(n > 0 ? n : 0) * 2);
    return bf16x8_to_f32(tmp);
}
static inline __m256 f32x8_n(const float* p, int64_t n) {
    if (n >= 8) return _mm256_loadu_ps(p);
    alignas(32) float tmp[8] = {0};
    memcpy(tmp, p, (size_t)(n > 0 ? n : 0) * 4);
    return _mm256_load_ps(tmp);
}
// The bf16 bits (low half of each lane) of x rounded to nearest-even, NaN -> 0x7FC0: torch's conversion.
static inline __m256i bf16_bits(__m256 x) {
    const __m256i b = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
    const __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7fff)), lsb), 16);
    const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
    return _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7fc0), _mm256_castps_si256(nan));
}
static inline __m256 round_bf16(__m256 x) {  // x rounded to the nearest bf16, as fp32
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits(x), 16));
}
// x rounded to bf16 into p[0 .. n) (n clamped to 0..8).
static inline void store_bf16(uint16_t* p, __m256 x, int64_t n) {
    const __m256i b = bf16_bits(x);
    const __m128i h = _mm256_castsi256_si128(_mm256_permute4x64_epi64(_mm256_packus_epi32(b, b), 0x08));
    if (n >= 8) {
        _mm_storeu_si128((__m128i*)p, h);
    } else if (n > 0) {
        alignas(16) uint16_t tmp[8];
        _mm_store_si128((__m128i*)tmp, h);
        memcpy(p, tmp, (size_t)n * 2);
    }
}
static inline float hsum8(__m256 x) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
static inline __m256 silu8(__m256 g) {  // bf16(g / (1 + exp(-g)))
    return round_bf16(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), exp8_ps(_mm256_sub_ps(_mm256_setzero_ps(), g)))));
}

// ---- elementwise (elementwise.h's contracts) -----------------------------------------------------------------------

// kv8_rmsnorm: residual add + RMSNorm (see kv8_rmsnorm_call), T rows of E values.
static int rmsnorm(const kv8_rmsnorm_call& call) {
    const uint16_t *x = call.x, *residual = call.residual, *w = call.weight;
    uint16_t *residual_out = call.residual_out, *out = call.out;
    const int64_t T = call.rows, E = call.hidden;
    const float eps = call.eps;
    const int threads = threads_for(call);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < T; ++t) {
        const uint16_t* xr = x + t * E;
        const uint16_t* rr = residual ? residual + t * E : nullptr;
        uint16_t* ro = residual_out ? residual_out + t * E : nullptr;
        __m256 ss = _mm256_setzero_ps();
        for (int64_t e = 0; e < E; e += 8) {
            __m256 h = bf16x8_to_f32_n(xr + e, E - e);
            if (rr) h = round_bf16(_mm256_add_ps(h, bf16x8_to_f32_n(rr + e, E - e)));
            if (ro) store_bf16(ro + e, h, E - e);
            ss = _mm256_fmadd_ps(h, h, ss);
        }
        const float inv = 1.0f / sqrtf(hsum8(ss) / (float)E + eps);
        const __m256 iv = _mm256_set1_ps(inv);
        const uint16_t* src = ro ? ro : xr;  // h, already rounded (or x itself without a residual)
        for (int64_t e = 0; e < E; e += 8) {
            __m256 h = (ro || !rr) ? bf16x8_to_f32_n(src + e, E - e)
                                   : round_bf16(_mm256_add_ps(bf16x8_to_f32_n(xr + e, E - e),
                                                              bf16x8_to_f32_n(rr + e, E - e)));
            const __m256 n = round_bf16(_mm256_mul_ps(h, iv));
            store_bf16(out + t * E + e, _mm256_mul_ps(bf16x8_to_f32_n(w + e, E - e), n), E - e);
        }
    }
    return OK;
}

// kv8_silu_mul: SiLU(gate) * up (see kv8_silu_mul_call), gu [T, 2I] -> out [T, I].
static int silu_mul(const kv8_silu_mul_call& call) {
    const uint16_t* gu = call.gate_up;
    uint16_t* out = call.out;
    const int64_t T = call.rows, I = call.intermediate;
    const int threads = threads_for(call);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < T; ++t) {
        const uint16_t* g = gu + t * 2 * I;
        const uint16_t* u = g + I;
        for (int64_t i = 0; i < I; i += 8)
            store_bf16(out + t * I + i, _mm256_mul_ps(silu8(bf16x8_to_f32_n(g + i, I - i)),
                                                      bf16x8_to_f32_n(u + i, I - i)), I - i);
    }
    return OK;
}

// kv8_rope_qkv: elementwise.h's rope_qkv (the same roundings), 8 channel pairs at a time.
static int rope_qkv(const kv8_rope_call& call) {
    const uint16_t* qkv = call.qkv;
    const float *cos = call.cos, *sin = call.sin;
    uint16_t *q_out = call.q_out, *k_out = call.k_out, *v_out = call.v_out;
    const int64_t T = call.rows, row_stride = call.row_stride;
    const int Hq = call.num_heads, Hkv = call.num_kv_heads, D = call.head_dim;
    const int half = D / 2;
    const int threads = threads_for(call);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < T; ++t) {
        const uint16_t* row = qkv + t * row_stride;
        const float* cr = cos + t * half;
        const float* sr = sin + t * half;
        for (int h = 0; h < Hq + Hkv; ++h) {
            const uint16_t* src = row + (int64_t)h * D;
            uint16_t* dst = h < Hq ? q_out + (t * Hq + h) * (int64_t)D : k_out + (t * Hkv + (h - Hq)) * (int64_t)D;
            for (int j = 0; j < half; j += 8) {
                const int n = half - j;
                const __m256 c = round_bf16(f32x8_n(cr + j, n));
                const __m256 s = round_bf16(f32x8_n(sr + j, n));
                const __m256 x1 = bf16x8_to_f32_n(src + j, n);
                const __m256 x2 = bf16x8_to_f32_n(src + half + j, n);
                // first half: x1 c - x2 s; second half: x2 c + x1 s (each product rounded, then the sum)
                const __m256 a = _mm256_add_ps(round_bf16(_mm256_mul_ps(x1, c)),
                                               round_bf16(_mm256_mul_ps(_mm256_sub_ps(_mm256_setzero_ps(), x2), s)));
                const __m256 b = _mm256_add_ps(round_bf16(_mm256_mul_ps(x2, c)), round_bf16(_mm256_mul_ps(x1, s)));
                store_bf16(dst + j, a, n);
                store_bf16(dst + half + j, b, n);
            }
        }
        memcpy(v_out + t * Hkv * (int64_t)D, row + (int64_t)(Hq + Hkv) * D, (size_t)Hkv * D * 2);
    }
    return OK;
}

// ---- argmax (argmax.h's contract) ----------------------------------------------------------------------------------

// kv8_argmax_rows: 8 lanes keep their running maximum and its first index (strict >), the tail (V % 8 values) runs
// scalar after them with the same strict >, and the row's result is the lowest index holding the maximum.
static int argmax_rows(const kv8_argmax_call& call) {
    const float* x = call.x;
    int64_t* out = call.out;
    const int64_t B = call.rows, V = call.cols;
    const int threads = threads_for(call);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < B; ++b) {
        const float* row = x + b * V;
        const int64_t body = V / 8 * 8;
        float m = -INFINITY;
        int64_t at = 0;
        if (body) {
            __m256 best = _mm256_set1_ps(-INFINITY);
            __m256i where = _mm256_setzero_si256();
            __m256i idx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
            const __m256i step = _mm256_set1_epi32(8);
            for (int64_t i = 0; i < body; i += 8) {
                const __m256 v = _mm256_loadu_ps(row + i);
                const __m256 gt = _mm256_cmp_ps(v, best, _CMP_GT_OQ);
                best = _mm256_blendv_ps(best, v, gt);
                where = _mm256_blendv_epi8(where, idx, _mm256_castps_si256(gt));
                idx = _mm256_add_epi32(idx, step);
            }
            alignas(32) float bv[8];
            alignas(32) int32_t wv[8];
            _mm256_store_ps(bv, best);
            _mm256_store_si256((__m256i*)wv, where);
            at = INT32_MAX;
            for (int l = 0; l < 8; ++l) m = bv[l] > m ? bv[l] : m;
            for (int l = 0; l < 8; ++l)
                if (bv[l] == m && wv[l] < at) at = wv[l];
        }
        for (int64_t i = body; i < V; ++i)
            if (row[i] > m) m = row[i], at = i;
        out[b] = at;
    }
    return OK;
}

// ---- linear --------------------------------------------------------------------------------------------------------

static const int64_t X_CHUNK_BYTES = 256 << 10;  // few rows: rows of x per pass over the weights, their fp32 copy in L2
static const int MAX_MR_AVX2 = 5;  // few rows: rows per block, 10 accumulators + 4 weights + 1 broadcast of 16 registers
// One row: bytes ahead of each panel stream that row_sums prefetches into L1. Measured on the AMD EPYC (Zen 3, 2
// threads, SmolLM2's 30 layers at M = 1 from DRAM, a C++ loop, the sum of each call's best of 15 passes, a loaded
// machine): bf16 two panels per pass 31.1 GB/s without prefetch, 31-34 GB/s 256 B to 2 KiB ahead; three panels 34.2,
// and 1 KiB ahead 38.1; FP8 two panels 27.3, and 1 KiB ahead 33.0 (2 KiB: 32.8).
static const int64_t ROW_PREFETCH = 1024;

// A thread's fp32 buffer (grown as needed, kept for the thread's life).
struct XBuffer {
    float* p = nullptr;
    size_t cap = 0;
    ~XBuffer() { free(p); }
    float* get(size_t floats) {
        if (floats > cap) {
            free(p);
            cap = (floats + 15) / 16 * 16;
            p = (float*)aligned_alloc(64, cap * 4);
            if (!p) cap = 0;
        }
        return p;
    }
};
// A thread's fp32 rows of x, its widened weights (a k block of half a panel) and the partial sums of its outputs
// between k blocks (linear_blocked).
static thread_local XBuffer tl_x, tl_w, tl_c;

// FP8 weights (see the top of this file): x is multiplied by X_FP8 (2^112) as it is widened, where every |x| < X_FP8_MAX.
static const float X_FP8 = 0x1p112f, X_FP8_MAX = 65536.0f;

// 8 values of x as fp32 times xs (a power of two; exact below overflow), and the running maximum of their |x| (NaN
// ignored).
static inline __m256 x8_scaled(__m256 v, float xs, __m256& amax) {
    amax = _mm256_max_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), v), amax);
    return xs == 1.0f ? v : _mm256_mul_ps(v, _mm256_set1_ps(xs));
}
// Whether x scaled by xs stays finite: xs is 1 or every |x| < X_FP8_MAX (amax: their maximum).
static inline bool x_fits(__m256 amax, float xs) {
    return xs == 1.0f || _mm256_movemask_ps(_mm256_cmp_ps(amax, _mm256_set1_ps(X_FP8_MAX), _CMP_GE_OQ)) == 0;
}

// rows x [M, K] bf16 -> xf [M, kp] fp32 times xs (column K of an odd K zero). Returns x_fits; where it does not, xf
// holds x unscaled.
static inline bool rows_to_f32(const uint16_t* x, int64_t M, int64_t K, int64_t kp, float* xf, float xs = 1.0f) {
    __m256 amax = _mm256_setzero_ps();
    for (int64_t r = 0; r < M; ++r) {
        const uint16_t* s = x + r * K;
        float* d = xf + r * kp;
        int64_t k = 0;
        for (; k + 8 <= K; k += 8) _mm256_storeu_ps(d + k, x8_scaled(bf16x8_to_f32(s + k), xs, amax));
        if (k < K) {
            alignas(32) float tail[8];
            _mm256_store_ps(tail, x8_scaled(bf16x8_to_f32_n(s + k, K - k), xs, amax));
            memcpy(d + k, tail, (size_t)(K - k) * 4);
        }
        if (kp > K) d[K] = 0.0f;
    }
    if (x_fits(amax, xs)) return true;
    rows_to_f32(x, M, K, kp, xf);
    return false;
}

// How a kernel reads its panel: the bf16 packed layout, or the FP8 one with x scaled by X_FP8 (W_FP8) or not
// (W_FP8_WIDE: the decoded weights times 2^112 instead; rows with some |x| >= X_FP8_MAX).
enum { W_BF16 = 0, W_FP8 = 1, W_FP8_WIDE = 2 };

// The even-k and odd-k fp32 weights of group g of pair-row kk (see the top of this file); bf16 panels: p points at
// the group's 32 bytes; FP8: at its 16 codes, W_FP8: the weights times 2^-120, W_FP8_WIDE: times 2^-8.
template <int SRC>
static inline void load_weights(const uint8_t* p, __m256& even, __m256& odd) {
    if (SRC != W_BF16) {
        // dword lane c: code (c, even k) sign-extended in its low word, code (c, odd k) in its high word; each shifted
        // to bits 27..20 (the sign's copies above it) and masked to sign | exponent | mantissa
        const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p));
        const __m256i m = _mm256_set1_epi32((int)0x87F00000u);
        even = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(s, 20), m));
        odd = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(s, 4), m));
        if (SRC == W_FP8_WIDE) {
            even = _mm256_mul_ps(even, _mm256_set1_ps(0x1p112f));
            odd = _mm256_mul_ps(odd, _mm256_set1_ps(0x1p112f));
        }
    } else {
        const __m256i w = _mm256_loadu_si256((const __m256i*)p);
        even = _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
        odd = _mm256_castsi256_ps(_mm256_and_si256(w, _mm256_set1_epi32((int)0xffff0000u)));
    }
}

// 8 outputs of one row from the sums of one group (columns c .. c + 7 of N): acc * scale * unit + bias, rounded.
static inline void store_cols(__m256 acc, const float* bias, const float* scale, float unit, int64_t c, int64_t N,
                              uint16_t* out_row) {
    const int64_t n = N - c;
    if (n <= 0) return;
    const __m256 b = bias ? f32x8_n(bias + c, n) : _mm256_setzero_ps();
    const __m256 s = scale ? _mm256_mul_ps(f32x8_n(scale + c, n), _mm256_set1_ps(unit)) : _mm256_set1_ps(unit);
    store_bf16(out_row + c, _mm256_fmadd_ps(acc, s, b), n);
}

// Gated: 8 outputs from the sums of a gate group (packed rows r ..) and its up group (packed rows r + 16 ..), written
// at output column c of N (the activation of linear.h's store_row).
static inline void store_gated(__m256 gacc, __m256 uacc, const float* bias, const float* scale, float unit, int64_t r,
                               int64_t c, int64_t N, uint16_t* out_row) {
    if (c >= N) return;
    const __m256 bg = bias ? _mm256_loadu_ps(bias + r) : _mm256_setzero_ps();   // (gated: padded to whole panels)
    const __m256 bu = bias ? _mm256_loadu_ps(bias + r + 16) : _mm256_setzero_ps();
    const __m256 u1 = _mm256_set1_ps(unit);
    const __m256 sg = scale ? _mm256_mul_ps(_mm256_loadu_ps(scale + r), u1) : u1;
    const __m256 su = scale ? _mm256_mul_ps(_mm256_loadu_ps(scale + r + 16), u1) : u1;
    const __m256 g = round_bf16(_mm256_fmadd_ps(gacc, sg, bg));
    const __m256 u = round_bf16(_mm256_fmadd_ps(uacc, su, bu));
    store_bf16(out_row + c, _mm256_mul_ps(silu8(g), u), N - c);
}

// The two groups of half h of a panel: 2h and 2h + 1, or, GATED, gate group h and its up group h + 2.
template <bool GATED>
static inline int half_group(int h, int i) { return GATED ? h + 2 * i : 2 * h + i; }
// The first output column of half h of the panel whose first packed row is n0.
template <bool GATED>
static inline int64_t half_column(int64_t n0, int h) { return GATED ? n0 / 2 + 8 * h : n0 + 16 * h; }

// The epilogue of one row of a half panel: its two groups' sums (acc0, acc1) -> 16 outputs (GATED: 8) of out_row.
// n0: the panel's first packed row; unit: 256 for FP8 weights (their 2^-8), else 1.
template <bool GATED>
static inline void store_half(__m256 acc0, __m256 acc1, const float* bias, const float* scale, float unit, int64_t n0,
                              int h, int64_t N, uint16_t* out_row) {
    const int64_t c = half_column<GATED>(n0, h);
    if (GATED) {
        store_gated(acc0, acc1, bias, scale, unit, n0 + 8 * h, c, N, out_row);
    } else {
        store_cols(acc0, bias, scale, unit, c, N, out_row);
        store_cols(acc1, bias, scale, unit, c + 8, N, out_row);
    }
}

// Few rows (at most FEW_ROWS): MR rows of xf (stride kp, fp32) times NG groups of a panel, read in place (NG = 2: half
// h of it; NG = 4: the whole panel; NG = 8: two adjacent panels, 8 chains of FMAs in flight for one row) -> outputs.
// out rows have stride N.
template <int MR, int NG, int SRC, bool GATED>
static inline void micro_avx2(const float* xf, int64_t kp, const uint8_t* panel, int h, const float* bias,
                              const float* scale, float unit, int64_t n0, int64_t N, uint16_t* out) {
    constexpr int64_t GB = SRC != W_BF16 ? 16 : 32;   // bytes of a group in a pair-row
    constexpr int64_t RB = 4 * GB;                   // bytes of a pair-row
    const int64_t pairs = kp / 2;
    int64_t go[NG];                                  // the groups' offsets in a pair-row (of the first panel)
    for (int i = 0; i < NG; ++i) go[i] = NG == 2 ? half_group<GATED>(h, i) * GB : (i / 4) * pairs * RB + (i % 4) * GB;
    __m256 acc[MR][NG];
    for (int r = 0; r < MR; ++r)
        for (int i = 0; i < NG; ++i) acc[r][i] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < pairs; ++kk) {
        if (MR == 1) {   // each group's two FMAs right after its load (8 groups of weights need no 16 registers)
            const __m256 xe = _mm256_broadcast_ss(xf + 2 * kk), xo = _mm256_broadcast_ss(xf + 2 * kk + 1);
            for (int i = 0; i < NG; ++i) {
                __m256 we, wo;
                load_weights<SRC>(panel + kk * RB + go[i], we, wo);
                acc[0][i] = _mm256_fmadd_ps(wo, xo, _mm256_fmadd_ps(we, xe, acc[0][i]));
            }
            continue;
        }
        __m256 we[NG], wo[NG];
        for (int i = 0; i < NG; ++i) load_weights<SRC>(panel + kk * RB + go[i], we[i], wo[i]);
        for (int r = 0; r < MR; ++r) {
            const __m256 xe = _mm256_broadcast_ss(xf + r * kp + 2 * kk);
            for (int i = 0; i < NG; ++i) acc[r][i] = _mm256_fmadd_ps(we[i], xe, acc[r][i]);
            const __m256 xo = _mm256_broadcast_ss(xf + r * kp + 2 * kk + 1);
            for (int i = 0; i < NG; ++i) acc[r][i] = _mm256_fmadd_ps(wo[i], xo, acc[r][i]);
        }
    }
    for (int r = 0; r < MR; ++r) {
        uint16_t* row = out + r * N;
        if (NG == 2) {
            store_half<GATED>(acc[r][0], acc[r][1], bias, scale, unit, n0, h, N, row);
            continue;
        }
        for (int q = 0; q < NG / 4; ++q)   // each panel's two halves in turn
            for (int hh = 0; hh < 2; ++hh)
                store_half<GATED>(acc[r][4 * q + half_group<GATED>(hh, 0)], acc[r][4 * q + half_group<GATED>(hh, 1)],
                                  bias, scale, unit, n0 + PANEL * q, hh, N, row);
    }
}

// One row times NP adjacent whole panels (32 NP columns): its fp32 sums, group i's 8 columns at sums + 8 i. NP streams,
// one per panel, and NG = 4 NP independent chains of FMAs (NP = 3: 12 chains of 2 dependent FMAs per pair-row hide the
// FMA latency that 8 chains only just cover). Each stream's line ROW_PREFETCH bytes ahead is prefetched into L1, past
// its panel's end the next pass's panel of the same stream (the caller's next panels: panel + NP panels on; at the end
// of a thread's run a few lines beyond it, harmless). The k loop is alone in its function (as tile_sums') so that the
// compiler keeps the accumulators in registers. The same chain of FMAs per column as micro_avx2's: the same bits.
template <int NP, int SRC>
static void row_sums(const float* xf, int64_t pairs, const uint8_t* panel, float* sums) {
    constexpr int NG = 4 * NP;
    constexpr int64_t GB = SRC != W_BF16 ? 16 : 32;   // bytes of a group in a pair-row
    constexpr int64_t RB = 4 * GB;                   // bytes of a pair-row
    const int64_t pb = pairs * RB;                   // bytes of a panel
    __m256 acc[NG];
#pragma GCC unroll 12
    for (int i = 0; i < NG; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t kk = 0; kk < pairs; ++kk) {
        int64_t ahead = kk * RB + ROW_PREFETCH;
        if (ahead >= pb) ahead += (NP - 1) * pb;
        for (int q = 0; q < NP; ++q)
            for (int64_t l = 0; l < RB; l += 64) _mm_prefetch((const char*)panel + q * pb + ahead + l, _MM_HINT_T0);
        const __m256 xe = _mm256_broadcast_ss(xf + 2 * kk), xo = _mm256_broadcast_ss(xf + 2 * kk + 1);
        const uint8_t* row = panel + kk * RB;
#pragma GCC unroll 12
        for (int i = 0; i < NG; ++i) {
            __m256 we, wo;
            load_weights<SRC>(row + (i / 4) * pb + (i % 4) * GB, we, wo);
            acc[i] = _mm256_fmadd_ps(wo, xo, _mm256_fmadd_ps(we, xe, acc[i]));
        }
    }
#pragma GCC unroll 12
    for (int i = 0; i < NG; ++i) _mm256_store_ps(sums + 8 * i, acc[i]);
}

// One row times NP whole panels from the one at `panel` (first packed row n0) -> its outputs (micro_avx2's signature;
// h unused).
template <int NP, int SRC, bool GATED>
static void whole_avx2(const float* xf, int64_t kp, const uint8_t* panel, int, const float* bias, const float* scale,
                       float unit, int64_t n0, int64_t N, uint16_t* out) {
    alignas(32) float sums[32 * NP];
    row_sums<NP, SRC>(xf, kp / 2, panel, sums);
    for (int q = 0; q < NP; ++q)   // each panel's two halves in turn
        for (int hh = 0; hh < 2; ++hh)
            store_half<GATED>(_mm256_load_ps(sums + 8 * (4 * q + half_group<GATED>(hh, 0))),
                              _mm256_load_ps(sums + 8 * (4 * q + half_group<GATED>(hh, 1))), bias, scale, unit,
                              n0 + PANEL * q, hh, N, out);
}

typedef void (*MicroAvx2Fn)(const float*, int64_t, const uint8_t*, int, const float*, const float*, float, int64_t,
                            int64_t, uint16_t*);
template <int SRC, bool G>
static const MicroAvx2Fn MICRO_AVX2[MAX_MR_AVX2 + 1] = {nullptr, micro_avx2<1, 2, SRC, G>, micro_avx2<2, 2, SRC, G>,
                                                        micro_avx2<3, 2, SRC, G>, micro_avx2<4, 2, SRC, G>,
                                                        micro_avx2<5, 2, SRC, G>};
// One row: WHOLE_AVX2[src][gated][np - 1] multiplies np whole panels (whole_avx2).
#define KV8_WHOLE(S, G) {whole_avx2<1, S, G>, whole_avx2<2, S, G>, whole_avx2<3, S, G>}
static const MicroAvx2Fn WHOLE_AVX2[3][2][3] = {{KV8_WHOLE(W_BF16, false), KV8_WHOLE(W_BF16, true)},
                                                {KV8_WHOLE(W_FP8, false), KV8_WHOLE(W_FP8, true)},
                                                {KV8_WHOLE(W_FP8_WIDE, false), KV8_WHOLE(W_FP8_WIDE, true)}};
#undef KV8_WHOLE

// ---- linear, more rows: a blocked GEMM -------------------------------------------------------------------------------
//
// A thread's panels meet the rows in chunks of MC rows; within a chunk the k range goes in blocks of at most KC_PAIRS
// pair-rows. Per (chunk, k block) the chunk's x values are converted once to fp32 (rows_to_f32_block, in L2), and per
// half panel its k block is widened once to fp32 (widen_half: 16 KiB, in L1 while every tile of the chunk passes over
// it; the next panel's k block is prefetched into L2 meanwhile). A tile is up to MR_TILE rows x 16 columns in 12
// accumulators (tile_sums: per k, 2 weight loads and MR broadcasts feed 2 MR FMAs); between k blocks its fp32 sums wait
// in the thread's buffer (tl_c) and continue where they stopped: a row's sum is the same chain of FMAs in k order as
// on the other paths, so the same bits.
static const int MR_TILE = 6;          // rows of a tile: 12 accumulators + 2 weights + 1 broadcast of 16 registers
static const int64_t KC_PAIRS = 128;   // pair-rows per k block: 16 KiB of a half panel's fp32 weights
static const int64_t MC = 120;         // rows per chunk: their fp32 k block (120 KiB) stays in L2
static const int64_t FEW_ROWS = 5;     // up to this many rows (one block): the panels read in place (micro_avx2)

// Half h of a panel (groups half_group(h, 0), half_group(h, 1)), pair-rows [kk0, kk0 + n) -> fp32 at w, 32 floats per
// pair-row: the two groups' even-k weights, then their odd-k weights. Exact (an FP8 weight times load_weights' power of two).
template <int SRC, bool GATED>
static inline void widen_half(const uint8_t* panel, int64_t kk0, int64_t n, int h, float* w) {
    constexpr int64_t GB = SRC != W_BF16 ? 16 : 32;
    const uint8_t* p = panel + kk0 * 4 * GB;
    const int64_t g0 = half_group<GATED>(h, 0) * GB, g1 = half_group<GATED>(h, 1) * GB;
    for (int64_t kk = 0; kk < n; ++kk, p += 4 * GB) {
        __m256 e0, o0, e1, o1;
        load_weights<SRC>(p + g0, e0, o0);
        load_weights<SRC>(p + g1, e1, o1);
        _mm256_store_ps(w + kk * 32, e0);
        _mm256_store_ps(w + kk * 32 + 8, e1);
        _mm256_store_ps(w + kk * 32 + 16, o0);
        _mm256_store_ps(w + kk * 32 + 24, o1);
    }
}

// rows of x (stride K), columns [k0, k0 + kc) -> xf [rows, kc] fp32 times xs (columns at or past K: 0). Returns
// x_fits; where it does not, xf holds x unscaled.
static inline bool rows_to_f32_block(const uint16_t* x, int64_t rows, int64_t K, int64_t k0, int64_t kc, float* xf,
                                     float xs = 1.0f) {
    __m256 amax = _mm256_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t* s = x + r * K + k0;
        float* d = xf + r * kc;
        const int64_t n = K - k0 < kc ? K - k0 : kc;   // columns inside x (kc - n: 0 or 1, the pad of an odd K)
        int64_t k = 0;
        for (; k + 8 <= n; k += 8) _mm256_storeu_ps(d + k, x8_scaled(bf16x8_to_f32(s + k), xs, amax));
        if (k < n) {
            alignas(32) float tail[8];
            _mm256_store_ps(tail, x8_scaled(bf16x8_to_f32_n(s + k, n - k), xs, amax));
            memcpy(d + k, tail, (size_t)(n - k) * 4);
            k = n;
        }
        for (; k < kc; ++k) d[k] = 0.0f;
    }
    if (x_fits(amax, xs)) return true;
    rows_to_f32_block(x, rows, K, k0, kc, xf);
    return false;
}

// A tile's sums: MR rows of fp32 x (stride ldx) times a half panel's widened k block (w: widen_half's), `pairs`
// pair-rows, continuing the sums at cin (MR x 16 floats; NULL: from zero) into c (MR x 16; may be cin). The k loop is
// alone in its function, whatever the epilogue, so that the compiler keeps the 12 accumulators in registers.
template <int MR>
static void tile_sums(const float* x, int64_t ldx, const float* w, int64_t pairs, const float* cin, float* c) {
    __m256 acc[MR][2];
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
        acc[r][0] = cin ? _mm256_load_ps(cin + r * 16) : _mm256_setzero_ps();
        acc[r][1] = cin ? _mm256_load_ps(cin + r * 16 + 8) : _mm256_setzero_ps();
    }
    for (int64_t kk = 0; kk < pairs; ++kk, w += 32, x += 2) {
        // Each weight register is loaded once and feeds MR FMAs (the empty asm keeps the compiler from folding the
        // load into every FMA: 2 + MR loads per 2 MR FMAs, not 3 MR).
        __m256 w0 = _mm256_load_ps(w), w1 = _mm256_load_ps(w + 8);
        __asm__("" : "+x"(w0), "+x"(w1));
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
            const __m256 b = _mm256_broadcast_ss(x + r * ldx);
            acc[r][0] = _mm256_fmadd_ps(w0, b, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w1, b, acc[r][1]);
        }
        w0 = _mm256_load_ps(w + 16);
        w1 = _mm256_load_ps(w + 24);
        __asm__("" : "+x"(w0), "+x"(w1));
#pragma GCC unroll 8
        for (int r = 0; r < MR; ++r) {
            const __m256 b = _mm256_broadcast_ss(x + r * ldx + 1);
            acc[r][0] = _mm256_fmadd_ps(w0, b, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w1, b, acc[r][1]);
        }
    }
#pragma GCC unroll 8
    for (int r = 0; r < MR; ++r) {
        _mm256_store_ps(c + r * 16, acc[r][0]);
        _mm256_store_ps(c + r * 16 + 8, acc[r][1]);
    }
}

typedef void (*TileFn)(const float*, int64_t, const float*, int64_t, const float*, float*);
static const TileFn TILES[MR_TILE + 1] = {nullptr,       tile_sums<1>, tile_sums<2>, tile_sums<3>,
                                          tile_sums<4>, tile_sums<5>, tile_sums<6>};

// Panels [p0, p1) of the blocked GEMM for one thread (see above); false when a buffer cannot be allocated.
template <int SRC, bool GATED>
static bool linear_blocked(const uint16_t* x, int64_t M, int64_t K, const uint8_t* packed, int64_t p0, int64_t p1,
                           const float* bias, const float* scale, float unit, int64_t N, uint16_t* out) {
    const int64_t kp = (K + 1) & ~(int64_t)1, pairs = kp / 2;
    const int64_t nkb = (pairs + KC_PAIRS - 1) / KC_PAIRS;
    const int64_t kcp = (pairs + nkb - 1) / nkb;   // pair-rows per k block (the last one: what is left)
    const int64_t chunks = (M + MC - 1) / MC, mc = (M + chunks - 1) / chunks;   // chunks of nearly equal rows
    const int64_t row_bytes = (int64_t)PANEL * (SRC != W_BF16 ? 2 : 4);   // of a pair-row
    const int64_t panel_bytes = pairs * row_bytes;
    float* xp = tl_x.get((size_t)mc * kcp * 2);
    float* wf = tl_w.get((size_t)kcp * 32);
    float* cb = nkb > 1 ? tl_c.get((size_t)mc * (p1 - p0) * PANEL) : nullptr;
    if (!xp || !wf || (nkb > 1 && !cb)) return false;
    alignas(32) float done[MR_TILE * 16];   // a tile's finished sums, before the epilogue
    for (int64_t m0 = 0; m0 < M; m0 += mc) {
        const int64_t rows = M - m0 < mc ? M - m0 : mc;
        // the chunk's tiles: nt of nearly equal rows (at most MR_TILE), tile b from row tile_r0[b] on
        const int nt = (int)((rows + MR_TILE - 1) / MR_TILE);
        int tile_r0[MC / MR_TILE + 2];
        for (int b = 0; b <= nt; ++b) tile_r0[b] = (int)(rows * b / nt);
        for (int64_t kk0 = 0; kk0 < pairs; kk0 += kcp) {
            const int64_t n = pairs - kk0 < kcp ? pairs - kk0 : kcp;
            const bool first = kk0 == 0, last = kk0 + n == pairs;
            const bool fits = rows_to_f32_block(x + m0 * K, rows, K, 2 * kk0, 2 * n, xp, SRC == W_FP8 ? X_FP8 : 1.0f);
            // The next panel's k block (`lines` cache lines) streams into L2 while a panel computes, per_tile lines
            // beside each of its 2 nt tiles.
            const int64_t lines = n * row_bytes / 64, per_tile = (lines + 2 * nt - 1) / (2 * nt);
            for (int64_t p = p0; p < p1; ++p) {
                const char* next = p + 1 < p1 ? (const char*)packed + (p + 1) * panel_bytes + kk0 * row_bytes : nullptr;
                for (int h = 0; h < 2; ++h) {
                    if (half_column<GATED>(p * PANEL, h) >= N) continue;   // a padded half: no outputs
                    if (SRC == W_FP8 && !fits) widen_half<W_FP8_WIDE, GATED>(packed + p * panel_bytes, kk0, n, h, wf);
                    else widen_half<SRC, GATED>(packed + p * panel_bytes, kk0, n, h, wf);
                    float* c = cb ? cb + ((p - p0) * 2 + h) * mc * 16 : nullptr;
                    for (int b = 0; b < nt; ++b) {
                        const int r0 = tile_r0[b], mr = tile_r0[b + 1] - r0;
                        for (int64_t l = (h * nt + b) * per_tile; next && l < lines && l < (h * nt + b + 1) * per_tile; ++l)
                            _mm_prefetch(next + l * 64, _MM_HINT_T1);
                        float* sums = last ? done : c + r0 * 16;
                        TILES[mr](xp + r0 * 2 * n, 2 * n, wf, n, first ? nullptr : c + r0 * 16, sums);
                        if (last)
                            for (int r = 0; r < mr; ++r)
                                store_half<GATED>(_mm256_load_ps(sums + r * 16), _mm256_load_ps(sums + r * 16 + 8),
                                                  bias, scale, unit, p * PANEL, h, N, out + (m0 + r0 + r) * N);
                    }
                }
            }
        }
    }
    return true;
}

// kv8_linear (FP8 false) and kv8_linear_fp8 on AVX2 (linear.h's contract; use_amx is ignored), on checked arguments
// with rows > 0 (dense.cpp's entry points). Threads take contiguous runs of panels. Up to FEW_ROWS rows, per chunk of
// rows (its fp32 copy within X_CHUNK_BYTES) a thread walks its panels: one row multiplies two or three whole panels at
// once (whole_avx2: each streamed once and prefetched ahead, 8 or 12 independent chains of FMAs); more rows go through
// each half panel in blocks of up to MAX_MR_AVX2 rows (the half panel stays in L1 between the blocks). More rows: the
// blocked GEMM (linear_blocked).
template <bool FP8>
static int linear(const kv8_linear_call& call) {
    const uint16_t* x = call.x;
    const uint8_t* packed = (const uint8_t*)call.packed;
    const float *scale = call.scale, *bias = call.bias;
    uint16_t* out = call.out;
    const int64_t M = call.rows, K = call.in_features, N = call.out_features;
    const bool gated = call.gated != 0;
    constexpr int SRC = FP8 ? W_FP8 : W_BF16;
    const float unit = FP8 ? 256.0f : 1.0f;
    const int64_t kp = (K + 1) & ~(int64_t)1;
    const int64_t panels = linear_panels(call);
    const int64_t panel_bytes = (int64_t)PANEL * kp * (FP8 ? 1 : 2);
    const int64_t chunk = X_CHUNK_BYTES / (kp * 4) > MAX_MR_AVX2 ? X_CHUNK_BYTES / (kp * 4) : MAX_MR_AVX2;
    const int threads = threads_for(call);
    int failed = 0;
#pragma omp parallel num_threads(threads) reduction(| : failed)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        if (M > FEW_ROWS) {
            failed = !(gated ? linear_blocked<SRC, true>(x, M, K, packed, p0, p1, bias, scale, unit, N, out)
                             : linear_blocked<SRC, false>(x, M, K, packed, p0, p1, bias, scale, unit, N, out));
        } else {
            float* xf = tl_x.get((size_t)(M < chunk ? M : chunk) * kp);
            if (!xf) failed = 1;
            for (int64_t m0 = 0; !failed && m0 < M; m0 += chunk) {
                const int64_t rows = M - m0 < chunk ? M - m0 : chunk;
                // FP8: x times X_FP8 where it fits, else the weights decoded times 2^112 (the same products)
                const bool fits = rows_to_f32(x + m0 * K, rows, K, kp, xf, FP8 ? X_FP8 : 1.0f);
                const int src = FP8 && !fits ? W_FP8_WIDE : SRC;
                const MicroAvx2Fn* blocks = src == W_FP8 ? (gated ? MICRO_AVX2<W_FP8, true> : MICRO_AVX2<W_FP8, false>)
                                          : src == W_FP8_WIDE ? (gated ? MICRO_AVX2<W_FP8_WIDE, true>
                                                                       : MICRO_AVX2<W_FP8_WIDE, false>)
                                          : (gated ? MICRO_AVX2<W_BF16, true> : MICRO_AVX2<W_BF16, false>);
                uint16_t* oc = out + m0 * N;
                for (int64_t p = p0; p < p1; ++p) {
                    const uint8_t* panel = packed + p * panel_bytes;
                    if (rows == 1) {   // bf16: three panels at a time, two where two or four are left, else one;
                        // FP8 (decode-bound: 8 chains hide the FMA latency, 12 spill one): two, else one
                        const int64_t left = p1 - p;
                        const int np = !FP8 && left >= 3 && left != 4 ? 3 : left >= 2 ? 2 : 1;
                        WHOLE_AVX2[src][gated][np - 1](xf, kp, panel, 0, bias, scale, unit, p * PANEL, N, oc);
                        p += np - 1;
                        continue;
                    }
                    const int64_t nblk = (rows + MAX_MR_AVX2 - 1) / MAX_MR_AVX2;
                    const int64_t base = rows / nblk, extra = rows % nblk;
                    for (int h = 0; h < 2; ++h) {
                        int64_t r0 = 0;
                        for (int64_t b = 0; b < nblk; ++b) {
                            const int mr = (int)(base + (b < extra ? 1 : 0));
                            blocks[mr](xf + r0 * kp, kp, panel, h, bias, scale, unit, p * PANEL, N, oc + r0 * N);
                            r0 += mr;
                        }
                    }
                }
            }
        }
    }
    return failed ? ERR_OOM : OK;
}

#endif
