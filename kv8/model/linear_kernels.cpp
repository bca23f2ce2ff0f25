// kv8 CPU kernels: bf16 x bf16 -> bf16 linear layers for few rows (decode), on pre-packed weights.
//
// Plain C ABI (extern "C"), loaded with ctypes by kv8/model/cpu_linear.py, compiled there with
// `g++ -O3 -march=native -fopenmp -shared -fPIC` (the build is kv8/native.py's). No torch headers.
//
// Why: a decode step multiplies a few rows (one per running sequence) with every weight matrix, so its
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
#include <cstring>
#include <omp.h>

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>
#define KV8_LINEAR_FAST 1
#else
#define KV8_LINEAR_FAST 0
#endif

static const int PANEL = 32;   // output columns per panel (two zmm registers of fp32 accumulators)
static const int MAX_MR = 12;  // rows per micro-kernel call: 24 accumulators + 2 weights + 1 broadcast

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
// MR rows of x (stride K) times one panel -> MR x 32 outputs (columns n0 .. n0 + ncols - 1 are stored).
template <int MR>
static inline void micro(const uint16_t* x, int64_t K, const uint16_t* panel, int64_t kp, const float* bias,
                         int64_t n0, int ncols, uint16_t* out, int64_t N) {
    __m512 acc[MR][2];
    for (int r = 0; r < MR; ++r) {
        acc[r][0] = _mm512_setzero_ps();
        acc[r][1] = _mm512_setzero_ps();
    }
    const int64_t pairs = kp / 2;
    const int64_t full = K / 2;  // pairs whose two x values both exist (K even: all of them)
    for (int64_t kk = 0; kk < pairs; ++kk) {
        const __m512bh w0 = (__m512bh)_mm512_loadu_si512((const void*)(panel + kk * 64));
        const __m512bh w1 = (__m512bh)_mm512_loadu_si512((const void*)(panel + kk * 64 + 32));
        if (kk + 8 < pairs) _mm_prefetch((const char*)(panel + (kk + 8) * 64), _MM_HINT_T0);
        for (int r = 0; r < MR; ++r) {
            int32_t xv;
            if (kk < full) {
                memcpy(&xv, x + r * K + 2 * kk, 4);
            } else {  // odd K: the last pair has one value (its partner weight is zero)
                xv = x[r * K + 2 * kk];
            }
            const __m512bh b = (__m512bh)_mm512_set1_epi32(xv);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], w0, b);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], w1, b);
        }
    }
    __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
    if (bias) {
        const __mmask16 m0 = ncols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << ncols) - 1);
        const __mmask16 m1 = ncols >= 32 ? (__mmask16)0xFFFF
                           : ncols <= 16 ? (__mmask16)0 : (__mmask16)((1u << (ncols - 16)) - 1);
        b0 = _mm512_maskz_loadu_ps(m0, bias + n0);
        b1 = _mm512_maskz_loadu_ps(m1, bias + n0 + 16);
    }
    const __mmask16 s0 = ncols >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << ncols) - 1);
    const __mmask16 s1 = ncols >= 32 ? (__mmask16)0xFFFF
                       : ncols <= 16 ? (__mmask16)0 : (__mmask16)((1u << (ncols - 16)) - 1);
    for (int r = 0; r < MR; ++r) {
        const __m256i y0 = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][0], b0));
        const __m256i y1 = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(acc[r][1], b1));
        _mm256_mask_storeu_epi16(out + r * N + n0, s0, y0);
        _mm256_mask_storeu_epi16(out + r * N + n0 + 16, s1, y1);
    }
}

typedef void (*MicroFn)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*, int64_t, int, uint16_t*,
                        int64_t);
static const MicroFn MICRO[MAX_MR + 1] = {nullptr, micro<1>, micro<2>, micro<3>, micro<4>, micro<5>, micro<6>,
                                          micro<7>, micro<8>, micro<9>, micro<10>, micro<11>, micro<12>};
#endif

// out[M, N] = x[M, K] @ W^T (+ bias), W pre-packed by kv8_linear_pack.
extern "C" int kv8_linear(const uint16_t* x, int64_t M, int64_t K, const uint16_t* packed, int64_t N,
                          const float* bias, uint16_t* out, int nthreads) {
#if KV8_LINEAR_FAST
    if (!x || !packed || !out || M <= 0 || K <= 0 || N <= 0 || nthreads <= 0) return 5;
    const int64_t kp = (K + 1) & ~(int64_t)1;
    const int64_t panels = (N + PANEL - 1) / PANEL;
    // Row blocks of nearly equal size, at most MAX_MR rows each.
    const int64_t nblk = (M + MAX_MR - 1) / MAX_MR;
    const int64_t base = M / nblk, extra = M % nblk;
    const int threads = (int)(panels < nthreads ? panels : nthreads);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < panels; ++p) {
        const uint16_t* panel = packed + p * PANEL * kp;
        const int64_t n0 = p * PANEL;
        const int ncols = (int)(N - n0 < PANEL ? N - n0 : PANEL);
        int64_t r0 = 0;
        for (int64_t b = 0; b < nblk; ++b) {
            const int mr = (int)(base + (b < extra ? 1 : 0));
            MICRO[mr](x + r0 * K, K, panel, kp, bias, n0, ncols, out + r0 * N, N);
            r0 += mr;
        }
    }
    return 0;
#else
    (void)x; (void)M; (void)K; (void)packed; (void)N; (void)bias; (void)out; (void)nthreads;
    return 7;
#endif
}
