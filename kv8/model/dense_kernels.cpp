// kv8 CPU kernels for the dense part of a decoder layer, bf16 in and out: linear layers on pre-packed
// weights, RMSNorm with the residual add fused in, SiLU(gate) * up, and RoPE of q/k (with v copied out).
//
// Plain C ABI (extern "C"), loaded with ctypes by kv8/layers/dense_kernels.py, compiled there with
// `g++ -O3 -march=native -fopenmp -shared -fPIC` (the build is kv8/native.py's). No torch headers.
//
// Linear. Why: a decode step multiplies a few rows (one per running sequence) with every weight matrix, so its
// cost is reading the weights. oneDNN's bf16 GEMM reaches ~10 GB/s of weights inside the model on this
// machine (a call per matrix, weights streamed from DRAM); this kernel reads each weight exactly once
// per call from a layout that is one sequential stream per thread, and does the arithmetic with AVX-512
// BF16 `vdpbf16ps`.
//
// Packed layout of W [N, K] (row-major bf16, y = x W^T): K is padded to Kp (even), N to a multiple of 32.
// Panel p (columns 32p .. 32p+31) is Kp/2 consecutive groups of 64 bf16 values: group kk holds, for each
// of the 32 columns c, the pair (W[32p+c, 2kk], W[32p+c, 2kk+1]) -- exactly the operand order vdpbf16ps
// wants, with the matching pair of x broadcast as one 32-bit value. Padding is zero.
//
// Numerics: each product of two bf16 values is exact in fp32; sums are accumulated in fp32 (two products
// per instruction, then in k order), the bias (fp32) is added, and the result is rounded to bf16 to
// nearest-even -- what torch's bf16 linear does, up to the order of the fp32 additions.
//
// Invariants: x rows are contiguous with stride K (K even); out rows are contiguous with stride N.
// Returns 0, or 5 for invalid arguments, 7 when this build has no AVX-512 BF16 path.

#include <cstdint>
#include <cmath>
#include <cstring>
#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#include "../simd_exp.h"
#define KV8_LINEAR_FAST 1
#else
#define KV8_LINEAR_FAST 0
#endif

static const int PANEL = 32;  // output columns per panel (two zmm registers of fp32 accumulators)
static const int64_t ROW_CHUNK = 192;  // rows of x per pass over the weights (x chunk stays in L2)

extern "C" int kv8_linear_available() { return KV8_LINEAR_FAST; }

extern "C" int64_t kv8_linear_packed_size(int64_t N, int64_t K) {
    if (N <= 0 || K <= 0) return -1;
    int64_t kp = (K + 1) & ~(int64_t)1;
    int64_t np = (N + PANEL - 1) / PANEL * PANEL;
    return np * kp;
}

// packed[p][kk][c][j] = W[p*32 + c, 2*kk + j] (zero outside W).
extern "C" int kv8_linear_pack(const uint16_t* w, int64_t N, int64_t K, uint16_t* packed) {
    if (!w || !packed || N <= 0 || K <= 0) return 5;
    const int64_t kp = (K + 1) & ~(int64_t)1;
    const int64_t panels = (N + PANEL - 1) / PANEL;
#pragma omp parallel for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
        uint16_t* dst = packed + p * PANEL * kp;
        for (int64_t kk = 0; kk < kp / 2; ++kk) {
            for (int c = 0; c < PANEL; ++c) {
                const int64_t n = p * PANEL + c;
                for (int j = 0; j < 2; ++j) {
                    const int64_t k = 2 * kk + j;
                    dst[(kk * PANEL + c) * 2 + j] = (n < N && k < K) ? w[n * K + k] : 0;
                }
            }
        }
    }
    return 0;
}

