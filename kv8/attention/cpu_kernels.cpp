// kv8 CPU kernels: fused paged attention over an 8/16/32-bit paged KV cache, and quantize-on-store.
//
// Plain C ABI (extern "C"), loaded with ctypes by kv8/attention/fused.py, compiled there with
// `g++ -O3 -march=native -fopenmp -shared -fPIC`. No torch headers: pointers and sizes only.
//
// Cache layer layout: k_cache / v_cache are [num_blocks, H_kv, block_size, D] contiguous, elements of
// `esize` bytes (uint8 FP8 codes, or bf16 / fp16 / fp32). Token `pos` of a sequence lives in block
// `block_table[pos / block_size]`, row `pos % block_size`. read = decode(code) * scale, with static scales
// (float32, element strides over (kv head, channel), 0 = broadcast) or dynamic per-token scales
// ([num_blocks, H_kv, block_size] float32 beside the codes).
//
// Two attention paths share the work decomposition (items = sequence x KV head x block of query tokens x
// context partition; OpenMP dynamic schedule, longest first; partitions combined by log-sum-exp, as
// vLLM's paged attention v2; small calls stay on one thread):
//
// * FAST (AVX-512 F/BW/VL + VBMI + BF16; KV dtype fp8 x3 or bf16; D % 16 == 0). Tiles of 16 tokens.
//   FP8 is decoded straight to bf16 by two in-register 128-entry byte tables (vpermt2b gives the low and
//   the high byte of the bf16 value, the sign bit is ORed in; every FP8 value is an exact bf16, subnormals
//   and NaN included) and multiplied with vdpbf16ps (bf16 x bf16 products are exact in fp32, fp32
//   accumulation). q is split into bf16 hi + lo parts (lo skipped when q is bf16 without a per-channel
//   K scale: it is zero), so q keeps ~16 significant bits; so do the softmax weights when the output is
//   fp32 / fp16, while for a bf16 output they are rounded to bf16 once (as precise as the output itself;
//   this halves the P.V products). The softmax scale and
//   per-tensor / per-head K scales multiply the 16 scores of a tile once; per-channel K scales fold into
//   q; V scales of any granularity multiply the output once; dynamic per-token scales multiply the scores
//   (K) and the softmax weights (V). K tiles are transposed at 128-bit granularity so a register holds 4
//   tokens x 4 partial sums (one short reduction per 16 tokens, shared by the GQA group's query heads);
//   V is paired over tokens for vdpbf16ps. Decode steps (<= 4 query rows per item) decode V directly into
//   the P.V product; prefill blocks decode each tile once into an L1 buffer used by all their rows.
//   Blocks are scattered, so K and V rows are software-prefetched two tiles ahead.
//   Decode items (bf16 compute, <= 4 rows, blocks of a multiple of 16 tokens, D = 64 / 128 / 256) take
//   run_item_decode instead: the same arithmetic with D a compile-time constant, tiles read in place
//   through one base pointer, the K decode fused into the scores, one online-softmax step per 64 tokens
//   (4 tiles) instead of per tile, and K/V prefetched into L2 six tiles ahead (~1.4x the tile loop).
// * GENERIC (any KV dtype, any D, any ISA): fp32 arithmetic, FP8 decoded on bits (E5M2 = high byte of
//   an fp16; E4M3/E4M3FNUZ shifted into an fp32 and multiplied by 2^120 / 2^119, exact for subnormals
//   because MXCSR DAZ/FTZ are cleared in every kernel thread).
//
// Store: FP8 encode is saturate(round-to-nearest-even(x / scale)) on float32 bits, NaN to the format's
// NaN code -- bit-exact with kv8.quant.formats.quantize.

#include <immintrin.h>
#include <omp.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../simd_exp.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512VBMI__) && \
    defined(__AVX512BF16__)
#define KV8_FAST 1
#else
#define KV8_FAST 0
#endif

enum { KV_E4M3 = 0, KV_E4M3FNUZ = 1, KV_E5M2 = 2, KV_BF16 = 3, KV_F16 = 4, KV_F32 = 5 };
enum { DT_BF16 = 0, DT_F16 = 1, DT_F32 = 2 };
enum { OK = 0, ERR_BLOCK_ID = 1, ERR_TABLE_WIDTH = 2, ERR_LENGTHS = 3, ERR_SLOT = 4, ERR_ARGS = 5, ERR_OOM = 6 };

static const int TILE = 16;  // context tokens per tile
static const int ROWS_PER_ITEM = 48;  // query rows (tokens x heads of a GQA group) per work item, at most
static const int64_t SMALL_WORK = 8192;  // (context tokens x query rows) below which one thread is used

// ------------------------------------------------------------------------------------------------
// Scalar helpers
// ------------------------------------------------------------------------------------------------

