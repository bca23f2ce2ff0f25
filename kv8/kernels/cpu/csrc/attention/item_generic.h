// The generic item kernel: fp32 arithmetic, any KV dtype (K and V each in its own: a pair of formats is read with
// two row decoders), any head dim, any ISA. FP8 is decoded on bits
// (base.h; exact for subnormals because every kernel thread clears DAZ/FTZ). It is the path of fp16 /
// fp32 caches, of the group-scaled formats' items the decode kernel does not take (prefill-sized items; FP4: E2M1
// codes times their group's E4M3 scale; int4_per_group32: int4 codes times their group's float16 scale: exact
// products), of head dims that are not a multiple of 16, and of builds without AVX-512 BF16; it
// carries no arithmetic shared with the fast kernels (those multiply bf16 in registers).
//
// Per tile of 16 tokens: decode K rows to fp32, scores and an online-softmax step per row, decode V rows,
// then acc = acc * alpha + p . V. Only the rows that see some token of the tile ([r0, r1): row limits and
// first positions both ascend) take part; tokens outside a row's [first, limit] are masked.
#pragma once

#include "problem.h"

template <int KV>
static void decode_row_f32(const uint8_t* row, int D, float* out) {
    constexpr KvFormat F = KV_FORMATS[KV];
    if constexpr (F.fp8) {
        for (int d = 0; d < D; ++d) out[d] = fp8_bits<KV>(row[d]);
    } else if constexpr (F.ibits == 8) {
        for (int d = 0; d < D; ++d) out[d] = (float)(int8_t)row[d];
    } else if constexpr (F.ibits == 4) {
        for (int d = 0; d < D; ++d) out[d] = (float)int4_at(row, d);
    } else if constexpr (F.group && F.gscale == 2) {  // int4 codes times their group's float16 scale (exact)
        for (int g0 = 0; g0 < D; g0 += F.group) {
            const uint8_t* sp = row + D / 2 + 2 * (g0 / F.group);
            const float s = f16_f((uint16_t)(sp[0] | (sp[1] << 8)));
            for (int d = g0; d < g0 + F.group; ++d) out[d] = (float)int4_at(row, d) * s;
        }
    } else if constexpr (F.group) {  // FP4: E2M1 codes times their group's E4M3 scale (after the D / 2 code bytes)
        for (int g0 = 0; g0 < D; g0 += F.group) {
            const float s = fp8_bits<KV_E4M3>(row[D / 2 + g0 / F.group]);
            const int g1 = g0 + F.group < D ? g0 + F.group : D;
            for (int d = g0; d < g1; d += 2) {
                const uint8_t b = row[d >> 1];
                out[d] = E2M1_VALUES[b & 0xF] * s;
                out[d + 1] = E2M1_VALUES[b >> 4] * s;
            }
        }
    } else if constexpr (F.elem == DT_BF16) {
        const uint16_t* r = (const uint16_t*)row;
        for (int d = 0; d < D; ++d) out[d] = bf16_f(r[d]);
    } else if constexpr (F.elem == DT_F16) {
        const uint16_t* r = (const uint16_t*)row;
        for (int d = 0; d < D; ++d) out[d] = f16_f(r[d]);
    } else {
        memcpy(out, row, sizeof(float) * (size_t)D);
    }
}

typedef void (*RowDecoder)(const uint8_t*, int, float*);

// The fp32 item kernels' scratch (run_item_generic, run_item_avx2), carved from the thread's: the item's query
// rows in fp32 (times the per-channel K scales where they are per channel, times q_scale), the accumulators (0),
// one tile's decoded K and V rows, the rows' running max (-inf) and sum (0), alpha, their visible positions
// [lo, lim], and one tile's weights per row.
struct F32Scratch {
    float *qf, *acc, *kf, *vf, *mx, *sum, *alpha, *prob;
    int64_t *lim, *lo;