#if KV8_LINEAR_FAST
static inline __mmask16 lane_mask(int n) {  // the first n (clamped to 0..16) of 16 lanes
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

// MR rows of x (stride K) times NP adjacent panels (NP = 1 or 2, i.e. 32 or 64 columns starting at n0) ->
// MR x 32*NP outputs; only columns below N are stored.
template <int MR, int NP>
static inline void micro(const uint16_t* x, int64_t K, const uint16_t* panel, int64_t kp, const float* bias,
                         int64_t n0, int64_t N, uint16_t* out, const uint16_t* pf, int pf_first, int pf_step) {
    constexpr int NV = 2 * NP;  // zmm accumulators per row
    __m512 acc[MR][NV];
    for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
    const int64_t pairs = kp / 2;
    const int64_t full = K / 2;  // pairs whose two x values both exist (K even: all of them)
    const int64_t panel_stride = (int64_t)PANEL * kp;
    int64_t pf_next = pf ? pf_first : pairs;  // next pair index whose lines of the next panels to prefetch
    for (int64_t kk = 0; kk < pairs; ++kk) {
        __m512bh w[NV];
        for (int q = 0; q < NP; ++q) {
            const uint16_t* src = panel + q * panel_stride + kk * 64;
            w[2 * q] = (__m512bh)_mm512_loadu_si512((const void*)src);
            w[2 * q + 1] = (__m512bh)_mm512_loadu_si512((const void*)(src + 32));
            if (kk == pf_next) {  // lines of the next panels, into L2: DRAM streams while the blocks compute
                const char* f = (const char*)(pf + q * panel_stride + kk * 64);
                __builtin_prefetch(f, 0, 2);
                __builtin_prefetch(f + 64, 0, 2);
            }
        }
        if (kk == pf_next) pf_next += pf_step;
        for (int r = 0; r < MR; ++r) {
            int32_t xv;
            if (kk < full) {
                memcpy(&xv, x + r * K + 2 * kk, 4);
            } else {  // odd K: the last pair has one value (its partner weight is zero)
                xv = x[r * K + 2 * kk];
            }
            const __m512bh b = (__m512bh)_mm512_set1_epi32(xv);
            for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], w[v], b);
        }
    }
    for (int v = 0; v < NV; ++v) {
        const int64_t c0 = n0 + 16 * v;
        const __mmask16 m = lane_mask((int)(N - c0 < 16 ? N - c0 : 16));
        if (!m) break;
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(m, bias + c0) : _mm512_setzero_ps();
        for (int r = 0; r < MR; ++r) {
            const __m256i y = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][v], bv));
            _mm256_mask_storeu_epi16(out + r * N + c0, m, y);
        }
    }
}

typedef void (*MicroFn)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*, int64_t, int64_t,
                        uint16_t*, const uint16_t*, int, int);
static const int MAX_MR1 = 12;  // one panel: 24 accumulators + 2 weights + 1 broadcast registers
static const int MAX_MR2 = 6;   // two panels: 24 accumulators + 4 weights + 1 broadcast
static const MicroFn MICRO1[MAX_MR1 + 1] = {nullptr, micro<1, 1>, micro<2, 1>, micro<3, 1>, micro<4, 1>,
                                            micro<5, 1>, micro<6, 1>, micro<7, 1>, micro<8, 1>, micro<9, 1>,
                                            micro<10, 1>, micro<11, 1>, micro<12, 1>};
static const MicroFn MICRO2[MAX_MR2 + 1] = {nullptr, micro<1, 2>, micro<2, 2>, micro<3, 2>, micro<4, 2>,
                                            micro<5, 2>, micro<6, 2>};

// Rows [0, M) in nearly equal blocks of at most max_mr rows, each through table[rows]; the blocks share the
// prefetch of the panels at `next` (NULL: none) into L2, block b taking the pairs kk = b mod blocks.
static inline void row_blocks(const MicroFn* table, int max_mr, const uint16_t* x, int64_t M, int64_t K,
                              const uint16_t* panel, int64_t kp, const float* bias, int64_t n0, int64_t N,
                              uint16_t* out, const uint16_t* next) {
    const int64_t nblk = (M + max_mr - 1) / max_mr;
    const int64_t base = M / nblk, extra = M % nblk;
    int64_t r0 = 0;
    for (int64_t b = 0; b < nblk; ++b) {
        const int mr = (int)(base + (b < extra ? 1 : 0));
        table[mr](x + r0 * K, K, panel, kp, bias, n0, N, out + r0 * N, next, (int)b, (int)nblk);
        r0 += mr;
    }
}
#endif

