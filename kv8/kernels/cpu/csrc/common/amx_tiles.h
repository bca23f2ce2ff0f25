// AMX (Intel AMX-BF16) set-up shared by the dense library (../dense: the packed linear) and the attention library
// (../attention: the prefill loop and decode items). kv8/kernels/cpu/build.py hashes the files a source includes with
// #include "...", so an edit here rebuilds both libraries.
//
// KV8_AMX is 1 where the compiler targets AMX-TILE and AMX-BF16 (-march=native on such a CPU) on Linux; the
// tiles are then used only where amx_permitted() (the OS grants them to this process). Every user loads its own
// tile configuration before its first tile instruction in a thread and releases the tiles (_tile_release)
// when done, so the two libraries, which share the OpenMP threads, never see each other's configuration.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#define KV8_AMX 1
#include <immintrin.h>
#include <stdint.h>
#include <string.h>
#include <sys/syscall.h>
#include <unistd.h>

// Whether this process may use AMX tiles: Linux grants them on request (arch_prctl), once per process.
static int amx_permitted() {
    static const int ok = [] {
        const long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
        return syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0 ? 1 : 0;
    }();
    return ok;
}

struct alignas(64) AmxConfig {
    uint8_t palette, start_row, reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
};

// Loads tile configuration c for the calling thread. Not _tile_loadconfig: GCC's declares a read of only the
// first 8 bytes of the configuration, so the compiler may drop the stores of the rest as dead (it does, once
// a caller's rows are constants).
static inline void amx_load(const AmxConfig& c) { __asm__ volatile("ldtilecfg %0" : : "m"(c)); }

// Loads (for the calling thread) the 8 tiles of palette 1, tile t with rows[t] rows of colsb[t] bytes.
static inline void amx_configure(const int rows[8], const int colsb[8]) {
    AmxConfig c;
    memset(&c, 0, sizeof(c));
    c.palette = 1;
    for (int t = 0; t < 8; ++t) {
        c.rows[t] = (uint8_t)rows[t];
        c.colsb[t] = (uint16_t)colsb[t];
    }
    amx_load(c);
}

// Loads (for the calling thread) a configuration of the 8 tiles of palette 1, 64 bytes per row: tiles
// 0 .. split-1 have `rows` rows, the others 16.
static inline void amx_load_config(int rows, int split) {
    int r[8], colsb[8];
    for (int t = 0; t < 8; ++t) {
        r[t] = t >= split ? 16 : rows;
        colsb[t] = 64;
    }
    amx_configure(r, colsb);
}
#else
#define KV8_AMX 0
#endif