static inline float bits_f(uint32_t b) { float f; memcpy(&f, &b, 4); return f; }
static inline uint32_t f_bits(float f) { uint32_t b; memcpy(&b, &f, 4); return b; }
static inline float bf16_f(uint16_t h) { return bits_f((uint32_t)h << 16); }
static inline uint16_t f_bf16(float f) {  // round to nearest even; NaN -> 0x7FC0 (as c10::BFloat16)
    uint32_t b = f_bits(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return 0x7fc0;
    b += 0x7fffu + ((b >> 16) & 1u);
    return (uint16_t)(b >> 16);
}
static inline float f16_f(uint16_t h) { _Float16 x; memcpy(&x, &h, 2); return (float)x; }
static inline uint16_t f_f16(float f) { _Float16 x = (_Float16)f; uint16_t h; memcpy(&h, &x, 2); return h; }

static inline float load_f(const void* p, int dtype, int64_t i) {
    if (dtype == DT_BF16) return bf16_f(((const uint16_t*)p)[i]);
    if (dtype == DT_F16) return f16_f(((const uint16_t*)p)[i]);
    return ((const float*)p)[i];
}

// Clears DAZ and FTZ for the lifetime of the object (subnormal FP8 values must survive), restores after.
struct FpEnv {
    unsigned saved;
    FpEnv() : saved(_mm_getcsr()) { _mm_setcsr(saved & ~0x8040u); }
    ~FpEnv() { _mm_setcsr(saved); }
};

// Exact value of an FP8 code (for the tables and tests).
static float fp8_exact(int fmt, int c) {
    int mag = c & 0x7f;
    float v;
    if (fmt == KV_E4M3) {
        if (mag == 0x7f) return NAN;
        int e = mag >> 3, m = mag & 7;
        v = e ? ldexpf((float)(8 + m), e - 10) : ldexpf((float)m, -9);
    } else if (fmt == KV_E4M3FNUZ) {
        if (c == 0x80) return NAN;
        int e = mag >> 3, m = mag & 7;
        v = e ? ldexpf((float)(8 + m), e - 11) : ldexpf((float)m, -10);
    } else {
        int e = mag >> 2, m = mag & 3;
        if (e == 31) {
            if (m) return NAN;
            v = INFINITY;
        } else {
            v = e ? ldexpf((float)(4 + m), e - 17) : ldexpf((float)m, -16);
        }
    }
    return (c & 0x80) ? -v : v;
}

// FP8 decode on bits (generic path).
template <int FMT>
static inline float fp8_bits(uint32_t c) {
    if (FMT == KV_E5M2) {  // an E5M2 code is the high byte of the fp16 with the same value
        return f16_f((uint16_t)(c << 8));
    }
    uint32_t mag = c & 0x7fu, sign = (c & 0x80u) << 24;
    float v = bits_f(mag << 20) * (FMT == KV_E4M3 ? 0x1p120f : 0x1p119f);  // exponent bias 127 -> 7 or 8
    if (FMT == KV_E4M3 ? mag == 0x7f : c == 0x80) v = NAN;
    return bits_f(f_bits(v) | sign);
}

template <int KV>
static void decode_row_f32(const uint8_t* row, int D, float* out) {
    if (KV == KV_E4M3 || KV == KV_E4M3FNUZ || KV == KV_E5M2) {
        for (int d = 0; d < D; ++d) out[d] = fp8_bits<KV>(row[d]);
    } else if (KV == KV_BF16) {
        const uint16_t* r = (const uint16_t*)row;
        for (int d = 0; d < D; ++d) out[d] = bf16_f(r[d]);
    } else if (KV == KV_F16) {
        const uint16_t* r = (const uint16_t*)row;
        for (int d = 0; d < D; ++d) out[d] = f16_f(r[d]);
    } else {
        memcpy(out, row, sizeof(float) * (size_t)D);
    }
}

// FP8 encode: saturate(round_to_nearest_even(x)), NaN -> nan code (sign kept where the format has a
// negative NaN); -0 and negative values rounding to zero keep the sign where there is a negative zero.
template <int FMT>
static inline uint8_t fp8_encode(float x) {
    const int MB = FMT == KV_E5M2 ? 2 : 3;                                   // mantissa bits
    const int BIAS = FMT == KV_E4M3 ? 7 : (FMT == KV_E4M3FNUZ ? 8 : 15);
    const float MAXF = FMT == KV_E4M3 ? 448.0f : (FMT == KV_E4M3FNUZ ? 240.0f : 57344.0f);
    uint32_t b = f_bits(x);
    uint32_t sign = b >> 31;
    if ((b & 0x7fffffffu) > 0x7f800000u) {  // NaN
        if (FMT == KV_E4M3) return sign ? 0xff : 0x7f;
        if (FMT == KV_E4M3FNUZ) return 0x80;
        return sign ? 0xfe : 0x7e;
    }
    float a = bits_f(b & 0x7fffffffu);
    a = a < MAXF ? a : MAXF;
    uint32_t code;
    const float min_normal = ldexpf(1.0f, 1 - BIAS);
    if (a < min_normal) {  // subnormal range: multiple of 2^(1 - BIAS - MB), rounded to nearest even
        code = (uint32_t)nearbyintf(a * ldexpf(1.0f, BIAS - 1 + MB));
    } else {
        uint32_t ab = f_bits(a);
        const int shift = 23 - MB;
        ab += ((1u << (shift - 1)) - 1u) + ((ab >> shift) & 1u);
        int e = (int)(ab >> 23) - 127 + BIAS;
        code = ((uint32_t)e << MB) | ((ab >> shift) & ((1u << MB) - 1u));
    }
    if (sign && (code != 0 || FMT != KV_E4M3FNUZ)) code |= 0x80u;
    return (uint8_t)code;
}

// ------------------------------------------------------------------------------------------------
// Problem description, items, scratch
// ------------------------------------------------------------------------------------------------

struct Problem {
    const void* q;
    int q_dtype;
    void* out;
    int Hq, Hkv, D, G;
    const uint8_t* kc;
    const uint8_t* vc;
    int kv, esize;
    int64_t num_blocks;
    int bs;
    const float* ks;
    int64_t ks_hs, ks_ds;
    const float* vs;
    int64_t vs_hs, vs_ds;
    const float* kts;  // dynamic per-token scales [num_blocks, Hkv, bs] of this layer's K / V, or NULL
    const float* vts;
    int B;
    const int64_t* qsl;
    const int64_t* seq_lens;
    const int64_t* bt;
    int64_t bt_stride;
    float sm_scale;
    int qb;        // query tokens per item
    int bs_shift;  // log2(bs) when bs is a power of two, else -1 (divisions are slow in the tile loop)
};

static inline int64_t block_index(const Problem& P, int64_t pos) { return P.bs_shift >= 0 ? pos >> P.bs_shift : pos / P.bs; }
static inline int64_t block_offset(const Problem& P, int64_t pos) {
    return P.bs_shift >= 0 ? pos & (P.bs - 1) : pos % P.bs;
}

struct Item {
    int seq, kvh, j0, j1;  // query tokens [j0, j1) of seq
    int64_t t0, t1;        // context tokens [t0, t1), t0 a multiple of TILE
    int64_t ws;            // offset (floats) of this item's partial result in the workspace, -1: write output
    int64_t cost;
};

typedef int (*ItemFn)(const Problem&, const Item&, float*);  // runs one item; 0 or an error code

struct Scratch {  // per thread, grows, never shrinks
    void* mem = nullptr;
    size_t size = 0;
    void* get(size_t n) {
        if (n > size) {
            free(mem);
            size = (n + 4095) & ~(size_t)4095;
            mem = aligned_alloc(64, size);
            if (!mem) size = 0;
        }
        return mem;
    }
};
static thread_local Scratch tl_scratch;
static thread_local Scratch tl_workspace;

static inline size_t up64(size_t n) { return (n + 63) & ~(size_t)63; }

alignas(64) static const uint8_t ZERO_ROW[4096] = {0};  // pad rows of a partial tile (D * esize <= 4096)

// Row geometry of one item.
struct Rows {
    int R;             // rows = (j1 - j0) * G, token-major: row r is query token j0 + r / G, head kvh*G + r % G
    int64_t base;      // position of query token 0 = seq_len - q_len
    int64_t qrow0;     // flat index of query token j0 in the batch
};

static inline Rows rows_of(const Problem& P, const Item& it) {
    Rows w;
    w.R = (it.j1 - it.j0) * P.G;
    int64_t q_len = P.qsl[it.seq + 1] - P.qsl[it.seq];
    w.base = P.seq_lens[it.seq] - q_len;
    w.qrow0 = P.qsl[it.seq] + it.j0;
    return w;
}

static inline int64_t row_limit(const Problem& P, const Item& it, const Rows& w, int r) {
    return w.base + it.j0 + r / P.G;  // last visible context position (inclusive)
}

// Row pointers of one tile of K and V (pad tokens point at zeros) and, with dynamic scales, the tokens'
// K and V scales (0 for pad tokens; without dynamic scales ksc/vsc are left alone: the caller sets them to
// 1 once and only the last tile of an item can have pad tokens, where their score is masked and their
// weight is 0 anyway). Returns false on a bad block id.
static inline bool tile_rows(const Problem& P, const Item& it, int64_t t0, int n, const uint8_t** kr,
                             const uint8_t** vr, float* ksc, float* vsc) {
    const int64_t* table = P.bt + (int64_t)it.seq * P.bt_stride;
    const int64_t row_bytes = (int64_t)P.D * P.esize;
    if (P.bs % TILE == 0) {  // t0 is a multiple of TILE: the whole tile lies in one block
        int64_t blk = table[block_index(P, t0)];
        if ((uint64_t)blk >= (uint64_t)P.num_blocks) return false;
        int64_t row0 = (blk * P.Hkv + it.kvh) * P.bs + block_offset(P, t0);
        const uint8_t* kb = P.kc + row0 * row_bytes;
        const uint8_t* vb = P.vc + row0 * row_bytes;
        for (int t = 0; t < TILE; ++t) {
            kr[t] = kb + t * row_bytes;
            vr[t] = vb + t * row_bytes;
        }
        if (P.kts)
            for (int t = 0; t < n; ++t) {
                ksc[t] = P.kts[row0 + t];
                vsc[t] = P.vts[row0 + t];
            }
        for (int t = n; t < TILE; ++t) {
            kr[t] = vr[t] = ZERO_ROW;
            ksc[t] = vsc[t] = 0.0f;
        }
        return true;
    }
    for (int t = 0; t < TILE; ++t) {
        if (t < n) {
            int64_t pos = t0 + t;
            int64_t blk = table[block_index(P, pos)];
            if ((uint64_t)blk >= (uint64_t)P.num_blocks) return false;
            int64_t row = (blk * P.Hkv + it.kvh) * P.bs + block_offset(P, pos);
            kr[t] = P.kc + row * row_bytes;
            vr[t] = P.vc + row * row_bytes;
            if (P.kts) {
                ksc[t] = P.kts[row];
                vsc[t] = P.vts[row];
            }
        } else {
            kr[t] = ZERO_ROW;
            vr[t] = ZERO_ROW;
            ksc[t] = 0.0f;
            vsc[t] = 0.0f;
        }
    }
    return true;
}

// A prefetch the optimizer cannot delete (GCC 12 drops loops whose only effect is __builtin_prefetch).
static inline void prefetch_l1(const void* p) { asm volatile("prefetcht0 %0" : : "m"(*(const char*)p)); }
static inline void prefetch_l2(const void* p) { asm volatile("prefetcht1 %0" : : "m"(*(const char*)p)); }

// Software prefetch of the K and V rows (and token scales) of the tile at t0: blocks are scattered, so the
// hardware prefetchers cannot follow. Out-of-range block ids are left to tile_rows to report. L2: into L2
// (prefetcht1) rather than L1.
template <bool K = true, bool V = true, bool L2 = false>
static inline void prefetch_tile(const Problem& P, const Item& it, int64_t t0) {
    if (t0 >= it.t1) return;
    const int n = (int)(it.t1 - t0 < TILE ? it.t1 - t0 : TILE);
    const int64_t* table = P.bt + (int64_t)it.seq * P.bt_stride;
    const int64_t row_bytes = (int64_t)P.D * P.esize;
    for (int t = 0; t < n;) {
        int64_t pos = t0 + t;
        int64_t blk = table[block_index(P, pos)];
        if ((uint64_t)blk >= (uint64_t)P.num_blocks) return;
        int64_t off = block_offset(P, pos);
        int run = (int)(P.bs - off < n - t ? P.bs - off : n - t);  // rows of this tile in this block
        int64_t row = (blk * P.Hkv + it.kvh) * P.bs + off;
        const char* k = (const char*)(P.kc + row * row_bytes);
        const char* v = (const char*)(P.vc + row * row_bytes);
        for (int64_t b = 0; b < run * row_bytes; b += 64) {
            if (K) L2 ? prefetch_l2(k + b) : prefetch_l1(k + b);
            if (V) L2 ? prefetch_l2(v + b) : prefetch_l1(v + b);
        }
        if (P.kts) {
            if (K) L2 ? prefetch_l2(P.kts + row) : prefetch_l1(P.kts + row);
            if (V) L2 ? prefetch_l2(P.vts + row) : prefetch_l1(P.vts + row);
        }
        t += run;
    }
}
static const int PREFETCH_TILES = 2;  // prefetch distance (measured: 1..4 are within noise, none is 3x slower)

static inline float k_head_scale(const Problem& P, int kvh) { return P.ks ? P.ks[kvh * P.ks_hs] : 1.0f; }
static inline bool k_per_channel(const Problem& P) { return P.ks && P.ks_ds != 0; }

// Finish one row: acc (natural channel order), running max m and sum l -> output row or partial.
static void finish_row(const Problem& P, const Item& it, const Rows& w, int r, const float* acc, float m,
                       float l, float* ws) {
    const int D = P.D;
    if (it.ws >= 0) {
        float* dst = ws + it.ws + (int64_t)r * (D + 2);
        dst[0] = m;
        dst[1] = l;
        memcpy(dst + 2, acc, sizeof(float) * (size_t)D);
        return;
    }
    int h = it.kvh * P.G + r % P.G;
    int64_t qi = w.qrow0 + r / P.G;
    int64_t o = (qi * P.Hq + h) * (int64_t)D;
    float inv = 1.0f / l;
    const float* vs = P.vs ? P.vs + it.kvh * P.vs_hs : nullptr;
    for (int d = 0; d < D; ++d) {
        float x = acc[d] * inv;
        if (vs) x *= vs[d * P.vs_ds];
        if (P.q_dtype == DT_BF16) ((uint16_t*)P.out)[o + d] = f_bf16(x);
        else if (P.q_dtype == DT_F16) ((uint16_t*)P.out)[o + d] = f_f16(x);
        else ((float*)P.out)[o + d] = x;
    }
}

// ------------------------------------------------------------------------------------------------
// GENERIC path: fp32 arithmetic, any KV dtype, any head dim
// ------------------------------------------------------------------------------------------------

typedef void (*RowDecoder)(const uint8_t*, int, float*);

static int run_item_generic(const Problem& P, const Item& it, float* ws) {
    RowDecoder decode_row;
    switch (P.kv) {
        case KV_E4M3: decode_row = decode_row_f32<KV_E4M3>; break;
        case KV_E4M3FNUZ: decode_row = decode_row_f32<KV_E4M3FNUZ>; break;
        case KV_E5M2: decode_row = decode_row_f32<KV_E5M2>; break;
        case KV_BF16: decode_row = decode_row_f32<KV_BF16>; break;
        case KV_F16: decode_row = decode_row_f32<KV_F16>; break;
        default: decode_row = decode_row_f32<KV_F32>; break;
    }
    const Rows w = rows_of(P, it);
    const int D = P.D, R = w.R;
    const size_t nq = (size_t)R * D;
    size_t bytes = up64(nq * 4) * 2 + up64((size_t)TILE * D * 4) * 2 + up64((size_t)R * 4) * 3 +
                   up64((size_t)R * 8) + up64((size_t)R * TILE * 4);
    char* mem = (char*)tl_scratch.get(bytes);
    if (!mem) return ERR_OOM;
    float* qf = (float*)mem; mem += up64(nq * 4);
    float* acc = (float*)mem; mem += up64(nq * 4);
    float* kf = (float*)mem; mem += up64((size_t)TILE * D * 4);
    float* vf = (float*)mem; mem += up64((size_t)TILE * D * 4);
    float* mx = (float*)mem; mem += up64((size_t)R * 4);
    float* sum = (float*)mem; mem += up64((size_t)R * 4);
    float* alpha = (float*)mem; mem += up64((size_t)R * 4);
    int64_t* lim = (int64_t*)mem; mem += up64((size_t)R * 8);
    float* prob = (float*)mem;

    const bool kch = k_per_channel(P);
    const float sfac = P.sm_scale * (kch ? 1.0f : k_head_scale(P, it.kvh));
    for (int r = 0; r < R; ++r) {
        int h = it.kvh * P.G + r % P.G;
        int64_t src = ((w.qrow0 + r / P.G) * P.Hq + h) * (int64_t)D;
        for (int d = 0; d < D; ++d) {
            float x = load_f(P.q, P.q_dtype, src + d);
            if (kch) x *= P.ks[it.kvh * P.ks_hs + d * P.ks_ds];
            qf[(size_t)r * D + d] = x;
        }
        mx[r] = -INFINITY;
        sum[r] = 0.0f;
        lim[r] = row_limit(P, it, w, r);
    }
    memset(acc, 0, nq * 4);

    const uint8_t* kr[TILE];
    const uint8_t* vr[TILE];
    float ksc[TILE], vsc[TILE];
    for (int t = 0; t < TILE; ++t) ksc[t] = vsc[t] = 1.0f;
    int r0 = 0;
    for (int p = 0; p < PREFETCH_TILES; ++p) prefetch_tile(P, it, it.t0 + p * TILE);
    for (int64_t t0 = it.t0; t0 < it.t1; t0 += TILE) {
        int n = (int)(it.t1 - t0 < TILE ? it.t1 - t0 : TILE);
        prefetch_tile(P, it, t0 + PREFETCH_TILES * TILE);
        if (!tile_rows(P, it, t0, n, kr, vr, ksc, vsc)) return ERR_BLOCK_ID;
        while (r0 < R && lim[r0] < t0) ++r0;  // rows before r0 see nothing of this tile (limits ascend)
        for (int t = 0; t < n; ++t) decode_row(kr[t], D, kf + (size_t)t * D);
        for (int r = r0; r < R; ++r) {
            const float* qr = qf + (size_t)r * D;
            float tmax = -INFINITY;
            float* s = prob + (size_t)r * TILE;
            for (int t = 0; t < TILE; ++t) {
                if (t >= n || t0 + t > lim[r]) { s[t] = -INFINITY; continue; }
                const float* kt = kf + (size_t)t * D;
                float dot = 0.0f;
                for (int d = 0; d < D; ++d) dot += qr[d] * kt[d];
                s[t] = dot * sfac * ksc[t];
                tmax = s[t] > tmax ? s[t] : tmax;
            }
            float mnew = tmax > mx[r] ? tmax : mx[r];
            alpha[r] = mnew == mx[r] ? 1.0f : expf(mx[r] - mnew);
            mx[r] = mnew;
            float ls = 0.0f;
            for (int t = 0; t < TILE; ++t) {
                s[t] = s[t] == -INFINITY ? 0.0f : expf(s[t] - mnew);
                ls += s[t];
            }
            sum[r] = sum[r] * alpha[r] + ls;
        }
        for (int t = 0; t < n; ++t) decode_row(vr[t], D, vf + (size_t)t * D);
        for (int r = r0; r < R; ++r) {
            float* ar = acc + (size_t)r * D;
            const float* p = prob + (size_t)r * TILE;
            for (int d = 0; d < D; ++d) ar[d] *= alpha[r];
            for (int t = 0; t < n; ++t) {
                if (p[t] == 0.0f) continue;
                const float* vt = vf + (size_t)t * D;
                const float pt = p[t] * vsc[t];
                for (int d = 0; d < D; ++d) ar[d] += pt * vt[d];
            }
        }
    }
    for (int r = 0; r < R; ++r) finish_row(P, it, w, r, acc + (size_t)r * D, mx[r], sum[r], ws);
    return OK;
}

// ------------------------------------------------------------------------------------------------
// FAST path: AVX-512 BF16
// ------------------------------------------------------------------------------------------------

#if KV8_FAST

struct Lut {
    __m512i lo0, lo1, hi0, hi1;  // low / high byte of the bf16 value of codes 0..127
};

static Lut make_lut(int fmt) {
    alignas(64) uint8_t lo[128], hi[128];
    for (int c = 0; c < 128; ++c) {
        float v = fp8_exact(fmt, c);
        uint16_t b = isnan(v) ? 0x7fc0 : (uint16_t)(f_bits(v) >> 16);  // exact: <= 3 mantissa bits
        lo[c] = (uint8_t)(b & 0xff);
        hi[c] = (uint8_t)(b >> 8);
    }
    Lut L;
    L.lo0 = _mm512_load_si512(lo);
    L.lo1 = _mm512_load_si512(lo + 64);
    L.hi0 = _mm512_load_si512(hi);
    L.hi1 = _mm512_load_si512(hi + 64);
    return L;
}

static const Lut& lut_for(int fmt) {
    static const Lut luts[3] = {make_lut(KV_E4M3), make_lut(KV_E4M3FNUZ), make_lut(KV_E5M2)};
    return luts[fmt];
}

// 64 FP8 codes -> 64 bf16: w0 = codes 0..7 of each 128-bit lane, w1 = codes 8..15 (lane order kept).
template <int KV>
static inline void fp8_to_bf16(__m512i c, const Lut& L, __m512i& w0, __m512i& w1) {
    __m512i lo = _mm512_permutex2var_epi8(L.lo0, c, L.lo1);
    __m512i hi = _mm512_permutex2var_epi8(L.hi0, c, L.hi1);
    hi = _mm512_ternarylogic_epi32(hi, c, _mm512_set1_epi8((char)0x80), 0xF8);  // hi | (c & 0x80)
    if (KV == KV_E4M3FNUZ) {  // 0x80 is NaN, not -0
        __mmask64 nan = _mm512_cmpeq_epi8_mask(c, _mm512_set1_epi8((char)0x80));
        hi = _mm512_mask_mov_epi8(hi, nan, _mm512_set1_epi8(0x7f));
        lo = _mm512_mask_mov_epi8(lo, nan, _mm512_set1_epi8((char)0xc0));
    }
    w0 = _mm512_unpacklo_epi8(lo, hi);
    w1 = _mm512_unpackhi_epi8(lo, hi);
}

// 4x4 transpose of 128-bit blocks: out[c] lane k = in[k] lane c.
static inline void transpose4x128(const __m512i in[4], __m512i out[4]) {
    __m512i a = _mm512_shuffle_i64x2(in[0], in[1], 0x44);
    __m512i b = _mm512_shuffle_i64x2(in[0], in[1], 0xEE);
    __m512i c = _mm512_shuffle_i64x2(in[2], in[3], 0x44);
    __m512i d = _mm512_shuffle_i64x2(in[2], in[3], 0xEE);
    out[0] = _mm512_shuffle_i64x2(a, c, 0x88);
    out[1] = _mm512_shuffle_i64x2(a, c, 0xDD);
    out[2] = _mm512_shuffle_i64x2(b, d, 0x88);
    out[3] = _mm512_shuffle_i64x2(b, d, 0xDD);
}

static inline bool is_fp8(int kv) { return kv <= KV_E5M2; }

// 64-byte loads of cache rows; masked only for the tail chunk of a head dim that is not a multiple of 64 bytes.
static inline __m512i load_bytes(const uint8_t* p, __mmask64 mk) {
    return mk == ~(__mmask64)0 ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi8(mk, p);
}
static inline __m512i load_words(const uint8_t* p, __mmask32 mk) {
    return mk == 0xffffffffu ? _mm512_loadu_si512(p) : _mm512_maskz_loadu_epi16(mk, p);
}

// Channel slots: slot s holds channels 8s..8s+7. K buffer: kbuf[s * 4 + g] = bf16 of channels of slot s
// for tokens 4g..4g+3 (one per 128-bit lane).
template <int KV>
static void decode_k_tile(const uint8_t* const* rows, int D, __m512i* kbuf) {
    if (KV == KV_BF16) {
        for (int z = 0; z * 32 < D; ++z) {
            int rem = D - z * 32;
            __mmask32 mk = rem >= 32 ? 0xffffffffu : ((1u << rem) - 1u);
            int nl = rem >= 32 ? 4 : rem / 8;
            for (int g = 0; g < 4; ++g) {
                __m512i in[4], out[4];
                for (int k = 0; k < 4; ++k) in[k] = load_words(rows[4 * g + k] + z * 64, mk);
                transpose4x128(in, out);
                for (int l = 0; l < nl; ++l) kbuf[(4 * z + l) * 4 + g] = out[l];
            }
        }
    } else {
        const Lut& L = lut_for(KV);
        for (int z = 0; z * 64 < D; ++z) {
            int rem = D - z * 64;
            __mmask64 mk = rem >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << rem) - 1);
            int nc = rem >= 64 ? 4 : rem / 16;
            for (int g = 0; g < 4; ++g) {
                __m512i in[4], out[4];
                for (int k = 0; k < 4; ++k) in[k] = load_bytes(rows[4 * g + k] + z * 64, mk);
                transpose4x128(in, out);
                for (int c = 0; c < nc; ++c) {
                    __m512i w0, w1;
                    fp8_to_bf16<KV>(out[c], L, w0, w1);
                    kbuf[(8 * z + 2 * c) * 4 + g] = w0;
                    kbuf[(8 * z + 2 * c + 1) * 4 + g] = w1;
                }
            }
        }
    }
}