    // false when the scratch cannot be allocated.
    bool init(const Problem& P, const Item& it, const Rows& w, float q_scale) {
        const int D = P.D, R = w.R;
        const size_t nq = (size_t)R * D;
        const size_t bytes = up64(nq * 4) * 2 + up64((size_t)TILE * D * 4) * 2 + up64((size_t)R * 4) * 3 +
                             up64((size_t)R * 8) * 2 + up64((size_t)R * TILE * 4);
        char* mem = (char*)tl_scratch.get(bytes);
        if (!mem) return false;
        qf = (float*)mem; mem += up64(nq * 4);
        acc = (float*)mem; mem += up64(nq * 4);
        kf = (float*)mem; mem += up64((size_t)TILE * D * 4);
        vf = (float*)mem; mem += up64((size_t)TILE * D * 4);
        mx = (float*)mem; mem += up64((size_t)R * 4);
        sum = (float*)mem; mem += up64((size_t)R * 4);
        alpha = (float*)mem; mem += up64((size_t)R * 4);
        lim = (int64_t*)mem; mem += up64((size_t)R * 8);
        lo = (int64_t*)mem; mem += up64((size_t)R * 8);
        prob = (float*)mem;
        const bool kch = k_per_channel(P);
        for (int r = 0; r < R; ++r) {
            const int h = it.kvh * P.G + r % P.G;
            const int64_t src = ((w.qrow0 + r / P.G) * P.Hq + h) * (int64_t)D;
            for (int d = 0; d < D; ++d) {
                float x = load_f(P.q, P.q_dtype, src + d);
                if (kch) x *= P.ks[it.kvh * P.ks_hs + d * P.ks_ds];
                qf[(size_t)r * D + d] = x * q_scale;
            }
            mx[r] = -INFINITY;
            sum[r] = 0.0f;
            lim[r] = row_limit(P, it, w, r);
            lo[r] = first_visible(P, lim[r]);
        }
        memset(acc, 0, nq * 4);
        return true;
    }
};

static int run_item_generic(const Problem& P, const Item& it, float* ws) {
    const RowDecoder decode_k_row =   // K rows in K's format, V rows in V's (one decoder for a cache of one format)
        with_kv_format(P.kv, [](auto K) -> RowDecoder { return decode_row_f32<decltype(K)::value>; });
    const RowDecoder decode_v_row =
        with_kv_format(P.vkv, [](auto K) -> RowDecoder { return decode_row_f32<decltype(K)::value>; });
    const Rows w = rows_of(P, it);
    const int D = P.D, R = w.R;
    F32Scratch S;
    if (!S.init(P, it, w, 1.0f)) return ERR_OOM;
    float *qf = S.qf, *acc = S.acc, *kf = S.kf, *vf = S.vf, *mx = S.mx, *sum = S.sum, *alpha = S.alpha, *prob = S.prob;
    const int64_t *lim = S.lim, *lo = S.lo;
    const float sfac = P.sm_scale * (k_per_channel(P) ? 1.0f : k_head_scale(P, it.kvh));

    const uint8_t* kr[TILE];
    const uint8_t* vr[TILE];
    float ksc[TILE], vsc[TILE];
    for (int t = 0; t < TILE; ++t) ksc[t] = vsc[t] = 1.0f;
    int r0 = 0, r1 = 0;
    for (int p = 0; p < PREFETCH_TILES; ++p) prefetch_tile(P, it, it.t0 + p * TILE);
    for (int64_t t0 = it.t0; t0 < it.t1; t0 += TILE) {
        int n = (int)(it.t1 - t0 < TILE ? it.t1 - t0 : TILE);
        prefetch_tile(P, it, t0 + PREFETCH_TILES * TILE);
        if (!tile_rows(P, it, t0, n, kr, vr, ksc, vsc)) return ERR_BLOCK_ID;
        while (r0 < R && lim[r0] < t0) ++r0;  // rows before r0 see nothing of this tile (limits ascend)
        while (r1 < R && lo[r1] < t0 + n) ++r1;  // nor do rows from r1 on (their windows start later)
        for (int t = 0; t < n; ++t) decode_k_row(kr[t], D, kf + (size_t)t * D);
        for (int r = r0; r < r1; ++r) {
            const float* qr = qf + (size_t)r * D;
            float tmax = -INFINITY;
            float* s = prob + (size_t)r * TILE;
            for (int t = 0; t < TILE; ++t) {
                if (t >= n || t0 + t > lim[r] || t0 + t < lo[r]) { s[t] = -INFINITY; continue; }
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
        for (int t = 0; t < n; ++t) decode_v_row(vr[t], D, vf + (size_t)t * D);
        for (int r = r0; r < r1; ++r) {
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
