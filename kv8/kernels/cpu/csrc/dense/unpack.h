// The packed weights back to a float32 matrix, for the float32 GEMM of long prefill chunks (kv8_unpack: the bf16
// packed layout; kv8_unpack_fp8: the FP8 one, each code decoded and times its row's scale). Included once, by
// dense.cpp, after avx2.h; compiled where the build has either path (AVX-512 BF16 + VBMI, or AVX2 + FMA + F16C).
//
//   out[r][k] = W[first + r][k]                              kv8_unpack      (exact: bf16 widens to float32)
//   out[r][k] = decode(code[first + r][k]) * scale[first + r]  kv8_unpack_fp8  (one float32 rounding, the product)
//
// for r < rows, k < in_features: rows of the packed matrix from `first` (a multiple of the 32-row panel) on, as
// kv8/kernels/cpu/dense.py's unpack_reference computes them in torch (tests/layers/test_layers.py: bit for bit).
//
// How. A panel holds, per pair-row kk, the dword (W[c, 2kk], W[c, 2kk+1]) of each of its 32 columns c, so 8
// consecutive pair-rows of one column are 16 consecutive values of an output row. A block of 8 pair-rows is read
// as four 8 x 8 dword tiles (8 columns each), each transposed in ymm registers (unpack / permute: the pairs of a
// column side by side), widened to float32 (a 16-bit shift) and stored as 16 floats of one output row. FP8 panels
// are first decoded to that bf16 order, 8 pair-rows (1 KiB) at a time into a buffer that stays in L1: AVX-512 with
// linear.h's table decode (exact); AVX2 with avx2.h's shift decode, in 16-bit lanes (the bf16 bits of the value times
// 2^-120, subnormal codes bf16 subnormals: exact), the 2^120 put back by an exact multiply before the scale's. A
// block that ends past in_features (K odd, or kp / 2 not a multiple of 8) goes through the same tiles into a
// buffer, from which its valid columns are copied. Threads take contiguous runs of panels.
#pragma once

#if KV8_LINEAR_FAST || KV8_LINEAR_AVX2

static const int UNPACK_BLOCK = 8;   // pair-rows per block: 16 values of an output row, one 8 x 8 dword tile

// ---- the contract of kv8_unpack / kv8_unpack_fp8 -------------------------------------------------------------------
// fp8: kv8_unpack_fp8, which needs a scale per packed row (kv8_unpack takes none). first: a multiple of the panel.
static inline int check_args(const kv8_unpack_call& c, bool fp8) {
    if (c.rows < 0 || c.first < 0 || c.first % PANEL || c.in_features <= 0 || c.num_threads <= 0 || (!fp8 && c.scale))
        return ERR_ARGS;
    return c.rows > 0 && (!c.packed || (fp8 && !c.scale) || !c.out) ? ERR_ARGS : OK;
}

// The 8 x 8 dword tile at src (row i: 8 dwords at src + i * stride) transposed: t[c] = (src[0][c], ..., src[7][c]).
static inline void transpose8x8(const uint32_t* src, int64_t stride, __m256i t[8]) {
    __m256i r[8];
    for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_si256((const __m256i*)(src + i * stride));
    __m256i a[8], b[8];
    for (int i = 0; i < 4; ++i) {
        a[2 * i] = _mm256_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
        a[2 * i + 1] = _mm256_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
    }
    for (int h = 0; h < 2; ++h) {   // rows 0..3 (h = 0) and 4..7 (h = 1): columns 0,1 | 2,3 side by side per lane
        b[4 * h + 0] = _mm256_unpacklo_epi64(a[4 * h + 0], a[4 * h + 2]);
        b[4 * h + 1] = _mm256_unpackhi_epi64(a[4 * h + 0], a[4 * h + 2]);
        b[4 * h + 2] = _mm256_unpacklo_epi64(a[4 * h + 1], a[4 * h + 3]);
        b[4 * h + 3] = _mm256_unpackhi_epi64(a[4 * h + 1], a[4 * h + 3]);
    }
    for (int c = 0; c < 4; ++c) {
        t[c] = _mm256_permute2x128_si256(b[c], b[4 + c], 0x20);
        t[c + 4] = _mm256_permute2x128_si256(b[c], b[4 + c], 0x31);
    }
}

// 16 bf16 (a column's 8 pairs) -> 16 float32 at dst, times mul (1: as they are; FP8: pre first, exact, then scale).
static inline void widen16(__m256i v, float pre, float scale, bool fp8, float* dst) {
    __m256 lo = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(v)), 16));
    __m256 hi = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(v, 1)), 16));
    if (fp8) {
        if (pre != 1.0f) {
            lo = _mm256_mul_ps(lo, _mm256_set1_ps(pre));
            hi = _mm256_mul_ps(hi, _mm256_set1_ps(pre));
        }
        lo = _mm256_mul_ps(lo, _mm256_set1_ps(scale));
        hi = _mm256_mul_ps(hi, _mm256_set1_ps(scale));
    }
    _mm256_storeu_ps(dst, lo);
    _mm256_storeu_ps(dst + 8, hi);
}

