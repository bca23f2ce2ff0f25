// The argument structures of the dense library's entry points (dense.cpp), mirrored by ctypes.Structure classes in
// kv8/kernels/cpu/dense.py. Each struct is declared once, as a field list; the same list generates the struct and the
// layout text kv8_abi_layout() returns (../common/kv8_abi.h), which Python checks against its mirror at load.
//
//   kv8_pack_call      one weight matrix into the packed layout (kv8_linear_packed_size, kv8_linear_pack)
//   kv8_linear_call    one linear layer on packed weights (kv8_linear: bf16, kv8_linear_fp8: E4M3 codes)
//   kv8_rmsnorm_call   residual add + RMSNorm (kv8_rmsnorm)
//   kv8_silu_mul_call  SiLU(gate) * up (kv8_silu_mul)
//   kv8_rope_call      RoPE of q and k read from packed q/k/v rows, v copied out (kv8_rope_qkv)
//   kv8_argmax_call    row argmax of float32 logits (kv8_argmax_rows)
//   kv8_gguf_linear_call  one linear layer on GGUF Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q4_K / Q6_K blocks (kv8_gguf_linear)
//   kv8_gguf_dequantize_call  those blocks to float32 (kv8_gguf_dequantize, gguf.h)
//   kv8_gguf_pack_call  those blocks to bf16 in the packed layout (kv8_gguf_dequantize_packed, gguf_pack.h)
//   kv8_unpack_call    rows of packed weights back to float32 (kv8_unpack: bf16, kv8_unpack_fp8: E4M3 codes; unpack.h)
//
// Every entry point returns OK or an error code of ../common/kv8_abi.h (ERR_ARGS, ERR_OOM, ERR_NO_FAST_PATH) whose
// message Python raises. bf16 tensors are uint16_t bits; rows are contiguous. Empty batches: an entry with rows == 0
// returns OK without reading its pointers, which may be NULL (a step whose rows all failed;
// tests/engine/test_empty_batch.py).
#pragma once

#include "../common/kv8_abi.h"

// weight: [out_features, in_features] bf16, row-major; packed: kv8_linear_packed_size values (dense.cpp's layout).
#define KV8_PACK_CALL_FIELDS(X)           \
    X(const uint16_t*, weight)            \
    X(uint16_t*, packed)                  \
    X(int64_t, out_features)              \
    X(int64_t, in_features)

// out [rows, out_features] = x [rows, in_features] @ W^T (+ bias): packed holds W (kv8_linear: bf16 in the packed
// layout; kv8_linear_fp8: E4M3 codes of W / scale in the FP8 order, see decode_panels_fp8), scale its float32 scale
// per packed row (kv8_linear_fp8 only; NULL for kv8_linear), bias NULL or float32 per packed row. gated != 0: W holds
// gate and up rows interleaved by 16 and out is silu(gate) * up, out_features wide (linear.h). use_amx != 0: the AMX
// path where this build and process have it and in_features % 32 == 0, else vdpbf16ps (the two sum in different
// orders: a caller keeps one choice for good). fp8_register_rows (>= 0; kv8_linear_fp8 on the vdpbf16ps path):
// calls of up to this many rows decode each pair-row of codes in registers for every block of rows, longer calls
// decode a few panels at a time into a buffer, once per call (linear_avx512); both give the same bits, which is
// faster depends on the CPU (kv8.layers.tuning chooses per machine).
#define KV8_LINEAR_CALL_FIELDS(X)         \
    X(const uint16_t*, x)                 \
    X(const void*, packed)                \
    X(const float*, scale)                \
    X(const float*, bias)                 \
    X(uint16_t*, out)                     \
    X(int64_t, rows)                      \
    X(int64_t, in_features)               \
    X(int64_t, out_features)              \
    X(int32_t, num_threads)               \
    X(int32_t, gated)                     \
    X(int32_t, use_amx)                   \
    X(int32_t, fp8_register_rows)

// h = x (+ residual, rounded to bf16); residual_out = h (if not NULL; it may alias residual or x);
// out = bf16(weight * bf16(h * rsqrt(mean(h^2) + eps))). x, residual, residual_out, out: [rows, hidden]; weight:
// [hidden].
#define KV8_RMSNORM_CALL_FIELDS(X)        \
    X(const uint16_t*, x)                 \
    X(const uint16_t*, residual)          \
    X(uint16_t*, residual_out)            \
    X(const uint16_t*, weight)            \
    X(uint16_t*, out)                     \
    X(int64_t, rows)                      \
    X(int64_t, hidden)                    \
    X(float, eps)                         \
    X(int32_t, num_threads)

// gate_up: [rows, 2 intermediate] (gate | up); out [rows, intermediate] = bf16(bf16(silu(gate)) * up).
#define KV8_SILU_MUL_CALL_FIELDS(X)       \
    X(const uint16_t*, gate_up)           \
    X(uint16_t*, out)                     \
    X(int64_t, rows)                      \
    X(int64_t, intermediate)              \
    X(int32_t, num_threads)

