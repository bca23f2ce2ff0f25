// The problem one attention call solves, its work items, and what every item kernel shares: row
// geometry, the tile walk over the paged cache (block ids checked here), prefetch, scratch, and the
// finish of a row (normalize, V scale, convert, or write a partial for the partition combine).
//
// Cache layer layout: k_cache / v_cache are [num_blocks, Hkv, bs, D] contiguous, K rows of K's format (kv,
// row_bytes) and V rows of V's (vkv, vrow_bytes): the two may differ (a pair such as int8 K with int4_per_group32 V),
// and every K address is computed with K's row bytes, every V address with V's.
// Token `pos` of a sequence lives in block `block_table[pos / bs]`, row `pos % bs`:
//
//   block_table[seq] = [ 7, 2, 9 ]        bs = 16, context of 40 tokens
//   pos  0..15 -> block 7, rows 0..15     tile at t0 = 16: 16 rows of block 2, one base pointer
//   pos 16..31 -> block 2, rows 0..15     tile at t0 = 32: 8 rows of block 9 + 8 pad rows (zeros)
//   pos 32..39 -> block 9, rows 0..7      pad rows are never read from the cache
//
// An item is (sequence, KV head, query tokens [j0, j1), context [t0, t1)); its rows are the query heads of
// the GQA group x its query tokens, token-major (row r = token j0 + r / G, head kvh * G + r % G).
//
// Row r sees context positions [first_visible(row_limit), row_limit] (both ascend with r): 0 .. its own
// position, or with a sliding window W only the W positions ending there. An item reads nothing before k0
// (the first position its first row sees); its first tile starts at k0 rounded down to TILE, and the rows of
// that tile before k0 are pad rows (zeros), never read -- neither their bytes nor, when they lie in earlier
// blocks, the block-table entries of those blocks:
//
//   W = 20, bs = 8, decode at position 43: k0 = 24, tiles start at 16
//   tile at 16: positions 16..23 pad (block 2: its entry is not looked up), 24..31 read (block 3)
//   tile at 32: positions 32..43 read (blocks 4, 5); blocks 0..2: entries never read, may hold any value
#pragma once

#include "base.h"
#include "abi.h"

static const int TILE = 16;  // context tokens per tile
static const int ROWS_PER_ITEM = 192;  // query rows (tokens x heads of a GQA group) per work item, at most
static const int ROWS_PER_ITEM_AMX = 384;  // the same where the prefill loop runs on AMX tiles (plan.h)
static const int64_t SMALL_WORK = 8192;  // (context tokens x query rows) below which one thread is used
// How far ahead (tiles of the same head) the decode kernels stream K and V into L2 where the call leaves it to the
// build (kv8_attention_call.stream_tiles 0). Measured on the Xeon with AMX (B = 32 x 1,088 tokens, SmolLM2's heads,
// 30 layers): 3 is ~1.2x the bursts it replaced, 2 / 4 / 6 a few % slower than 3, prefetcht0 instead of prefetcht1
// ~10% slower (see stream_row); on an AMD EPYC (Zen 5) 4 was 1.12x 3 with an FP8 cache. The engine times the
// distances per machine (kv8.attention.tuning) and passes its choice.
static const int DEFAULT_STREAM_TILES = 3;

// One attention call in the kernels' short names: built by make_problem (plan.h) from kv8_layer and
// kv8_attention_call, read-only in the item kernels.
struct Problem {
    const void* q;
    int q_dtype;
    void* out;
    int Hq, Hkv, D, G;
    const uint8_t* kc;
    const uint8_t* vc;
    int kv, esize;      // K's format and its element size
    int vkv, vesize;    // V's format (vkv == kv: one format) and its element size
    int64_t row_bytes;  // one head's row of D values in the K cache (kv_row_bytes(kv, D))
    int64_t vrow_bytes; // the same in the V cache (kv_row_bytes(vkv, D))
    int64_t num_blocks;
    int bs;
    const float* ks;
    int64_t ks_hs, ks_ds;
    const float* vs;
    int64_t vs_hs, vs_ds;
    const float* kts;  // dynamic per-token scales [num_blocks, Hkv, bs] of this layer's K / V, or NULL (each side on
    const float* vts;  // its own: a side of integer codes has them, a group-scaled side has none)
    int B;
    const int64_t* qsl;
    const int64_t* seq_lens;
    const int64_t* bt;
    int64_t bt_stride;
    float sm_scale;
    int64_t window;  // sliding window W (>= 1), or 0: full causal attention
    int qb;        // query tokens per item
    int bs_shift;  // log2(bs) when bs is a power of two, else -1 (divisions are slow in the tile loop)
    bool amx;      // AMX tiles may serve prefill and decode items (the call asked; the build, CPU and OS allow it)
    int stream;    // tiles ahead the decode kernels stream K and V into L2 (item_decode.h), 1 .. KV8_MAX_STREAM_TILES
};

