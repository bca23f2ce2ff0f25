"""Decode-step attention: kv8's fused CPU kernel (FP8 and bf16 caches) vs torch SDPA vs memcpy, side by side.

SmolLM2 shapes (9 query heads, 3 KV heads, head_dim 64, blocks of 16), bf16 queries, one new token per
sequence. For every (batch, context) it prints the time of one layer's decode attention for

* ``kv8 fp8``  -- :meth:`kv8.kernels.cpu.attention.KernelLibrary.attention` (what the ``cpu_fused`` backend calls)
  over an fp8_e4m3 paged cache,
* ``kv8 bf16`` -- the same kernel over a bf16 paged cache,
* ``sdpa``     -- ``F.scaled_dot_product_attention(..., enable_gqa=True)`` over a contiguous bf16 cache,
* ``copy fp8`` / ``copy bf16`` -- ``dst.copy_(src)`` of as many bytes as the fp8 / bf16 cache holds,

(best of 5 timing windows) with effective bandwidth (cache bytes read / time; for a copy, bytes copied / time),
the kernels' fraction of the copy bandwidth of the same bytes, and the ratios fp8/bf16 and bf16/sdpa. On a CPU
with AMX-BF16 the kv8 columns are the decode-item kernel on AMX tiles (what the library picks there), and each
line ends with the same two calls on the AVX-512 path (the library's ``amx`` flag off) and the speed-up of AMX.
Calls cycle through enough layers (distinct buffers) that every variant streams at least ``--footprint-mb`` MiB,
i.e. from DRAM rather than a warm L3, as in a real decode step where each layer's cache is read once (a small
``--footprint-mb``, e.g. 4, times caches that stay in the CPU's caches instead).

Then Gemma-3 local-layer rows (4 query heads, 1 KV head, head_dim 256, blocks of 16, sliding window 512):
for every context, a decode step (batch 1 and 8) and a prefill chunk (``--prefill-chunk`` new tokens ending at
that context, over a cached prefix), each timed for the kernel over an fp8_e4m3 and a bf16 cache, with the
window and without (full causal attention at the same context), all four in the same run, and the ratios
fp8/bf16 (windowed and full) and windowed/full (fp8 and bf16). As the engine does, the windowed caches hold
only the blocks the window needs; the other block-table entries are 0 and never read.

``--tables smollm2-prefill``: SmolLM2 prefill shapes (9 query heads, 3 KV heads, head_dim 64, blocks of 16, q
bf16): 2 sequences x 1024 new tokens (causal prefill from an empty cache), 1 sequence of 512 new tokens over
1,536 cached ones (a chunked-prefill step) and 2,048 new over 2,048 cached (the second step of a 4,096-token
prompt), each over an fp8_e4m3 and a bf16 cache, in microseconds per layer
call and GFLOP/s (4 * D flops per query head and visible key: q.k and p.v). On a CPU with AMX-BF16 each is
timed on both paths of the prefill loop (AMX tiles, and AVX-512 with the library's ``amx`` flag off), with
the speed-up of AMX.

    .venv/bin/python benchmarks/bench_attention.py            # batch 1, 8, 32 x context 1k, 4k, 8k; Gemma-3
    .venv/bin/python benchmarks/bench_attention.py --quick    # batch 1, 8 x context 1k, 4k; Gemma-3 batch 1
    .venv/bin/python benchmarks/bench_attention.py --kv8-only --batch 1 8 32 --context 4096  # kv8 only
    .venv/bin/python benchmarks/bench_attention.py --tables gemma3 --context 1024 4096 8192  # Gemma-3 rows only
    .venv/bin/python benchmarks/bench_attention.py --tables smollm2-prefill --threads 2  # SmolLM2 prefill rows
    .venv/bin/python benchmarks/bench_attention.py --tables smollm2-prefill --before HEAD~1 --rounds 30  # now vs then
    .venv/bin/python benchmarks/bench_attention.py --tables smollm2 --blocks contiguous  # blocks in address order
    .venv/bin/python benchmarks/bench_attention.py --tables builds --builds native x86-64-v3 x86-64-v2
    .venv/bin/python benchmarks/bench_attention.py --tables formats --before main  # formats, now and at main
    .venv/bin/python benchmarks/bench_attention.py --tables formats --formats fp8 int8 int4g32 k8v4  # a K/V pair
    .venv/bin/python benchmarks/bench_attention.py --tables stream --min-time 0.2 --rounds 9  # stream distances

With ``--before REV`` the prefill rows are also timed on the library's own path at REV and now, one call of each
in turn for ``--rounds`` rounds (use 20 or more on a drifting machine), with REV's time over now's per round.

``--tables stream``: the decode kernels' stream distance (how many tiles of 16 tokens ahead K and V are prefetched
into L2; the engine times it per machine and format, kv8.attention.tuning): each candidate distance and the default
side by side per format on decode 32 x 1,024 and 8 x 4,096, ``--rounds`` rounds rotating the distances, the default's
time over each distance's, and the distance the engine's rule would pick from these medians.

``--tables builds``: the library built for each ``-march`` of ``--builds`` (default ``native`` and ``x86-64-v2``,
the scalar generic kernel every x86-64 CPU runs; ``x86-64-v3`` is the AVX2 kernel), side by side on SmolLM2
shapes: one prefill call (1 sequence x 1,024 new tokens, causal) and one decode call (32 sequences at 1,024 tokens
of context), over an fp8_e4m3 and a bf16 cache, ``--rounds`` rounds alternating the builds (order rotated each
round); the median per cell with its min-max, GFLOP/s, and each build's time over the first build's.

``--tables formats``: every KV format on the native library (fp8_e4m3 with scale 1.0, fp8_e4m3 with dynamic
scales, int8_per_token_head, int4_per_token_head, int4_per_group32, fp4_e2m1, bfloat16, and the K/V pairs k8v4 --
int8_per_token_head keys, int4_per_group32 values -- and int8/int4), side by side on SmolLM2 shapes: prefill 1 x
1,024, decode 32 x 1,024, 8 x 4,096 (issue 40's target: int4 at <= 1 / 1.4 of fp8's time) and 1 x 8,192,
``--rounds`` rounds rotating the formats' order; medians (min-max) and each format's time over the fp8 cache's
(``--formats LABEL ...``: only those, e.g. ``--formats fp8 int8 int4g32 k8v4``). ``--layers N``: each decode row
calls N distinct caches in turn, as a model's N layers (SmolLM2: 30), each of its format's size (by default as many
as ``--footprint-mb`` needs, which may stay in a large L3).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.nn.functional as F
from revisions import worktree

import kv8
from kv8.attention.metadata import AttentionMetadata
from kv8.attention.tuning import STREAM_CANDIDATES, choose_stream_tiles
from kv8.cache.codec import KVCodec
from kv8.cache.paged_cache import CacheShape, PagedKVCache
from kv8.kernels.cpu.attention import SOURCE, KernelLibrary, KernelTesting, load_kernels
from kv8.kernels.cpu.build import KernelUnavailable, build_shared_library
from kv8.quant.formats import resolve_kv_cache_dtype, resolve_kv_cache_dtypes
from kv8.quant.scales import KVScales

HQ, HKV, D, BS = 9, 3, 64, 16
GEMMA_HQ, GEMMA_HKV, GEMMA_D, GEMMA_WINDOW = 4, 1, 256, 512  # Gemma-3 local (sliding-window) layers


def timeit(fn: Callable[[int], object], n_layers: int, min_time: float, windows: int = 5) -> float:
    """Seconds per call of ``fn(layer)``, cycling layers: the best of ``windows`` windows, each at least
    ``min_time / windows`` seconds and one full cycle of layers (robust to other load on the machine)."""
    for i in range(min(n_layers, 3)):
        fn(i)
    best, layer = math.inf, 0
    for _ in range(windows):
        calls, start = 0, time.perf_counter()
        while True:
            fn(layer % n_layers)
            layer += 1
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time / windows and calls >= n_layers:
                break
        best = min(best, elapsed / calls)
    return best


def layers_for(bytes_per_layer: int, footprint: int, cap: int = 4096) -> int:
    return max(2, min(cap, math.ceil(footprint / bytes_per_layer)))


def fill_random(cache: PagedKVCache) -> None:
    """Random contents: FP8 codes without NaN (0x7F / 0xFF), uniform over the finite values; else randn."""
    for which, data in enumerate((cache.k_data, cache.v_data)):
        if cache.codec.dtype_of(which).is_fp8:
            codes = torch.randint(0, 126, data.shape, dtype=torch.uint8)
            codes |= torch.randint(0, 2, data.shape, dtype=torch.uint8) << 7
            data.copy_(codes)
        else:
            data.copy_(torch.randn(data.shape, dtype=torch.bfloat16))


def paged_cache(kv_name: str, n_layers: int, batch: int, ctx: int,
                contiguous: bool = False) -> tuple[PagedKVCache, AttentionMetadata]:
    """``batch`` sequences of ``ctx`` tokens; their blocks scattered over the cache (a random permutation), or
    ``contiguous``: each sequence's blocks at ascending addresses, as the engine gives a prompt's blocks taken
    in one step."""
    kv = resolve_kv_cache_dtype(kv_name, torch.bfloat16)
    blocks_per_seq = ctx // BS
    cache = PagedKVCache(CacheShape(n_layers, batch * blocks_per_seq, HKV, BS, D),
                         KVCodec.build(kv, D, scales=KVScales.default(n_layers) if kv.is_fp8 else None))
    fill_random(cache)
    ids = torch.arange(batch * blocks_per_seq) if contiguous else torch.randperm(batch * blocks_per_seq)
    meta = AttentionMetadata.build([1] * batch, [ctx] * batch, ids.view(batch, blocks_per_seq).tolist(), BS)
    return cache, meta


def gemma_cache(kv_name: str, n_layers: int, batch: int, ctx: int, q_len: int,
                window: int | None) -> tuple[PagedKVCache, AttentionMetadata]:
    """Gemma-3-shaped caches of ``batch`` sequences of ``ctx`` tokens (the last ``q_len`` new). With a window,
    only the blocks from the first key's on exist (as after the engine frees the others); the entries before
    them are 0 and never read."""
    kv = resolve_kv_cache_dtype(kv_name, torch.bfloat16)
    n_table = -(-ctx // BS)
    first_block = 0 if window is None else max(0, ctx - q_len + 1 - window) // BS
    n_real = n_table - first_block
    cache = PagedKVCache(CacheShape(n_layers, batch * n_real, GEMMA_HKV, BS, GEMMA_D),
                         KVCodec.build(kv, GEMMA_D, scales=KVScales.default(n_layers) if kv.is_fp8 else None))
    fill_random(cache)
    perm = torch.randperm(batch * n_real).view(batch, n_real).tolist()
    tables = [[0] * first_block + row for row in perm]
    meta = AttentionMetadata.build([q_len] * batch, [ctx] * batch, tables, BS, sliding_window=window)
    return cache, meta


def bench_gemma(batch: int, ctx: int, q_len: int, args: argparse.Namespace) -> dict[str, float]:
    """Seconds per layer call of the kernel for {fp8, bf16} x {window, full}: ``batch`` sequences, ``q_len`` new
    tokens each (1 = decode), context ``ctx``."""
    lib = load_kernels()
    q = torch.randn(batch * q_len, GEMMA_HQ, GEMMA_D, dtype=torch.bfloat16)
    scale = GEMMA_D ** -0.5
    res: dict[str, float] = {}
    for kv_name, tag in (("fp8_e4m3", "fp8"), ("bfloat16", "bf16")):
        for window, wtag in ((GEMMA_WINDOW, "win"), (None, "full")):
            read = ctx if window is None else min(ctx, window + q_len - 1)  # tokens a sequence's queries see
            nbytes = batch * read * GEMMA_HKV * GEMMA_D * 2 * (1 if tag == "fp8" else 2)
            nl = layers_for(nbytes, args.footprint_mb << 20)
            cache, meta = gemma_cache(kv_name, nl, batch, ctx, q_len, window)
            res[f"{tag}_{wtag}"] = timeit(lambda i, c=cache, m=meta: lib.attention(q, c, i, m, scale), nl,
                                          args.min_time)
            del cache
    return res


def print_gemma(batches: list[int], contexts: list[int], args: argparse.Namespace) -> None:
    print()
    print(f"Gemma-3 local layer: Hq={GEMMA_HQ} Hkv={GEMMA_HKV} D={GEMMA_D} block={BS} window={GEMMA_WINDOW}, q bf16; "
          f"decode = one new token per sequence, prefill = a chunk of {args.prefill_chunk} new tokens ending at ctx")
    print("times are microseconds per layer call; win = sliding window 512, full = full causal at the same context")
    hdr = (f"{'step':>7} {'batch':>5} {'ctx':>6} | {'fp8 win':>9} {'bf16 win':>9} {'fp8 full':>9} {'bf16 full':>9} | "
           f"{'fp8/bf16 win':>12} {'fp8/bf16 full':>13} | {'win/full fp8':>12} {'win/full bf16':>13}")
    print(hdr)
    print("-" * len(hdr))
    rows = [("decode", b, 1) for b in batches] + [("prefill", 1, args.prefill_chunk)]
    for step, b, q_len in rows:
        for ctx in contexts:
            if q_len > ctx:
                continue
            r = bench_gemma(b, ctx, q_len, args)
            us = lambda t: t * 1e6  # noqa: E731
            print(f"{step:>7} {b:>5} {ctx:>6} | {us(r['fp8_win']):>9.1f} {us(r['bf16_win']):>9.1f} "
                  f"{us(r['fp8_full']):>9.1f} {us(r['bf16_full']):>9.1f} | "
                  f"{r['fp8_win'] / r['bf16_win']:>12.2f} {r['fp8_full'] / r['bf16_full']:>13.2f} | "
                  f"{r['fp8_win'] / r['fp8_full']:>12.3f} {r['bf16_win'] / r['bf16_full']:>13.3f}", flush=True)


# (sequences, new tokens, context) of the prefill rows; the last: the second 2,048-token step of a 4,096-token
# prompt (the engine's default max_num_batched_tokens), as in the TTFT at 4k of bench_vs_peers
PREFILL_SHAPES = [(2, 1024, 1024), (1, 512, 2048), (1, 2048, 4096)]


def prefill_cache(kv_name: str, n_layers: int, batch: int, q_len: int, ctx: int,
                  dynamic: bool = False) -> tuple[PagedKVCache, AttentionMetadata]:
    """SmolLM2-shaped caches of ``batch`` sequences of ``ctx`` tokens, the last ``q_len`` of them new. K and V
    are N(0, 1) values stored through the codec (scale 1, or a scale per token and head with ``dynamic`` and for
    int8), so the scores spread as a model's do; uniform FP8 codes (fill_random) would make every softmax row
    one-hot and most exponentials underflow. Layers 2 and up are copies of layer 0 or 1 (the timings read distinct
    buffers, not distinct values; encoding every layer of a 30-layer cache takes minutes)."""
    kv, v_kv = resolve_kv_cache_dtypes(kv_name, torch.bfloat16)   # a K/V pair ("k8v4"): each side its format
    blocks_per_seq = -(-ctx // BS)
    static = kv.is_fp8 and not dynamic and v_kv == kv
    cache = PagedKVCache(CacheShape(n_layers, batch * blocks_per_seq, HKV, BS, D),
                         KVCodec.build(kv, D, scale_mode="dynamic" if dynamic else "static",
                                       scales=KVScales.default(n_layers) if static else None, v_dtype=v_kv))
    for layer in range(n_layers):
        if layer >= 2:
            for t in cache.tensors:
                t[layer].copy_(t[layer % 2])
            continue
        for which, (data, scales) in enumerate(((cache.k_data, cache.k_token_scales),
                                                (cache.v_data, cache.v_token_scales))):
            x = torch.randn(batch * blocks_per_seq * BS, HKV, D)
            stored, ts = cache.codec.encode(x, layer, which)
            data[layer].copy_(stored.view(-1, BS, HKV, data.shape[-1]).transpose(1, 2))
            if ts is not None and scales is not None:
                scales[layer].copy_(ts.view(-1, BS, HKV).transpose(1, 2))
    perm = torch.randperm(batch * blocks_per_seq).view(batch, blocks_per_seq).tolist()
    meta = AttentionMetadata.build([q_len] * batch, [ctx] * batch, perm, BS)
    return cache, meta


def prefill_flops(batch: int, q_len: int, ctx: int) -> float:
    """Flops of one call: 4 * D per (query head, visible key) pair (2 D for q.k, 2 D for p.v)."""
    pairs = sum(ctx - q_len + i + 1 for i in range(q_len))  # causal: new token i sees ctx - q_len + i + 1 keys
    return 4.0 * D * HQ * batch * pairs


@contextmanager
def on_path(lib: KernelLibrary, path: str) -> Iterator[None]:
    """The library's item kernels on ``path`` ("amx": AMX tiles; "avx512": vdpbf16ps) inside the block, its own
    choice restored afterwards."""
    chosen = lib.amx
    lib.amx = path == "amx"
    try:
        yield
    finally:
        lib.amx = chosen


def print_smollm2_prefill(args: argparse.Namespace, before: tuple[str, KernelLibrary] | None = None) -> None:
    lib = load_kernels()
    scale = D ** -0.5
    paths = ("amx", "avx512") if lib.amx else ("avx512",)  # where the CPU has AMX, both paths side by side
    print()
    print(f"SmolLM2 prefill: Hq={HQ} Hkv={HKV} D={D} block={BS}, q bf16, causal; prefill loop on "
          f"{' and '.join(paths)}")
    print("times are microseconds per layer call; GFLOP/s counts 4 * D flops per query head and visible key")
    cols = [(kv, path) for kv in ("fp8", "bf16") for path in paths]
    hdr = (f"{'batch':>5} {'new':>5} {'ctx':>6} | " + " ".join(f"{kv + ' ' + p:>11}" for kv, p in cols) + " | " +
           " ".join(f"{kv + ' ' + p + ' GF/s':>16}" for kv, p in cols) + f" | {'fp8/bf16':>8}" +
           (f" {'amx/avx512 fp8':>14} {'amx/avx512 bf16':>15}" if lib.amx else ""))
    print(hdr)
    print("-" * len(hdr))
    for batch, q_len, ctx in PREFILL_SHAPES:
        q = torch.randn(batch * q_len, HQ, D, dtype=torch.bfloat16)
        res: dict[tuple[str, str], float] = {}
        for kv_name, tag in (("fp8_e4m3", "fp8"), ("bfloat16", "bf16")):
            nbytes = batch * ctx * HKV * D * 2 * (1 if tag == "fp8" else 2)
            nl = layers_for(nbytes, args.footprint_mb << 20, cap=16)  # each call re-reads its cache many times
            cache, meta = prefill_cache(kv_name, nl, batch, q_len, ctx)
            for path in paths:
                with on_path(lib, path):
                    res[tag, path] = timeit(lambda i, c=cache, m=meta, x=q: lib.attention(x, c, i, m, scale), nl,
                                            args.min_time)
            del cache
        gf = prefill_flops(batch, q_len, ctx) / 1e9
        ratio = res["fp8", paths[0]] / res["bf16", paths[0]]
        line = (f"{batch:>5} {q_len:>5} {ctx:>6} | " + " ".join(f"{res[c] * 1e6:>11.1f}" for c in cols) + " | " +
                " ".join(f"{gf / res[c]:>16.1f}" for c in cols) + f" | {ratio:>8.2f}")
        if lib.amx:
            line += (f" {res['fp8', 'avx512'] / res['fp8', 'amx']:>14.2f}"
                     f" {res['bf16', 'avx512'] / res['bf16', 'amx']:>15.2f}")
        print(line, flush=True)
    if before is not None:
        print_prefill_before(lib, before, args)


def print_prefill_before(lib: KernelLibrary, before: tuple[str, KernelLibrary], args: argparse.Namespace) -> None:
    """The prefill rows on the library's own path, now and at a revision, calls alternating: ``--rounds`` rounds
    of one call of each library in turn (the order swapped each round), per shape and cache; the median time of
    each, and the median (min-max) of the per-round ratios then / now (> 1: faster now)."""
    rev, old = before
    scale = D ** -0.5
    print()
    print(f"SmolLM2 prefill rows now and at {rev}, {'AMX tiles' if lib.amx else 'AVX-512'}: {args.rounds} rounds of "
          f"one call of each, alternating; ms per layer call (median), {rev} / now per round: median (min-max)")
    hdr = f"{'batch':>5} {'new':>5} {'ctx':>6} {'cache':>6} | {'now':>8} {rev[:12]:>12} | {rev[:12] + ' / now':>22}"
    print(hdr)
    print("-" * len(hdr))
    for batch, q_len, ctx in PREFILL_SHAPES:
        q = torch.randn(batch * q_len, HQ, D, dtype=torch.bfloat16)
        for kv_name, tag in (("fp8_e4m3", "fp8"), ("bfloat16", "bf16")):
            cache, meta = prefill_cache(kv_name, 2, batch, q_len, ctx)
            libs = {"now": lib, rev: old}
            times: dict[str, list[float]] = {"now": [], rev: []}
            for name in libs:   # warm-up: each library's first calls
                libs[name].attention(q, cache, 0, meta, scale)
            for r in range(args.rounds):
                for name in (["now", rev] if r % 2 == 0 else [rev, "now"]):
                    start = time.perf_counter()
                    libs[name].attention(q, cache, r % 2, meta, scale)
                    times[name].append(time.perf_counter() - start)
            ratios = sorted(b / a for a, b in zip(times["now"], times[rev]))
            now_ms, then_ms = statistics.median(times["now"]) * 1e3, statistics.median(times[rev]) * 1e3
            cell = f"{statistics.median(ratios):.3f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"
            print(f"{batch:>5} {q_len:>5} {ctx:>6} {tag:>6} | {now_ms:>8.2f} {then_ms:>12.2f} | {cell:>22}", flush=True)
            del cache


def print_builds(args: argparse.Namespace) -> None:
    libs = {march: load_kernels(march) for march in args.builds}
    scale = D ** -0.5
    cases: dict[str, tuple[PagedKVCache, AttentionMetadata, torch.Tensor, float]] = {}
    for kv_name, tag in (("fp8_e4m3", "fp8"), ("bfloat16", "bf16")):
        cache, meta = prefill_cache(kv_name, 2, 1, 1024, 1024)
        cases[f"prefill 1 x 1024 {tag}"] = (cache, meta, torch.randn(1024, HQ, D, dtype=torch.bfloat16),
                                            prefill_flops(1, 1024, 1024))
        cache, meta = paged_cache(kv_name, layers_for(32 * 1024 * HKV * D * 4, args.footprint_mb << 20), 32, 1024)
        cases[f"decode 32 x 1024 {tag}"] = (cache, meta, torch.randn(32, HQ, D, dtype=torch.bfloat16),
                                           4.0 * D * HQ * 32 * 1024)
    times: dict[tuple[str, str], list[float]] = {(c, m): [] for c in cases for m in libs}
    marches = list(libs)
    for r in range(args.rounds):
        for case, (cache, meta, q, _) in cases.items():
            for march in marches[r % len(marches):] + marches[:r % len(marches)]:
                call = lambda i, lb=libs[march], c=cache, m=meta, x=q: lb.attention(x, c, i, m, scale)  # noqa: E731
                times[case, march].append(timeit(call, cache.shape.num_layers, args.min_time))
    print()
    print(f"SmolLM2 shapes (Hq={HQ} Hkv={HKV} D={D} block={BS}, q bf16), the library built per -march; medians of "
          f"{args.rounds} alternating rounds (min-max), microseconds per layer call")
    item = {m: kernel_name(libs[m]) for m in marches}
    hdr = f"{'call':<22}" + "".join(f"{m + ' (' + item[m] + ')':>34}" for m in marches) + "".join(
        f"{m + ' GF/s':>18}" for m in marches) + "".join(f"{m + '/' + marches[0]:>22}" for m in marches[1:])
    print(hdr)
    print("-" * len(hdr))
    for case, (_, _, _, flops) in cases.items():
        med = {m: statistics.median(times[case, m]) for m in marches}
        cells = "".join(f"{f'{med[m] * 1e6:.1f} ({min(times[case, m]) * 1e6:.0f}-{max(times[case, m]) * 1e6:.0f})':>34}"
                        for m in marches)
        print(f"{case:<22}{cells}" + "".join(f"{flops / med[m] / 1e9:>18.1f}" for m in marches) +
              "".join(f"{med[m] / med[marches[0]]:>22.2f}" for m in marches[1:]), flush=True)


#: --tables formats: each KV format (kv_cache_dtype, dynamic scales, label); the K/V pairs last (int8 keys with
#: int4_per_group32 values, "k8v4", and with int4 values per token and head)
FORMATS = (("fp8_e4m3", False, "fp8"), ("fp8_e4m3", True, "fp8+dynamic"), ("int8_per_token_head", True, "int8"),
           ("int4_per_token_head", True, "int4"), ("int4_per_group32", False, "int4g32"), ("fp4_e2m1", False, "fp4"),
           ("bfloat16", False, "bf16"), ("k8v4", True, "k8v4"), ("int8/int4", True, "int8/int4"))


def print_formats(args: argparse.Namespace, before: tuple[str, KernelLibrary] | None = None) -> None:
    """Each KV format on the native library, side by side on SmolLM2 shapes, alternating rounds; with ``before``
    (a revision and its library) every format on both libraries in the same rounds, and each format's time now over
    its time then."""
    lib = load_kernels()
    libs = {"now": lib} if before is None else {"now": lib, before[0]: before[1]}
    scale = D ** -0.5
    chosen = [f for f in FORMATS if args.formats is None or f[2] in args.formats]
    shapes = (("prefill 1 x 1024", 1, 1024, 1024), ("decode 32 x 1024", 32, 1, 1024), ("decode 8 x 4096", 8, 1, 4096),
              ("decode 1 x 8192", 1, 1, 8192))
    cases: dict[tuple[str, str], tuple[PagedKVCache, AttentionMetadata, torch.Tensor]] = {}
    for shape, batch, q_len, ctx in shapes:
        q = torch.randn(batch * q_len, HQ, D, dtype=torch.bfloat16)
        for kv_name, dynamic, label in chosen:
            sides = resolve_kv_cache_dtypes(kv_name, torch.bfloat16)
            nbytes = batch * ctx * HKV * D * sum(side.bits_per_value for side in sides) // 8
            nl = 2 if q_len > 1 else args.layers or layers_for(nbytes, args.footprint_mb << 20, cap=64)
            cache, meta = prefill_cache(kv_name, nl, batch, q_len, ctx, dynamic)
            cases[shape, label] = (cache, meta, q)
    # (a --before revision's library may not know a newer format: that format runs on the native library only)
    known = {name: [label for kv, _, label in chosen
                    if all(side.name in lb.kv_dtype_codes for side in resolve_kv_cache_dtypes(kv, torch.bfloat16))]
             for name, lb in libs.items()}
    known_kv = {name: set(lb.kv_dtype_codes) for name, lb in libs.items()}
    variants = [(name, label) for name in libs for label in known[name]]
    times: dict[tuple[str, str, str], list[float]] = {(shape, *v): [] for shape, *_ in shapes for v in variants}
    for r in range(args.rounds):
        for shape, *_ in shapes:
            for name, label in variants[r % len(variants):] + variants[:r % len(variants)]:
                cache, meta, q = cases[shape, label]
                call = lambda i, lb=libs[name], c=cache, m=meta, x=q: lb.attention(x, c, i, m, scale)  # noqa: E731
                times[shape, name, label].append(timeit(call, cache.shape.num_layers, args.min_time))
    for name in libs:   # each library's item kernel of a prefill item
        ints, fp4, i4g = (KernelTesting(libs[name]).item_kernel(kv, torch.bfloat16, D) if kv in known_kv[name] else "-"
                          for kv in ("int4_per_token_head", "fp4_e2m1", "int4_per_group32"))
        print()
        k8v4 = KernelTesting(libs[name]).item_kernel("int8_per_token_head", torch.bfloat16, D, BS, HQ // HKV,
                                                     v_kv_dtype="int4_per_group32")
        print(f"KV formats ({name}), SmolLM2 shapes (Hq={HQ} Hkv={HKV} D={D} block={BS}, q bf16), item kernel "
              f"{kernel_name(libs[name])} (int8, int4: {ints}; int4g32: {i4g}; fp4: {fp4}; k8v4 decode items: "
              f"{k8v4}); medians of "
              f"{args.rounds} alternating rounds (min-max), microseconds per layer call; x/fp8 = time over the fp8 "
              "cache's")
        mine = known[name]
        base = "fp8" if "fp8" in mine else mine[0]   # the time each format's is divided by
        hdr = f"{'call':<18}" + "".join(f"{label:>24}" for label in mine) + "".join(
            f"{label + '/' + base:>18}" for label in mine if label != base)
        print(hdr)
        print("-" * len(hdr))
        for shape, *_ in shapes:
            t = {label: times[shape, name, label] for label in mine}
            med = {label: statistics.median(t[label]) for label in mine}
            spread = {x: f"{med[x] * 1e6:.1f} ({min(t[x]) * 1e6:.0f}-{max(t[x]) * 1e6:.0f})" for x in mine}
            cells = "".join(f"{spread[x]:>24}" for x in mine)
            print(f"{shape:<18}{cells}" + "".join(f"{med[x] / med[base]:>18.2f}" for x in mine if x != base),
                  flush=True)
    if before is not None:
        rev = before[0]
        print()
        print(f"now / {rev}: each format's median time now over its median time at {rev} (< 1: faster now)")
        both = known[rev]
        hdr = f"{'call':<18}" + "".join(f"{label:>14}" for label in both)
        print(hdr)
        print("-" * len(hdr))
        for shape, *_ in shapes:
            ratio = {x: statistics.median(times[shape, "now", x]) / statistics.median(times[shape, rev, x])
                     for x in both}
            print(f"{shape:<18}" + "".join(f"{ratio[x]:>14.2f}" for x in both), flush=True)


def print_stream(args: argparse.Namespace) -> None:
    """The decode kernels' stream distance (``stream_tiles``: tiles of 16 tokens ahead that K and V are prefetched into
    L2), each of :data:`kv8.attention.tuning.STREAM_CANDIDATES` and the build's default side by side on SmolLM2
    decode shapes per format, ``--rounds`` rounds rotating the distances' order: the median time per layer call and
    the default's time over each distance's (> 1: faster than the default), with that ratio's min-max over the
    rounds; and the distance :func:`kv8.attention.tuning.choose_stream_tiles`'s rule would pick from these medians."""
    lib = load_kernels()
    scale = D ** -0.5
    dists = list(dict.fromkeys([lib.default_stream_tiles, *STREAM_CANDIDATES]))
    chosen = [f for f in FORMATS if args.formats is None or f[2] in args.formats]
    shapes = (("decode 32 x 1024", 32, 1024), ("decode 8 x 4096", 8, 4096))
    print(f"\ndecode stream distance (stream_tiles; default {lib.default_stream_tiles}), SmolLM2 shapes (Hq={HQ} "
          f"Hkv={HKV} D={D} block={BS}, q bf16, fast path: {lib.has_fast_path}); medians of {args.rounds} rounds "
          "rotating the distances, microseconds per layer call; x default = the default's time over the distance's "
          "(min-max over rounds)")
    hdr = f"{'format':<12}{'call':<18}" + "".join(f"{d:>23}" for d in dists) + f"{'rule picks':>12}"
    print(hdr)
    print("-" * len(hdr))
    for kv_name, dynamic, label in chosen:
        sides = resolve_kv_cache_dtypes(kv_name, torch.bfloat16)
        for shape, batch, ctx in shapes:
            nbytes = batch * ctx * HKV * D * sum(side.bits_per_value for side in sides) // 8
            nl = args.layers or layers_for(nbytes, args.footprint_mb << 20, cap=64)
            cache, meta = prefill_cache(kv_name, nl, batch, 1, ctx, dynamic)
            q = torch.randn(batch, HQ, D, dtype=torch.bfloat16)
            times: dict[int, list[float]] = {d: [] for d in dists}
            for r in range(args.rounds):
                for d in dists[r % len(dists):] + dists[:r % len(dists)]:
                    call = lambda i, n=d, c=cache, m=meta, x=q: lib.attention(  # noqa: E731
                        x, c, i, m, scale, stream_tiles=n)
                    times[d].append(timeit(call, nl, args.min_time, windows=2))
            med = {d: statistics.median(t) for d, t in times.items()}
            base = times[lib.default_stream_tiles]
            ratios = {d: [b / t for b, t in zip(base, times[d])] for d in dists}
            cell = {d: f"{med[d] * 1e6:.0f} {med[lib.default_stream_tiles] / med[d]:.2f}x "
                       f"({min(ratios[d]):.2f}-{max(ratios[d]):.2f})" for d in dists}
            cells = "".join(f"{cell[d]:>23}" for d in dists)
            pick = choose_stream_tiles(lib.default_stream_tiles, med.__getitem__, dists, rounds=1).stream_tiles
            print(f"{label:<12}{shape:<18}{cells}{pick:>12}", flush=True)