// V buffer: vbuf[u * nvs + v] = bf16 pairs (token 2u, token 2u+1) for the 16 channels of accumulator v.
// Accumulator channel maps: fp8: v = 4z + m, lane 4k + j -> d = 64z + 16k + 4m + j;
//                           bf16: v = 2z + h, lane 4k + j -> d = 32z + 8k + 4h + j.
static inline int num_vslots(int kv, int D) { return is_fp8(kv) ? 4 * ((D + 63) / 64) : 2 * ((D + 31) / 32); }

static inline int acc_channel(int kv, int a) {
    int v = a >> 4, k = (a >> 2) & 3, j = a & 3;
    if (is_fp8(kv)) return 64 * (v >> 2) + 16 * k + 4 * (v & 3) + j;
    return 32 * (v >> 1) + 8 * k + 4 * (v & 1) + j;
}

template <int KV>
static void decode_v_tile(const uint8_t* const* rows, int D, __m512i* vbuf) {
    const int nvs = num_vslots(KV, D);
    if (KV == KV_BF16) {
        for (int u = 0; u < 8; ++u) {
            for (int z = 0; z * 32 < D; ++z) {
                int rem = D - z * 32;
                __mmask32 mk = rem >= 32 ? 0xffffffffu : ((1u << rem) - 1u);
                __m512i a = load_words(rows[2 * u] + z * 64, mk);
                __m512i b = load_words(rows[2 * u + 1] + z * 64, mk);
                vbuf[u * nvs + 2 * z] = _mm512_unpacklo_epi16(a, b);
                vbuf[u * nvs + 2 * z + 1] = _mm512_unpackhi_epi16(a, b);
            }
        }
    } else {
        const Lut& L = lut_for(KV);
        for (int u = 0; u < 8; ++u) {
            for (int z = 0; z * 64 < D; ++z) {
                int rem = D - z * 64;
                __mmask64 mk = rem >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << rem) - 1);
                __m512i a = load_bytes(rows[2 * u] + z * 64, mk);
                __m512i b = load_bytes(rows[2 * u + 1] + z * 64, mk);
                __m512i* dst = vbuf + u * nvs + 4 * z;
                fp8_to_bf16<KV>(_mm512_unpacklo_epi8(a, b), L, dst[0], dst[1]);
                fp8_to_bf16<KV>(_mm512_unpackhi_epi8(a, b), L, dst[2], dst[3]);
            }
        }
    }
}