// A panel's FP8 pair-rows kk0 .. kk0 + n - 1 (n <= UNPACK_BLOCK; 64 codes each, this build's order: DenseKernels.
// pack_fp8) -> bf16 pair-rows in the bf16 packed layout's order at dst (64 values each); returns the factor that
// makes them the codes' values (1, or 2^120: avx2.h's decode).
static inline float decode_pair_rows_fp8(const uint8_t* codes, int n, uint16_t* dst) {
#if KV8_LINEAR_FAST
    static const Fp8Tables L = fp8_tables(KV_E4M3);
    for (int i = 0; i < n; ++i) {
        __m512i w0, w1;
        fp8_table_decode<KV_FORMATS[KV_E4M3].nan_0x80>(_mm512_loadu_si512(codes + i * 64), L, w0, w1);
        _mm512_storeu_si512(dst + i * 64, w0);
        _mm512_storeu_si512(dst + i * 64 + 32, w1);
    }
    return 1.0f;
#else
    // codes in the bf16 layout's own order: each sign-extended to 16 bits, its 7 exponent and mantissa bits shifted to
    // bf16 bits 10..4 and the sign kept: the bf16 of the value times 2^-120 (avx2.h, load_weights)
    const __m256i m = _mm256_set1_epi16((short)0x87F0);
    for (int i = 0; i < 4 * n; ++i) {
        const __m256i s = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(codes + 16 * i)));
        _mm256_storeu_si256((__m256i*)(dst + 16 * i), _mm256_and_si256(_mm256_slli_epi16(s, 4), m));
    }
    return 0x1p120f;
#endif
}

// One panel (its pair-rows at src: bf16 packed layout, or FP8 codes) -> out rows 0 .. cols - 1 (the panel's first
// `cols` columns; stride K).
template <bool FP8>
static void unpack_panel(const void* src, int64_t kp, int64_t K, int cols, const float* scale, float* out) {
    alignas(64) uint16_t decoded[UNPACK_BLOCK * 64];
    alignas(32) float tail[2 * UNPACK_BLOCK];
    const int64_t pairs = kp / 2;
    for (int64_t kk0 = 0; kk0 < pairs; kk0 += UNPACK_BLOCK) {
        const int n = (int)(pairs - kk0 < UNPACK_BLOCK ? pairs - kk0 : UNPACK_BLOCK);
        const uint16_t* block;
        float pre = 1.0f;
        if (FP8) {
            pre = decode_pair_rows_fp8((const uint8_t*)src + kk0 * 64, n, decoded);
            block = decoded;
        } else {
            block = (const uint16_t*)src + kk0 * 64;
        }
        if (n < UNPACK_BLOCK) {   // the last, short block: the missing pair-rows as zeros (their columns not stored)
            if (!FP8) {
                memcpy(decoded, block, (size_t)n * 128);
                block = decoded;
            }
            memset(decoded + n * 64, 0, (size_t)(UNPACK_BLOCK - n) * 128);
        }
        const int64_t k0 = 2 * kk0;
        const bool whole = k0 + 2 * UNPACK_BLOCK <= K;   // every one of the block's 16 values is a column of out
        for (int g = 0; g < PANEL / 8; ++g) {
            if (8 * g >= cols) break;
            __m256i t[8];
            transpose8x8((const uint32_t*)block + 8 * g, 32, t);
            for (int c = 0; c < 8 && 8 * g + c < cols; ++c) {
                const int col = 8 * g + c;
                const float s = FP8 ? scale[col] : 1.0f;
                if (whole) {
                    widen16(t[c], pre, s, FP8, out + col * K + k0);
                } else {
                    widen16(t[c], pre, s, FP8, tail);
                    memcpy(out + col * K + k0, tail, (size_t)(K - k0) * 4);
                }
            }
        }
    }
}

// kv8_unpack (FP8 false) and kv8_unpack_fp8, on checked arguments.
template <bool FP8>
static int unpack(const kv8_unpack_call& call) {
    const int64_t K = call.in_features, kp = (K + 1) & ~(int64_t)1;
    const int64_t p0 = call.first / PANEL, panels = (call.rows + PANEL - 1) / PANEL;
    const int64_t panel_bytes = (int64_t)PANEL * kp * (FP8 ? 1 : 2);
    const int threads = (int)(panels < call.num_threads ? panels : call.num_threads);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t p = 0; p < panels; ++p) {
        const int64_t r0 = p * PANEL;
        const int cols = (int)(call.rows - r0 < PANEL ? call.rows - r0 : PANEL);
        unpack_panel<FP8>((const uint8_t*)call.packed + (p0 + p) * panel_bytes, kp, K, cols,
                          FP8 ? call.scale + call.first + r0 : nullptr, call.out + r0 * K);
    }
    return OK;
}

#endif
