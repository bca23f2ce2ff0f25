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
// Panels of four whole groups of every type but Q6_K, on the AVX-512 build, are instead read in the groups' own
// column order (gguf_pack_panel512): no gather and no transpose, 3.2x less time for SmolLM2's Q4_1 layers.
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

#if KV8_LINEAR_FAST
// Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q4_K panels whose 32 columns are four full groups of the kernel's layout (grp[0..3]: 8
// rows each, columns 8i .. 8i + 7 from grp[i]), read in that layout: one 32-byte section holds 4 codes of each of a
// group's 8 rows, so two groups' sections side by side are 16 columns' codes in dword lanes, and every pair-row of the
// panel's half comes from shifts of them (Q4_0 / Q4_1 / Q5_0: byte b of section i holds value 4i + b in its low nibble,
// 4i + b + 16 in its high one, Q5_0's fifth bits at bits 8b + i and 8b + i + 4 of the row's qh'; Q8_0: value 4i + b,
// signed; Q4_K: section s holds qs[4s .. 4s + 3], byte b value 64p + 4(s % 8) + b in its low nibble and 32 more in its
// high one, p = s / 8, of sub-blocks 2p and 2p + 1, whose 6-bit scales and mins are decoded per lane from the groups'
// sc_lo / m_lo / hi sections). Each value is gguf_dequantize_block's float32, bit for bit (the same products and the
// same unfused add or subtraction), rounded by vcvtne2ps2bf16 (to nearest even; NaN kept quiet with its payload's top
// bits, as gguf_bf16_16; these values are never float32 subnormals, which the instruction would flush), and vpermw
// interleaves the two values of each column into its dword. About a tenth of the instructions per value of the generic
// gather / dequantize / transpose path, which serves every other panel and type.
template <int QT>
static inline void gguf_pack_panel512(const uint8_t* const grp[4], int64_t nwb, uint32_t* dst) {
    constexpr bool K4 = QT == GGUF_Q4_K;
    constexpr bool Q5 = QT == GGUF_Q5_0;
    const int64_t unit = GGUF_UNIT[QT];
    constexpr int codes = QT == GGUF_Q4_1 ? 32 : K4 ? 128 : Q5 ? 48 : 16;   // offset of the codes' sections (8 rows)
    constexpr int sections = QT == GGUF_Q8_0 ? 8 : K4 ? 32 : 4;
    constexpr int pairs = K4 ? 128 : 16;                          // pair-rows per block
    alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                   8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
    const __m512i idx = _mm512_load_si512(order), low4 = _mm512_set1_epi32(15), one = _mm512_set1_epi32(1);
    const __m512i offset = _mm512_set1_epi32(QT == GGUF_Q4_0 ? 8 : 16);   // Q4_0: c - 8, Q5_0: c - 16
    const auto halves16 = [](const uint8_t* a, const uint8_t* b) {   // 8 float16 of each group -> 16 float32
        return _mm512_cvtph_ps(_mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128((const __m128i*)a)),
                                                       _mm_loadu_si128((const __m128i*)b), 1));
    };
    const auto bytes16 = [](const uint8_t* a, const uint8_t* b) {   // 8 bytes of each group -> 16 dword lanes
        return _mm512_cvtepu8_epi32(_mm_unpacklo_epi64(_mm_loadl_epi64((const __m128i*)a),
                                                       _mm_loadl_epi64((const __m128i*)b)));
    };
    for (int64_t w = 0; w < nwb; ++w) {
        for (int h = 0; h < 2; ++h) {   // columns 16h .. 16h + 15
            const uint8_t* a = grp[2 * h] + w * GGUF_ROWS * unit;
            const uint8_t* b = grp[2 * h + 1] + w * GGUF_ROWS * unit;
            const __m512 d = halves16(a, b);
            const __m512 m = QT == GGUF_Q4_1 || K4 ? halves16(a + 16, b + 16) : _mm512_setzero_ps();   // m, dmin
            __m512i qh = _mm512_setzero_si512();   // Q5_0: each lane's qh' (bit 8b + i: value 4i + b's fifth bit)
            if constexpr (Q5)
                qh = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(a + 16))),
                                        _mm256_loadu_si256((const __m256i*)(b + 16)), 1);
            __m512 dsub[K4 ? 8 : 1], msub[K4 ? 8 : 1];   // Q4_K: d * sc and dmin * m of each sub-block, per lane
            if constexpr (K4) {
                for (int t = 0; t < 4; ++t) {
                    const __m512i sl = bytes16(a + 32 + 8 * t, b + 32 + 8 * t);
                    const __m512i ml = bytes16(a + 64 + 8 * t, b + 64 + 8 * t);
                    const __m512i hi = bytes16(a + 96 + 8 * t, b + 96 + 8 * t);
                    const auto top = [&](int shift) {   // 2 bits of hi at `shift`, as bits 4-5
                        return _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(hi, shift), _mm512_set1_epi32(3)),
                                                 4);
                    };
                    const __m512i sc0 = _mm512_or_si512(_mm512_and_si512(sl, low4), top(0));
                    const __m512i sc1 = _mm512_or_si512(_mm512_srli_epi32(sl, 4), top(2));
                    const __m512i mn0 = _mm512_or_si512(_mm512_and_si512(ml, low4), top(4));
                    const __m512i mn1 = _mm512_or_si512(_mm512_srli_epi32(ml, 4), top(6));
                    dsub[t] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc0));
                    dsub[t + 4] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc1));
                    msub[t] = _mm512_mul_ps(m, _mm512_cvtepi32_ps(mn0));
                    msub[t + 4] = _mm512_mul_ps(m, _mm512_cvtepi32_ps(mn1));
                }
            }
            uint32_t* out = dst + w * pairs * PANEL + 16 * h;
            // pair-row kk: values (q0, q1) per column (Q4_K: of sub-block t)
            const auto emit = [&](int kk, __m512i q0, __m512i q1, int t = 0) {
                if (QT == GGUF_Q4_0 || Q5) {
                    q0 = _mm512_sub_epi32(q0, offset);
                    q1 = _mm512_sub_epi32(q1, offset);
                }
                const __m512 scale = K4 ? dsub[t] : d;
                __m512 v0 = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(q0));
                __m512 v1 = _mm512_mul_ps(scale, _mm512_cvtepi32_ps(q1));
                if (QT == GGUF_Q4_1) {
                    v0 = _mm512_add_ps(v0, m);
                    v1 = _mm512_add_ps(v1, m);
                } else if (K4) {
                    v0 = _mm512_sub_ps(v0, msub[t]);
                    v1 = _mm512_sub_ps(v1, msub[t]);
                }
                const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);   // words 0-15: v0's, 16-31: v1's
                _mm512_storeu_si512(out + kk * PANEL, _mm512_permutexvar_epi16(idx, both));
            };
            for (int i = 0; i < sections; ++i) {
                const __m512i x = _mm512_inserti64x4(
                    _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(a + codes + 32 * i))),
                    _mm256_loadu_si256((const __m256i*)(b + codes + 32 * i)), 1);
                const auto nib = [&](int k, int hi) {   // Q5_0: with the fifth bit of value 4i + k + 16 hi
                    const __m512i q = _mm512_and_si512(_mm512_srli_epi32(x, 8 * k + 4 * hi), low4);
                    if (!Q5) return q;
                    const __m512i bit = _mm512_and_si512(_mm512_srli_epi32(qh, 8 * k + i + 4 * hi), one);
                    return _mm512_or_si512(q, _mm512_slli_epi32(bit, 4));
                };
                if constexpr (QT == GGUF_Q8_0) {
                    const auto byte = [&](int k) { return _mm512_srai_epi32(_mm512_slli_epi32(x, 24 - 8 * k), 24); };
                    emit(2 * i, byte(0), byte(1));
                    emit(2 * i + 1, byte(2), byte(3));
                } else if constexpr (K4) {
                    const int p = i / 8, kk = 32 * p + 2 * (i % 8);
                    emit(kk, nib(0, 0), nib(1, 0), 2 * p);
                    emit(kk + 1, nib(2, 0), nib(3, 0), 2 * p);
                    emit(kk + 16, nib(0, 1), nib(1, 1), 2 * p + 1);
                    emit(kk + 17, nib(2, 1), nib(3, 1), 2 * p + 1);
                } else {
                    emit(2 * i, nib(0, 0), nib(1, 0));
                    emit(2 * i + 1, nib(2, 0), nib(3, 0));
                    emit(2 * i + 8, nib(0, 1), nib(1, 1));
                    emit(2 * i + 9, nib(2, 1), nib(3, 1));
                }
            }
        }
    }
}
#endif

