// Attention planning: work items, their order and threads, and the log-sum-exp combine of partitions.
//
//   sequence i, query tokens split in blocks of qb (~96 rows with the GQA group), per group of nh KV heads
//   (nh = 1, or up to MAX_ITEM_HEADS where the item kernel reads several heads -- see ItemHeads):
//     context [start, end) cut into partitions of `part` tokens  ->  one item per partition
//   end = position of the block's last query token + 1; start = 0, or with a sliding window W the first
//   key of the block's first query token (k0 = its position - W + 1, at least 0) rounded down to a tile, so
//   an item's work and a partitioned decode are O(W + query tokens), not O(context), and nothing before k0
//   is read (problem.h)
//   items run longest first on an OpenMP dynamic schedule; an item of a split context writes
//   (max, sum, acc[D]) per row into the workspace, and the combine merges them (vLLM's paged attention v2):
//     out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p
// Small calls stay on one thread (waking the others costs more than the work).
#pragma once

#include "problem.h"

// Whether side format kv (K's or V's) may be read with these scales and head dim: rows that fit ZERO_ROW, whole
// code bytes, whole groups of 32 for int4_per_group32; a group-scaled side has neither static nor per-token scales
// (its scales are in its rows), a side of integer codes has its per-token scales (codes mean nothing without them).
static inline bool side_usable(int kv, int D, const void* static_scale, const float* token_scales) {
    const KvFormat& F = KV_FORMATS[kv];
    return kv_row_bytes(kv, D) <= (int64_t)sizeof(ZERO_ROW) && !((F.ibits == 4 || F.group) && D % 2) &&
           !(F.group && (token_scales || static_scale)) && !(F.gscale == 2 && D % F.group) &&
           !(F.ibits && !token_scales);
}

// The problem of one call, from the layer and call structs; ERR_ARGS when they are unusable. K and V are checked
// each against its own format (side_usable); one format keeps per-token scales on both sides or on neither, and a
// group-scaled one no static scales on either side.
static int make_problem(const kv8_layer& L, const kv8_attention_call& C, Problem& P) {
    const int Hkv = L.num_kv_heads, Hq = C.num_q_heads, D = L.head_dim, bs = L.block_size, kv = L.kv_dtype;
    const int vkv = L.v_kv_dtype;
    if (Hkv <= 0 || Hq % Hkv != 0 || D <= 0 || bs <= 0 || C.num_seqs < 0 || C.num_threads <= 0 || kv < 0 ||
        kv >= KV_COUNT || vkv < 0 || vkv >= KV_COUNT || C.q_dtype < 0 || C.q_dtype >= DT_COUNT ||
        C.sliding_window < 0 || C.stream_tiles < 0 || C.stream_tiles > KV8_MAX_STREAM_TILES ||
        !side_usable(kv, D, L.k_scale, L.k_token_scales) ||
        !side_usable(vkv, D, L.v_scale, L.v_token_scales) ||
        (kv == vkv && ((L.k_token_scales == nullptr) != (L.v_token_scales == nullptr) ||
                       (KV_FORMATS[kv].group && (L.k_scale || L.v_scale)))))
        return ERR_ARGS;
    P.q = C.q; P.q_dtype = C.q_dtype; P.out = C.out;
    P.Hq = Hq; P.Hkv = Hkv; P.D = D; P.G = Hq / Hkv;
    P.kc = (const uint8_t*)L.k_cache; P.vc = (const uint8_t*)L.v_cache;
    P.kv = kv; P.esize = KV_FORMATS[kv].esize; P.row_bytes = kv_row_bytes(kv, D); P.num_blocks = L.num_blocks;
    P.vkv = vkv; P.vesize = KV_FORMATS[vkv].esize; P.vrow_bytes = kv_row_bytes(vkv, D);
    P.bs = bs;
    P.ks = L.k_scale; P.ks_hs = L.k_scale_head_stride; P.ks_ds = L.k_scale_dim_stride;
    P.vs = L.v_scale; P.vs_hs = L.v_scale_head_stride; P.vs_ds = L.v_scale_dim_stride;
    P.kts = L.k_token_scales; P.vts = L.v_token_scales;
    P.B = C.num_seqs; P.qsl = C.query_start_loc; P.seq_lens = C.seq_lens; P.bt = C.block_tables;
    P.bt_stride = C.block_table_stride;
    P.sm_scale = C.sm_scale;
    P.window = C.sliding_window;
    P.stream = C.stream_tiles > 0 ? C.stream_tiles : DEFAULT_STREAM_TILES;
    // Query tokens per item: ~ROWS_PER_ITEM rows (tokens x GQA group) share each decoded K/V tile. Measured
    // on 4 x 512 prefill tokens, 48 rows took ~15% less time than 16 (32: ~9%); with the prefill loop
    // (item_prefill.h) 96 rows take ~2% less than 48 on SmolLM2 prefill (2 x 1024, 512 over 1,536 cached) and
    // on Gemma-3's 512-token chunks, decode unchanged; on its AMX form 192 rows take 0-6% less than 96 on 2 x
    // 1024 and 3-15% less on 512 over 1,536 (bench_attention.py --tables smollm2-prefill, alternating builds).
    // Where the prefill loop runs on AMX tiles (uses_amx_loop), 384 rows took 1.02-1.09x less time than 192 on
    // prefill calls of SmolLM2 (D 64), D 128 and Gemma-3 (D 256) shapes (1,024-2,048 new tokens over 1,024-4,096;
    // alternating calls of both libraries, 2026-12-01, AMX Xeon); on the AVX-512 loop they tied (0.996-1.011x).
    P.amx = amx_granted(C.use_amx);
    const int rows = uses_amx_loop(P, ROWS_PER_ITEM_AMX) ? ROWS_PER_ITEM_AMX : ROWS_PER_ITEM;
    P.qb = P.G >= rows ? 1 : rows / P.G;
    P.bs_shift = (bs & (bs - 1)) == 0 ? __builtin_ctz((unsigned)bs) : -1;
    return OK;
}

