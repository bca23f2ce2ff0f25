// kv8 CPU kernels: fused paged attention over a paged KV cache of 4/8/16/32-bit formats -- K and V in one format or
// each in its own (a pair) -- and quantize-on-store.
//
// The one translation unit of the library: it includes the parts below and defines the C ABI (extern "C",
// argument structs in abi.h), loaded with ctypes by kv8/kernels/cpu/attention.py and compiled by kv8/kernels/cpu/build.py
// (`g++ -O3 -march=<march> -fopenmp -shared -fPIC`; the build hash covers every file included here, recursively).
// No torch headers: pointers and sizes only.
//
//   ../common/kv8_abi.h    dtype and error codes with their names and messages (their one definition, shared
//                          with the dense library), the argument-struct declaration and layout text
//   base.h                 which fast paths the build has, scalar conversions, FP8 codecs on bits
//   abi.h                  kv8_layer / kv8_attention_call / kv8_store_call
//   problem.h              Problem, items, row geometry, tile walk (block ids checked), prefetch, row finish
//   plan.h                 work items, threads, partition combine (log-sum-exp)
//   item_generic.h         item kernel: fp32, any KV dtype / head dim / ISA
//   item_avx2.h            item kernel: fp32 on AVX2 + FMA, any KV dtype, head dims a multiple of 8
//   fast_simd.h            AVX-512 BF16 building blocks: FP8 / int8 / int4 -> bf16 tables, K / V register layouts,
//                          P.V step
//   tile_chunk.h           what the tile loops share: chunk walk, V decode and P.V, the prefill loop's row step
//   item_prefill_amx.h     the prefill loop's blocks on AMX tiles (16 rows)
//   item_prefill.h         the tile kernel's prefill loop (items of more than 4 rows with D <= 128)
//   item_tile.h            item kernel: AVX-512 BF16, any item shape (prefill, fp16 / fp32 compute); its chunked
//                          tile loop, and the prefill loop where it applies
//   item_staged.h          the tile kernel on int8 / int4 / int4_per_group32 / fp4_e2m1 tiles decoded to bf16
//   item_decode.h          item kernel: AVX-512 BF16, decode-shaped items (<= 4 rows, bf16 compute; FP8, bf16,
//                          int8, int4, int4_per_group32, fp4_e2m1)
//   item_decode_amx.h      the decode item kernel on AMX tiles
//   ../common/amx_tiles.h  AMX permission and tile configuration (shared with the dense library)
//   ../common/fp8_bf16.h   FP8 -> bf16 table decode in registers (shared with the dense library's FP8 weights)
//   store.h                quantize-on-store
//   store_int4_group.h     int4_per_group32's encoder: each group's float16 scale by a search (AVX-512 and reference)
//
// Cache layer layout: k_cache / v_cache are [num_blocks, H_kv, block_size, D] contiguous (uint8 FP8 codes,
// or bf16 / fp16 / fp32; K in kv8_layer.kv_dtype, V in v_kv_dtype, each row the size of its format). read = decode(code) * scale, with static scales (float32, element strides over
// (kv head, channel), 0 = broadcast) or dynamic per-token scales ([num_blocks, H_kv, block_size] float32
// beside the codes).
//
// Item kernels (one per item; pick_item_fn):
//   FAST (AVX-512 F/BW/VL + VBMI + BF16 compiled in; KV dtype fp8 x3 or bf16; D % 16 == 0, D <= 1024):
//     decode-shaped items with bf16 compute -> run_item_decode (with AMX tiles -- the call's use_amx, an AMX
//     build, CPU and OS -- and K scales not per channel: run_item_decode_amx), every other item ->
//     run_item_tile (items of more than 4 rows with D <= 128 -> its prefill loop, run_item_prefill; with AMX
//     tiles, bf16 compute without per-channel K scales and D % 64 == 0, D <= 256 -> the same loop on AMX
//     tiles, 16 rows per block)
//   FAST, KV dtype int8 / int4 / int4_per_group32 / fp4_e2m1 (D % 16 == 0, D <= 1024; run_item_coded):
//     decode-shaped items the decode kernel serves -> run_item_decode (int8 with AMX tiles and K scales not per
//     channel: run_item_decode_amx); items of more than 4 rows -> run_item_tile on tiles decoded to bf16
//     (item_staged.h; its prefill loop on AMX tiles as for a bf16 cache; int4_per_group32 with bf16 compute only);
//     every other item -> the AVX2 / generic kernel below
//   FAST, K and V in different formats (a pair), each of those four, FP8 or bf16 (run_item_coded): decode-shaped items of the pairs with decode instances (int8 K with int4_per_group32 or int4
//     V: decode_pair_fn) -> run_item_decode on K's and V's formats; every other item -> run_item_tile on K tiles
//     staged from K's format and V tiles from V's (FP8 and bf16 staged too), where staged tiles serve it; else the
//     generic kernel
//   K and V in different formats otherwise (an fp16 / fp32 side) -> run_item_generic, two row decoders
//   otherwise, AVX2 + FMA + F16C compiled in and D % 8 == 0, D <= 1024 -> run_item_avx2
//   otherwise -> run_item_generic
// All kernels clear MXCSR DAZ/FTZ in their threads (FpEnv), so FP8 subnormals survive.
//
// Sliding window (kv8_attention_call.sliding_window = W > 0): every item covers only the positions its rows
// see (plan.h: from the first row's first key, rounded down to a 16-token tile), every kernel masks keys
// outside a row's [position - W + 1, position], and nothing before the first key is read -- rows, scales or
// block-table entries (problem.h: tile_rows, prefetch_tile; item_decode.h: its padded first tile).
//
// Entry points: production (kv8_has_fast_path, the stream distances, the code tables, kv8_abi_layout,
// kv8_paged_attention, kv8_store_kv) and, at the end, a testing interface (kv8_test_*) that production code never
// calls.