static inline __m512bh as_bh(__m512i x) { return (__m512bh)x; }

// acc[g] lane (k, i): token 4g + k, partial i (the layout of a transposed K tile). Sums the partials;
// result lane t = token t.
static inline __m512 reduce_scores(const __m512* acc) {
    const __m512i nat = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
    __m512 x01 = _mm512_add_ps(_mm512_unpacklo_ps(acc[0], acc[1]), _mm512_unpackhi_ps(acc[0], acc[1]));
    __m512 x23 = _mm512_add_ps(_mm512_unpacklo_ps(acc[2], acc[3]), _mm512_unpackhi_ps(acc[2], acc[3]));
    __m512d a = _mm512_castps_pd(x01), b = _mm512_castps_pd(x23);
    __m512 y = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
    return _mm512_permutexvar_ps(nat, y);  // lane 4k + j held token 4j + k
}

// Scores of RB rows against one K tile: out[r] lane t = q_r . k_t (unscaled), natural token order.
template <int RB, bool QLO>
static inline void tile_scores(const __m512i* kbuf, int nslots, const __m512i* const* qhi,
                               const __m512i* const* qlo, __m512* out) {
    __m512 acc[RB][4];
    for (int r = 0; r < RB; ++r)
        for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_setzero_ps();
    for (int s = 0; s < nslots; ++s) {
        __m512i q[RB];
        for (int r = 0; r < RB; ++r) q[r] = _mm512_load_si512(qhi[r] + s);
        for (int g = 0; g < 4; ++g) {
            __m512i k = _mm512_load_si512(kbuf + s * 4 + g);
            for (int r = 0; r < RB; ++r) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], as_bh(q[r]), as_bh(k));
        }
        if (QLO) {
            for (int r = 0; r < RB; ++r) q[r] = _mm512_load_si512(qlo[r] + s);
            for (int g = 0; g < 4; ++g) {
                __m512i k = _mm512_load_si512(kbuf + s * 4 + g);
                for (int r = 0; r < RB; ++r) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], as_bh(q[r]), as_bh(k));
            }
        }
    }
    for (int r = 0; r < RB; ++r) out[r] = reduce_scores(acc[r]);
}

// out[r] (RB rows x nvs accumulators, in memory) = out * alpha + P . V for one tile (P as bf16 hi + lo).
template <int RB, bool PLO>
static inline void tile_pv(const __m512i* vbuf, int nvs, const uint32_t* const* phi, const uint32_t* const* plo,
                           float* const* obuf, const float* alpha) {
    int v0 = 0;
    for (; v0 + 4 <= nvs; v0 += 4) {
        __m512 acc[RB][4];
        for (int r = 0; r < RB; ++r) {
            __m512 a = _mm512_set1_ps(alpha[r]);
            for (int m = 0; m < 4; ++m) acc[r][m] = _mm512_mul_ps(_mm512_load_ps(obuf[r] + (v0 + m) * 16), a);
        }
        for (int u = 0; u < 8; ++u) {
            __m512i v[4];
            for (int m = 0; m < 4; ++m) v[m] = _mm512_load_si512(vbuf + u * nvs + v0 + m);
            for (int r = 0; r < RB; ++r) {
                __m512i p = _mm512_set1_epi32((int)phi[r][u]);
                for (int m = 0; m < 4; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], as_bh(v[m]), as_bh(p));
                if (PLO) {
                    __m512i pl = _mm512_set1_epi32((int)plo[r][u]);
                    for (int m = 0; m < 4; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], as_bh(v[m]), as_bh(pl));
                }
            }
        }
        for (int r = 0; r < RB; ++r)
            for (int m = 0; m < 4; ++m) _mm512_store_ps(obuf[r] + (v0 + m) * 16, acc[r][m]);
    }
    for (; v0 < nvs; ++v0) {
        for (int r = 0; r < RB; ++r) {
            __m512 acc = _mm512_mul_ps(_mm512_load_ps(obuf[r] + v0 * 16), _mm512_set1_ps(alpha[r]));
            for (int u = 0; u < 8; ++u) {
                __m512i v = _mm512_load_si512(vbuf + u * nvs + v0);
                acc = _mm512_dpbf16_ps(acc, as_bh(v), as_bh(_mm512_set1_epi32((int)phi[r][u])));
                if (PLO) acc = _mm512_dpbf16_ps(acc, as_bh(v), as_bh(_mm512_set1_epi32((int)plo[r][u])));
            }
            _mm512_store_ps(obuf[r] + v0 * 16, acc);
        }
    }
}

// tile_pv with the V decode fused in (no V buffer): for the few rows of a decode step. Same accumulator
// layout as decode_v_tile + tile_pv.
template <int KV, int RB, bool PLO>
static void tile_pv_fused(const uint8_t* const* rows, int D, const uint32_t* const* phi, const uint32_t* const* plo,
                          float* const* obuf, const float* alpha) {
    const bool fp8 = KV != KV_BF16;
    const int NV = fp8 ? 4 : 2;          // accumulators per chunk of rows
    const int CH = fp8 ? 64 : 32;        // channels per chunk
    const Lut& L = lut_for(fp8 ? KV : KV_E4M3);
    for (int z = 0; z * CH < D; ++z) {
        int rem = D - z * CH;
        __m512 acc[RB][4];
        for (int r = 0; r < RB; ++r) {
            __m512 a = _mm512_set1_ps(alpha[r]);
            for (int m = 0; m < NV; ++m) acc[r][m] = _mm512_mul_ps(_mm512_load_ps(obuf[r] + (z * NV + m) * 16), a);
        }
        for (int u = 0; u < 8; ++u) {
            __m512i v[4];
            if (fp8) {
                __mmask64 mk = rem >= 64 ? ~(__mmask64)0 : (((__mmask64)1 << rem) - 1);
                __m512i a = load_bytes(rows[2 * u] + z * 64, mk);
                __m512i b = load_bytes(rows[2 * u + 1] + z * 64, mk);
                fp8_to_bf16<KV>(_mm512_unpacklo_epi8(a, b), L, v[0], v[1]);
                fp8_to_bf16<KV>(_mm512_unpackhi_epi8(a, b), L, v[2], v[3]);
            } else {
                __mmask32 mk = rem >= 32 ? 0xffffffffu : ((1u << rem) - 1u);
                __m512i a = load_words(rows[2 * u] + z * 64, mk);
                __m512i b = load_words(rows[2 * u + 1] + z * 64, mk);
                v[0] = _mm512_unpacklo_epi16(a, b);
                v[1] = _mm512_unpackhi_epi16(a, b);
            }
            for (int r = 0; r < RB; ++r) {
                __m512i p = _mm512_set1_epi32((int)phi[r][u]);
                for (int m = 0; m < NV; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], as_bh(v[m]), as_bh(p));
                if (PLO) {
                    __m512i pl = _mm512_set1_epi32((int)plo[r][u]);
                    for (int m = 0; m < NV; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], as_bh(v[m]), as_bh(pl));
                }
            }
        }
        for (int r = 0; r < RB; ++r)
            for (int m = 0; m < NV; ++m) _mm512_store_ps(obuf[r] + (z * NV + m) * 16, acc[r][m]);
    }
}

typedef void (*PvFused)(const uint8_t* const*, int, const uint32_t* const*, const uint32_t* const*, float* const*,
                        const float*);

template <int KV, bool PLO>
static inline void pick_pv_fused(PvFused* f) {
    f[1] = tile_pv_fused<KV, 1, PLO>;
    f[2] = tile_pv_fused<KV, 2, PLO>;
    f[3] = tile_pv_fused<KV, 3, PLO>;
    f[4] = tile_pv_fused<KV, 4, PLO>;
}

