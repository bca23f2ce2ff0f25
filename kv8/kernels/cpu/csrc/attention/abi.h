// The argument structures of the C entry points (attention.cpp), mirrored by ctypes.Structure classes in
// kv8/kernels/cpu/attention.py. Each struct is declared once, as a field list; the same list generates the struct and
// the layout text kv8_abi_layout() returns (../common/kv8_abi.h), which Python checks against its mirror at load.
//
//   kv8_layer           one (cache, layer): constant across steps, built once per layer and reused
//   kv8_attention_call  one attention call: the query batch and its layout
//   kv8_store_call      one quantize-on-store call: the new K/V and their slots
#pragma once

#include "../common/kv8_abi.h"

#define KV8_MAX_STREAM_TILES 16   // kv8_attention_call.stream_tiles, at most

// k_cache: [num_blocks, num_kv_heads, block_size, head_dim] elements of kv_dtype (K's format); v_cache: the same of
// v_kv_dtype (V's format; equal to kv_dtype for a cache of one format, else its rows have their own size). Static
// scales (FP8): float32 with element strides over (kv head, channel), 0 = broadcast; NULL for a 16/32-bit cache
// or with dynamic scales. Dynamic per-token scales: [num_blocks, num_kv_heads, block_size] float32 beside
// the codes, per side: a side of integer codes has them, a group-scaled or 16/32-bit side has none, an FP8 side
// has them with dynamic scales; a cache of one format has them on both sides or neither.
#define KV8_LAYER_FIELDS(X)               \
    X(void*, k_cache)                     \
    X(void*, v_cache)                     \
    X(int64_t, num_blocks)                \
    X(int32_t, kv_dtype)                  \
    X(int32_t, v_kv_dtype)                \
    X(int32_t, num_kv_heads)              \
    X(int32_t, block_size)                \
    X(int32_t, head_dim)                  \
    X(const float*, k_scale)              \
    X(int64_t, k_scale_head_stride)       \
    X(int64_t, k_scale_dim_stride)        \
    X(const float*, v_scale)              \
    X(int64_t, v_scale_head_stride)       \
    X(int64_t, v_scale_dim_stride)        \
    X(float*, k_token_scales)             \
    X(float*, v_token_scales)

// q / out: [num_tokens, num_q_heads, head_dim] contiguous in q_dtype. The batch (kv8.attention.metadata):
// query_start_loc [num_seqs + 1], seq_lens [num_seqs], block_tables [num_seqs, block_table_stride], int64.
// partition_size: context tokens per partition (rounded up to 16), 0 = automatic, < 0 = never split.
// num_threads: the threads that run the call; plan_threads: the thread count the work is split for (items of
// several heads or one, automatic partitions). Results depend on the plan, never on num_threads, so a caller
// that keeps plan_threads fixed gets the same bits at any num_threads (kv8.engine.threads changes it).
// sliding_window: W >= 1 = the query at position p sees keys p - W < k <= p only; 0 = full causal attention.
// use_amx: 1 = prefill and decode items may multiply with AMX tiles where the build, the CPU and the OS allow it
// (item_prefill_amx.h, item_decode_amx.h); 0 = never (the AVX-512 paths; the two sum in different orders, so a caller
// keeps one choice for good).
// stream_tiles: how many tiles (16 context tokens of one head) ahead the decode kernels stream K and V into L2, 1 ..
// KV8_MAX_STREAM_TILES; 0 = the build's default (problem.h: DEFAULT_STREAM_TILES). It changes speed only, never a
// bit of the result: the best distance differs between CPUs, and kv8.attention.tuning times it per machine.
// With a window, block-table entries of blocks wholly before the first query's window hold anything and are
// never read (kv8.attention.metadata).
#define KV8_ATTENTION_CALL_FIELDS(X)      \
    X(const void*, q)                     \
    X(void*, out)                         \
    X(int64_t, num_tokens)                \
    X(int32_t, num_q_heads)               \
    X(int32_t, q_dtype)                   \
    X(const int64_t*, query_start_loc)    \
    X(const int64_t*, seq_lens)           \
    X(const int64_t*, block_tables)       \
    X(int64_t, block_table_stride)        \
    X(int32_t, num_seqs)                  \
    X(int32_t, num_threads)               \
    X(int32_t, plan_threads)              \
    X(float, sm_scale)                    \
    X(int64_t, partition_size)            \
    X(int64_t, sliding_window)            \
    X(int32_t, use_amx)                   \
    X(int32_t, stream_tiles)

// key / value: [num_tokens, num_kv_heads, head_dim] contiguous in in_dtype; slot_mapping [num_tokens] int64
// (slot = block * block_size + offset).
#define KV8_STORE_CALL_FIELDS(X)          \
    X(const void*, key)                   \
    X(const void*, value)                 \
    X(const int64_t*, slot_mapping)       \
    X(int64_t, num_tokens)                \
    X(int32_t, in_dtype)                  \
    X(int32_t, num_threads)

// The structs, in the order of the layout text (and of kv8/kernels/cpu/attention.py's STRUCTS).
#define KV8_ATTENTION_STRUCTS(Y)                         \
    Y(kv8_layer, KV8_LAYER_FIELDS)                       \
    Y(kv8_attention_call, KV8_ATTENTION_CALL_FIELDS)     \
    Y(kv8_store_call, KV8_STORE_CALL_FIELDS)
KV8_ABI_STRUCTS(KV8_ATTENTION_STRUCTS)
