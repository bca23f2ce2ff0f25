// kv8 CPU kernels for the dense part of a decoder layer, bf16 in and out: linear layers on pre-packed
// weights (linear.h), and RMSNorm with the residual add fused in, SiLU(gate) * up, and RoPE of q/k
// with v copied out (elementwise.h). This file is the one translation unit; the parts are
// headers so that the build stays one g++ call (kv8/kernels/build.py hashes every included file).
//
// Also the row argmax of float32 logits that the sampler uses (argmax.h).
//
// Plain C ABI (extern "C"), loaded with ctypes by kv8/kernels/dense.py, compiled there with
// `g++ -O3 -march=native -fopenmp -shared -fPIC` (the build is kv8/kernels/build.py's). No torch headers.
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
// Returns 0, or 5 for invalid arguments, 7 when this build has no AVX-512 BF16 + VBMI path, 8 when a buffer cannot be
// allocated.

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
