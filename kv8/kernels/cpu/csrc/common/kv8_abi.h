// What kv8's two kernel libraries (../attention, ../dense) share at their C boundary, defined once: the dtype codes
// and the table of KV cache formats, the error codes and their messages, and the machinery that declares argument
// structs and spells their layout. Python (kv8/kernels/cpu/abi.py) reads the names, the messages and the layout from each
// library at load, so no number defined here is copied on the Python side.
//
// Argument structs: a library lists its structs once, STRUCTS(Y) calling Y(S, FIELDS) for each struct S whose
// fields FIELDS(X) lists as X(type, name). KV8_ABI_STRUCTS(STRUCTS) declares the structs from the lists and
// abi_layout_text(), which spells their layout as "S <size>: <field>@<offset>+<size> ...; S2 ...;" (structs and
// fields in list order): the text kv8.kernels.cpu.abi.abi_layout builds from the ctypes mirror. The library exports
// it as kv8_abi_layout(), and Python refuses a library whose text differs from its mirror's. The layout text starts
// with the structs every library shares (KV8_COMMON_STRUCTS: kv8_kernel_call), then the library's own.
//
// Replaying recorded calls: run_kernel_calls (below), exported by each library as kv8_run_calls, calls a list of
// entry points -- of either library: it only follows function pointers -- in order, for a CPU graph's runs of kernel
// calls (kv8/kernels/cpu/graph.py). It lives here, not in one library, so that a graph replays through whichever
// library it recorded (a model on the torch dense backend loads only the attention library).
#pragma once

#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

// Query / output / store input types ("compute dtype"); the names are torch dtype names.
enum { DT_BF16 = 0, DT_F16 = 1, DT_F32 = 2, DT_COUNT = 3 };
static const char* const COMPUTE_DTYPE_NAMES[DT_COUNT] = {"bfloat16", "float16", "float32"};

// KV cache element types (and the FP8 weights' E4M3): KV_FORMATS[code] says everything the kernels need to know of
// a format -- the store, every decode path and the FP8 -> bf16 tables read it rather than compare codes; template
// parameters that pick code paths at compile time are codes whose traits are read from this table as constants.
enum { KV_E4M3 = 0, KV_E4M3FNUZ = 1, KV_E5M2 = 2, KV_BF16 = 3, KV_F16 = 4, KV_F32 = 5, KV_I8 = 6, KV_I4 = 7,
       KV_FP4 = 8, KV_I4G = 9, KV_COUNT = 10 };
struct KvFormat {
    const char* name;   // kv8.quant.formats.KVCacheDtype.name
    int esize;          // bytes per element
    int elem;           // a 16/32-bit format: the compute dtype (DT_*) of the same element type; codes: -1
    bool fp8;           // the fields below up to nan_code describe an FP8 format (and are 0 for the others)
    int ibits;          // symmetric integer codes of 8 or 4 bits (0: none), always with a scale per token and head;
                        // max_finite is the largest code (127, 7); 4-bit: two per byte, the even channel in the low
                        // nibble (two's complement)
    int mbits;          // mantissa bits
    int bias;           // exponent bias
    float max_finite;   // the largest finite value (the store saturates to it; integer codes: the largest code)
    bool nan_0x80;      // code 0x80 is the one NaN, and there is no -0 (the "fnuz" formats)
    bool has_inf;       // IEEE-style: the top exponent holds inf and NaNs; else only magnitude 0x7f is NaN ("fn")
    uint8_t nan_code;   // what the encoders write for NaN (with its sign bit where the format has a -NaN)
    int group;          // codes two per byte (the even channel in the low nibble) with a scale per `group` values
                        // after the row's codes; 0: none. Which codes and scales: gscale
    int gscale;         // bytes of one group scale: 1 = E4M3 with E2M1 codes (kv8.quant.fp4), 2 = float16
                        // (little-endian, either sign) with int4 codes -8..7, two's complement (kv8.quant.int4_group;
                        // D % group == 0; the store searches each group's scale: ../attention/store_int4_group.h)
};
static constexpr KvFormat KV_FORMATS[KV_COUNT] = {
    // name                 esize  elem     fp8    ibits  mbits  bias  max_finite  nan_0x80  has_inf  nan_code group gscale
    {"fp8_e4m3",            1,     -1,      true,  0,     3,     7,    448.0f,     false,    false,   0x7f},  // KV_E4M3
    {"fp8_e4m3fnuz",        1,     -1,      true,  0,     3,     8,    240.0f,     true,     false,   0x80},  // KV_E4M3FNUZ
    {"fp8_e5m2",            1,     -1,      true,  0,     2,     15,   57344.0f,   false,    true,    0x7e},  // KV_E5M2
    {"bfloat16",            2,     DT_BF16, false, 0,     0,     0,    0.0f,       false,    false,   0},     // KV_BF16
    {"float16",             2,     DT_F16,  false, 0,     0,     0,    0.0f,       false,    false,   0},     // KV_F16
    {"float32",             4,     DT_F32,  false, 0,     0,     0,    0.0f,       false,    false,   0},     // KV_F32
    {"int8_per_token_head", 1,     -1,      false, 8,     0,     0,    127.0f,     false,    false,   0},     // KV_I8
    {"int4_per_token_head", 1,     -1,      false, 4,     0,     0,    7.0f,       false,    false,   0},     // KV_I4
    {"fp4_e2m1",            1,     -1,      false, 0,     1,     1,    6.0f,       false,    false,   0, 16, 1}, // KV_FP4
    {"int4_per_group32",    1,     -1,      false, 0,     0,     0,    7.0f,       false,    false,   0, 32, 2}, // KV_I4G
};