// q row (D values) -> bf16 hi / lo slots, each slot's 8 channels broadcast to the 4 lanes.
static inline void prep_q(const Problem& P, int64_t src, const float* kscale, __m512i* hi, __m512i* lo) {
    const int D = P.D;
    for (int d = 0; d < D; d += 16) {
        __m512 x;
        if (P.q_dtype == DT_BF16)
            x = _mm512_castsi512_ps(_mm512_slli_epi32(
                _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)((const uint16_t*)P.q + src + d))), 16));
        else if (P.q_dtype == DT_F16)
            x = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)((const uint16_t*)P.q + src + d)));
        else
            x = _mm512_loadu_ps((const float*)P.q + src + d);
        if (kscale) x = _mm512_mul_ps(x, _mm512_loadu_ps(kscale + d));
        __m256i h = (__m256i)_mm512_cvtneps_pbh(x);
        __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        __m256i l = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(x, hf));
        int s = d / 8;
        hi[s] = _mm512_broadcast_i32x4(_mm256_castsi256_si128(h));
        hi[s + 1] = _mm512_broadcast_i32x4(_mm256_extracti128_si256(h, 1));
        lo[s] = _mm512_broadcast_i32x4(_mm256_castsi256_si128(l));
        lo[s + 1] = _mm512_broadcast_i32x4(_mm256_extracti128_si256(l, 1));
    }
}

// Per item: the query rows as bf16 hi / lo slots (D / 8 per row; per-channel K scales folded in, kscale
// [D] filled then), each row's last visible position; returns the factor of the scores (softmax scale times
// a per-tensor / per-head K scale).
static float prep_rows(const Problem& P, const Item& it, const Rows& w, float* kscale, __m512i* qhi,
                       __m512i* qlo, int64_t* lim) {
    const int D = P.D, nslots = D / 8;
    const bool kch = k_per_channel(P);
    if (kch)
        for (int d = 0; d < D; ++d) kscale[d] = P.ks[it.kvh * P.ks_hs + d * P.ks_ds];
    for (int r = 0; r < w.R; ++r) {
        int h = it.kvh * P.G + r % P.G;
        int64_t src = ((w.qrow0 + r / P.G) * P.Hq + h) * (int64_t)D;
        prep_q(P, src, kch ? kscale : nullptr, qhi + (size_t)r * nslots, qlo + (size_t)r * nslots);
        lim[r] = row_limit(P, it, w, r);
    }
    return P.sm_scale * (kch ? 1.0f : k_head_scale(P, it.kvh));
}

// ------------------------------------------------------------------------------------------------
// FAST path, decode items: <= 4 rows (a GQA group of <= 4 query heads of one new token, or <= 4 query
// tokens of one head) over blocks of a multiple of 16 tokens, so that every tile is 16 consecutive rows
// of one block, read in place through one base pointer. D is a compile-time constant (64, 128, 256), the K
// decode is fused into the scores (no K buffer) and the online softmax steps once per chunk of
// CHUNK_TILES tiles: the scores of the whole chunk come first, so the max, the exponentials and the P.V
// products of its tiles are independent work (one serial max/rescale step per 64 tokens, not per 16).
// Arithmetic as run_item_fast: the same bf16 products, fp32 accumulation and accumulator layout.
// ------------------------------------------------------------------------------------------------

static const int CHUNK_TILES = 4;
static const int L2_PREFETCH_TILES = 6;  // measured 4..8 within noise, 0 slower by ~1.25x

// Scores of R rows against the 16 rows of one tile starting at kb (row stride D * esize).
template <int KV, int D, int R, bool QLO>
static inline void tile_scores_inplace(const uint8_t* kb, const Lut& L, const __m512i* qhi, const __m512i* qlo,
                                       __m512* out) {
    constexpr bool fp8 = KV != KV_BF16;
    constexpr int RBYTES = D * (fp8 ? 1 : 2), NS = D / 8;
    __m512 acc[R][4];
    for (int r = 0; r < R; ++r)
        for (int g = 0; g < 4; ++g) acc[r][g] = _mm512_setzero_ps();
    for (int z = 0; z < RBYTES / 64; ++z) {
        for (int g = 0; g < 4; ++g) {
            __m512i in[4], t[4];
            for (int k = 0; k < 4; ++k) in[k] = _mm512_loadu_si512(kb + (4 * g + k) * RBYTES + z * 64);
            transpose4x128(in, t);
            for (int c = 0; c < 4; ++c) {
                __m512i wv[2];
                int nw = 1, slot = 4 * z + c;
                if (fp8) {
                    fp8_to_bf16<KV>(t[c], L, wv[0], wv[1]);
                    nw = 2;
                    slot = 8 * z + 2 * c;
                } else {
                    wv[0] = t[c];
                }
                for (int h = 0; h < nw; ++h)
                    for (int r = 0; r < R; ++r) {
                        acc[r][g] = _mm512_dpbf16_ps(acc[r][g], as_bh(qhi[r * NS + slot + h]), as_bh(wv[h]));
                        if (QLO) acc[r][g] = _mm512_dpbf16_ps(acc[r][g], as_bh(qlo[r * NS + slot + h]), as_bh(wv[h]));
                    }
            }
        }
    }
    for (int r = 0; r < R; ++r) out[r] = reduce_scores(acc[r]);
}

// obuf (R rows x D accumulators) = obuf * alpha + P . V over the nt tiles of a chunk (V tile j at vb[j];
// weights of row r, tile j: dwords (r * CHUNK_TILES + j) * 8 of phi / plo, bf16 pairs of tokens 2u, 2u + 1).
template <int KV, int D, int R>
static inline void chunk_pv_inplace(const uint8_t* const* vb, int nt, const Lut& L, const uint32_t* phi,
                                    float* obuf, const float* alpha) {
    constexpr bool fp8 = KV != KV_BF16;
    constexpr int RBYTES = D * (fp8 ? 1 : 2), NV = fp8 ? 4 : 2;  // accumulators per 64-byte chunk of a row
    for (int z = 0; z < RBYTES / 64; ++z) {
        __m512 acc[R][NV];
        for (int r = 0; r < R; ++r) {
            __m512 a = _mm512_set1_ps(alpha[r]);
            for (int m = 0; m < NV; ++m) acc[r][m] = _mm512_mul_ps(_mm512_load_ps(obuf + r * D + (z * NV + m) * 16), a);
        }
        for (int j = 0; j < nt; ++j) {
            const uint8_t* v0 = vb[j] + z * 64;
            for (int u = 0; u < 8; ++u) {
                __m512i a = _mm512_loadu_si512(v0 + 2 * u * RBYTES);
                __m512i b = _mm512_loadu_si512(v0 + (2 * u + 1) * RBYTES);
                __m512i v[4];
                if (fp8) {
                    fp8_to_bf16<KV>(_mm512_unpacklo_epi8(a, b), L, v[0], v[1]);
                    fp8_to_bf16<KV>(_mm512_unpackhi_epi8(a, b), L, v[2], v[3]);
                } else {
                    v[0] = _mm512_unpacklo_epi16(a, b);
                    v[1] = _mm512_unpackhi_epi16(a, b);
                }
                for (int r = 0; r < R; ++r) {
                    const int w = (r * CHUNK_TILES + j) * 8 + u;
                    __m512i p = _mm512_set1_epi32((int)phi[w]);
                    for (int m = 0; m < NV; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], as_bh(v[m]), as_bh(p));
                }
            }
        }
        for (int r = 0; r < R; ++r)
            for (int m = 0; m < NV; ++m) _mm512_store_ps(obuf + r * D + (z * NV + m) * 16, acc[r][m]);
    }
}

template <int KV, int D, int R>
static int run_item_decode(const Problem& P, const Item& it, float* ws) {
    constexpr bool fp8 = KV != KV_BF16;
    constexpr int RBYTES = D * (fp8 ? 1 : 2), NS = D / 8, CT = CHUNK_TILES;
    const Lut& L = lut_for(fp8 ? P.kv : KV_E4M3);  // E4M3 and E5M2 share the code, their tables differ
    const Rows w = rows_of(P, it);
    alignas(64) __m512i qhi[R * NS], qlo[R * NS];
    alignas(64) float obuf[R * D], nat[D], kscale[D];
    alignas(64) uint32_t phi[R * CT * 8];
    alignas(64) uint8_t pad_k[TILE * RBYTES], pad_v[TILE * RBYTES];  // the partial tile, zero-padded
    float mx[R], alpha[R];
    __m512 sum[R];
    int64_t lim[R];

    const bool kch = k_per_channel(P);
    const float sfac = prep_rows(P, it, w, kscale, qhi, qlo, lim);
    for (int r = 0; r < R; ++r) {
        mx[r] = -INFINITY;
        sum[r] = _mm512_setzero_ps();
    }
    memset(obuf, 0, sizeof(obuf));

    const int64_t* table = P.bt + (int64_t)it.seq * P.bt_stride;
    for (int p = 0; p < PREFETCH_TILES; ++p) prefetch_tile<true, false>(P, it, it.t0 + p * TILE);
    for (int64_t c0 = it.t0; c0 < it.t1; c0 += CT * TILE) {
        const int nt = (int)((it.t1 - c0 + TILE - 1) / TILE < CT ? (it.t1 - c0 + TILE - 1) / TILE : CT);
        const uint8_t* vb[CT];
        __m512 s[R][CT], vsv[CT];
        __mmask16 valid[R][CT];
        for (int j = 0; j < nt; ++j) {
            const int64_t t0 = c0 + j * TILE;
            const int n = (int)(it.t1 - t0 < TILE ? it.t1 - t0 : TILE);
            // From DRAM: K and V into L2 L2_PREFETCH_TILES ahead, K into L1 two tiles ahead, V of this tile
            // into L1 now (its P.V comes after the chunk's scores). Measured ~1.25x over L1 prefetch alone.
            prefetch_tile<true, true, true>(P, it, t0 + L2_PREFETCH_TILES * TILE);
            prefetch_tile<true, false>(P, it, t0 + PREFETCH_TILES * TILE);
            prefetch_tile<false, true>(P, it, t0);
            const int64_t blk = table[block_index(P, t0)];
            if ((uint64_t)blk >= (uint64_t)P.num_blocks) return ERR_BLOCK_ID;
            const int64_t row0 = (blk * P.Hkv + it.kvh) * P.bs + block_offset(P, t0);
            const uint8_t* kb = P.kc + row0 * RBYTES;
            vb[j] = P.vc + row0 * RBYTES;
            const __mmask16 full = n >= TILE ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
            __m512 kf = _mm512_set1_ps(sfac);
            if (P.kts) {
                kf = _mm512_mul_ps(kf, _mm512_maskz_loadu_ps(full, P.kts + row0));
                vsv[j] = _mm512_maskz_loadu_ps(full, P.vts + row0);
            }
            if (n < TILE) {  // rows past the sequence may hold anything: read zeros instead
                memcpy(pad_k, kb, (size_t)n * RBYTES);
                memset(pad_k + n * RBYTES, 0, (size_t)(TILE - n) * RBYTES);
                memcpy(pad_v, vb[j], (size_t)n * RBYTES);
                memset(pad_v + n * RBYTES, 0, (size_t)(TILE - n) * RBYTES);
                kb = pad_k;
                vb[j] = pad_v;
            }
            __m512 sc[R];
            if (kch) tile_scores_inplace<KV, D, R, true>(kb, L, qhi, qlo, sc);
            else tile_scores_inplace<KV, D, R, false>(kb, L, qhi, qlo, sc);
            for (int r = 0; r < R; ++r) {
                int64_t nv = lim[r] - t0 + 1 < n ? lim[r] - t0 + 1 : n;  // visible tokens of this tile
                valid[r][j] = nv <= 0 ? (__mmask16)0 : (nv >= TILE ? full : (__mmask16)((1u << nv) - 1u));
                s[r][j] = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid[r][j], sc[r], kf);
            }
        }
        for (int r = 0; r < R; ++r) {
            __m512 m = s[r][0];
            for (int j = 1; j < nt; ++j) m = _mm512_max_ps(m, s[r][j]);
            const float cm = _mm512_reduce_max_ps(m);
            uint32_t* ph = phi + r * CT * 8;
            if (cm == -INFINITY) {  // the row sees nothing of this chunk (a multi-token item's early rows)
                alpha[r] = 1.0f;
                memset(ph, 0, CT * 32);
                continue;
            }
            const float mnew = cm > mx[r] ? cm : mx[r];
            alpha[r] = mnew == mx[r] ? 1.0f : expf(mx[r] - mnew);
            mx[r] = mnew;
            const __m512 mv = _mm512_set1_ps(mnew);
            __m512 psum = _mm512_setzero_ps();
            for (int j = 0; j < nt; ++j) {
                __m512 p = _mm512_maskz_mov_ps(valid[r][j], exp_ps(_mm512_sub_ps(s[r][j], mv)));
                psum = _mm512_add_ps(psum, p);
                if (P.vts) p = _mm512_mul_ps(p, vsv[j]);  // per-token V scale rides on the weight
                _mm256_store_si256((__m256i*)(ph + j * 8), (__m256i)_mm512_cvtneps_pbh(p));
            }
            sum[r] = _mm512_fmadd_ps(sum[r], _mm512_set1_ps(alpha[r]), psum);
        }
        chunk_pv_inplace<KV, D, R>(vb, nt, L, phi, obuf, alpha);
    }
    for (int r = 0; r < R; ++r) {
        const float* a = obuf + r * D;
        for (int i = 0; i < D; ++i) nat[acc_channel(KV, i)] = a[i];
        finish_row(P, it, w, r, nat, mx[r], _mm512_reduce_add_ps(sum[r]), ws);
    }
    return OK;
}