def kernel_name(lib: KernelLibrary) -> str:
    """Which item kernel serves a prefill item of the library (bf16 compute, head_dim 64, an FP8 cache)."""
    return KernelTesting(lib).item_kernel("fp8_e4m3", torch.bfloat16, D)


def bench(batch: int, ctx: int, args: argparse.Namespace) -> dict[str, float]:
    lib = load_kernels()
    q = torch.randn(batch, HQ, D, dtype=torch.bfloat16)
    scale = D ** -0.5
    res: dict[str, float] = {}
    tokens = batch * ctx
    fp8_bytes = tokens * HKV * D * 2          # K and V, one byte each
    bf16_bytes = 2 * fp8_bytes
    res["fp8_bytes"], res["bf16_bytes"] = fp8_bytes, bf16_bytes
    for name, nbytes in (("fp8", fp8_bytes), ("bf16", bf16_bytes)):
        nl = layers_for(nbytes, args.footprint_mb << 20)
        cache, meta = paged_cache("fp8_e4m3" if name == "fp8" else "bfloat16", nl, batch, ctx,
                                  args.blocks == "contiguous")
        # the library's path (AMX tiles where it has them), and with AMX the AVX-512 path beside it
        for path, key in (("amx", name), ("avx512", name + "_avx512")) if lib.amx else (("avx512", name),):
            with on_path(lib, path):
                res[key] = timeit(lambda i, c=cache, m=meta: lib.attention(q, c, i, m, scale), nl, args.min_time)
        del cache
    if args.kv8_only:
        return res
    nl = layers_for(bf16_bytes, args.footprint_mb << 20)
    kc = torch.randn(nl, batch, HKV, ctx, D, dtype=torch.bfloat16)
    vc = torch.randn(nl, batch, HKV, ctx, D, dtype=torch.bfloat16)
    q4 = q.unsqueeze(2)  # [B, Hq, 1, D]
    res["sdpa"] = timeit(
        lambda i, k=kc, v=vc: F.scaled_dot_product_attention(q4, k[i], v[i], scale=scale, enable_gqa=True),
        nl, args.min_time)
    del kc, vc
    for name, nbytes in (("copy_fp8", fp8_bytes), ("copy_bf16", bf16_bytes)):
        nl = layers_for(nbytes, args.footprint_mb << 20)
        src = torch.empty(nl, nbytes, dtype=torch.uint8).fill_(1)
        dst = torch.empty(nbytes, dtype=torch.uint8)
        res[name] = timeit(lambda i, d=dst, s=src: d.copy_(s[i]), nl, args.min_time)
        del src, dst
    return res