#include "base.h"
#include "abi.h"
#include "problem.h"
#include "plan.h"
#include "item_generic.h"
#include "item_avx2.h"
#include "tile_chunk.h"
#include "item_prefill_amx.h"
#include "item_prefill.h"
#include "item_tile.h"
#include "item_staged.h"
#include "item_decode.h"
#include "item_decode_amx.h"
#include "store.h"

enum { KERNEL_GENERIC = 0, KERNEL_TILE = 1, KERNEL_DECODE = 2, KERNEL_PREFILL = 3, KERNEL_AMX = 4,
       KERNEL_AMX_DECODE = 5, KERNEL_AVX2 = 6 };

// The fp32 item kernel of a problem: AVX2 where compiled in and the head dim suits it, else generic.
static ItemFn fp32_item_fn(const Problem& P) {
#if KV8_AVX2
    if (avx2_serves(P)) return avx2_item_fn(P);
#endif
    (void)P;
    return run_item_generic;
}

#if KV8_FAST
// Whether the tile kernel serves items of `rows` rows of staged formats (item_staged.h): items that staged tiles
// serve, prefill items (more than 4 rows) of a cache of one format, and every item of a pair (K and V in different
// formats) that decode_fn does not take (the fp32 kernel left for them is the scalar generic one).
static inline bool staged_item(const Problem& P, int rows) {
    return (rows > 4 || P.vkv != P.kv) && staged_serves(P);
}

// An item of an integer or group-scaled cache (kv_staged): a decode kernel where one serves the item's rows (AMX
// tiles first: int8), else the tile kernel on staged bf16 tiles for prefill items, else the fp32 kernel.
template <bool QLO, bool PLO>
static int run_item_coded(const Problem& P, const Item& it, float* ws) {
    const int rows = (it.j1 - it.j0) * P.G;
#if KV8_ATTN_AMX
    if (ItemFn f = decode_amx_fn(P, rows)) return f(P, it, ws);
#endif
    if (ItemFn f = decode_fn(P, rows)) return f(P, it, ws);
    if (staged_item(P, rows)) return run_item_staged<QLO, PLO>(P, it, ws);
    return fp32_item_fn(P)(P, it, ws);
}