// The decode-item kernel for this problem and item rows, or NULL where run_item_fast serves.
template <int KV>
static ItemFn decode_fn_kv(int D, int R) {
#define KV8_ROWS(DD)                                    \
    switch (R) {                                        \
        case 1: return run_item_decode<KV, DD, 1>;      \
        case 2: return run_item_decode<KV, DD, 2>;      \
        case 3: return run_item_decode<KV, DD, 3>;      \
        case 4: return run_item_decode<KV, DD, 4>;      \
        default: return nullptr;                        \
    }
    switch (D) {
        case 64: KV8_ROWS(64)
        case 128: KV8_ROWS(128)
        case 256: KV8_ROWS(256)
        default: return nullptr;
    }
#undef KV8_ROWS
}

static ItemFn decode_fn(const Problem& P, int R) {
    if (P.bs % TILE != 0 || P.q_dtype != DT_BF16) return nullptr;
    switch (P.kv) {
        case KV_E4M3: case KV_E5M2: return decode_fn_kv<KV_E4M3>(P.D, R);  // table decode, tables per format
        case KV_E4M3FNUZ: return decode_fn_kv<KV_E4M3FNUZ>(P.D, R);
        case KV_BF16: return decode_fn_kv<KV_BF16>(P.D, R);
        default: return nullptr;
    }
}

typedef void (*TileDecoder)(const uint8_t* const*, int, __m512i*);

template <bool QLO, bool PLO>
static int run_item_fast(const Problem& P, const Item& it, float* ws) {
    TileDecoder decode_k, decode_v;
    PvFused pv_fused[5];
    switch (P.kv) {
        case KV_E4M3: decode_k = decode_k_tile<KV_E4M3>; decode_v = decode_v_tile<KV_E4M3>;
            pick_pv_fused<KV_E4M3, PLO>(pv_fused); break;
        case KV_E4M3FNUZ: decode_k = decode_k_tile<KV_E4M3FNUZ>; decode_v = decode_v_tile<KV_E4M3FNUZ>;
            pick_pv_fused<KV_E4M3FNUZ, PLO>(pv_fused); break;
        case KV_E5M2: decode_k = decode_k_tile<KV_E5M2>; decode_v = decode_v_tile<KV_E5M2>;
            pick_pv_fused<KV_E5M2, PLO>(pv_fused); break;
        default: decode_k = decode_k_tile<KV_BF16>; decode_v = decode_v_tile<KV_BF16>;
            pick_pv_fused<KV_BF16, PLO>(pv_fused); break;
    }
    const Rows w = rows_of(P, it);
    if (ItemFn f = decode_fn(P, w.R)) return f(P, it, ws);  // bf16 compute, decode-sized items
    const int D = P.D, R = w.R;
    const int nslots = D / 8, nvs = num_vslots(P.kv, D), nacc = nvs * 16;
    size_t qbytes = (size_t)R * nslots * 64;
    size_t bytes = 2 * qbytes + (size_t)nslots * 4 * 64 + (size_t)8 * nvs * 64 + (size_t)R * nacc * 4 +
                   up64((size_t)R * 4) * 2 + (size_t)R * 64 * 3 + up64((size_t)D * 4) * 2 + up64((size_t)R * 8);
    char* mem = (char*)tl_scratch.get(bytes);
    if (!mem) return ERR_OOM;
    __m512i* qhi = (__m512i*)mem; mem += qbytes;
    __m512i* qlo = (__m512i*)mem; mem += qbytes;
    __m512i* kbuf = (__m512i*)mem; mem += (size_t)nslots * 4 * 64;
    __m512i* vbuf = (__m512i*)mem; mem += (size_t)8 * nvs * 64;
    float* obuf = (float*)mem; mem += (size_t)R * nacc * 4;
    float* mx = (float*)mem; mem += up64((size_t)R * 4);
    float* sum = (float*)mem; mem += (size_t)R * 64;  // per row: 16 lane-wise partial sums
    float* alpha = (float*)mem; mem += up64((size_t)R * 4);
    uint32_t* phi = (uint32_t*)mem; mem += (size_t)R * 64;  // 8 used dwords per row, 64-byte stride
    uint32_t* plo = (uint32_t*)mem; mem += (size_t)R * 64;
    float* kscale = (float*)mem; mem += up64((size_t)D * 4);
    int64_t* lim = (int64_t*)mem; mem += up64((size_t)R * 8);
    float* nat = (float*)mem;

    const float sfac = prep_rows(P, it, w, kscale, qhi, qlo, lim);
    for (int r = 0; r < R; ++r) {
        mx[r] = -INFINITY;
        _mm512_store_ps(sum + (size_t)r * 16, _mm512_setzero_ps());
    }
    memset(obuf, 0, (size_t)R * nacc * 4);

    const uint8_t* kr[TILE];
    const uint8_t* vr[TILE];
    alignas(64) float ksc[TILE], vsc[TILE];
    for (int t = 0; t < TILE; ++t) ksc[t] = vsc[t] = 1.0f;
    const __m512i* qh[4];
    const __m512i* ql[4];
    const uint32_t* ph[4];
    const uint32_t* pl[4];
    float* ob[4];
    __m512 sc[4];
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    int r0 = 0;
    for (int p = 0; p < PREFETCH_TILES; ++p) prefetch_tile(P, it, it.t0 + p * TILE);
    for (int64_t t0 = it.t0; t0 < it.t1; t0 += TILE) {
        int n = (int)(it.t1 - t0 < TILE ? it.t1 - t0 : TILE);
        // K lines now, V lines before the V decode: bursts that fit the L1 miss buffers (one burst of both
        // was 2x slower for bf16).
        prefetch_tile<true, false>(P, it, t0 + PREFETCH_TILES * TILE);
        if (!tile_rows(P, it, t0, n, kr, vr, ksc, vsc)) return ERR_BLOCK_ID;
        while (r0 < R && lim[r0] < t0) ++r0;  // rows before r0 see nothing of this tile (limits ascend)
        decode_k(kr, D, kbuf);
        const __m512 sfv = _mm512_mul_ps(_mm512_set1_ps(sfac), _mm512_load_ps(ksc));
        const __m512 vsv = _mm512_load_ps(vsc);
        for (int rb = r0; rb < R; rb += 4) {
            int nb = R - rb < 4 ? R - rb : 4;
            for (int i = 0; i < nb; ++i) {
                qh[i] = qhi + (size_t)(rb + i) * nslots;
                ql[i] = qlo + (size_t)(rb + i) * nslots;
            }
            switch (nb) {
                case 4: tile_scores<4, QLO>(kbuf, nslots, qh, ql, sc); break;
                case 3: tile_scores<3, QLO>(kbuf, nslots, qh, ql, sc); break;
                case 2: tile_scores<2, QLO>(kbuf, nslots, qh, ql, sc); break;
                default: tile_scores<1, QLO>(kbuf, nslots, qh, ql, sc); break;
            }
            for (int i = 0; i < nb; ++i) {
                int r = rb + i;
                int64_t nv = lim[r] - t0 + 1 < n ? lim[r] - t0 + 1 : n;  // visible tokens of this tile (>= 1)
                __mmask16 valid = (__mmask16)_mm512_cmplt_epi32_mask(lane, _mm512_set1_epi32((int)nv));
                __m512 s = _mm512_mask_mul_ps(_mm512_set1_ps(-INFINITY), valid, sc[i], sfv);
                float tmax = _mm512_reduce_max_ps(s);
                float mnew = tmax > mx[r] ? tmax : mx[r];
                alpha[r] = mnew == mx[r] ? 1.0f : expf(mx[r] - mnew);
                mx[r] = mnew;
                __m512 p = _mm512_maskz_mov_ps(valid, exp_ps(_mm512_sub_ps(s, _mm512_set1_ps(mnew))));
                float* sr = sum + (size_t)r * 16;
                _mm512_store_ps(sr, _mm512_fmadd_ps(_mm512_load_ps(sr), _mm512_set1_ps(alpha[r]), p));
                if (P.vts) p = _mm512_mul_ps(p, vsv);  // per-token V scale rides on the weight
                __m256i h = (__m256i)_mm512_cvtneps_pbh(p);
                _mm256_store_si256((__m256i*)(phi + (size_t)r * 16), h);
                if (PLO) {
                    __m512 hf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
                    _mm256_store_si256((__m256i*)(plo + (size_t)r * 16),
                                       (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(p, hf)));
                }
            }
        }
        prefetch_tile<false, true>(P, it, t0 + PREFETCH_TILES * TILE);
        if (R - r0 <= 4) {  // decode step: decode V straight into the P.V product
            int nb = R - r0;
            for (int i = 0; i < nb; ++i) {
                ph[i] = phi + (size_t)(r0 + i) * 16;
                pl[i] = plo + (size_t)(r0 + i) * 16;
                ob[i] = obuf + (size_t)(r0 + i) * nacc;
            }
            pv_fused[nb](vr, D, ph, pl, ob, alpha + r0);
            continue;
        }
        decode_v(vr, D, vbuf);
        for (int rb = r0; rb < R; rb += 4) {
            int nb = R - rb < 4 ? R - rb : 4;
            for (int i = 0; i < nb; ++i) {
                ph[i] = phi + (size_t)(rb + i) * 16;
                pl[i] = plo + (size_t)(rb + i) * 16;
                ob[i] = obuf + (size_t)(rb + i) * nacc;
            }
            switch (nb) {
                case 4: tile_pv<4, PLO>(vbuf, nvs, ph, pl, ob, alpha + rb); break;
                case 3: tile_pv<3, PLO>(vbuf, nvs, ph, pl, ob, alpha + rb); break;
                case 2: tile_pv<2, PLO>(vbuf, nvs, ph, pl, ob, alpha + rb); break;
                default: tile_pv<1, PLO>(vbuf, nvs, ph, pl, ob, alpha + rb); break;
            }
        }
    }
    for (int r = 0; r < R; ++r) {
        const float* a = obuf + (size_t)r * nacc;
        for (int i = 0; i < nacc; ++i) {
            int d = acc_channel(P.kv, i);
            if (d < D) nat[d] = a[i];
        }
        finish_row(P, it, w, r, nat, mx[r], _mm512_reduce_add_ps(_mm512_load_ps(sum + (size_t)r * 16)), ws);
    }
    return OK;
}