// Whether a call with use_amx may multiply with AMX tiles: it asks, the build targets them and the OS grants them.
static inline bool amx_granted(int use_amx) {
#if KV8_ATTN_AMX
    return use_amx != 0 && amx_permitted();
#else
    (void)use_amx;
    return false;
#endif
}

static inline int64_t block_index(const Problem& P, int64_t pos) {
    return P.bs_shift >= 0 ? pos >> P.bs_shift : pos / P.bs;
}
static inline int64_t block_offset(const Problem& P, int64_t pos) {
    return P.bs_shift >= 0 ? pos & (P.bs - 1) : pos % P.bs;
}

struct Item {
    int seq, kvh, j0, j1;  // query tokens [j0, j1) of seq
    int nh;                // KV heads kvh .. kvh + nh - 1 (nh > 1 only for a kernel that says so: ItemHeads)
    int64_t t0, t1;        // context tokens [t0, t1), t0 a multiple of TILE
    int64_t k0;            // first position the item reads (t0 <= k0 < t0 + TILE in its first partition)
    int64_t ws;            // offset (floats) of this item's partial result in the workspace, -1: write output;
                           // head kvh + h's rows at ws + h * rows * (D + 2)
    int64_t cost;
};

static const int MAX_ITEM_HEADS = 4;  // KV heads of one item, at most

// The one-head item of head it.kvh + h of a several-head item (its rows' partial results where they go).
static inline Item head_item(const Item& it, int h, int rows, int D) {
    Item one = it;
    one.kvh = it.kvh + h;
    one.nh = 1;
    if (it.ws >= 0) one.ws = it.ws + (int64_t)h * rows * (D + 2);
    return one;
}

// The cache row of position pos of item it's KV head (block, head and offset flattened: its K / V codes start at
// row * row bytes, its per-token scale is entry row), or -1 where the block table (the item's row) gives a block
// id outside the cache.
static inline int64_t head_row(const Problem& P, const Item& it, const int64_t* table, int64_t pos) {
    const int64_t blk = table[block_index(P, pos)];
    return (uint64_t)blk < (uint64_t)P.num_blocks ? (blk * P.Hkv + it.kvh) * P.bs + block_offset(P, pos) : -1;
}

typedef int (*ItemFn)(const Problem&, const Item&, float*);  // runs one item; 0 or an error code
// How many KV heads (1 .. MAX_ITEM_HEADS) one item of `rows` rows may take: more than 1 only where the kernel
// that serves such items reads several heads (the decode kernels).
typedef int (*ItemHeads)(const Problem&, int rows);

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

alignas(64) static const uint8_t ZERO_ROW[4096] = {0};  // pad rows of a partial tile (row_bytes <= 4096)

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

// First visible context position of a query at position `pos` (0 without a sliding window).
static inline int64_t first_visible(const Problem& P, int64_t pos) {
    return P.window > 0 && pos - P.window + 1 > 0 ? pos - P.window + 1 : 0;
}

// Bits [a, b) of a 16-lane mask (a, b clamped to [0, 16]; empty when b <= a).
static inline uint16_t lane_range(int64_t a, int64_t b) {
    a = a < 0 ? 0 : (a > 16 ? 16 : a);
    b = b < 0 ? 0 : (b > 16 ? 16 : b);
    return b <= a ? (uint16_t)0 : (uint16_t)(((1u << b) - 1u) & ~((1u << a) - 1u));
}

