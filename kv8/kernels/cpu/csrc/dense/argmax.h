// Row argmax of float32 logits, for greedy decoding and the sampler's exponential race. Included once, by
// dense.cpp, after elementwise.h (tail_mask, PARALLEL_MIN).
//
// Why: torch.argmax(dim=-1) on CPU reads a [B, 49152] float32 row at ~1.6 GB/s on this project's machine
// (1.3-1.6 ms at B = 32, ~2% of a decode step); this kernel streams it with AVX-512 compares.
//
// Semantics (torch.argmax's on rows without NaN): out[b] = the lowest index i with x[b, i] equal to the row's
// maximum; -inf and +inf entries compare as usual; a row of -inf only gives 0. A NaN entry is never chosen
// (torch would return the first NaN): callers pass rows whose maximum is finite, or +inf.
//
// How: 16 lanes each keep their running maximum and its first index (a strict > comparison keeps the first
// of equal values within a lane); the row's result is the lowest index among the lanes holding the maximum.
#pragma once

// The contract, whatever the path (this kernel and avx2.h's; see elementwise.h's check_args).
static inline int check_args(const kv8_argmax_call& c) {
    if (c.rows < 0 || c.cols <= 0 || c.cols > INT32_MAX || c.num_threads <= 0) return ERR_ARGS;
    return c.rows > 0 && (!c.x || !c.out) ? ERR_ARGS : OK;
}
static inline int threads_for(const kv8_argmax_call& c) { return threads_for(c.rows * c.cols, c.num_threads); }

#if KV8_LINEAR_FAST
// kv8_argmax_rows: the argmax of each of B rows of V values (see kv8_argmax_call).
static int argmax_rows(const kv8_argmax_call& call) {
    const float* x = call.x;
    int64_t* out = call.out;
    const int64_t B = call.rows, V = call.cols;
    const int threads = threads_for(call);
#pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < B; ++b) {
        const float* row = x + b * V;
        __m512 best = _mm512_set1_ps(-INFINITY);
        __m512i where = _mm512_setzero_si512();
        __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
        const __m512i step = _mm512_set1_epi32(16);
        for (int64_t i = 0; i < V; i += 16) {
            const __m512 v = _mm512_maskz_loadu_ps(tail_mask(V - i), row + i);   // past the end: 0, masked below
            const __mmask16 gt = _mm512_mask_cmp_ps_mask(tail_mask(V - i), v, best, _CMP_GT_OQ);
            best = _mm512_mask_mov_ps(best, gt, v);
            where = _mm512_mask_mov_epi32(where, gt, idx);
            idx = _mm512_add_epi32(idx, step);
        }
        const float m = _mm512_reduce_max_ps(best);
        const __mmask16 at = _mm512_cmp_ps_mask(best, _mm512_set1_ps(m), _CMP_EQ_OQ);
        out[b] = at ? (int64_t)_mm512_mask_reduce_min_epi32(at, where) : 0;   // (at is never empty: no NaN)
    }
    return OK;
}
#endif