// A fast item: a decode kernel where one applies to the item's rows (AMX tiles first), else the tile kernel.
template <bool QLO, bool PLO>
static int run_item_fast(const Problem& P, const Item& it, float* ws) {
#if KV8_ATTN_AMX
    if (ItemFn f = decode_amx_fn(P, (it.j1 - it.j0) * P.G)) return f(P, it, ws);
#endif
    if (ItemFn f = decode_fn(P, (it.j1 - it.j0) * P.G)) return f(P, it, ws);
    return run_item_tile<QLO, PLO>(P, it, ws);
}
#endif

// KV heads per item (ItemHeads): every head of a sequence (up to MAX_ITEM_HEADS) where a decode kernel serves
// the rows -- a block's rows of all heads lie together, so one item reads them in address order and the
// hardware prefetchers follow it (docs/benchmarks.md, "Decode items of all KV heads"); else one.
static int item_heads_of(const Problem& P, int rows) {
#if KV8_FAST
#if KV8_ATTN_AMX
    if (decode_amx_fn(P, rows) != nullptr) return MAX_ITEM_HEADS;
#endif
    if (decode_fn(P, rows) != nullptr) return MAX_ITEM_HEADS;
#endif
    (void)P;
    (void)rows;
    return 1;
}

// The item function of a problem; *fast = 1 when it is a fast one.
static ItemFn pick_item_fn(const Problem& P, int* fast) {
    *fast = 0;
#if KV8_FAST
    const bool qlo = !(P.q_dtype == DT_BF16 && !k_per_channel(P));
    const bool plo = P.q_dtype != DT_BF16;  // bf16 compute: weights in bf16, as precise as the output
    if (P.D % 16 == 0 && P.D <= 1024 && kv_bf16_exact(P.kv) && P.vkv == P.kv) {
        *fast = 1;
        if (qlo) return plo ? run_item_fast<true, true> : run_item_fast<true, false>;
        return plo ? run_item_fast<false, true> : run_item_fast<false, false>;
    }
    if (P.D % 16 == 0 && P.D <= 1024 &&   // integer / group-scaled codes; a pair with such a side (item_staged.h)
        (P.vkv == P.kv ? kv_staged(P.kv) : kv_pair_stageable(P.kv) && kv_pair_stageable(P.vkv))) {
        *fast = 1;
        if (qlo) return plo ? run_item_coded<true, true> : run_item_coded<true, false>;
        return plo ? run_item_coded<false, true> : run_item_coded<false, false>;
    }
#endif
    return fp32_item_fn(P);
}