// qkv: [rows, row_stride] with q at column 0 (num_heads * head_dim), k after it and v after k (num_kv_heads *
// head_dim each); cos, sin: [rows, head_dim / 2] float32. q_out [rows, num_heads, head_dim] and k_out [rows,
// num_kv_heads, head_dim] rotated (rotate-half), v_out [rows, num_kv_heads, head_dim] copied.
#define KV8_ROPE_CALL_FIELDS(X)           \
    X(const uint16_t*, qkv)               \
    X(const float*, cos)                  \
    X(const float*, sin)                  \
    X(uint16_t*, q_out)                   \
    X(uint16_t*, k_out)                   \
    X(uint16_t*, v_out)                   \
    X(int64_t, rows)                      \
    X(int64_t, row_stride)                \
    X(int32_t, num_heads)                 \
    X(int32_t, num_kv_heads)              \
    X(int32_t, head_dim)                  \
    X(int32_t, num_threads)

// x: [rows, cols] float32; out [rows] int64 = the lowest index of each row's maximum (argmax.h).
#define KV8_ARGMAX_CALL_FIELDS(X)         \
    X(const float*, x)                    \
    X(int64_t*, out)                      \
    X(int64_t, rows)                      \
    X(int64_t, cols)                      \
    X(int32_t, num_threads)

// out [rows, out_features] bf16 = x [rows, in_features] bf16 @ W^T (+ bias, float32 [out_features] or NULL): blocks
// holds W as GGUF blocks of type qtype (gguf.h's codes: kv8_gguf_type_name), out_features rows of in_features /
// GGUF_BLOCK_VALUES blocks each (32 values; Q4_K, Q6_K 256), in_features a multiple of that. path: the kernel's
// instructions (gguf.h's codes: kv8_gguf_path_name; one this build lacks returns ERR_NO_FAST_PATH); every path
// computes the same bits.
#define KV8_GGUF_LINEAR_CALL_FIELDS(X)    \
    X(const uint16_t*, x)                 \
    X(const uint8_t*, blocks)             \
    X(const float*, bias)                 \
    X(uint16_t*, out)                     \
    X(int64_t, rows)                      \
    X(int64_t, in_features)               \
    X(int64_t, out_features)              \
    X(int32_t, qtype)                     \
    X(int32_t, num_threads)               \
    X(int32_t, path)

// out [rows, in_features] float32 = W dequantized: blocks as in kv8_gguf_linear_call (rows rows of blocks of type
// qtype, the kernel's grouped order).
#define KV8_GGUF_DEQUANTIZE_CALL_FIELDS(X) \
    X(const uint8_t*, blocks)             \
    X(float*, out)                        \
    X(int64_t, rows)                      \
    X(int64_t, in_features)               \
    X(int32_t, qtype)                     \
    X(int32_t, num_threads)

// out = panels first_panel .. first_panel + panels - 1 of the packed bf16 layout (kv8_linear's: 32 * in_features values
// a panel) of W dequantized and rounded to bf16: blocks as in kv8_gguf_dequantize_call (rows rows of type qtype).
// gated != 0: W = [gate; up] (rows even), the panels those of the gated kernel's interleaved order (gguf_pack.h).
#define KV8_GGUF_PACK_CALL_FIELDS(X)      \
    X(const uint8_t*, blocks)             \
    X(uint16_t*, out)                     \
    X(int64_t, rows)                      \
    X(int64_t, in_features)               \
    X(int64_t, first_panel)               \
    X(int64_t, panels)                    \
    X(int32_t, qtype)                     \
    X(int32_t, gated)                     \
    X(int32_t, num_threads)

// out [rows, in_features] float32 = rows first .. first + rows - 1 of the matrix in packed (kv8_unpack: the bf16 packed
// layout, exact; kv8_unpack_fp8: the FP8 one, decode(code) * scale[first + r], scale float32 per packed row; NULL for
// kv8_unpack). first % 32 == 0; rows past the packed matrix's last are not allowed (the caller checks its size).
#define KV8_UNPACK_CALL_FIELDS(X)         \
    X(const void*, packed)                \
    X(const float*, scale)                \
    X(float*, out)                        \
    X(int64_t, first)                     \
    X(int64_t, rows)                      \
    X(int64_t, in_features)               \
    X(int32_t, num_threads)

// The structs, in the order of the layout text (and of kv8/kernels/cpu/dense.py's STRUCTS).
#define KV8_DENSE_STRUCTS(Y)                                     \
    Y(kv8_pack_call, KV8_PACK_CALL_FIELDS)                       \
    Y(kv8_linear_call, KV8_LINEAR_CALL_FIELDS)                   \
    Y(kv8_rmsnorm_call, KV8_RMSNORM_CALL_FIELDS)                 \
    Y(kv8_silu_mul_call, KV8_SILU_MUL_CALL_FIELDS)               \
    Y(kv8_rope_call, KV8_ROPE_CALL_FIELDS)                       \
    Y(kv8_argmax_call, KV8_ARGMAX_CALL_FIELDS)                   \
    Y(kv8_gguf_linear_call, KV8_GGUF_LINEAR_CALL_FIELDS)         \
    Y(kv8_gguf_dequantize_call, KV8_GGUF_DEQUANTIZE_CALL_FIELDS) \
    Y(kv8_gguf_pack_call, KV8_GGUF_PACK_CALL_FIELDS)             \
    Y(kv8_unpack_call, KV8_UNPACK_CALL_FIELDS)
KV8_ABI_STRUCTS(KV8_DENSE_STRUCTS)
