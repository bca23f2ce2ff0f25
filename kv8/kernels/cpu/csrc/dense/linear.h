// Packed bf16 linear layer (see dense.cpp for the layout, numerics and invariants). Included once,
// by dense.cpp, after elementwise.h (its bf16 helpers serve the gated epilogue).
//
// Gated (SiLU(gate) * up fused into the gate/up projection): the packed matrix holds the gate and up rows
// interleaved in groups of 16 -- panel p = gate outputs 16p..16p+15, then up outputs 16p..16p+15 -- so the
// two accumulators of a panel hold matching gate and up columns, and the epilogue writes
// bf16(bf16(silu(g)) * u) with g and u first rounded to bf16 -- exactly what the unfused linear followed by
// kv8_silu_mul computes, without writing and re-reading the [M, 2I] projection.
#pragma once

static const int PANEL = 32;  // output columns per panel (two zmm registers of fp32 accumulators)
static const int64_t ROW_CHUNK = 192;  // rows of x per pass over the weights (x chunk stays in L2)
static const int FP8_PREFETCH_STEPS = 8;  // FP8 panels read once: k steps of codes prefetched (4..24 measured)
static const int FP8_AHEAD_PANELS = 1;  // vdpbf16ps path, codes in registers: the panel whose codes stream into L2
// vdpbf16ps path: up to the call's fp8_register_rows, FP8 pair-rows are decoded in registers for every block of rows
// (micro_fp8), beyond it a group of panels at a time into a buffer. Which wins depends on the CPU: on an AMD EPYC
// (Zen 5), SmolLM2's 30 layers, 2 threads, in registers ran 1.9x the buffer at M = 1-10, 1.3x at 32, 1.06x at 192;
// on an Intel Xeon without AMX the buffer wins from 32 rows (docs/benchmarks.md).
// FP8 weights with several chunks of rows (prefill): a thread decodes this many bytes of its panels (bf16) at a
// time and passes every chunk over them, so each panel is decoded once per call, not once per chunk.
static const int64_t FP8_GROUP_BYTES = 1 << 20;

// Panels decoded at a time by a thread (FP8; see FP8_GROUP_BYTES): one where the call has one chunk of rows (the
// panel is decoded once anyway and its bf16 stays in L1), else as many as FP8_GROUP_BYTES holds, rounded down to
// a multiple of `align` (the vdpbf16ps path walks panels in pairs), at least `align`.
static inline int64_t fp8_group(int64_t M, int64_t kp, int64_t align) {
    if (M <= ROW_CHUNK) return align;
    const int64_t fit = FP8_GROUP_BYTES / (PANEL * kp * 2) / align * align;
    return fit > align ? fit : align;
}

// kv8_linear_packed_size: the number of values of the packed layout of call's matrix (only its shape is read), or -1
// for an empty shape.
static int64_t packed_size(const kv8_pack_call& call) {
    const int64_t N = call.out_features, K = call.in_features;
    if (N <= 0 || K <= 0) return -1;
    int64_t kp = (K + 1) & ~(int64_t)1;
    int64_t np = (N + PANEL - 1) / PANEL * PANEL;
    return np * kp;
}

// kv8_linear_pack: packed[p][kk][c][j] = W[p*32 + c, 2*kk + j] (zero outside W), for W = call's weight [N, K].
static int pack(const kv8_pack_call& call) {
    const uint16_t* w = call.weight;
    uint16_t* packed = call.packed;
    const int64_t N = call.out_features, K = call.in_features;
    if (!w || !packed || N <= 0 || K <= 0) return ERR_ARGS;
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
    return OK;
}

