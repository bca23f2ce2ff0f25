// Quantize-on-store: the new key/value rows of one step -> their slots in one layer's caches.
//
//   key/value [T, H, D] (in_dtype)  --slot_mapping[t] = block * bs + offset-->  cache[block, h, offset, :]
//
// FP8 with static scales: code = saturate(rne(x / scale)) with the layer's K/V scales (strides over head and
// channel). FP8 with dynamic scales: each (token, head) gets scale amax|x| / max_finite (1.0 when that is 0
// or not finite), written beside its codes. 16/32-bit caches store the value converted (round to nearest
// even). Bit-exact with kv8.cache.paged_cache.PagedKVCache.store, NaN rule included (common.h).
#pragma once

#include "common.h"
#include "abi.h"

static int run_store(const kv8_layer& L, const kv8_store_call& C) {
    const int64_t T = C.num_tokens, num_blocks = L.num_blocks;
    const int H = L.num_kv_heads, D = L.head_dim, bs = L.block_size, kv = L.kv_dtype, in_dtype = C.in_dtype;
    const int nthreads = C.num_threads;
    const void *key = C.key, *value = C.value;
    const int64_t* slots = C.slot_mapping;
    void *k_cache = L.k_cache, *v_cache = L.v_cache;
    const float *k_scale = L.k_scale, *v_scale = L.v_scale;
    const int64_t ks_hs = L.k_scale_head_stride, ks_ds = L.k_scale_dim_stride;
    const int64_t vs_hs = L.v_scale_head_stride, vs_ds = L.v_scale_dim_stride;
    float *k_token_scales = L.k_token_scales, *v_token_scales = L.v_token_scales;
    if (H <= 0 || D <= 0 || bs <= 0 || T < 0 || kv < 0 || kv >= KV_COUNT || in_dtype < 0 || in_dtype >= DT_COUNT ||
        nthreads <= 0 || (k_token_scales == nullptr) != (v_token_scales == nullptr) ||
        (k_token_scales && !is_fp8(kv)) || (is_fp8(kv) && !k_token_scales && (!k_scale || !v_scale)))
        return ERR_ARGS;
    const float maxf = fp8_max_finite(kv);
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
