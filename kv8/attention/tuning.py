"""Per-machine choice of how far ahead the CPU decode attention streams the cache (``stream_tiles``), timed on the
engine's own cache formats and head shapes.

The decode kernels (``csrc/attention/item_decode.h``) read each head's K and V in tiles of 16 tokens and prefetch the
tile ``stream_tiles`` ahead into L2, one row beside each row they read. The best distance depends on the CPU (memory
latency, line-fill buffers) and on the format's bytes per tile. ``benchmarks/bench_attention.py --tables stream``
measures it: on an AMD EPYC (Zen 5, 2 threads, SmolLM2's heads, 8 x 4,096 tokens) 4 tiles ran 1.17x the build's
default 3 with an FP8 cache and 1.40x with int4, 0.98x with bf16; on the AMX Xeon the default 3 was best. So the
engine times the distances once per machine and cache format:

1. for each distinct cache format of the engine's pools (:class:`StreamCase`: the K and V formats, whether tokens
   keep scales, query and KV heads, head_dim, block size), a cache of that format with random contents holds
   :data:`TUNE_BATCH` sequences of :data:`TUNE_CONTEXT` tokens in as many layers (distinct buffers) as fill
   :data:`TUNE_FOOTPRINT` bytes, so that each call reads its layer from memory, as a decode step reads each layer's
   cache once, not from a warm L3;
2. a pass is one decode call per layer; :data:`TUNE_ROUNDS` rounds take the distances of :data:`STREAM_CANDIDATES`
   in turn, in a rotated order (none always first or last), and each distance's median pass is its time;
3. the fastest median wins if it is at least :data:`MIN_GAIN` below the default's, else the default stays (a
   difference inside the machine's noise does not move the choice); of distances within :data:`TIE` of the fastest,
   the one nearest the default (the nearer of two at the same distance: the shorter);
4. the choice is kept in this machine's plan file (:class:`kv8.machine_plans.MachinePlans`, key ``attention/...``)
   with the attention library's build: a plan timed on another build, or beside other work (:data:`BUSY_CORES`
   cores taken by other processes: provisional), is timed again at the next start.

Only caches the decode kernels read are timed (:func:`streams`: the AVX-512 BF16 build, bf16 compute, head_dim 64 /
128 / 256, blocks of a multiple of 16 tokens); elsewhere the distance does nothing and the default stays.

Invariant: the choice changes speed only. The kernels compute the same bits at every distance (a prefetch reads
nothing into the result; ``tests/attention/test_stream_tuning.py`` checks it on every format).
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kv8.attention.metadata import AttentionMetadata
from kv8.cache.codec import KVCodec
from kv8.cache.paged_cache import CacheShape, PagedKVCache
from kv8.cache.plan import KVSpec
from kv8.cpu_load import others_cores, read_cpu_clock, this_process_cpus
from kv8.kernels.cpu.attention import KernelLibrary
from kv8.machine_plans import MachinePlans
from kv8.quant.scales import KVScales

logger = logging.getLogger("kv8")

__all__ = ["BUSY_CORES", "MIN_GAIN", "STREAM_CANDIDATES", "TIE", "TUNE_BATCH", "TUNE_CONTEXT", "TUNE_FOOTPRINT",
           "TUNE_ROUNDS", "StreamCase", "StreamChoice", "choose_stream_tiles", "plan_entry_key", "stored_stream_tiles",
           "streams", "tuned_stream_tiles"]

STREAM_CANDIDATES = (2, 3, 4, 5, 6, 8)   # tiles ahead (each must be 1 .. the library's max_stream_tiles)
TUNE_BATCH, TUNE_CONTEXT = 8, 2048       # decode sequences x context tokens of each timed call
TUNE_FOOTPRINT = 96 << 20                # bytes of cache the layers of a pass hold (more than a CPU's L3)
TUNE_ROUNDS = 9                          # rounds over the candidates (module docstring, step 2)
MIN_GAIN = 0.03                          # how much faster than the default a distance must be to be chosen
TIE = 0.01                               # distances this close to the fastest median count as tied with it
BUSY_CORES = 0.25                        # other processes' CPU use while timing above which a choice is provisional
_MIN_LAYERS, _MAX_LAYERS = 2, 64

#: ``measure(stream_tiles) -> seconds`` of one pass
Measure = Callable[[int], float]


@dataclass(frozen=True)
class StreamCase:
    """One cache format the engine's decode attention reads, with the head shapes of its calls."""

    spec: KVSpec
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype = torch.bfloat16   # the compute dtype (the queries')

    @property
    def formats(self) -> tuple[str, str]:
        """(K format, V format) names: what :class:`kv8.attention.cpu_fused.FusedCPUBackend` looks its choice up by
        (a cache's ``k_dtype.name``, ``v_dtype.name``)."""
        return self.spec.kv_dtype.name, self.spec.values_dtype.name

    def describe(self) -> str:
        return (f"{self.spec.name} cache, {self.num_q_heads} query / {self.num_kv_heads} KV heads of {self.head_dim}, "
                f"blocks of {self.block_size}")