// ---- the contract of kv8_linear / kv8_linear_fp8, whatever the path (the kernels below and avx2.h's) ---------------
// check_args as elementwise.h's; fp8: kv8_linear_fp8, which needs a scale per packed row (kv8_linear takes none).
static inline int check_args(const kv8_linear_call& c, bool fp8) {
    if (c.rows < 0 || c.in_features <= 0 || c.out_features <= 0 || c.num_threads <= 0 || (!fp8 && c.scale) ||
        c.fp8_register_rows < 0)
        return ERR_ARGS;
    return c.rows > 0 && (!c.x || !c.packed || (fp8 && !c.scale) || !c.out) ? ERR_ARGS : OK;
}
// The panels of N outputs (gated: each panel gives 16 outputs, see the top of this file), which a call's threads
// share in contiguous runs: one thread per panel at most.
static inline int64_t linear_panels(int64_t N, bool gated) { return gated ? (N + 15) / 16 : (N + PANEL - 1) / PANEL; }
static inline int64_t linear_panels(const kv8_linear_call& c) { return linear_panels(c.out_features, c.gated != 0); }
static inline int threads_for(const kv8_linear_call& c) {
    const int64_t panels = linear_panels(c);
    return (int)(panels < c.num_threads ? panels : c.num_threads);
}

#if KV8_LINEAR_FAST
static inline __mmask16 lane_mask(int n) {  // the first n (clamped to 0..16) of 16 lanes
    return n >= 16 ? (__mmask16)0xFFFF : n <= 0 ? (__mmask16)0 : (__mmask16)((1u << n) - 1);
}

// The epilogue of one output row: the 32 * NP fp32 sums acc[v] (columns n0 + 16 v on) -> bf16 in out_row,
// only columns below N. GATED: each panel's two accumulators are 16 gate and the matching 16 up columns (see
// the top of this file), giving 16 outputs from column n0 / 2 + 16 q on.
template <int NP, bool GATED>
static inline void store_row(const __m512* acc, const float* bias, const float* scale, int64_t n0, int64_t N,
                             uint16_t* out_row) {
    if (GATED) {
        for (int q = 0; q < NP; ++q) {
            const int64_t c0 = n0 / 2 + 16 * q;   // output column of the panel's first gate/up pair
            const __mmask16 m = lane_mask((int)(N - c0 < 16 ? N - c0 : 16));
            if (!m) break;
            const int64_t b0 = n0 + (int64_t)PANEL * q;   // the panel's bias: 16 gate values, then 16 up values
            const __m512 bg = bias ? _mm512_loadu_ps(bias + b0) : _mm512_setzero_ps();
            const __m512 bu = bias ? _mm512_loadu_ps(bias + b0 + 16) : _mm512_setzero_ps();
            const __m512 sg = scale ? _mm512_loadu_ps(scale + b0) : _mm512_set1_ps(1.0f);
            const __m512 su = scale ? _mm512_loadu_ps(scale + b0 + 16) : _mm512_set1_ps(1.0f);
            const __m512 g = round_bf16(_mm512_fmadd_ps(acc[2 * q], sg, bg));
            const __m512 u = round_bf16(_mm512_fmadd_ps(acc[2 * q + 1], su, bu));
            const __m512 act = round_bf16(_mm512_div_ps(
                g, _mm512_add_ps(_mm512_set1_ps(1.0f), exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), g)))));
            store_bf16(out_row + c0, _mm512_mul_ps(act, u), m);
        }
        return;
    }
    for (int v = 0; v < 2 * NP; ++v) {
        const int64_t c0 = n0 + 16 * v;
        const __mmask16 m = lane_mask((int)(N - c0 < 16 ? N - c0 : 16));
        if (!m) break;
        const __m512 bv = bias ? _mm512_maskz_loadu_ps(m, bias + c0) : _mm512_setzero_ps();
        const __m512 sv = scale ? _mm512_maskz_loadu_ps(m, scale + c0) : _mm512_set1_ps(1.0f);
        const __m256i y = (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(acc[v], sv, bv));
        _mm256_mask_storeu_epi16(out_row + c0, m, y);
    }
}