template <int QT>
static void gguf_pack_rows(const kv8_gguf_pack_call& call) {
    const int64_t N = call.rows, K = call.in_features, values = GGUF_BLOCK_VALUES[QT];
    const int64_t unit = GGUF_UNIT[QT], nwb = K / values, row_bytes = nwb * unit, half = N / 2;
    const int threads = threads_for(call.panels * PANEL * K, call.num_threads);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t i = 0; i < call.panels; ++i) {
        const int64_t p = call.first_panel + i;
        uint32_t* dst = (uint32_t*)(call.out + i * PANEL * K);   // pair-row kk, column c: dst[kk * 32 + c]
#if KV8_LINEAR_FAST
        if constexpr (QT != GGUF_Q6_K) {
            // the columns' rows: 32p .. 32p + 31, or (gated) gate rows 16p .. 16p + 15 and up rows half + 16p ..;
            // whole groups of 8 where every row exists and each run starts a group
            const int64_t r0 = call.gated ? 16 * p : 32 * p, r2 = call.gated ? half + 16 * p : 32 * p + 16;
            if ((call.gated ? 16 * p + 16 <= half && half % GGUF_ROWS == 0 : 32 * p + 32 <= N)) {
                const uint8_t* const grp[4] = {call.blocks + r0 * row_bytes, call.blocks + (r0 + 8) * row_bytes,
                                               call.blocks + r2 * row_bytes, call.blocks + (r2 + 8) * row_bytes};
                gguf_pack_panel512<QT>(grp, nwb, dst);
                continue;
            }
        }
#endif
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