@dataclass(frozen=True)
class StreamChoice:
    """The distance chosen for one :class:`StreamCase` and the median pass per distance timed (``seconds``; empty
    where nothing was timed: :func:`streams` is False)."""

    stream_tiles: int
    default: int
    seconds: dict[int, float]
    measured: str = ""        # when (UTC, ISO 8601)
    build: str = ""           # the attention library's build it was timed on
    others: float = 0.0       # cores' worth of CPU time other processes took while it was timed
    layers: int = 0           # layers (distinct buffers) of a timed pass

    @property
    def provisional(self) -> bool:
        return self.others > BUSY_CORES

    @property
    def speedup(self) -> float:
        """The default's time over the choice's (1.0 where nothing was timed)."""
        if not self.seconds:
            return 1.0
        return self.seconds[self.default] / self.seconds[self.stream_tiles]

    def table(self) -> str:
        lines = [f"{'stream_tiles':<14}{'pass (ms)':>12}{'x default':>12}"]
        for n, t in sorted(self.seconds.items()):
            mark = "  <- chosen" if n == self.stream_tiles else ("  (default)" if n == self.default else "")
            lines.append(f"{n:<14}{t * 1e3:>12.3f}{self.seconds[self.default] / t:>12.3f}{mark}")
        return "\n".join(lines)


def streams(lib: KernelLibrary, case: StreamCase) -> bool:
    """Whether the decode kernels whose stream ``stream_tiles`` sets read this case's decode calls (the module
    docstring's conditions): elsewhere the distance changes nothing, and nothing is timed."""
    return (lib.has_fast_path and case.dtype == torch.bfloat16 and case.head_dim in (64, 128, 256)
            and case.block_size % 16 == 0)


def plan_entry_key(case: StreamCase) -> str:
    text = json.dumps([case.spec.name, case.spec.dynamic, case.num_q_heads, case.num_kv_heads, case.head_dim,
                       case.block_size, str(case.dtype)])
    return "attention/stream_tiles/" + hashlib.sha256(text.encode()).hexdigest()[:16]


def _build_id(lib: KernelLibrary) -> str:
    return Path(lib.path).stem


class _PassTimer:
    """One pass (a decode call per layer) over a cache of ``case``'s format with random contents, at a distance."""

    def __init__(self, lib: KernelLibrary, case: StreamCase, plan_threads: int) -> None:
        spec, d, bs = case.spec, case.head_dim, case.block_size
        per_token = case.num_kv_heads * sum(side.bits_per_value for side in (spec.kv_dtype, spec.values_dtype)) * d / 8
        self.layers = max(_MIN_LAYERS, min(_MAX_LAYERS, math.ceil(TUNE_FOOTPRINT / (per_token * TUNE_BATCH
                                                                                      * TUNE_CONTEXT))))
        static_fp8 = spec.kv_dtype.is_fp8 and not spec.dynamic and spec.v_dtype is None
        codec = KVCodec.build(spec.kv_dtype, d, scale_mode="dynamic" if spec.dynamic else "static",
                              scales=KVScales.default(self.layers) if static_fp8 else None, v_dtype=spec.v_dtype)
        per_seq = TUNE_CONTEXT // bs
        blocks = TUNE_BATCH * per_seq
        self.cache = PagedKVCache(CacheShape(self.layers, blocks, case.num_kv_heads, bs, d), codec)
        generator = torch.Generator().manual_seed(0)
        slots = torch.arange(blocks * bs, dtype=torch.int64)
        for layer in range(self.layers):   # random rows through the store kernel: codes and token scales as served
            k, v = (torch.randn(blocks * bs, case.num_kv_heads, d, generator=generator).to(case.dtype)
                    for _ in range(2))
            lib.store(k, v, self.cache, layer, slots)
        ids = torch.randperm(blocks, generator=generator).view(TUNE_BATCH, per_seq)   # blocks scattered, as served
        self.meta = AttentionMetadata.build([1] * TUNE_BATCH, [TUNE_CONTEXT] * TUNE_BATCH, ids.tolist(), bs)
        self.query = torch.randn(TUNE_BATCH, case.num_q_heads, d, generator=generator).to(case.dtype)
        self.lib, self.scale, self.plan_threads = lib, d ** -0.5, plan_threads

    def measure(self, stream_tiles: int) -> float:
        start = time.perf_counter()
        for layer in range(self.layers):
            self.lib.attention(self.query, self.cache, layer, self.meta, self.scale, plan_threads=self.plan_threads,
                               stream_tiles=stream_tiles)
        return time.perf_counter() - start