// MR rows of x (stride K) times NP adjacent panels (NP = 1 or 2, i.e. 32 or 64 columns starting at n0) ->
// MR x 32*NP outputs; only columns below N are stored. GATED: N is the output width I, each panel gives 16
// outputs from n0 / 2 on (see the top of this file), and out rows have stride I.
template <int MR, int NP, bool GATED>
static inline void micro(const uint16_t* x, int64_t K, const uint16_t* panel, int64_t kp, const float* bias,
                         const float* scale, int64_t n0, int64_t N, uint16_t* out, const uint16_t* pf, int pf_first,
                         int pf_step) {
    constexpr int NV = 2 * NP;  // zmm accumulators per row
    __m512 acc[MR][NV];
    for (int r = 0; r < MR; ++r)
        for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_setzero_ps();
    const int64_t pairs = kp / 2;
    const int64_t full = K / 2;  // pairs whose two x values both exist (K even: all of them)
    const int64_t panel_stride = (int64_t)PANEL * kp;
    int64_t pf_next = pf ? pf_first : pairs;  // next pair index whose lines of the next panels to prefetch
    // The x pairs are broadcast straight from memory (a load, no vector-ALU work): on Zen 4 a broadcast from a
    // general register costs vector-pipe slots that the vdpbf16ps need (measured ~20% of the M = 32 time). The
    // main loop covers the full pairs; an odd K leaves one pair with a single x value (its weight partner is
    // zero), done after it.
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
        if (kk < full) {
            for (int r = 0; r < MR; ++r) {
                const __m512bh b = (__m512bh)_mm512_broadcastd_epi32(_mm_loadu_si32(x + r * K + 2 * kk));
                for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], w[v], b);
            }
        } else {
            for (int r = 0; r < MR; ++r) {
                const __m512bh b = (__m512bh)_mm512_set1_epi32((int32_t)x[r * K + 2 * kk]);
                for (int v = 0; v < NV; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], w[v], b);
            }
        }
    }
    for (int r = 0; r < MR; ++r) store_row<NP, GATED>(acc[r], bias, scale, n0, N, out + r * N);
}

typedef void (*MicroFn)(const uint16_t*, int64_t, const uint16_t*, int64_t, const float*, const float*, int64_t,
                        int64_t, uint16_t*, const uint16_t*, int, int);
static const int MAX_MR1 = 12;  // one panel: 24 accumulators + 2 weights + 1 broadcast registers
static const int MAX_MR2 = 6;   // two panels: 24 accumulators + 4 weights + 1 broadcast
template <bool G>
static const MicroFn MICRO1[MAX_MR1 + 1] = {nullptr, micro<1, 1, G>, micro<2, 1, G>, micro<3, 1, G>, micro<4, 1, G>,
                                            micro<5, 1, G>, micro<6, 1, G>, micro<7, 1, G>, micro<8, 1, G>,
                                            micro<9, 1, G>, micro<10, 1, G>, micro<11, 1, G>, micro<12, 1, G>};
template <bool G>
static const MicroFn MICRO2[MAX_MR2 + 1] = {nullptr, micro<1, 2, G>, micro<2, 2, G>, micro<3, 2, G>, micro<4, 2, G>,
                                            micro<5, 2, G>, micro<6, 2, G>};

// Rows [0, M) in nearly equal blocks of at most max_mr rows, each through table[rows]; the blocks share the
// prefetch of the panels at `next` (NULL: none) into L2, block b taking the pairs kk = b mod blocks. out rows
// have stride N.
static inline void row_blocks(const MicroFn* table, int max_mr, const uint16_t* x, int64_t M, int64_t K,
                              const uint16_t* panel, int64_t kp, const float* bias, const float* scale, int64_t n0,
                              int64_t N, uint16_t* out, const uint16_t* next) {
    const int64_t nblk = (M + max_mr - 1) / max_mr;
    const int64_t base = M / nblk, extra = M % nblk;
    int64_t r0 = 0;
    for (int64_t b = 0; b < nblk; ++b) {
        const int mr = (int)(base + (b < extra ? 1 : 0));
        table[mr](x + r0 * K, K, panel, kp, bias, scale, n0, N, out + r0 * N, next, (int)b, (int)nblk);
        r0 += mr;
    }
}
#endif

#if KV8_LINEAR_FAST
// FP8 (E4M3) weights: the codes of the packed layout, one byte per value, in the order fp8_table_decode
// (../common/fp8_bf16.h) turns into the bf16 packed layout (kv8_linear_fp8). Byte b of a pair-row's 64 codes holds
// bf16 value v(b) = 8 (b / 16) + b % 8 for b % 16 < 8, else 32 + 8 (b / 16) + b % 8 -- the decode's lane order --
// so one 64-byte load decodes into the pair-row's 32 + 32 bf16 values (columns 0..15, then 16..31). The tables are
// the E4M3 (fn) row's of the format table (../common/kv8_abi.h); its NaN, 0x7F, is never produced by the quantizer
// (it saturates).