// Row pointers of one tile of K and V (pad tokens point at zeros) and, with dynamic scales, the tokens'
// K and V scales (0 for pad tokens). Pad tokens: past the tile's n tokens (the last tile of an item) and
// before the item's k0 (its first tile; those rows and, where they lie in earlier blocks, their block table
// entries are never read). A side without dynamic scales has its ksc / vsc left alone for the leading pad tokens
// (the caller sets them to 1 once; later tiles use them) and zeroed for the trailing ones (the last tile); pad
// tokens are masked by every kernel (score -inf, weight 0), so their scale never matters. K rows advance by K's
// row bytes, V rows by V's. Returns false on a bad block id.
static inline bool tile_rows(const Problem& P, const Item& it, int64_t t0, int n, const uint8_t** kr,
                             const uint8_t** vr, float* ksc, float* vsc) {
    const int64_t* table = P.bt + (int64_t)it.seq * P.bt_stride;
    const int64_t krb = P.row_bytes, vrb = P.vrow_bytes;
    const int lead = it.k0 > t0 ? (int)(it.k0 - t0) : 0;  // < n: an item's tiles all hold a position >= k0
    if (P.bs % TILE == 0) {  // t0 is a multiple of TILE: the whole tile lies in one block (that of k0)
        const int64_t row0 = head_row(P, it, table, t0);
        if (row0 < 0) return false;
        const uint8_t* kb = P.kc + row0 * krb;
        const uint8_t* vb = P.vc + row0 * vrb;
        for (int t = 0; t < TILE; ++t) {
            kr[t] = kb + t * krb;
            vr[t] = vb + t * vrb;
        }
        if (P.kts)
            for (int t = lead; t < n; ++t) ksc[t] = P.kts[row0 + t];
        if (P.vts)
            for (int t = lead; t < n; ++t) vsc[t] = P.vts[row0 + t];
        for (int t = 0; t < lead; ++t) {
            kr[t] = vr[t] = ZERO_ROW;
            if (P.kts) ksc[t] = 0.0f;
            if (P.vts) vsc[t] = 0.0f;
        }
        for (int t = n; t < TILE; ++t) {
            kr[t] = vr[t] = ZERO_ROW;
            ksc[t] = vsc[t] = 0.0f;
        }
        return true;
    }
    for (int t = 0; t < TILE; ++t) {
        if (t < lead) {
            kr[t] = vr[t] = ZERO_ROW;
            if (P.kts) ksc[t] = 0.0f;
            if (P.vts) vsc[t] = 0.0f;
        } else if (t < n) {
            const int64_t row = head_row(P, it, table, t0 + t);
            if (row < 0) return false;
            kr[t] = P.kc + row * krb;
            vr[t] = P.vc + row * vrb;
            if (P.kts) ksc[t] = P.kts[row];
            if (P.vts) vsc[t] = P.vts[row];
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

// The K and/or V lines (and per-token scales) of `rows` consecutive cache rows from row `row` (K rows of krb bytes,
// V rows of vrb), into L2 (prefetcht1) or L1.
template <bool K, bool V, bool L2>
static inline void prefetch_rows(const Problem& P, int64_t row, int rows, int64_t krb, int64_t vrb) {
    const char* k = (const char*)(P.kc + row * krb);
    const char* v = (const char*)(P.vc + row * vrb);
    if (krb == vrb) {  // one format: K and V lines interleaved
        for (int64_t b = 0; b < rows * krb; b += 64) {
            if (K) L2 ? prefetch_l2(k + b) : prefetch_l1(k + b);
            if (V) L2 ? prefetch_l2(v + b) : prefetch_l1(v + b);
        }
    } else {
        if (K)
            for (int64_t b = 0; b < rows * krb; b += 64) L2 ? prefetch_l2(k + b) : prefetch_l1(k + b);
        if (V)
            for (int64_t b = 0; b < rows * vrb; b += 64) L2 ? prefetch_l2(v + b) : prefetch_l1(v + b);
    }
    if (K && P.kts) L2 ? prefetch_l2(P.kts + row) : prefetch_l1(P.kts + row);
    if (V && P.vts) L2 ? prefetch_l2(P.vts + row) : prefetch_l1(P.vts + row);
}

// Software prefetch of the K and V rows (and token scales) of the tile at t0: blocks are scattered, so the
// hardware prefetchers cannot follow. Out-of-range block ids are left to tile_rows to report; positions
// before the item's k0 are not touched. L2: into L2 (prefetcht1) rather than L1.
template <bool K = true, bool V = true, bool L2 = false>
static inline void prefetch_tile(const Problem& P, const Item& it, int64_t t0) {
    if (t0 >= it.t1) return;
    const int n = (int)(it.t1 - t0 < TILE ? it.t1 - t0 : TILE);
    const int64_t* table = P.bt + (int64_t)it.seq * P.bt_stride;
    for (int t = it.k0 > t0 ? (int)(it.k0 - t0) : 0; t < n;) {
        const int64_t row = head_row(P, it, table, t0 + t);
        if (row < 0) return;
        const int64_t off = block_offset(P, t0 + t);
        const int run = (int)(P.bs - off < n - t ? P.bs - off : n - t);  // rows of this tile in this block
        prefetch_rows<K, V, L2>(P, row, run, P.row_bytes, P.vrow_bytes);
        t += run;
    }
}
static const int PREFETCH_TILES = 2;  // prefetch distance (measured: 1..4 are within noise, none is 3x slower)

static inline float k_head_scale(const Problem& P, int kvh) { return P.ks ? P.ks[kvh * P.ks_hs] : 1.0f; }
static inline bool k_per_channel(const Problem& P) { return P.ks && P.ks_ds != 0; }

// Whether items of R rows run the prefill loop on AMX tiles (item_prefill_amx.h): granted AMX, more than 4 rows,
// bf16 compute, D % 64 == 0 and D <= 256, no per-channel K scale. Here, beside the Problem it reads, so that the
// plan (plan.h: the rows per item) and the item kernels ask the same question.
static inline bool uses_amx_loop(const Problem& P, int R) {
    return P.amx && R > 4 && P.D % 64 == 0 && P.D <= 256 && P.q_dtype == DT_BF16 && !k_per_channel(P);
}

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
// 16 lanes of f_bf16: round to nearest even on the bits, NaN -> 0x7FC0 (vcvtneps2bf16 would flush subnormals
// and keep NaN payloads), as 16-bit integers in the low half of each 32-bit lane.
static inline __m512i bf16_bits16(__m512 x) {
    const __m512i b = _mm512_castps_si512(x);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), odd)), 16);
    return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}
