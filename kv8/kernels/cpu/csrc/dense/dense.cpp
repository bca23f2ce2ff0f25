// kv8 CPU kernels for the dense part of a decoder layer, bf16 in and out: linear layers on pre-packed
// weights (linear.h), and RMSNorm with the residual add fused in, SiLU(gate) * up, and RoPE of q/k
// with v copied out (elementwise.h). This file is the one translation unit; the parts are
// headers so that the build stays one g++ call (kv8/kernels/cpu/build.py hashes every included file).
//
// Also the row argmax of float32 logits that the sampler uses (argmax.h), packed weights back to float32 for the
// float32 GEMM of long prefill chunks (unpack.h), linear layers on GGUF Q8_0 / Q4_0 /
// Q4_1 / Q5_0 / Q4_K / Q6_K blocks read in place (gguf.h: AVX2, or VNNI where the CPU has it), and those blocks
// dequantized into the packed layout for the GEMM of long calls (gguf_pack.h).
//
// Plain C ABI (extern "C"), loaded with ctypes by kv8/kernels/cpu/dense.py, compiled there with
// `g++ -O3 -march=native -fopenmp -shared -fPIC` (the build is kv8/kernels/cpu/build.py's). No torch headers. Each entry
// point takes a pointer to its argument struct (abi.h: declared once, its layout checked by Python at load) and
// returns OK or an error code whose message Python raises (../common/kv8_abi.h).
//
// Linear. Why: a decode step multiplies a few rows (one per running sequence) with every weight matrix, so its
// cost is reading the weights. oneDNN's bf16 GEMM reaches ~10 GB/s of weights inside the model on this
// machine (a call per matrix, weights streamed from DRAM); this kernel reads each weight exactly once
// per call from a layout that is one sequential stream per thread, and does the arithmetic with AVX-512
// BF16 `vdpbf16ps`.
//
// Packed layout of W [N, K] (row-major bf16, y = x W^T): K is padded to Kp (even), N to a multiple of 32.
// Panel p (columns 32p .. 32p+31) is Kp/2 consecutive groups of 64 bf16 values: group kk holds, for each
// of the 32 columns c, the pair (W[32p+c, 2kk], W[32p+c, 2kk+1]) -- exactly the operand order vdpbf16ps
// wants, with the matching pair of x broadcast as one 32-bit value. Padding is zero.
//
// Numerics: each product of two bf16 values is exact in fp32; sums are accumulated in fp32 (two products
// per instruction, then in k order), the bias (fp32) is added, and the result is rounded to bf16 to
// nearest-even -- what torch's bf16 linear does, up to the order of the fp32 additions.
//
// Invariants: x rows are contiguous with stride K (K even); out rows are contiguous with stride N.
// Returns OK, or ERR_ARGS for invalid arguments, ERR_NO_FAST_PATH when this build has neither the AVX-512 BF16 + VBMI
// path nor the AVX2 + FMA + F16C one (avx2.h: the same kernels and layout on CPUs without AVX-512 BF16, fp32 FMA
// in 8-lane registers), ERR_OOM when a buffer cannot be allocated.

#include "abi.h"

#include <cstdint>
#include <cmath>
#include <cstring>
#include <omp.h>

// The fast path needs AVX-512 F/BW, BF16 (vdpbf16ps) and VBMI (vpermt2b: the FP8 weights' table decode) -- the
// set the attention library's fast path needs too.
#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VBMI__)
#include <immintrin.h>
#include "../common/simd_exp.h"
#include "../common/fp8_bf16.h"
#define KV8_LINEAR_FAST 1
#else
#define KV8_LINEAR_FAST 0
#endif
// Without it, AVX2 + FMA + F16C (avx2.h): every kernel in 8-lane fp32 registers.
#if !KV8_LINEAR_FAST && defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#include <cstdlib>
#include "../common/simd_exp.h"
#define KV8_LINEAR_AVX2 1
#else
#define KV8_LINEAR_AVX2 0
#endif
#include "../common/amx_tiles.h"
#if KV8_LINEAR_FAST && KV8_AMX
#include <cstdlib>
#define KV8_LINEAR_AMX 1   // AMX-BF16 tiles for the linear layers (linear.h)
#else
#define KV8_LINEAR_AMX 0
#endif

#include "elementwise.h"
#include "linear.h"
#include "argmax.h"
#include "avx2.h"
#include "gguf.h"
#include "unpack.h"
#include "gguf_pack.h"

// ------------------------------------------------------------------------------------------------
// The C ABI
// ------------------------------------------------------------------------------------------------