// out[M, N] = x[M, K] @ W^T (+ bias), W pre-packed by kv8_linear_pack.
extern "C" int kv8_linear(const uint16_t* x, int64_t M, int64_t K, const uint16_t* packed, int64_t N,
                          const float* bias, uint16_t* out, int nthreads) {
#if KV8_LINEAR_FAST
    if (!x || !packed || !out || M <= 0 || K <= 0 || N <= 0 || nthreads <= 0) return 5;
    const int64_t kp = (K + 1) & ~(int64_t)1;
    const int64_t panels = (N + PANEL - 1) / PANEL;
    const int threads = (int)(panels < nthreads ? panels : nthreads);
    // Rows go in chunks of ROW_CHUNK so that a chunk of x stays in L2 while every panel passes over it.
    // Within a chunk each thread takes a contiguous run of panels and walks it two panels (64 columns) at
    // a time, one panel for an odd one left over.
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        for (int64_t m0 = 0; m0 < M; m0 += ROW_CHUNK) {
            const int64_t rows = M - m0 < ROW_CHUNK ? M - m0 : ROW_CHUNK;
            const uint16_t* xc = x + m0 * K;
            uint16_t* oc = out + m0 * N;
            for (int64_t p = p0; p < p1; p += 2) {
                const uint16_t* panel = packed + p * PANEL * kp;
                // Prefetch the next two panels while this pair computes (within the thread's run): with
                // several row blocks per panel the compute no longer waits for DRAM.
                const uint16_t* next = p + 3 < p1 ? panel + 2 * PANEL * kp : nullptr;
                if (p + 1 < p1) {
                    row_blocks(MICRO2, MAX_MR2, xc, rows, K, panel, kp, bias, p * PANEL, N, oc, next);
                } else {
                    row_blocks(MICRO1, MAX_MR1, xc, rows, K, panel, kp, bias, p * PANEL, N, oc, nullptr);
                }
            }
        }
    }
    return 0;
#else
    (void)x; (void)M; (void)K; (void)packed; (void)N; (void)bias; (void)out; (void)nthreads;
    return 7;
#endif
}

// ------------------------------------------------------------------------------------------------
// Elementwise parts of a decoder layer, bf16 in and out, fp32 arithmetic, rounded where torch's bf16
// ops round (so results match the torch code they replace up to the last bit of exp / rsqrt / the order
// of a row's sum of squares). Rows are split across threads when a call is large enough to pay for it.
// ------------------------------------------------------------------------------------------------

static const int64_t PARALLEL_MIN = 1 << 16;  // elements below which one thread does the whole call

#if KV8_LINEAR_FAST
static inline __m512 bf16x16_to_f32(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline __m512 bf16x16_to_f32_mask(const uint16_t* p, __mmask16 m) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
static inline __m512 round_bf16(__m512 x) {  // x rounded to the nearest bf16 (ties to even), as fp32
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}
static inline void store_bf16(uint16_t* p, __m512 x, __mmask16 m) {
    _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(x));
}
static inline __mmask16 tail_mask(int64_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1); }
#endif

// h = x (+ residual, rounded to bf16); residual_out = h (if given); out = bf16(w * bf16(h * rsqrt(mean(h^2) + eps))).
// x, residual, residual_out, out: [T, E] contiguous; w: [E]. residual_out may alias residual or x.
extern "C" int kv8_rmsnorm(const uint16_t* x, const uint16_t* residual, uint16_t* residual_out, const uint16_t* w,
                           float eps, int64_t T, int64_t E, uint16_t* out, int nthreads) {
#if KV8_LINEAR_FAST
    if (!x || !w || !out || T < 0 || E <= 0 || nthreads <= 0) return 5;
    const int threads = T * E < PARALLEL_MIN ? 1 : nthreads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < T; ++t) {
        const uint16_t* xr = x + t * E;
        const uint16_t* rr = residual ? residual + t * E : nullptr;
        uint16_t* ro = residual_out ? residual_out + t * E : nullptr;
        __m512 ss = _mm512_setzero_ps();
        for (int64_t e = 0; e < E; e += 16) {
            const __mmask16 m = tail_mask(E - e);
            __m512 h = bf16x16_to_f32_mask(xr + e, m);
            if (rr) h = round_bf16(_mm512_add_ps(h, bf16x16_to_f32_mask(rr + e, m)));
            if (ro) store_bf16(ro + e, h, m);
            ss = _mm512_fmadd_ps(h, h, ss);
        }
        const float inv = 1.0f / sqrtf(_mm512_reduce_add_ps(ss) / (float)E + eps);
        const __m512 iv = _mm512_set1_ps(inv);
        const uint16_t* src = ro ? ro : xr;  // h, already rounded (or x itself without a residual)
        for (int64_t e = 0; e < E; e += 16) {
            const __mmask16 m = tail_mask(E - e);
            __m512 h = (ro || !rr) ? bf16x16_to_f32_mask(src + e, m)
                                   : round_bf16(_mm512_add_ps(bf16x16_to_f32_mask(xr + e, m),
                                                              bf16x16_to_f32_mask(rr + e, m)));
            __m512 n = round_bf16(_mm512_mul_ps(h, iv));
            store_bf16(out + t * E + e, _mm512_mul_ps(bf16x16_to_f32_mask(w + e, m), n), m);
        }
    }
    return 0;
