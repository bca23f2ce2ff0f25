// GGUF blocks dequantized straight into the packed bf16 layout of linear.h (kv8_gguf_dequantize_packed), for the
// packed kernel's GEMM of long prefill calls: GGUFLinearMethod's bf16 expansion multiplies a call's rows with
// kv8_linear on the panels this writes, where it would otherwise dequantize to a float32 matrix, round that to bf16
// in a second pass and hand it to torch's GEMM (which reorders it once more, for its own tiles). Included once, by
// dense.cpp, after gguf.h and unpack.h (transpose8x8).
//
//   packed[p - first_panel][kk][c][j] = bf16(W[row(p, c), 2kk + j])   for p = first_panel .. first_panel + panels - 1
//
// W's values are gguf_dequantize's float32 (bit for bit), each rounded to bf16 to nearest even (a NaN stays a NaN):
// what torch's .to(torch.bfloat16) makes of gguf_dequantize's matrix. row(p, c) = 32p + c, zero past the last row.
// gated: W = [gate; up], rows / 2 rows each, in the gated kernel's interleaved order (linear.h; DenseKernels.
// interleave_gate_up): row(p, c) = 16p + c for c < 16 (gate), rows / 2 + 16p + c - 16 for c >= 16 (up), zero where
// 16p + c % 16 >= rows / 2. in_features is a multiple of 32 (every GGUF block), so it is its own padded width.
//
// How: a thread takes a contiguous run of panels; per panel and weight block (`values` columns: 32, Q4_K / Q6_K 256),
// each of the 32 rows is gathered from its group of 8 and dequantized to float32 (gguf.h), rounded to bf16 pairs in
// 8-lane registers, and the 32 x values / 2 dword tile is transposed 8 x 8 at a time into the panel's pair-rows.
#pragma once

#if KV8_GGUF_AVX2 && (KV8_LINEAR_FAST || KV8_LINEAR_AVX2)
#define KV8_GGUF_PACK 1
#else
#define KV8_GGUF_PACK 0
#endif

// The packed matrix's panels: 32 rows each, or (gated) 16 of each half.
static inline int64_t gguf_pack_panels(int64_t rows, bool gated) {
    return gated ? (rows / 2 + 15) / 16 : (rows + PANEL - 1) / PANEL;
}

// rows = W's rows (gated: even), the panels asked for within the packed matrix.
static inline int check_args(const kv8_gguf_pack_call& c) {
    if (c.rows < 0 || gguf_bad_shape(c.qtype, c.in_features) || c.num_threads <= 0 || c.first_panel < 0 ||
        c.panels < 0 || (c.gated != 0 && c.gated != 1) || (c.gated && c.rows % 2) ||
        c.first_panel + c.panels > gguf_pack_panels(c.rows, c.gated))
        return ERR_ARGS;
    return c.panels > 0 && (!c.blocks || !c.out) ? ERR_ARGS : OK;
}

#if KV8_GGUF_PACK

// 16 float32 (two vectors) -> 16 bf16, rounded to nearest even, NaN kept quiet (gguf_round_bf16 in 8 lanes).
static inline __m256i gguf_bf16_16(__m256 lo, __m256 hi) {
    const __m256i one = _mm256_set1_epi32(1), bias = _mm256_set1_epi32(0x7fff), abs = _mm256_set1_epi32(0x7fffffff);
    const __m256i inf = _mm256_set1_epi32(0x7f800000), quiet = _mm256_set1_epi32(0x40);
    __m256i r[2];
    const __m256 v[2] = {lo, hi};
    for (int i = 0; i < 2; ++i) {
        const __m256i u = _mm256_castps_si256(v[i]);
        const __m256i rounded = _mm256_srli_epi32(
            _mm256_add_epi32(_mm256_add_epi32(u, bias), _mm256_and_si256(_mm256_srli_epi32(u, 16), one)), 16);
        const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, abs), inf);
        r[i] = _mm256_blendv_epi8(rounded, _mm256_or_si256(_mm256_srli_epi32(u, 16), quiet), nan);
    }
    // packus works per 128-bit lane: [lo0-3 hi0-3 lo4-7 hi4-7] -> the 64-bit quarters back in order
    return _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xD8);
}

template <int QT>
static void gguf_pack_rows(const kv8_gguf_pack_call& call) {
    const int64_t N = call.rows, K = call.in_features, values = GGUF_BLOCK_VALUES[QT];
    const int64_t unit = GGUF_UNIT[QT], nwb = K / values, row_bytes = nwb * unit, half = N / 2;
    const int threads = threads_for(call.panels * PANEL * K, call.num_threads);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < call.panels; ++i) {
        const int64_t p = call.first_panel + i;
        uint32_t* dst = (uint32_t*)(call.out + i * PANEL * K);   // pair-row kk, column c: dst[kk * 32 + c]
        int64_t src[PANEL];   // W's row of each column, -1: a zero column
        for (int c = 0; c < PANEL; ++c) {
            if (call.gated) {
                const int64_t r = 16 * p + c % 16;
                src[c] = r < half ? r + (c < 16 ? 0 : half) : -1;
            } else {
                src[c] = 32 * p + c < N ? 32 * p + c : -1;
            }
        }
        alignas(32) float f[GGUF_BLOCK_VALUES[GGUF_Q4_K]];
        alignas(32) uint32_t tile[PANEL * GGUF_BLOCK_VALUES[GGUF_Q4_K] / 2];   // [c][values / 2]: bf16 pairs
        alignas(32) uint8_t canon[GGUF_UNIT_MAX];
        const int64_t pairs = values / 2;
        for (int64_t w = 0; w < nwb; ++w) {
            for (int c = 0; c < PANEL; ++c) {
                uint32_t* row = tile + c * pairs;
                if (src[c] < 0) {
                    std::memset(row, 0, (size_t)pairs * 4);
                    continue;
                }
                const int64_t n0 = src[c] / GGUF_ROWS * GGUF_ROWS;
                const int g = (int)(N - n0 < GGUF_ROWS ? N - n0 : GGUF_ROWS), r = (int)(src[c] - n0);
                gguf_gather<QT>(call.blocks + n0 * row_bytes + w * g * unit, g, r, canon);
                gguf_dequantize_block<QT>(canon, f);
                for (int64_t v = 0; v < values; v += 16)
                    _mm256_store_si256((__m256i*)(row + v / 2),
                                       gguf_bf16_16(_mm256_load_ps(f + v), _mm256_load_ps(f + v + 8)));
            }
            // the tile's 8 x 8 dword blocks: 8 columns' pairs kk0 .. kk0 + 7 -> pair-rows kk0 .. kk0 + 7 of them
            uint32_t* out = dst + w * pairs * PANEL;
            for (int c0 = 0; c0 < PANEL; c0 += 8) {
                for (int64_t kk0 = 0; kk0 < pairs; kk0 += 8) {
                    __m256i t[8];
                    transpose8x8(tile + c0 * pairs + kk0, pairs, t);
                    for (int j = 0; j < 8; ++j) _mm256_storeu_si256((__m256i*)(out + (kk0 + j) * PANEL + c0), t[j]);
                }
            }
        }
    }
}

static int gguf_dequantize_packed(const kv8_gguf_pack_call& call) {
    gguf_by_type(call.qtype, [&](auto qt) { gguf_pack_rows<decltype(qt)::value>(call); });
    return OK;
}

#endif  // KV8_GGUF_PACK
