// Elementwise parts of a decoder layer. Included once, by dense.cpp, before linear.h (whose gated
// epilogue uses the bf16 helpers below).
#pragma once

// ------------------------------------------------------------------------------------------------
// Elementwise parts of a decoder layer, bf16 in and out, fp32 arithmetic, rounded where torch's bf16
// ops round (so results match the torch code they replace up to the last bit of exp / rsqrt / the order
// of a row's sum of squares). Rows are split across threads when a call is large enough to pay for it.
// ------------------------------------------------------------------------------------------------

static const int64_t PARALLEL_MIN = 1 << 16;  // elements below which one thread does the whole call

// ---- the contracts, whatever the path (these kernels and avx2.h's) ------------------------------------------------
// check_args: ERR_ARGS for invalid arguments, else OK; the pointers are checked only where rows > 0 (an empty batch
// may pass NULL ones: abi.h). dense.cpp's entry points call it, and return before the kernel for an empty batch, so a
// kernel runs on checked arguments and rows > 0. threads_for: how many of the call's threads a kernel uses.

// One thread below PARALLEL_MIN elements of work, else the call's.
static inline int threads_for(int64_t elements, int num_threads) { return elements < PARALLEL_MIN ? 1 : num_threads; }

static inline int check_args(const kv8_rmsnorm_call& c) {
    if (c.rows < 0 || c.hidden <= 0 || c.num_threads <= 0) return ERR_ARGS;
    return c.rows > 0 && (!c.x || !c.weight || !c.out) ? ERR_ARGS : OK;
}
static inline int threads_for(const kv8_rmsnorm_call& c) { return threads_for(c.rows * c.hidden, c.num_threads); }

static inline int check_args(const kv8_silu_mul_call& c) {
    if (c.rows < 0 || c.intermediate <= 0 || c.num_threads <= 0) return ERR_ARGS;
    return c.rows > 0 && (!c.gate_up || !c.out) ? ERR_ARGS : OK;
}
static inline int threads_for(const kv8_silu_mul_call& c) { return threads_for(c.rows * c.intermediate, c.num_threads); }

static inline int check_args(const kv8_rope_call& c) {
    if (c.rows < 0 || c.num_heads <= 0 || c.num_kv_heads <= 0 || c.head_dim <= 0 || c.head_dim % 2 ||
        c.row_stride < (int64_t)(c.num_heads + 2 * c.num_kv_heads) * c.head_dim || c.num_threads <= 0)
        return ERR_ARGS;
    return c.rows > 0 && (!c.qkv || !c.cos || !c.sin || !c.q_out || !c.k_out || !c.v_out) ? ERR_ARGS : OK;
}
static inline int threads_for(const kv8_rope_call& c) {
    return threads_for(c.rows * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.num_threads);
}

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
        for (int64_t i = 0; i < I; i += 16) {
            const __mmask16 m = tail_mask(I - i);
            __m512 a = bf16x16_to_f32_mask(g + i, m);
            __m512 s = round_bf16(_mm512_div_ps(a, _mm512_add_ps(_mm512_set1_ps(1.0f),
                                                                 exp_ps(_mm512_sub_ps(_mm512_setzero_ps(), a)))));
            store_bf16(out + t * I + i, _mm512_mul_ps(s, bf16x16_to_f32_mask(u + i, m)), m);
        }
    }
    return OK;
}

// kv8_rope_qkv: rotate-half RoPE of q and k read from packed projection rows, plus a copy of v, into contiguous
// outputs (see kv8_rope_call), T rows, Hq query and Hkv KV heads of D channels. The angles' cos/sin are, like torch's,
// first rounded to bf16, then out = bf16(bf16(x * c) + bf16(rot(x) * s)) with rot(x) = (-x2, x1).
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
    return OK;
}
#endif