def print_smollm2(batches: list[int], contexts: list[int], args: argparse.Namespace) -> None:
    amx = load_kernels().amx
    print()
    print(f"SmolLM2 decode: Hq={HQ} Hkv={HKV} D={D} block={BS}, q bf16; kv8 on "
          f"{'AMX tiles (the AVX-512 path at the end of each line)' if amx else 'AVX-512'}")
    hdr = (f"{'batch':>5} {'ctx':>6} | {'kv8 fp8':>9} {'kv8 bf16':>9} {'sdpa':>9} {'copy fp8':>9} {'copy bf16':>9} | "
           f"{'fp8 GB/s':>8} {'bf16 GB/s':>9} {'sdpa GB/s':>9} {'cp8 GB/s':>8} {'cp16 GB/s':>9} | "
           f"{'fp8/cp':>6} {'bf16/cp':>7} | {'fp8/bf16':>8} {'bf16/sdpa':>9}")
    print("times are microseconds per layer call; fp8/cp = fp8 kernel bandwidth / copy bandwidth of the same bytes")
    if args.kv8_only:
        hdr = f"{'batch':>5} {'ctx':>6} | {'kv8 fp8':>9} {'kv8 bf16':>9} | {'fp8/bf16':>8}"
    if amx:
        hdr += f" | {'fp8 avx512':>10} {'bf16 avx512':>11} {'avx512/amx fp8':>14} {'avx512/amx bf16':>15}"
    print(hdr)
    print("-" * len(hdr))
    for b in batches:
        for ctx in contexts:
            r = bench(b, ctx, args)
            tail = ""
            if amx:
                tail = (f" | {r['fp8_avx512'] * 1e6:>10.1f} {r['bf16_avx512'] * 1e6:>11.1f} "
                        f"{r['fp8_avx512'] / r['fp8']:>14.2f} {r['bf16_avx512'] / r['bf16']:>15.2f}")
            if args.kv8_only:
                print(f"{b:>5} {ctx:>6} | {r['fp8'] * 1e6:>9.1f} {r['bf16'] * 1e6:>9.1f} | "
                      f"{r['fp8'] / r['bf16']:>8.2f}{tail}", flush=True)
                continue
            gb = lambda nbytes, t: nbytes / t / 1e9  # noqa: E731
            f8, b16 = gb(r["fp8_bytes"], r["fp8"]), gb(r["bf16_bytes"], r["bf16"])
            sd = gb(r["bf16_bytes"], r["sdpa"])
            c8, c16 = gb(r["fp8_bytes"], r["copy_fp8"]), gb(r["bf16_bytes"], r["copy_bf16"])
            us = lambda t: t * 1e6  # noqa: E731
            print(f"{b:>5} {ctx:>6} | {us(r['fp8']):>9.1f} {us(r['bf16']):>9.1f} {us(r['sdpa']):>9.1f} "
                  f"{us(r['copy_fp8']):>9.1f} {us(r['copy_bf16']):>9.1f} | {f8:>8.1f} {b16:>9.1f} {sd:>9.1f} "
                  f"{c8:>8.1f} {c16:>9.1f} | {f8 / c8:>6.2f} {b16 / c16:>7.2f} | "
                  f"{r['fp8'] / r['bf16']:>8.2f} {r['bf16'] / r['sdpa']:>9.2f}{tail}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="batch 1, 8 and contexts 1k, 4k only")
    ap.add_argument("--batch", type=int, nargs="*", default=None)
    ap.add_argument("--context", type=int, nargs="*", default=None)
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds per measurement (default 1.0)")
    ap.add_argument("--footprint-mb", type=int, default=128, help="bytes each variant cycles through (MiB)")
    ap.add_argument("--layers", type=int, default=None, metavar="N",
                    help="--tables formats: each decode row calls N distinct caches in turn, as a model's N layers "
                         "(SmolLM2: 30) each read once per step, whatever their bytes; default: as many as "
                         "--footprint-mb needs (at most 64)")
    ap.add_argument("--kv8-only", action="store_true", help="time the kv8 kernels only (no sdpa, no copies)")
    ap.add_argument("--threads", type=int, default=None, help="torch / kernel threads (default: torch's)")
    ap.add_argument("--blocks", choices=["scattered", "contiguous"], default="scattered",
                    help="SmolLM2 decode rows: each sequence's blocks scattered over the cache (default) or at "
                         "ascending addresses (a prompt's blocks in the engine)")
    ap.add_argument("--tables", nargs="*",
                    choices=["smollm2", "gemma3", "smollm2-prefill", "builds", "formats", "stream"],
                    default=["smollm2", "gemma3"],
                    help="which tables to print (default: smollm2 and gemma3, the decode tables)")
    ap.add_argument("--gemma-batch", type=int, nargs="*", default=None,
                    help="decode batches of the Gemma-3 rows (default 1 8; --quick: 1)")
    ap.add_argument("--prefill-chunk", type=int, default=512, help="new tokens of a Gemma-3 prefill row")
    ap.add_argument("--builds", nargs="+", default=["native", "x86-64-v2"], metavar="MARCH",
                    help="--tables builds: the -march targets to compare (default: native x86-64-v2)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="--tables builds / formats / stream: alternating rounds (default 5)")
    ap.add_argument("--formats", nargs="+", default=None, metavar="LABEL",
                    choices=[label for _, _, label in FORMATS],
                    help="--tables formats / stream: only these formats (labels; default: all)")
    ap.add_argument("--before", default=None, metavar="REV",
                    help="--tables formats / smollm2-prefill: also the kernels as of git revision REV (built from a "
                         "temporary worktree): every format on both in the same alternating rounds / the prefill "
                         "rows on both, one call of each in turn for --rounds rounds")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    batches = args.batch or ([1, 8] if args.quick else [1, 8, 32])
    contexts = args.context or ([1024, 4096] if args.quick else [1024, 4096, 8192])
    lib = load_kernels()
    print(f"kv8 attention benchmark: {torch.get_num_threads()} threads, fast path: {lib.has_fast_path}, "
          f"footprint >= {args.footprint_mb} MiB, {args.blocks} blocks, load average {os.getloadavg()[0]:.2f}")
    if "smollm2" in args.tables:
        print_smollm2(batches, contexts, args)
    if "gemma3" in args.tables:
        print_gemma(args.gemma_batch or ([1] if args.quick else [1, 8]), contexts, args)
    with contextlib.ExitStack() as stack:
        before = None
        if args.before and {"formats", "smollm2-prefill"} & set(args.tables):
            try:
                checkout = stack.enter_context(worktree(args.before, "--before"))
            except (ValueError, RuntimeError) as e:
                ap.error(str(e))
            source = Path(checkout.path) / SOURCE.relative_to(Path(kv8.__file__).parents[1])
            try:
                before = (checkout.rev, KernelLibrary(build_shared_library(source, "native"), "native"))
            except KernelUnavailable as e:  # e.g. a revision with other argument structs
                ap.error(f"--before {args.before}: {e}")
        if "smollm2-prefill" in args.tables:
            print_smollm2_prefill(args, before)
        if "builds" in args.tables:
            print_builds(args)
        if "formats" in args.tables:
            print_formats(args, before)
        if "stream" in args.tables:
            print_stream(args)


if __name__ == "__main__":
    main()