extern "C" {

// The layout text of the argument structs (abi.h), checked by Python at load, and the message of return code `code`
// (NULL past the last one).
const char* kv8_abi_layout(void) { return abi_layout_text(); }
const char* kv8_error_message(int code) { return error_message(code); }

// calls[0 .. count - 1] made in order (a CPU graph's run; ../common/kv8_abi.h's run_kernel_calls): the index of the
// first that failed, its code in *code, or count.
int64_t kv8_run_calls(const kv8_kernel_call* calls, int64_t count, int32_t* code) {
    return run_kernel_calls(calls, count, code);
}

// Which path every kernel below but the packing has in this build: 1 the AVX-512 BF16 + VBMI path, 2 the AVX2 + FMA
// + F16C path (avx2.h), 0 none (the entries return ERR_NO_FAST_PATH); kv8_dense_isa names it ("avx512", "avx2",
// "none"). kv8_linear_amx_available: 1 where the linear layers can multiply with AMX tiles (compiled in, and the OS
// grants them).
int kv8_linear_available(void) { return KV8_LINEAR_FAST ? 1 : KV8_LINEAR_AVX2 ? 2 : 0; }
const char* kv8_dense_isa(void) { return KV8_LINEAR_FAST ? "avx512" : KV8_LINEAR_AVX2 ? "avx2" : "none"; }
int kv8_linear_amx_available(void) {
#if KV8_LINEAR_AMX
    return amx_permitted();
#else
    return 0;
#endif
}

// The GGUF block types of kv8_gguf_linear (gguf.h) by code (NULL past the last one); kv8_gguf_linear_available: 1
// where this build has its AVX2 path. The paths of kv8_gguf_linear_call.path by code (NULL past the last one), and
// whether this build has path `code` (1) or not (0).
const char* kv8_gguf_type_name(int code) { return code >= 0 && code < GGUF_TYPE_COUNT ? GGUF_TYPE_NAMES[code] : NULL; }
int kv8_gguf_linear_available(void) { return KV8_GGUF_AVX2; }
const char* kv8_gguf_path_name(int code) { return code >= 0 && code < GGUF_PATH_COUNT ? GGUF_PATH_NAMES[code] : NULL; }
int kv8_gguf_path_available(int code) { return gguf_path_available(code) ? 1 : 0; }

int64_t kv8_linear_packed_size(const kv8_pack_call* call) { return packed_size(*call); }
int kv8_linear_pack(const kv8_pack_call* call) { return pack(*call); }

}  // extern "C"

// The entry point `name` of a fast-path kernel (linear.h, elementwise.h, argmax.h; avx2.h where the build has the
// AVX2 path instead): `check` (the contract both paths share: check_args) on *call, OK for an empty batch without
// reading its pointers, else the kernel; ERR_NO_FAST_PATH in a build with neither path.
#if KV8_LINEAR_FAST || KV8_LINEAR_AVX2
#define KV8_ENTRY(name, Call, kernel, check)                 \
    extern "C" int name(const Call* call) {                  \
        if (!call) return ERR_ARGS;                          \
        const int rc = check;                                \
        return rc != OK || call->rows == 0 ? rc : kernel(*call); \
    }
#else
#define KV8_ENTRY(name, Call, kernel, check) extern "C" int name(const Call*) { return ERR_NO_FAST_PATH; }
#endif
KV8_ENTRY(kv8_linear, kv8_linear_call, linear<false>, check_args(*call, false))
KV8_ENTRY(kv8_linear_fp8, kv8_linear_call, linear<true>, check_args(*call, true))
KV8_ENTRY(kv8_rmsnorm, kv8_rmsnorm_call, rmsnorm, check_args(*call))
KV8_ENTRY(kv8_silu_mul, kv8_silu_mul_call, silu_mul, check_args(*call))
KV8_ENTRY(kv8_rope_qkv, kv8_rope_call, rope_qkv, check_args(*call))
KV8_ENTRY(kv8_argmax_rows, kv8_argmax_call, argmax_rows, check_args(*call))
KV8_ENTRY(kv8_unpack, kv8_unpack_call, unpack<false>, check_args(*call, false))
KV8_ENTRY(kv8_unpack_fp8, kv8_unpack_call, unpack<true>, check_args(*call, true))
#undef KV8_ENTRY

// The GGUF entries: arguments checked on every build; the kernels where they are built (gguf_linear: the call's path
// where this build has it), else no fast path.
#if KV8_GGUF_AVX2
#define KV8_GGUF_ENTRY(name, Call, kernel)                         \
    extern "C" int name(const Call* call) {                        \
        if (!call) return ERR_ARGS;                                \
        const int rc = check_args(*call);                          \
        return rc != OK || call->rows == 0 ? rc : kernel(*call);   \
    }
#else
#define KV8_GGUF_ENTRY(name, Call, kernel)                         \
    extern "C" int name(const Call* call) {                        \
        if (!call) return ERR_ARGS;                                \
        const int rc = check_args(*call);                          \
        return rc != OK ? rc : ERR_NO_FAST_PATH;                   \
    }
#endif
KV8_GGUF_ENTRY(kv8_gguf_linear, kv8_gguf_linear_call, gguf_linear)
KV8_GGUF_ENTRY(kv8_gguf_dequantize, kv8_gguf_dequantize_call, gguf_dequantize)
#undef KV8_GGUF_ENTRY

// kv8_gguf_dequantize_packed (gguf_pack.h): where the build has the GGUF and a linear path; a call of no panels
// returns OK without reading its pointers.
extern "C" int kv8_gguf_dequantize_packed(const kv8_gguf_pack_call* call) {
    if (!call) return ERR_ARGS;
    const int rc = check_args(*call);
#if KV8_GGUF_PACK
    return rc != OK || call->panels == 0 ? rc : gguf_dequantize_packed(*call);
#else
    return rc != OK ? rc : ERR_NO_FAST_PATH;
#endif
}