// `panels` adjacent packed FP8 panels at src (each kp / 2 pair-rows of 64 codes) -> the bf16 packed layout
// at dst (the same panels, 64 bf16 per pair-row). ahead (or NULL): as many 64-byte lines from there are
// prefetched into L2, one beside each pair-row decoded (spread over the decode, they overlap it; a burst of them
// stalls the core until line-fill buffers free).
static inline void decode_panels_fp8(const uint8_t* src, int64_t panels, int64_t kp, uint16_t* dst,
                                     const char* ahead = nullptr) {
    static const Fp8Tables L = fp8_tables(KV_E4M3);
    const int64_t rows = panels * kp / 2;
    for (int64_t i = 0; i < rows; ++i) {
        if (ahead) _mm_prefetch(ahead + i * 64, _MM_HINT_T1);
        __m512i w0, w1;
        fp8_table_decode<KV_FORMATS[KV_E4M3].nan_0x80>(_mm512_loadu_si512(src + i * 64), L, w0, w1);
        _mm512_store_si512(dst + i * 64, w0);
        _mm512_store_si512(dst + i * 64 + 32, w1);
    }
}
#endif

#if KV8_LINEAR_FAST
// FP8 weights for at most MAX_MR_FP8 rows (decode batches) on the vdpbf16ps path: MR rows of x times one packed
// FP8 panel (32 columns from n0), each pair-row's 64 codes decoded in registers right before its vdpbf16ps, so the
// decoded bf16 never goes to memory (a decoded panel is used once here: writing it to a buffer and reading it back
// cost more than the bytes FP8 saves). `ahead`: the codes of a later panel, prefetched into L2 one line per pair-row.
// The sums are those of micro<MR, 1, GATED> on the decoded panel, in the same order: the same bits.
static const int MAX_MR_FP8 = 10;  // 20 accumulators + 2 weights + 4 tables + 1 broadcast + decode temporaries
template <int MR, bool GATED>
static inline void micro_fp8(const uint16_t* x, int64_t K, const uint8_t* codes, int64_t kp, const float* bias,
                             const float* scale, int64_t n0, int64_t N, uint16_t* out, const uint8_t* ahead) {
    static const Fp8Tables L = fp8_tables(KV_E4M3);
    __m512 acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    const int64_t pairs = kp / 2, full = K / 2;
    for (int64_t kk = 0; kk < pairs; ++kk) {
        if (ahead) _mm_prefetch((const char*)ahead + kk * 64, _MM_HINT_T1);
        __m512i w0, w1;
        fp8_table_decode<KV_FORMATS[KV_E4M3].nan_0x80>(_mm512_loadu_si512(codes + kk * 64), L, w0, w1);
        for (int r = 0; r < MR; ++r) {
            const __m512bh b = kk < full ? (__m512bh)_mm512_broadcastd_epi32(_mm_loadu_si32(x + r * K + 2 * kk))
                                         : (__m512bh)_mm512_set1_epi32((int32_t)x[r * K + 2 * kk]);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], (__m512bh)w0, b);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], (__m512bh)w1, b);
        }
    }
    for (int r = 0; r < MR; ++r) store_row<1, GATED>(acc[r], bias, scale, n0, N, out + r * N);
}

typedef void (*MicroFp8Fn)(const uint16_t*, int64_t, const uint8_t*, int64_t, const float*, const float*, int64_t,
                           int64_t, uint16_t*, const uint8_t*);
template <bool G>
static const MicroFp8Fn MICRO_FP8[MAX_MR_FP8 + 1] = {
    nullptr, micro_fp8<1, G>, micro_fp8<2, G>, micro_fp8<3, G>, micro_fp8<4, G>, micro_fp8<5, G>, micro_fp8<6, G>,
    micro_fp8<7, G>, micro_fp8<8, G>, micro_fp8<9, G>, micro_fp8<10, G>};
#endif