#else
    (void)x; (void)residual; (void)residual_out; (void)w; (void)eps; (void)T; (void)E; (void)out; (void)nthreads;
    return 7;
#endif
}

// gu: [T, 2I] (gate | up); out[T, I] = bf16(bf16(silu(gate)) * up).
extern "C" int kv8_silu_mul(const uint16_t* gu, int64_t T, int64_t I, uint16_t* out, int nthreads) {
#if KV8_LINEAR_FAST
    if (!gu || !out || T < 0 || I <= 0 || nthreads <= 0) return 5;
    const int threads = T * I < PARALLEL_MIN ? 1 : nthreads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < T; ++t) {
        const uint16_t* g = gu + t * 2 * I;
        const uint16_t* u = g + I;
        for (int64_t i = 0; i < I; i += 16) {
            const __mmask16 m = tail_mask(I - i);
            __m512 a = bf16x16_to_f32_mask(g + i, m);
            __m512 s = round_bf16(_mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                                 exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), a)))));
            store_bf16(out + t * I + i, _mm512_mul_ps(s, bf16x16_to_f32_mask(u + i, m)), m);
        }
    }
    return 0;
#else
    (void)gu; (void)T; (void)I; (void)out; (void)nthreads;
    return 7;
#endif
}

// Rotate-half RoPE of q and k read from packed projection rows, plus a copy of v, into contiguous outputs.
// qkv: [T, row_stride] with q at column 0 (Hq*D), k after it (Hkv*D), v after k (Hkv*D).
// cos, sin: [T, D/2] float32 angles' cos/sin; like torch they are first rounded to bf16, then
// out = bf16(bf16(x * c) + bf16(rot(x) * s)) with rot(x) = (-x2, x1).
extern "C" int kv8_rope_qkv(const uint16_t* qkv, int64_t T, int64_t row_stride, int Hq, int Hkv, int D,
                            const float* cos, const float* sin, uint16_t* q_out, uint16_t* k_out, uint16_t* v_out,
                            int nthreads) {
#if KV8_LINEAR_FAST
    if (!qkv || !cos || !sin || !q_out || !k_out || !v_out || T < 0 || Hq <= 0 || Hkv <= 0 || D <= 0 || D % 2 ||
        row_stride < (int64_t)(Hq + 2 * Hkv) * D || nthreads <= 0)
        return 5;
    const int half = D / 2;
    const int threads = T * (Hq + 2 * Hkv) * D < PARALLEL_MIN ? 1 : nthreads;
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t t = 0; t < T; ++t) {
        const uint16_t* row = qkv + t * row_stride;
        const float* cr = cos + t * half;
        const float* sr = sin + t * half;
        for (int h = 0; h < Hq + Hkv; ++h) {
            const uint16_t* src = row + (int64_t)h * D;
            uint16_t* dst = h < Hq ? q_out + (t * Hq + h) * (int64_t)D : k_out + (t * Hkv + (h - Hq)) * (int64_t)D;
            for (int j = 0; j < half; j += 16) {
                const __mmask16 m = tail_mask(half - j);
                __m512 c = round_bf16(_mm512_maskz_loadu_ps(m, cr + j));
                __m512 s = round_bf16(_mm512_maskz_loadu_ps(m, sr + j));
                __m512 x1 = bf16x16_to_f32_mask(src + j, m);
                __m512 x2 = bf16x16_to_f32_mask(src + half + j, m);
                // first half: x1 c - x2 s; second half: x2 c + x1 s (each product rounded, then the sum)
                __m512 a = _mm512_add_ps(round_bf16(_mm512_mul_ps(x1, c)),
                                         round_bf16(_mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), s)));
                __m512 b = _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, c)), round_bf16(_mm512_mul_ps(x1, s)));
                store_bf16(dst + j, a, m);
                store_bf16(dst + half + j, b, m);
            }
        }
        memcpy(v_out + t * Hkv * (int64_t)D, row + (int64_t)(Hq + Hkv) * D, (size_t)Hkv * D * 2);
    }
    return 0;
#else
    (void)qkv; (void)T; (void)row_stride; (void)Hq; (void)Hkv; (void)D; (void)cos; (void)sin; (void)q_out;
    (void)k_out; (void)v_out; (void)nthreads;
    return 7;
#endif
}