// KV heads per item for items of `rows` rows: heads_of's answer within [1, min(Hkv, MAX_ITEM_HEADS)].
static inline int item_heads(const Problem& P, ItemHeads heads_of, int rows) {
    int nh = heads_of ? heads_of(P, rows) : 1;
    nh = nh < P.Hkv ? nh : P.Hkv;
    nh = nh < MAX_ITEM_HEADS ? nh : MAX_ITEM_HEADS;
    return nh > 1 ? nh : 1;
}

// Runs `fn` over every item of P (T query tokens in all) on nthreads threads, then combines split contexts.
// The batch layout is checked first (lengths, table width; block ids are checked by the tile walk).
// plan_threads and partition_size: see kv8_attention_call (the items, hence the bits of the result, depend on
// them, not on nthreads). heads_of: KV heads per item (NULL: one).
static int run_attention(const Problem& P, int64_t T, int nthreads, int plan_threads, int64_t partition_size,
                         ItemFn fn, ItemHeads heads_of) {
    const int B = P.B, Hkv = P.Hkv, D = P.D, bs = P.bs;
    const int64_t *qsl = P.qsl, *seq_lens = P.seq_lens, bt_stride = P.bt_stride;
    if (qsl[0] != 0 || qsl[B] != T) return ERR_LENGTHS;
    int64_t n_base = 0, n_heads = 0, total_ctx = 0;  // unsplit items, (query block, head) pairs, keys they read
    auto count = [&](ItemHeads heads) -> int {
        n_base = n_heads = total_ctx = 0;
        for (int i = 0; i < B; ++i) {
            int64_t ql = qsl[i + 1] - qsl[i], sl = seq_lens[i];
            if (ql < 0 || sl < ql || (ql > 0 && sl < 1)) return ERR_LENGTHS;
            if ((sl + bs - 1) / bs > bt_stride) return ERR_TABLE_WIDTH;
            int64_t span = P.window > 0 && P.window + ql - 1 < sl ? P.window + ql - 1 : sl;  // keys the queries see
            for (int64_t j0 = 0; j0 < ql; j0 += P.qb) {
                int64_t j1 = j0 + P.qb < ql ? j0 + P.qb : ql;
                int nh = item_heads(P, heads, (int)(j1 - j0) * P.G), groups = (Hkv + nh - 1) / nh;
                n_base += groups;
                n_heads += Hkv;
                total_ctx += span * groups;
            }
        }
        return OK;
    };
    int err = count(heads_of);
    if (err != OK) return err;
    // Items of several heads only where they alone keep every thread busy: a context split into partitions
    // of several heads leaves fewer, longer items than one head per item (B = 1 x 1k, SmolLM2, 2 threads: 5
    // against 15), and the threads finish unevenly.
    if (heads_of && partition_size == 0 && n_base < 4 * (int64_t)plan_threads) {
        heads_of = nullptr;
        count(heads_of);
    }
    int64_t part;
    if (partition_size > 0) part = (partition_size + TILE - 1) / TILE * TILE;
    else if (partition_size < 0 || n_base >= 4 * (int64_t)plan_threads)
        part = (int64_t)1 << 40;  // no split (and no overflow in the ceil-divisions below)
    else {
        int64_t want = (total_ctx + 8 * plan_threads - 1) / (8 * plan_threads);
        part = want < 256 ? 256 : (want + TILE - 1) / TILE * TILE;
    }

    // Items, and workspace for partitioned ones.
    int64_t n_items = 0;
    for (int i = 0; i < B; ++i) {
        int64_t ql = qsl[i + 1] - qsl[i], sl = seq_lens[i];
        for (int64_t j0 = 0; j0 < ql; j0 += P.qb) {
            int64_t j1 = j0 + P.qb < ql ? j0 + P.qb : ql;
            int64_t end = sl - ql + j1, start = first_visible(P, sl - ql + j0) / TILE * TILE;
            int nh = item_heads(P, heads_of, (int)(j1 - j0) * P.G);
            n_items += (Hkv + nh - 1) / nh * ((end - start + part - 1) / part);
        }
    }
    Item* items = (Item*)malloc(sizeof(Item) * (size_t)(n_items ? n_items : 1));
    if (!items) return ERR_OOM;
    // One group per (query block, KV head): its partitions are items first .. first + nparts - 1, head h of each.
    struct Group { int64_t first, nparts; int rows, h; };
    Group* groups = (Group*)malloc(sizeof(Group) * (size_t)(n_heads ? n_heads : 1));
    if (!groups) { free(items); return ERR_OOM; }
    int64_t ni = 0, ng = 0, ws_floats = 0;
    for (int i = 0; i < B; ++i) {
        int64_t ql = qsl[i + 1] - qsl[i], sl = seq_lens[i];
        for (int64_t j0 = 0; j0 < ql; j0 += P.qb) {
            int64_t j1 = j0 + P.qb < ql ? j0 + P.qb : ql;
            int64_t end = sl - ql + j1, k0 = first_visible(P, sl - ql + j0), start = k0 / TILE * TILE;
            int64_t np = (end - start + part - 1) / part;
            int rows = (int)(j1 - j0) * P.G, nh = item_heads(P, heads_of, rows);
            for (int h0 = 0; h0 < Hkv; h0 += nh) {
                const int n = Hkv - h0 < nh ? Hkv - h0 : nh;
                for (int h = 0; h < n; ++h) groups[ng++] = Group{ni, np, rows, h};
                for (int64_t p = 0; p < np; ++p) {
                    Item& it = items[ni++];
                    it.seq = i; it.kvh = h0; it.nh = n; it.j0 = (int)j0; it.j1 = (int)j1;
                    it.t0 = start + p * part;
                    it.t1 = start + (p + 1) * part < end ? start + (p + 1) * part : end;
                    it.k0 = k0;
                    it.cost = (it.t1 - it.t0) * rows * n;
                    if (np > 1) { it.ws = ws_floats; ws_floats += (int64_t)rows * (D + 2) * n; }
                    else it.ws = -1;
                }
            }
        }
    }
    float* ws = nullptr;
    if (ws_floats) {
        ws = (float*)tl_workspace.get((size_t)ws_floats * 4);
        if (!ws) { free(items); free(groups); return ERR_OOM; }
    }
    // Longest items first, so the dynamic schedule ends balanced.
    int64_t* order = (int64_t*)malloc(sizeof(int64_t) * (size_t)(n_items ? n_items : 1));
    if (!order) { free(items); free(groups); return ERR_OOM; }
    for (int64_t k = 0; k < n_items; ++k) order[k] = k;
    qsort_r(order, (size_t)n_items, sizeof(int64_t),
            [](const void* a, const void* b, void* ctx) -> int {
                const Item* its = (const Item*)ctx;
                int64_t ca = its[*(const int64_t*)a].cost, cb = its[*(const int64_t*)b].cost;
                return ca < cb ? 1 : (ca > cb ? -1 : 0);
            },
            items);

    err = OK;
    int64_t total_cost = 0;
    for (int64_t k = 0; k < n_items; ++k) total_cost += items[k].cost;
    // Waking the other threads costs ~10 us (much more on a busy machine): small calls run on one thread.
    int nt = (int)(n_items < nthreads ? (n_items ? n_items : 1) : nthreads);
    if (total_cost < SMALL_WORK) nt = 1;
#pragma omp parallel num_threads(nt)
    {
        FpEnv env;
#pragma omp for schedule(dynamic, 1)
        for (int64_t k = 0; k < n_items; ++k) {
            int e = fn(P, items[order[k]], ws);
            if (e != OK) {
#pragma omp atomic write
                err = e;
            }
        }
        if (ws_floats && err == OK) {
            // Combine partitions: out = sum_p e^(m_p - M) acc_p / sum_p e^(m_p - M) l_p.
#pragma omp for schedule(dynamic, 4)
            for (int64_t g = 0; g < ng; ++g) {
                const Group& gr = groups[g];
                if (gr.nparts < 2) continue;
                Item direct = head_item(items[gr.first], gr.h, gr.rows, D);
                direct.ws = -1;
                Rows w = rows_of(P, direct);
                float* acc = (float*)tl_scratch.get((size_t)D * 4);
                for (int r = 0; r < gr.rows; ++r) {
                    float M = -INFINITY;
                    for (int64_t p = 0; p < gr.nparts; ++p) {
                        float m = ws[head_item(items[gr.first + p], gr.h, gr.rows, D).ws + (int64_t)r * (D + 2)];
                        M = m > M ? m : M;
                    }
                    float L = 0.0f;
                    for (int d = 0; d < D; ++d) acc[d] = 0.0f;
                    for (int64_t p = 0; p < gr.nparts; ++p) {
                        const float* src = ws + head_item(items[gr.first + p], gr.h, gr.rows, D).ws +
                                           (int64_t)r * (D + 2);
                        if (src[1] == 0.0f) continue;  // the row saw nothing of this partition
                        float f = expf(src[0] - M);
                        L += f * src[1];
                        for (int d = 0; d < D; ++d) acc[d] += f * src[2 + d];
                    }
                    finish_row(P, direct, w, r, acc, M, L, nullptr);
                }
            }
        }
    }
    free(order);
    free(items);
    free(groups);
    return err;
}