#if KV8_LINEAR_AMX
// AMX (Intel AMX-BF16): the same packed layout is the tile operand. For a pair-row kk, columns 0..15 of a panel
// are its first 64 bytes and columns 16..31 the next 64, so a B tile (16 pair-rows x 16 columns, the pair order
// tdpbf16ps wants) is read in place with a row stride of 128 bytes; an A tile is 16 rows x 32 values of x read
// in place (stride 2K bytes, hence K % 32 == 0). Tiles 0..3: C (fp32 16 x 16; A tile a times B half b -> tile
// 2a + b), 4..5: A, 6..7: B. Products of bf16 are exact; the fp32 sums run in k order, 16 pairs per
// instruction, so a row's result does not depend on M (a tile's other rows are other rows of x or zeros) -- but it
// is not bit-identical to the vdpbf16ps path (another order of fp32 additions): a DenseKernels instance picks
// one path for good (kv8_linear's use_amx), so each layer computes every row the same way at every batch size.

// A block of at most 32 rows x one panel whose fp32 sums wait in a buffer (row stride 32) for their epilogue:
// rows r0 .. r0 + rows - 1 of the output, columns from n0 (rows = 0: none).
struct PendingBlock {
    const float* c;
    int rows;
    int64_t r0, n0;
};

// The epilogue (store_row) of rows [from, to) of a pending block.
template <bool GATED>
static inline void finish_rows(const PendingBlock& b, int from, int to, const float* bias, const float* scale,
                               int64_t N, uint16_t* out) {
    for (int r = from; r < to; ++r) {
        const __m512 acc[2] = {_mm512_load_ps(b.c + r * 32), _mm512_load_ps(b.c + r * 32 + 16)};
        store_row<1, GATED>(acc, bias, scale, b.n0, N, out + (b.r0 + r) * N);
    }
}