def choose_stream_tiles(default: int, measure: Measure, candidates: Sequence[int] = STREAM_CANDIDATES,
                        rounds: int = TUNE_ROUNDS, min_gain: float = MIN_GAIN) -> StreamChoice:
    """Time ``candidates`` (and ``default``) by ``measure`` in ``rounds`` rounds, in a rotated order, after one
    warm-up pass each; the fastest median (of those within :data:`TIE` of it, the nearest the default) wins if
    ``min_gain`` below the default's, else the default (module docstring, steps 2-3)."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be >= 1")
    names = list(dict.fromkeys([default, *candidates]))
    for n in names:
        measure(n)   # warm-up: caches, page faults, the first call's plan
    times: dict[int, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            times[n].append(measure(n))
    median = {n: statistics.median(t) for n, t in times.items()}
    fastest = min(median.values())
    best = min((n for n in names if median[n] <= fastest * (1 + TIE)), key=lambda n: (abs(n - default), n))
    chosen = best if median[best] <= median[default] * (1 - min_gain) else default
    return StreamChoice(chosen, default, median, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def stored_stream_tiles(plans: MachinePlans, key: str, lib: KernelLibrary) -> StreamChoice | None:
    """The choice kept under ``key`` (:func:`plan_entry_key`) for this build of the kernels, or None (none kept, another
    build's, or a damaged entry)."""
    entry: Any = plans.entry(key)
    try:
        choice = StreamChoice(int(entry["stream_tiles"]), int(entry["default"]),
                              {int(n): float(t) for n, t in entry["seconds"].items()}, str(entry["measured"]),
                              str(entry["build"]), float(entry.get("others", 0.0)), int(entry.get("layers", 0)))
    except (TypeError, KeyError, ValueError, AttributeError):
        return None
    if choice.build != _build_id(lib) or choice.default != lib.default_stream_tiles \
            or not 1 <= choice.stream_tiles <= lib.max_stream_tiles:
        return None   # another build of the kernels (or a damaged entry): timed again
    return choice


def tuned_stream_tiles(lib: KernelLibrary, cases: Sequence[StreamCase], plan_threads: int,
                       plans: MachinePlans | None = None, retune: bool = False,
                       measure: Callable[[StreamCase], Measure] | None = None) -> dict[StreamCase, StreamChoice]:
    """Each case's distance on this machine: the plan file's, or timed now (and kept) where there is none, it was
    timed on another build or beside other work, or ``retune``. Cases the decode kernels do not read
    (:func:`streams`) get the default, untimed. ``measure(case)`` (tests: a fake clock) replaces the timed passes."""
    plans = plans if plans is not None else MachinePlans()
    chosen: dict[StreamCase, StreamChoice] = {}
    for case in dict.fromkeys(cases):
        if not streams(lib, case):
            chosen[case] = StreamChoice(lib.default_stream_tiles, lib.default_stream_tiles, {})
            continue
        key = plan_entry_key(case)
        stored = None if retune else stored_stream_tiles(plans, key, lib)
        if stored is not None and not stored.provisional:
            chosen[case] = stored
            continue
        start = time.perf_counter()
        logger.warning("timing the decode attention's stream distance on a %s on this machine: once, then kept in "
                       "%s", case.describe(), plans.path)
        timer = _PassTimer(lib, case, plan_threads) if measure is None else None
        run = measure(case) if measure is not None else timer.measure   # type: ignore[union-attr]
        candidates = [n for n in STREAM_CANDIDATES if n <= lib.max_stream_tiles]
        cpus = this_process_cpus()
        before = read_cpu_clock(cpus)
        fresh = choose_stream_tiles(lib.default_stream_tiles, run, candidates)
        after = read_cpu_clock(cpus)
        fresh = replace(fresh, build=_build_id(lib), layers=timer.layers if timer is not None else 0,
                        others=others_cores(before, after) if before is not None and after is not None else 0.0)
        del timer   # the timing cache
        if stored is None or fresh.others <= stored.others:   # (of two timings beside other work, the quieter)
            plans.keep(key, {"stream_tiles": fresh.stream_tiles, "default": fresh.default, "measured": fresh.measured,
                             "build": fresh.build, "others": round(fresh.others, 3), "layers": fresh.layers,
                             "seconds": {str(n): t for n, t in fresh.seconds.items()}})
            stored = fresh
        chosen[case] = stored
        busy = (f"; beside other work (other processes took {fresh.others:.2f} cores): provisional, timed again at "
                "the next start") if fresh.provisional else ""
        logger.warning("decode attention streams %d tiles ahead on the %s cache: %.2fx the default %d (timed in "
                       "%.1f s%s)", stored.stream_tiles, case.spec.name, stored.speedup, stored.default,
                       time.perf_counter() - start, busy)
    return chosen