#endif

// Finish one row: acc (natural channel order), running max m and sum l -> output row or partial. The output
// is acc[d] * (1 / l), times the channel's V scale when there is one, rounded once to the output dtype (bf16:
// f_bf16, fp16: f_f16, round to nearest even); with AVX-512 16 channels at a time, the same products and
// roundings as the scalar loop.
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
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
    const __m512 iv = _mm512_set1_ps(inv);
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int d = 0; d < D; d += 16) {
        const __mmask16 mk = D - d >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (D - d)) - 1u);
        __m512 x = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, acc + d), iv);
        if (vs) {
            __m512 s;
            if (P.vs_ds == 0) s = _mm512_set1_ps(vs[0]);
            else if (P.vs_ds == 1) s = _mm512_maskz_loadu_ps(mk, vs + d);
            else s = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), mk,
                                              _mm512_mullo_epi32(_mm512_add_epi32(lane, _mm512_set1_epi32(d)),
                                                                 _mm512_set1_epi32((int)P.vs_ds)), vs, 4);
            x = _mm512_mul_ps(x, s);
        }
        if (P.q_dtype == DT_BF16)
            _mm512_mask_cvtepi32_storeu_epi16((uint16_t*)P.out + o + d, mk, bf16_bits16(x));
        else if (P.q_dtype == DT_F16)
            _mm256_mask_storeu_epi16((uint16_t*)P.out + o + d, mk,
                                     _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
        else _mm512_mask_storeu_ps((float*)P.out + o + d, mk, x);
    }
#else
    for (int d = 0; d < D; ++d) {
        float x = acc[d] * inv;
        if (vs) x *= vs[d * P.vs_ds];
        if (P.q_dtype == DT_BF16) ((uint16_t*)P.out)[o + d] = f_bf16(x);
        else if (P.q_dtype == DT_F16) ((uint16_t*)P.out)[o + d] = f_f16(x);
        else ((float*)P.out)[o + d] = x;
    }
#endif
}