// cbuf (16 MB rows x 32 fp32, row stride 32) = 16 MB rows of x (stride K) x one panel, while the epilogue of
// the previous block (`prev`) runs a few rows after each k step: its vector work (bf16 conversion, the gated
// SiLU) overlaps the tile multiplies instead of following them while the tiles idle. Every row of prev is
// finished when this returns. x's tiles are loaded with the streaming hint (tileloaddt1): they come from L2 and
// leave L1 to the panel, which the chunk's other row blocks read again. ONCE (M <= 32: this block is the only
// one that reads the panel): the panel's tiles are streamed too. (Software prefetch of the panel stream, 4-16 KiB
// ahead into L1 or L2, measured no faster: the hardware prefetchers follow it.) codes (FP8 weights, a panel read
// once): the panel's E4M3 codes, decoded one k step ahead into two 2 KiB buffers that the B tiles load from
// (`panel` unused), so the decode overlaps the tile multiplies and its output stays in L1.
template <int MB, bool GATED, bool ONCE>
static inline void amx_panel(const uint16_t* x, int64_t K, const uint16_t* panel, float* cbuf,
                             const PendingBlock& prev, const float* bias, const float* scale, int64_t N,
                             uint16_t* out, const uint8_t* codes = nullptr) {
    alignas(64) uint16_t steps[2][16 * 64];   // codes: the decoded pair-rows of a k step (16 of 64 bf16)
    if (codes) decode_panels_fp8(codes, 1, 32, steps[0]);
    _tile_zero(0);
    _tile_zero(1);
    if (MB == 2) {
        _tile_zero(2);
        _tile_zero(3);
    }
    const size_t xs = (size_t)K * 2;
    const int per_step = (int)((prev.rows + K / 32 - 1) / (K / 32));   // rows of prev finished per k step
    int done = 0;
    for (int64_t k0 = 0; k0 < K; k0 += 32) {
        const uint16_t* b = codes ? steps[(k0 / 32) & 1] : panel + k0 * 32;  // pair-row k0 / 2
        if (ONCE && !codes) {   // (decoded codes stay in L1 for the next step's decode: no streaming hint)
            _tile_stream_loadd(6, b, 128);
            _tile_stream_loadd(7, b + 32, 128);
        } else {
            _tile_loadd(6, b, 128);
            _tile_loadd(7, b + 32, 128);
        }
        _tile_stream_loadd(4, x + k0, xs);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (MB == 2) {
            _tile_stream_loadd(5, x + 16 * K + k0, xs);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
        if (codes && k0 + 32 < K) {   // and the codes FP8_PREFETCH_STEPS k steps ahead into L2 (past a panel: the next)
            const char* ahead = (const char*)codes + (k0 + 32 * FP8_PREFETCH_STEPS) * 32;
            decode_panels_fp8(codes + (k0 + 32) * 32, 1, 32, steps[((k0 / 32) + 1) & 1], ahead);
        }
        if (done < prev.rows) {
            const int to = done + per_step < prev.rows ? done + per_step : prev.rows;
            finish_rows<GATED>(prev, done, to, bias, scale, N, out);
            done = to;
        }
    }
    _tile_stored(0, cbuf, 128);
    _tile_stored(1, cbuf + 16, 128);
    if (MB == 2) {
        _tile_stored(2, cbuf + 16 * 32, 128);
        _tile_stored(3, cbuf + 16 * 32 + 16, 128);
    }
}

// kv8_linear with AMX tiles (K % 32 == 0). Threads take contiguous runs of panels as the vdpbf16ps path does;
// per chunk of ROW_CHUNK rows each panel meets every block of 32 rows while it is in L1/L2. A block's epilogue
// runs during the next block's k steps (amx_panel; the thread's last block after its loop). M < 16: the A and
// C tiles have M rows and read x in place (decode batches; no 16-row tile work per panel); otherwise tiles
// have 16 rows and the last partial block reads a zero-padded copy of its rows.
template <bool GATED, bool FP8>
static int linear_amx(const uint16_t* x, int64_t M, int64_t K, const void* packed, int64_t N, const float* bias,
                      const float* scale, uint16_t* out, int threads) {
    const int64_t panels = linear_panels(N, GATED);
    const int64_t full = M / 32 * 32, rem = M - full;
    uint16_t* pad = nullptr;
    const int arows = M < 16 ? (int)M : 16;
    if (rem && M >= 16) {
        pad = (uint16_t*)aligned_alloc(64, (size_t)32 * K * 2);
        if (!pad) return ERR_OOM;
        memcpy(pad, x + full * K, (size_t)rem * K * 2);
        memset(pad + rem * K, 0, (size_t)(32 - rem) * K * 2);
    }
    const bool once = M <= 32;  // one row block per panel: the panel is read once (amx_panel's ONCE)
    // FP8 with several row blocks per panel: each thread decodes `group` panels at a time into its buffer, and
    // every chunk of rows passes over them (one group: the order of the bf16 path, chunks outside panels).
    const int64_t group = FP8 && !once ? fp8_group(M, K, 1) : panels;
    uint16_t* decoded = nullptr;
    if (FP8 && !once && !(decoded = (uint16_t*)aligned_alloc(64, (size_t)threads * group * PANEL * K * 2))) {
        free(pad);
        return ERR_OOM;
    }
#pragma omp parallel num_threads(threads)
    {
        amx_load_config(arows, 6);  // A and C tiles (0..5) of arows rows, B tiles of 16
        alignas(64) float cbuf[2][32 * 32];   // a block's sums, and the previous block's awaiting its epilogue
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        uint16_t* dec = decoded ? decoded + (size_t)t * group * PANEL * K : nullptr;
        PendingBlock prev = {nullptr, 0, 0, 0};
        int cur = 0;
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        for (int64_t g0 = p0; g0 < p1; g0 += group) {
            const int64_t g1 = p1 - g0 < group ? p1 : g0 + group;
            if (dec) decode_panels_fp8((const uint8_t*)packed + g0 * PANEL * K, g1 - g0, K, dec);
            for (int64_t m0 = 0; m0 < M; m0 += ROW_CHUNK) {
                const int64_t m1 = M - m0 < ROW_CHUNK ? M : m0 + ROW_CHUNK;
                for (int64_t p = g0; p < g1; ++p) {
                    const uint16_t* panel = dec ? dec + (p - g0) * PANEL * K : (const uint16_t*)packed + p * PANEL * K;
                    const uint8_t* codes = FP8 && once ? (const uint8_t*)packed + p * PANEL * K : nullptr;
                    for (int64_t r0 = m0; r0 < m1; r0 += 32) {
                        const int n = (int)(M - r0 < 32 ? M - r0 : 32);
                        const uint16_t* src = r0 < full || !pad ? x + r0 * K : pad;
                        float* c = cbuf[cur];
                        if (n > 16 && once)
                            amx_panel<2, GATED, true>(src, K, panel, c, prev, bias, scale, N, out, codes);
                        else if (n > 16) amx_panel<2, GATED, false>(src, K, panel, c, prev, bias, scale, N, out);
                        else if (once) amx_panel<1, GATED, true>(src, K, panel, c, prev, bias, scale, N, out, codes);
                        else amx_panel<1, GATED, false>(src, K, panel, c, prev, bias, scale, N, out);
                        prev = {cbuf[cur], n, r0, p * PANEL};
                        cur ^= 1;
                    }
                }
            }
        }
        finish_rows<GATED>(prev, 0, prev.rows, bias, scale, N, out);
        _tile_release();
    }
    free(pad);
    free(decoded);
    return OK;
}
#endif

#if KV8_LINEAR_FAST
// The vdpbf16ps path of kv8_linear / kv8_linear_fp8 (see there).
template <bool FP8>
static int linear_avx512(const uint16_t* x, int64_t M, int64_t K, const void* packed, int64_t N, const float* bias,
                         const float* scale, uint16_t* out, int threads, bool gated, int64_t register_rows) {
    const int64_t kp = (K + 1) & ~(int64_t)1;
    const int64_t panels = linear_panels(N, gated);
    const MicroFn* micro1 = gated ? MICRO1<true> : MICRO1<false>;
    const MicroFn* micro2 = gated ? MICRO2<true> : MICRO2<false>;
    if (FP8 && M <= register_rows) {
        // A decode batch: each thread walks its run of panels one at a time, decoding in registers (micro_fp8),
        // the panel FP8_AHEAD_PANELS on prefetched beside.
        const MicroFp8Fn* table = gated ? MICRO_FP8<true> : MICRO_FP8<false>;
        const uint8_t* codes = (const uint8_t*)packed;
        const int64_t nblk = (M + MAX_MR_FP8 - 1) / MAX_MR_FP8, base = M / nblk, extra = M % nblk;
#pragma omp parallel num_threads(threads)
        {
            const int t = omp_get_thread_num(), nt = omp_get_num_threads();
            const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
            for (int64_t p = p0; p < p1; ++p) {
                const uint8_t* ahead = p + FP8_AHEAD_PANELS < p1 ? codes + (p + FP8_AHEAD_PANELS) * PANEL * kp
                                                                 : nullptr;
                int64_t r0 = 0;
                for (int64_t b = 0; b < nblk; ++b) {
                    const int mr = (int)(base + (b < extra ? 1 : 0));
                    table[mr](x + r0 * K, K, codes + p * PANEL * kp, kp, bias, scale, p * PANEL, N, out + r0 * N,
                              b == 0 ? ahead : nullptr);
                    r0 += mr;
                }
            }
        }
        return OK;
    }
    // FP8: each thread decodes `group` panels at a time (fp8_group: a pair where the call has one chunk of rows)
    // into its buffer, and every chunk passes over them.
    const int64_t group = FP8 ? fp8_group(M, kp, 2) : panels;
    uint16_t* decoded = nullptr;
    if (FP8 && !(decoded = (uint16_t*)aligned_alloc(64, (size_t)threads * group * PANEL * kp * 2))) return ERR_OOM;
    // Rows go in chunks of ROW_CHUNK so that a chunk of x stays in L2 while every panel passes over it.
    // Within a chunk each thread takes a contiguous run of panels and walks it two panels (64 columns) at
    // a time, one panel for an odd one left over.
#pragma omp parallel num_threads(threads)
    {
        const int t = omp_get_thread_num(), nt = omp_get_num_threads();
        const int64_t p0 = panels * t / nt, p1 = panels * (t + 1) / nt;
        uint16_t* dec = FP8 ? decoded + (size_t)t * group * PANEL * kp : nullptr;
        for (int64_t g0 = p0; g0 < p1; g0 += group) {
            const int64_t g1 = p1 - g0 < group ? p1 : g0 + group;
            if (FP8) {   // the next group's codes stream into L2 beside the decode, and arrive during the compute
                const int64_t n1 = p1 - g1 < group ? p1 : g1 + group;
                const char* ahead = g1 < p1 && n1 - g1 == g1 - g0 ? (const char*)packed + g1 * PANEL * kp : nullptr;
                decode_panels_fp8((const uint8_t*)packed + g0 * PANEL * kp, g1 - g0, kp, dec, ahead);
            }
            for (int64_t m0 = 0; m0 < M; m0 += ROW_CHUNK) {
                const int64_t rows = M - m0 < ROW_CHUNK ? M - m0 : ROW_CHUNK;
                const uint16_t* xc = x + m0 * K;
                uint16_t* oc = out + m0 * N;
                for (int64_t p = g0; p < g1; p += 2) {
                    const uint16_t* panel = FP8 ? dec + (p - g0) * PANEL * kp
                                                : (const uint16_t*)packed + p * PANEL * kp;
                    // Prefetch the next two panels while this pair computes (within the thread's run): with
                    // several row blocks per panel the compute no longer waits for DRAM. FP8: the group was
                    // decoded first (a sequential read the hardware prefetchers follow).
                    const uint16_t* next = !FP8 && p + 3 < p1 ? panel + 2 * PANEL * kp : nullptr;
                    if (p + 1 < g1) {
                        row_blocks(micro2, MAX_MR2, xc, rows, K, panel, kp, bias, scale, p * PANEL, N, oc, next);
                    } else {
                        row_blocks(micro1, MAX_MR1, xc, rows, K, panel, kp, bias, scale, p * PANEL, N, oc, nullptr);
                    }
                }
            }
        }
    }
    free(decoded);
    return OK;
}
#endif

#if KV8_LINEAR_FAST
// kv8_linear (FP8 false) and kv8_linear_fp8 (see kv8_linear_call), on checked arguments with rows > 0 (dense.cpp):
// the AMX path where this build and process have it, use_amx asks for it and K % 32 == 0, else the vdpbf16ps path.
//
// kv8_linear: out[M, N] = x[M, K] @ W^T (+ bias), W pre-packed by kv8_linear_pack (call.scale NULL). gated != 0:
// out[M, N] = the gated activation of a gate/up matrix packed interleaved (see the top of this file; N = I, the packed
// matrix has 2 * ceil(I / 16) * 16 rows and the bias, if any, as many values in the same order).
//
// kv8_linear_fp8: the same with FP8 (E4M3) weights: packed holds kv8_linear_packed_size(N, K) codes in the FP8 order
// (see decode_panels_fp8) of W_q, where W = W_q * scale per output row; scale [N] float32 (for a gated matrix: one
// value per packed row, in the interleaved order of its bias). Each pair-row is decoded to bf16 (exactly: every
// E4M3 value is a bf16) and multiplied as kv8_linear multiplies a bf16 panel: on the vdpbf16ps path in registers,
// once per block of up to MAX_MR_FP8 rows, for M <= fp8_register_rows (micro_fp8), else a group of panels at a time
// into a buffer, once per call (fp8_group); on AMX one k step ahead of the tiles (M <= 32) or once per call. The
// epilogue computes acc * scale + bias before the rounding to bf16; every path sums in the same order.
template <bool FP8>
static int linear(const kv8_linear_call& call) {
    const uint16_t* x = call.x;
    const void* packed = call.packed;
    const float *scale = call.scale, *bias = call.bias;
    uint16_t* out = call.out;
    const int64_t M = call.rows, K = call.in_features, N = call.out_features;
    const int threads = threads_for(call), gated = call.gated, use_amx = call.use_amx;
#if KV8_LINEAR_AMX
    if (use_amx && K % 32 == 0 && amx_permitted())
        return gated ? linear_amx<true, FP8>(x, M, K, packed, N, bias, scale, out, threads)
                     : linear_amx<false, FP8>(x, M, K, packed, N, bias, scale, out, threads);
#else
    (void)use_amx;
#endif
    return linear_avx512<FP8>(x, M, K, packed, N, bias, scale, out, threads, gated != 0, call.fp8_register_rows);
}
#endif