#endif  // KV8_FAST

// ------------------------------------------------------------------------------------------------
// Dispatch, work decomposition, partition combine
// ------------------------------------------------------------------------------------------------


static ItemFn pick_item_fn(const Problem& P, int* fast) {
    *fast = 0;
#if KV8_FAST
    if (P.D % 16 == 0 && P.D <= 1024 && (is_fp8(P.kv) || P.kv == KV_BF16)) {
        *fast = 1;
        bool qlo = !(P.q_dtype == DT_BF16 && !k_per_channel(P));
        bool plo = P.q_dtype != DT_BF16;  // bf16 compute: weights in bf16, as precise as the output
        if (qlo) return plo ? run_item_fast<true, true> : run_item_fast<true, false>;
        return plo ? run_item_fast<false, true> : run_item_fast<false, false>;
    }
#endif
    return run_item_generic;
}

static int esize_of(int kv) { return kv <= KV_E5M2 ? 1 : (kv == KV_F32 ? 4 : 2); }

extern "C" {

// 1 when the AVX-512 BF16 fast path was compiled in.
int kv8_has_fast_path(void) { return KV8_FAST; }

// Which path attention takes for these parameters (1 fast, 0 generic).
int kv8_attention_path(int kv, int q_dtype, int D) {
    Problem P;
    memset(&P, 0, sizeof(P));
    P.kv = kv;
    P.q_dtype = q_dtype;
    P.D = D;
    int fast;
    pick_item_fn(P, &fast);
    return fast;
}

// 1 when items of `rows` rows (query heads per KV head x query tokens) take the decode-item kernel.
int kv8_decode_item_path(int kv, int q_dtype, int D, int bs, int rows) {
#if KV8_FAST
    Problem P;
    memset(&P, 0, sizeof(P));
    P.kv = kv;
    P.q_dtype = q_dtype;
    P.D = D;
    P.bs = bs;
    int fast;
    pick_item_fn(P, &fast);
    return fast && bs > 0 && decode_fn(P, rows) != nullptr;
#else
    (void)kv; (void)q_dtype; (void)D; (void)bs; (void)rows;
    return 0;
#endif
}

// Paged attention over the stored context. q/out [T, Hq, D] contiguous in q_dtype; k_cache/v_cache one
// layer [num_blocks, Hkv, bs, D]; k_scale/v_scale float32 with strides (or NULL for 16/32-bit caches).
// partition_size: context tokens per partition (multiple of 16), 0 = automatic, < 0 = never split.
int kv8_paged_attention(const void* q, int q_dtype, void* out, int64_t T, int Hq, int Hkv, int D,
                        const void* k_cache, const void* v_cache, int kv, int64_t num_blocks, int bs,
                        const float* k_scale, int64_t ks_hs, int64_t ks_ds, const float* v_scale, int64_t vs_hs,
                        int64_t vs_ds, const float* k_token_scales, const float* v_token_scales, int B, const int64_t* qsl, const int64_t* seq_lens, const int64_t* bt,
                        int64_t bt_stride, float sm_scale, int nthreads, int64_t partition_size) {
    if (Hkv <= 0 || Hq % Hkv != 0 || D <= 0 || bs <= 0 || B < 0 || nthreads <= 0 || kv < 0 || kv > KV_F32 ||
        q_dtype < 0 || q_dtype > DT_F32 || (int64_t)D * esize_of(kv) > (int64_t)sizeof(ZERO_ROW))
        return ERR_ARGS;
    Problem P;
    P.q = q; P.q_dtype = q_dtype; P.out = out;
    P.Hq = Hq; P.Hkv = Hkv; P.D = D; P.G = Hq / Hkv;
    P.kc = (const uint8_t*)k_cache; P.vc = (const uint8_t*)v_cache;
    P.kv = kv; P.esize = esize_of(kv); P.num_blocks = num_blocks; P.bs = bs;
    P.ks = k_scale; P.ks_hs = ks_hs; P.ks_ds = ks_ds;
    P.vs = v_scale; P.vs_hs = vs_hs; P.vs_ds = vs_ds;
    P.kts = k_token_scales; P.vts = v_token_scales;
    if ((P.kts == nullptr) != (P.vts == nullptr)) return ERR_ARGS;
    P.B = B; P.qsl = qsl; P.seq_lens = seq_lens; P.bt = bt; P.bt_stride = bt_stride;
    P.sm_scale = sm_scale;
    // Query tokens per item: ~48 rows (tokens x GQA group) share each decoded K/V tile; measured on 4 x 512
    // prefill tokens, 48 rows took ~15% less time than 16 (32: ~9%, 64: no better than 48).
    P.qb = P.G >= ROWS_PER_ITEM ? 1 : ROWS_PER_ITEM / P.G;
    P.bs_shift = (bs & (bs - 1)) == 0 ? __builtin_ctz((unsigned)bs) : -1;

    if (qsl[0] != 0 || qsl[B] != T) return ERR_LENGTHS;
    int64_t n_base = 0, total_ctx = 0;
    for (int i = 0; i < B; ++i) {
        int64_t ql = qsl[i + 1] - qsl[i], sl = seq_lens[i];
        if (ql < 0 || sl < ql || (ql > 0 && sl < 1)) return ERR_LENGTHS;
        if ((sl + bs - 1) / bs > bt_stride) return ERR_TABLE_WIDTH;
        int64_t nq = (ql + P.qb - 1) / P.qb;
        n_base += nq * Hkv;
        total_ctx += sl * nq * Hkv;
    }
    int64_t part;
    if (partition_size > 0) part = (partition_size + TILE - 1) / TILE * TILE;
    else if (partition_size < 0 || n_base >= 4 * (int64_t)nthreads) part = (int64_t)1 << 40;  // no split (and no overflow in the ceil-divisions below)
    else {
        int64_t want = (total_ctx + 8 * nthreads - 1) / (8 * nthreads);
        part = want < 256 ? 256 : (want + TILE - 1) / TILE * TILE;
    }

    // Items, and workspace for partitioned ones.
    int64_t n_items = 0;
    for (int i = 0; i < B; ++i) {
        int64_t ql = qsl[i + 1] - qsl[i], sl = seq_lens[i];
        for (int64_t j0 = 0; j0 < ql; j0 += P.qb) {
            int64_t j1 = j0 + P.qb < ql ? j0 + P.qb : ql;
            int64_t end = sl - ql + j1;
            n_items += Hkv * ((end + part - 1) / part);
        }
    }
    Item* items = (Item*)malloc(sizeof(Item) * (size_t)(n_items ? n_items : 1));
    if (!items) return ERR_OOM;
    struct Group { int64_t first, nparts; int rows; };
    Group* groups = (Group*)malloc(sizeof(Group) * (size_t)(n_base ? n_base : 1));
    if (!groups) { free(items); return ERR_OOM; }
    int64_t ni = 0, ng = 0, ws_floats = 0;
    for (int i = 0; i < B; ++i) {
        int64_t ql = qsl[i + 1] - qsl[i], sl = seq_lens[i];
        for (int64_t j0 = 0; j0 < ql; j0 += P.qb) {
            int64_t j1 = j0 + P.qb < ql ? j0 + P.qb : ql;
            int64_t end = sl - ql + j1;
            int64_t np = (end + part - 1) / part;
            int rows = (int)(j1 - j0) * P.G;
            for (int h = 0; h < Hkv; ++h) {
                groups[ng] = Group{ni, np, rows};
                for (int64_t p = 0; p < np; ++p) {
                    Item& it = items[ni++];
                    it.seq = i; it.kvh = h; it.j0 = (int)j0; it.j1 = (int)j1;
                    it.t0 = p * part;
                    it.t1 = (p + 1) * part < end ? (p + 1) * part : end;
                    it.cost = (it.t1 - it.t0) * rows;
                    if (np > 1) { it.ws = ws_floats; ws_floats += (int64_t)rows * (D + 2); }
                    else it.ws = -1;
                }
                ++ng;
            }
        }
    }
    float* ws = nullptr;
    if (ws_floats) {
        ws = (float*)tl_workspace.get((size_t)ws_floats * 4);
        if (!ws) { free(items); free(groups); return ERR_OOM; }
    }
    // Longest items first, so the dynamic schedule ends balanced.
    int64_t* order = (int64_t*)malloc(sizeof(int64_t) * (size_t)(n_items ? n_items : 1));
    if (!order) { free(items); free(groups); return ERR_OOM; }
    for (int64_t k = 0; k < n_items; ++k) order[k] = k;
    qsort_r(order, (size_t)n_items, sizeof(int64_t),
            [](const void* a, const void* b, void* ctx) -> int {
                const Item* its = (const Item*)ctx;
                int64_t ca = its[*(const int64_t*)a].cost, cb = its[*(const int64_t*)b].cost;
                return ca < cb ? 1 : (ca > cb ? -1 : 0);
            },
            items);

    int fast;
    ItemFn fn = pick_item_fn(P, &fast);
    int err = OK;
    int64_t total_cost = 0;
    for (int64_t k = 0; k < n_items; ++k) total_cost += items[k].cost;
    // Waking the other threads costs ~10 us (much more on a busy machine): small calls run on one thread.
    int nt = (int)(n_items < nthreads ? (n_items ? n_items : 1) : nthreads);
    if (total_cost < SMALL_WORK) nt = 1;
#pragma omp parallel num_threads(nt)
    {
        FpEnv env;
#pragma omp for schedule(dynamic, 1)
        for (int64_t k = 0; k < n_items; ++k) {
            int e = fn(P, items[order[k]], ws);
            if (e != OK) {
#pragma omp atomic write
                err = e;
            }
        }
        if (ws_floats && err == OK) {
            // Combine partitions: out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p.
#pragma omp for schedule(dynamic, 4)
            for (int64_t g = 0; g < ng; ++g) {
                const Group& gr = groups[g];
                if (gr.nparts < 2) continue;
                const Item& first = items[gr.first];
                Item direct = first;
                direct.ws = -1;
                Rows w = rows_of(P, direct);
                float* acc = (float*)tl_scratch.get((size_t)D * 4);
                for (int r = 0; r < gr.rows; ++r) {
                    float M = -INFINITY;
                    for (int64_t p = 0; p < gr.nparts; ++p) {
                        float m = ws[items[gr.first + p].ws + (int64_t)r * (D + 2)];
                        M = m > M ? m : M;
                    }
                    float L = 0.0f;
                    for (int d = 0; d < D; ++d) acc[d] = 0.0f;
                    for (int64_t p = 0; p < gr.nparts; ++p) {
                        const float* src = ws + items[gr.first + p].ws + (int64_t)r * (D + 2);
                        if (src[1] == 0.0f) continue;  // the row saw nothing of this partition
                        float f = expf(src[0] - M);
                        L += f * src[1];
                        for (int d = 0; d < D; ++d) acc[d] += f * src[2 + d];
                    }
                    finish_row(P, direct, w, r, acc, M, L, nullptr);
                }
            }
        }
    }
    free(order);
    free(items);
    free(groups);
    return err;
}

// Quantize-on-store: key/value [T, H, D] contiguous (in_dtype) -> slots of one layer's caches.
// FP8 with static scales: k_scale/v_scale with strides. FP8 with dynamic scales (k_token_scales and
// v_token_scales non-NULL, [num_blocks, H, bs]): each (token, head) gets scale amax|x| / max_finite
// (1.0 when that is 0 or not finite), written beside its codes.
int kv8_store_kv(const void* key, const void* value, int in_dtype, int64_t T, int H, int D, const int64_t* slots,
                 void* k_cache, void* v_cache, int kv, int64_t num_blocks, int bs, const float* k_scale,
                 int64_t ks_hs, int64_t ks_ds, const float* v_scale, int64_t vs_hs, int64_t vs_ds,
                 float* k_token_scales, float* v_token_scales, int nthreads) {
    if (H <= 0 || D <= 0 || bs <= 0 || T < 0 || kv < 0 || kv > KV_F32 || in_dtype < 0 || in_dtype > DT_F32 ||
        nthreads <= 0 || (k_token_scales == nullptr) != (v_token_scales == nullptr) ||
        (k_token_scales && kv > KV_E5M2) || (kv <= KV_E5M2 && !k_token_scales && (!k_scale || !v_scale)))
        return ERR_ARGS;
    const float maxf = kv == KV_E4M3 ? 448.0f : (kv == KV_E4M3FNUZ ? 240.0f : 57344.0f);
    const int64_t nslots = num_blocks * bs;
    for (int64_t t = 0; t < T; ++t)
        if ((uint64_t)slots[t] >= (uint64_t)nslots) return ERR_SLOT;
    const int es = esize_of(kv);
    const int64_t work = T * H * D;
    int nt = work >= 65536 ? nthreads : 1;
#pragma omp parallel num_threads(nt)
    {
        FpEnv env;
        float* buf = (float*)tl_scratch.get((size_t)D * 4);
#pragma omp for schedule(static)
        for (int64_t th = 0; th < 2 * T * H; ++th) {
            int which = (int)(th / (T * H));  // 0 = K, 1 = V
            int64_t t = (th % (T * H)) / H;
            int h = (int)(th % H);
            const void* src = which ? value : key;
            const float* sc = which ? v_scale : k_scale;
            int64_t hs = which ? vs_hs : ks_hs, ds = which ? vs_ds : ks_ds;
            int64_t slot = slots[t];
            int64_t blk = slot / bs, off = slot % bs;
            uint8_t* dst = (uint8_t*)(which ? v_cache : k_cache) + (((blk * H + h) * bs + off) * D) * (int64_t)es;
            int64_t s0 = (t * H + h) * (int64_t)D;
            if ((kv == KV_BF16 && in_dtype == DT_BF16) || (kv == KV_F16 && in_dtype == DT_F16) ||
                (kv == KV_F32 && in_dtype == DT_F32)) {
                memcpy(dst, (const uint8_t*)src + s0 * es, (size_t)D * es);
                continue;
            }
            for (int d = 0; d < D; ++d) buf[d] = load_f(src, in_dtype, s0 + d);
            if (kv <= KV_E5M2) {
                if (k_token_scales) {
                    float amax = 0.0f;
                    bool nan = false;
                    for (int d = 0; d < D; ++d) {
                        float a = fabsf(buf[d]);
                        nan |= a != a;
                        amax = a > amax ? a : amax;
                    }
                    float sc1 = amax / maxf;
                    if (nan || !(sc1 > 0.0f) || sc1 == INFINITY) sc1 = 1.0f;
                    (which ? v_token_scales : k_token_scales)[(blk * H + h) * bs + off] = sc1;
                    for (int d = 0; d < D; ++d) buf[d] = buf[d] / sc1;
                } else {
                    for (int d = 0; d < D; ++d) buf[d] = buf[d] / sc[h * hs + d * ds];
                }
                if (kv == KV_E4M3) for (int d = 0; d < D; ++d) dst[d] = fp8_encode<KV_E4M3>(buf[d]);
                else if (kv == KV_E4M3FNUZ) for (int d = 0; d < D; ++d) dst[d] = fp8_encode<KV_E4M3FNUZ>(buf[d]);
                else for (int d = 0; d < D; ++d) dst[d] = fp8_encode<KV_E5M2>(buf[d]);
            } else if (kv == KV_BF16) {
                for (int d = 0; d < D; ++d) ((uint16_t*)dst)[d] = f_bf16(buf[d]);
            } else if (kv == KV_F16) {
                for (int d = 0; d < D; ++d) ((uint16_t*)dst)[d] = f_f16(buf[d]);
            } else {
                memcpy(dst, buf, (size_t)D * 4);
            }
        }
    }
    return OK;
}

// Test hooks: decode n FP8 codes of format fmt to float32 with the generic bit decoder (path 0) or the
// fast path's bf16 tables (path 1, AVX-512 builds only; returns ERR_ARGS otherwise).
int kv8_decode_fp8(int fmt, int path, const uint8_t* codes, int64_t n, float* out) {
    if (fmt < 0 || fmt > KV_E5M2) return ERR_ARGS;
    FpEnv env;
    if (path == 0) {
        for (int64_t i = 0; i < n; ++i)
            out[i] = fmt == KV_E4M3 ? fp8_bits<KV_E4M3>(codes[i])
                   : fmt == KV_E4M3FNUZ ? fp8_bits<KV_E4M3FNUZ>(codes[i]) : fp8_bits<KV_E5M2>(codes[i]);
        return OK;
    }
#if KV8_FAST
    const Lut& L = lut_for(fmt);
    for (int64_t i = 0; i < n; i += 64) {
        int64_t m = n - i < 64 ? n - i : 64;
        __mmask64 mk = m == 64 ? ~(__mmask64)0 : (((__mmask64)1 << m) - 1);
        __m512i c = _mm512_maskz_loadu_epi8(mk, codes + i);
        __m512i w0, w1;
        if (fmt == KV_E4M3) fp8_to_bf16<KV_E4M3>(c, L, w0, w1);
        else if (fmt == KV_E4M3FNUZ) fp8_to_bf16<KV_E4M3FNUZ>(c, L, w0, w1);
        else fp8_to_bf16<KV_E5M2>(c, L, w0, w1);
        alignas(64) uint16_t wb[64];
        _mm512_store_si512(wb, w0);
        _mm512_store_si512(wb + 32, w1);
        // w0 holds codes 0..7 of each 128-bit lane, w1 codes 8..15.
        for (int64_t j = 0; j < m; ++j) {
            int lane = (int)(j / 16), k = (int)(j % 16);
            out[i + j] = bf16_f(k < 8 ? wb[lane * 8 + k] : wb[32 + lane * 8 + (k - 8)]);
        }
    }
    return OK;
#else
    return ERR_ARGS;
#endif
}

}  // extern "C"