// Bytes one head's row of D values takes in a cache of format kv (D / 2 for 4-bit codes; group-scaled: and gscale
// bytes per group).
static constexpr int64_t kv_row_bytes(int kv, int64_t D) {
    return KV_FORMATS[kv].group ? D / 2 + (D + KV_FORMATS[kv].group - 1) / KV_FORMATS[kv].group * KV_FORMATS[kv].gscale
         : KV_FORMATS[kv].ibits == 4 ? D / 2 : D * KV_FORMATS[kv].esize;
}

// The exact value of code c (0..255) of FP8 format kv (NaN where the format has NaN; subnormals included).
static inline float fp8_value(int kv, int c) {
    const KvFormat& F = KV_FORMATS[kv];
    const int mag = c & 0x7f, e = mag >> F.mbits, m = mag & ((1 << F.mbits) - 1), top = 0x7f >> F.mbits;
    if (F.nan_0x80 ? c == 0x80 : (F.has_inf ? e == top && m != 0 : mag == 0x7f)) return NAN;
    const float v = F.has_inf && e == top ? INFINITY
                  : e ? ldexpf((float)((1 << F.mbits) + m), e - F.bias - F.mbits)
                      : ldexpf((float)m, 1 - F.bias - F.mbits);
    return (c & 0x80) ? -v : v;
}

// Return codes of the entry points (0 = success); the messages are what Python raises (ValueError).
enum { OK = 0, ERR_BLOCK_ID = 1, ERR_TABLE_WIDTH = 2, ERR_LENGTHS = 3, ERR_SLOT = 4, ERR_ARGS = 5, ERR_OOM = 6,
       ERR_NO_FAST_PATH = 7, ERR_COUNT = 8 };
static const char* const ERROR_MESSAGES[ERR_COUNT] = {
    "ok",
    "a block table entry is not a valid block id (>= num_blocks or negative)",
    "block_tables is too narrow for seq_lens",
    "query_start_loc / seq_lens are inconsistent (need 0 <= query_len <= seq_len, query_start_loc[-1] == T)",
    "slot_mapping holds a slot outside the cache",
    "invalid kernel arguments",
    "out of memory in the kernel",
    "this build has no AVX-512 BF16 + VBMI path (the CPU or the compiler lacks it)",
};
// The message of return code `code`, NULL past the last one (each library's kv8_error_message).
static inline const char* error_message(int code) {
    return code >= 0 && code < ERR_COUNT ? ERROR_MESSAGES[code] : nullptr;
}

// A layout text being written (see the top of this file). A text that would overflow is cut short, so it matches
// no mirror and the library is refused.
struct AbiLayout {
    char text[4096] = "";
    size_t n = 0;

    __attribute__((format(printf, 2, 3))) void put(const char* fmt, ...) {
        if (n >= sizeof(text)) return;
        va_list ap;
        va_start(ap, fmt);
        n += (size_t)vsnprintf(text + n, sizeof(text) - n, fmt, ap);
        va_end(ap);
    }
};