extern "C" {

// ------------------------------------------------------------------------------------------------
// Production interface
// ------------------------------------------------------------------------------------------------

// 1 when the AVX-512 BF16 fast path is compiled in.
int kv8_has_fast_path(void) { return KV8_FAST; }

// 1 when the AVX2 item kernel is compiled in.
int kv8_has_avx2_path(void) { return KV8_AVX2; }

// 1 when prefill and decode items can multiply with AMX tiles: compiled in, and the OS grants the tiles.
int kv8_attention_amx_available(void) { return amx_granted(1) ? 1 : 0; }

// The decode kernels' stream distance (kv8_attention_call.stream_tiles) where a call passes 0, and the largest a
// call may pass.
int kv8_default_stream_tiles(void) { return DEFAULT_STREAM_TILES; }
int kv8_max_stream_tiles(void) { return KV8_MAX_STREAM_TILES; }

// Name of KV dtype / compute dtype `code`, NULL past the last one: Python builds its code tables from these.
const char* kv8_kv_dtype_name(int code) { return code >= 0 && code < KV_COUNT ? KV_FORMATS[code].name : nullptr; }
const char* kv8_compute_dtype_name(int code) {
    return code >= 0 && code < DT_COUNT ? COMPUTE_DTYPE_NAMES[code] : nullptr;
}

// Message of return code `code` (0 = "ok"), NULL past the last one.
const char* kv8_error_message(int code) { return error_message(code); }

// Names, offsets and sizes of the argument structs' fields (abi.h), checked by Python at load.
const char* kv8_abi_layout(void) { return abi_layout_text(); }

// calls[0 .. count - 1] made in order (a CPU graph's run; ../common/kv8_abi.h's run_kernel_calls): the index of the
// first that failed, its code in *code, or count.
int64_t kv8_run_calls(const kv8_kernel_call* calls, int64_t count, int32_t* code) {
    return run_kernel_calls(calls, count, code);
}

// Paged attention of one layer over the stored context (see kv8_attention_call). Checks what memory safety
// needs (lengths, table width, block ids) and returns an error code; the other arguments are trusted.
int kv8_paged_attention(const kv8_layer* layer, const kv8_attention_call* call) {
    Problem P;
    int err = make_problem(*layer, *call, P);
    if (err != OK) return err;
    int fast;
    ItemFn fn = pick_item_fn(P, &fast);
    if (call->plan_threads <= 0) return ERR_ARGS;
    return run_attention(P, call->num_tokens, call->num_threads, call->plan_threads, call->partition_size, fn,
                         fast ? item_heads_of : nullptr);
}

// Quantize-on-store of one layer (see kv8_store_call); ERR_SLOT when a slot lies outside the cache.
int kv8_store_kv(const kv8_layer* layer, const kv8_store_call* call) { return run_store(*layer, *call); }

// ------------------------------------------------------------------------------------------------
// Testing interface: entry points for kv8's tests only (kv8.kernels.cpu.attention.KernelTesting)
// ------------------------------------------------------------------------------------------------

// Which item kernel serves items of `rows` rows (query heads per KV head x query tokens of one sequence) in a
// call with use_amx: KERNEL_GENERIC, KERNEL_AVX2, KERNEL_TILE, KERNEL_DECODE, KERNEL_PREFILL (the tile kernel's prefill
// loop), KERNEL_AMX (that loop on AMX tiles) or KERNEL_AMX_DECODE (the decode kernel on AMX tiles);
// kv / vkv: K's and V's formats; k_per_channel: the K scales are per channel.
int kv8_test_item_kernel(int kv, int vkv, int q_dtype, int D, int bs, int rows, int use_amx, int k_per_channel) {
    static const float one = 1.0f;
    if (kv < 0 || kv >= KV_COUNT || vkv < 0 || vkv >= KV_COUNT) return -1;
    Problem P;
    memset(&P, 0, sizeof(P));
    P.kv = kv;
    P.vkv = vkv;
    P.q_dtype = q_dtype;
    P.D = D;
    P.bs = bs;
    if (k_per_channel) {
        P.ks = &one;
        P.ks_ds = 1;
    }
    P.amx = amx_granted(use_amx);
    int fast;
    const ItemFn fn = pick_item_fn(P, &fast);
    if (!fast) return fn == run_item_generic ? KERNEL_GENERIC : KERNEL_AVX2;
#if KV8_FAST
    if (!kv_bf16_exact(kv) || vkv != kv) {  // integer / group codes, or a pair (run_item_coded): a decode kernel,
                                            // the tile kernel on staged tiles (its prefill loop on AMX tiles where
                                            // granted: staged_view keeps P.amx) or fp32
#if KV8_ATTN_AMX
        if (bs > 0 && decode_amx_fn(P, rows) != nullptr) return KERNEL_AMX_DECODE;
#endif
        if (bs > 0 && decode_fn(P, rows) != nullptr) return KERNEL_DECODE;
        if (!staged_item(P, rows)) return fp32_item_fn(P) == run_item_generic ? KERNEL_GENERIC : KERNEL_AVX2;
#if KV8_ATTN_AMX
        if (uses_amx_loop(staged_view(P), rows)) return KERNEL_AMX;
#endif
        return uses_prefill_loop(D, rows) ? KERNEL_PREFILL : KERNEL_TILE;
    }
#if KV8_ATTN_AMX
    if (bs > 0 && decode_amx_fn(P, rows) != nullptr) return KERNEL_AMX_DECODE;
#endif
    if (bs > 0 && decode_fn(P, rows) != nullptr) return KERNEL_DECODE;
#if KV8_ATTN_AMX
    if (uses_amx_loop(P, rows)) return KERNEL_AMX;
#endif
    if (uses_prefill_loop(D, rows)) return KERNEL_PREFILL;
#endif
    (void)rows;
    return KERNEL_TILE;
}

// FP8 codes -> float with decoder `path`: 0 the bits (generic kernel), 1 the bf16 tables (AVX-512 kernels), 2 the
// AVX2 kernel's 8 lanes (E4M3: through fp16 for 8 codes without a NaN code, else exactly; times 2^(15 - bias));
// ERR_ARGS where the build lacks the path.
int kv8_test_decode_fp8(int fmt, int path, const uint8_t* codes, int64_t n, float* out) {
    if (fmt < 0 || fmt >= KV_COUNT || !KV_FORMATS[fmt].fp8) return ERR_ARGS;
    FpEnv env;
    if (path == 0) {
        with_kv_format(fmt, [&](auto K) {
            if constexpr (KV_FORMATS[decltype(K)::value].fp8)
                for (int64_t i = 0; i < n; ++i) out[i] = fp8_bits<decltype(K)::value>(codes[i]);
        });
        return OK;
    }
    if (path == 2) {
#if KV8_AVX2
        for (int64_t i = 0; i < n; i += 8) {
            uint8_t c[8] = {0};
            alignas(32) float v[8];
            const int64_t m = n - i < 8 ? n - i : 8;
            memcpy(c, codes + i, (size_t)m);
            with_kv_format(fmt, [&](auto K) {  // as the kernel reads a row: through fp16 unless it holds a NaN code
                constexpr int KV = decltype(K)::value;
                if constexpr (half_codes<KV>()) {
                    const uint8_t* row = c;
                    const __m256 x = rows_have_nan<KV>(&row, 1, 8) ? decode8<KV, false>(c, 0) : decode8<KV, true>(c, 0);
                    _mm256_store_ps(v, _mm256_mul_ps(x, _mm256_set1_ps(half_scale<KV>())));
                } else if constexpr (KV_FORMATS[KV].fp8) {
                    _mm256_store_ps(v, decode8<KV, true>(c, 0));
                }
            });
            memcpy(out + i, v, sizeof(float) * (size_t)m);
        }
        return OK;
#else
        return ERR_ARGS;
#endif
    }
#if KV8_FAST
    const Lut& L = lut_for(fmt);
    for (int64_t i = 0; i < n; i += 64) {
        int64_t m = n - i < 64 ? n - i : 64;
        __mmask64 mk = m == 64 ? ~(__mmask64)0 : (((__mmask64)1 << m) - 1);
        __m512i c = _mm512_maskz_loadu_epi8(mk, codes + i);
        __m512i w0, w1;
        with_kv_format(fmt, [&](auto K) { fp8_to_bf16<decltype(K)::value>(c, L, w0, w1); });
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

// The softmax weights of the AVX-512 kernels (exp2_weights, fast_simd.h): out[i] = e^(s[i] - ref) in the form whose
// weights are then rounded to bf16 (bf16 = 1, degree 3) or the one that keeps 16 bits (bf16 = 0, degree 5).
// ERR_ARGS without the AVX-512 BF16 path.
int kv8_test_softmax_weights(int bf16, const float* s, int64_t n, float ref, float* out) {
#if KV8_FAST
    const __m512 log2e = _mm512_set1_ps(LOG2E), ref2 = _mm512_set1_ps(ref * LOG2E);
    for (int64_t i = 0; i < n; i += 16) {
        const __mmask16 m = n - i < 16 ? (__mmask16)((1u << (n - i)) - 1) : (__mmask16)0xFFFF;
        const __m512 x = _mm512_maskz_loadu_ps(m, s + i);
        _mm512_mask_storeu_ps(out + i, m, bf16 ? exp2_weights<true>(x, log2e, ref2) : exp2_weights<false>(x, log2e, ref2));
    }
    return OK;
#else
    (void)bf16; (void)s; (void)n; (void)ref; (void)out;
    return ERR_ARGS;
#endif
}

}  // extern "C"