#define KV8_ABI_MEMBER(type, name) type name;
#define KV8_ABI_DECLARE(S, FIELDS) struct S { FIELDS(KV8_ABI_MEMBER) };
#define KV8_ABI_FIELD(type, name) \
    kv8_abi_text.put(" %s@%zu+%zu", #name, offsetof(kv8_abi_struct, name), sizeof(kv8_abi_struct::name));
#define KV8_ABI_APPEND(S, FIELDS)                                                    \
    {                                                                                \
        using kv8_abi_struct = S;                                                    \
        kv8_abi_text.put("%s%s %zu:", kv8_abi_text.n ? " " : "", #S, sizeof(S));     \
        FIELDS(KV8_ABI_FIELD)                                                        \
        kv8_abi_text.put(";");                                                       \
    }
#define KV8_ABI_STRUCTS(STRUCTS)                                                     \
    STRUCTS(KV8_ABI_DECLARE)                                                         \
    static const char* abi_layout_text(void) {                                       \
        static const AbiLayout layout = [] { /* once, thread-safe */                 \
            AbiLayout kv8_abi_text;                                                  \
            KV8_COMMON_STRUCTS(KV8_ABI_APPEND)                                       \
            STRUCTS(KV8_ABI_APPEND)                                                  \
            return kv8_abi_text;                                                     \
        }();                                                                         \
        return layout.text;                                                          \
    }

// ------------------------------------------------------------------------------------------------
// Recorded kernel calls, replayed from C
// ------------------------------------------------------------------------------------------------

// An entry point of either library: it takes nargs pointers to its argument structs and returns OK or an error code.
// The entry points are declared with their own struct types (int kv8_linear(const kv8_linear_call*)); a call
// through this untyped pointer passes the same pointers in the same registers under the C calling convention.
typedef int (*kv8_entry_fn)(void);
enum { KV8_CALL_MAX_ARGS = 4 };

// One recorded call: fn(arg0, ..., arg<nargs - 1>), 1 <= nargs <= KV8_CALL_MAX_ARGS; the args past nargs are unused.
#define KV8_KERNEL_CALL_FIELDS(X)         \
    X(kv8_entry_fn, fn)                   \
    X(int64_t, nargs)                     \
    X(const void*, arg0)                  \
    X(const void*, arg1)                  \
    X(const void*, arg2)                  \
    X(const void*, arg3)

// The structs every library shares, first in each layout text (kv8/kernels/cpu/abi.py's COMMON_STRUCTS).
#define KV8_COMMON_STRUCTS(Y) Y(kv8_kernel_call, KV8_KERNEL_CALL_FIELDS)
KV8_COMMON_STRUCTS(KV8_ABI_DECLARE)

// Call calls[0 .. count - 1] in order, as Python would one after the other, and stop at the first that fails: returns
// its index and writes its return code to *code (ERR_ARGS for an nargs out of range, the call not made); returns
// count, *code = OK, when every call succeeded. Each call reads its structs when it is made, so a struct field
// written between replays (num_threads) is seen.
static inline int64_t run_kernel_calls(const kv8_kernel_call* calls, int64_t count, int32_t* code) {
    typedef int (*fn1)(const void*);
    typedef int (*fn2)(const void*, const void*);
    typedef int (*fn3)(const void*, const void*, const void*);
    typedef int (*fn4)(const void*, const void*, const void*, const void*);
    for (int64_t i = 0; i < count; ++i) {
        const kv8_kernel_call& c = calls[i];
        int rc = ERR_ARGS;
        switch (c.nargs) {
            case 1: rc = reinterpret_cast<fn1>(c.fn)(c.arg0); break;
            case 2: rc = reinterpret_cast<fn2>(c.fn)(c.arg0, c.arg1); break;
            case 3: rc = reinterpret_cast<fn3>(c.fn)(c.arg0, c.arg1, c.arg2); break;
            case 4: rc = reinterpret_cast<fn4>(c.fn)(c.arg0, c.arg1, c.arg2, c.arg3); break;
            default: break;
        }
        if (rc != OK) {
            *code = rc;
            return i;
        }
    }
    *code = OK;
    return count;
}
