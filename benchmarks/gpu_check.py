"""kv8's GPU check: what the GPU path owes a real GPU, judged against its targets in one run under a deadline.

Sections, in this order (``--skip`` leaves some out):

1. **attention**: one layer's decode attention at Llama-3.1-8B shapes (32 query heads, 8 KV heads, head_dim 128,
   blocks of 16 in shuffled order) for B x context in {1 x 32k, 32 x 4k, 128 x 2k}: kv8's Triton kernel over an
   fp8_e4m3 and a bf16 paged cache, and torch SDPA pinned to its flash backend over a contiguous bf16 cache of the
   same tokens (the GQA group as the query length: one decode token per query head). Each is timed as N launches
   back to back between one pair of CUDA events (captured in a CUDA graph, so the wrapper's host work is not
   timed; eager launches where capture fails, said so in the results), over enough copies of its inputs that
   the L2 cache holds none of a call's bytes when it starts (:func:`rotation_count`). The cache bytes each reads
   per second are set against the device-to-device copy rate (bytes read + written by ``dst.copy_(src)`` of
   1 GiB, timed the same way).
2. **engine**: decode tokens/s of the engine (``LLM``, ``load_format="dummy"``: random bf16 weights of
   Llama-3.1-8B's shapes) at 2k context with bf16 KV and with fp8_e4m3 KV, each at the largest batch its cache
   runs at once in one KV budget (``--kv-budget-gib``, default 17 GiB: 65 sequences of 2k prompt + 53 tokens in
   bf16, 130 of 2k + 69 in fp8; :func:`batch_in_budget`), every request running through every timed step
   (:func:`request_tokens`: a timed step that is not the whole batch leaves the target without a number). At a
   fixed batch the weights read per step dominate; at one budget the FP8 cache's doubled batch shows.
3. **tests**: the Triton kernel tests (FP8, 16-bit, int8, 4-bit and K/V-pair caches), the device tests and the
   engine on the triton backend, compiled for the GPU (pytest without ``TRITON_INTERPRET``, on pytest-xdist's
   workers where it is installed) in a subprocess, with the time the deadline leaves.

Between 1 and 2, judged by no target: **formats** times the same decode attention over int8_per_token_head,
int4_per_token_head, int4_per_group32 and k8v4 caches at section 1's shapes, against its FP8 kernel (issue 40's
speed targets are the CPU's); **sweep** times the FP8 decode with fewer pipeline stages and with two warps
(:data:`SWEEP_VARIANTS`), a lead for its speed; **probe** checks 4-bit caches at head_dim 256, which compiled
launches refuse, against the reference attention and store with the refusal lifted, in two tilings
(:data:`PROBE_VARIANTS`), a lead for lifting it.

Then one verdict per target (:data:`TARGETS`, the numbers of issue 39), PASS or FAIL, and the exit status
(:func:`exit_status`): 0 when every target of the sections run passes, 1 when one fails (the tests section fails
with pytest's return code), 3 when the deadline (``--deadline``, 480 s, compile included) cut the run short: it
then prints the verdicts of what it has. A target whose section ran without producing its number fails.

``--smoke`` runs the same code at tiny shapes (a tiny Llama, contexts of a few blocks) on the CPU through Triton's
interpreter when there is no GPU: the test suite runs it so, and the script works before a GPU sees it. Its
numbers mean nothing, and its verdicts are printed like any others.

    PYTHONPATH=. python3 benchmarks/gpu_check.py --json $OUT/gpu_check.json      # on the GPU machine
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/gpu_check.py --smoke --skip tests --json /tmp/gpu_check.json
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import platform
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Llama-3.1-8B (meta-llama/Llama-3.1-8B's config.json, shapes only)
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192})
TINY_LLAMA = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=4096,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)

# (batch, context, roles): "bandwidth" rows are judged against the copy rate (32 x 4k and above), "long" rows
# against the bf16 kernel (long context). The smoke shapes take the same roles at tiny sizes.
SHAPES = ((1, 32768, ("long",)), (32, 4096, ("long", "bandwidth")), (128, 2048, ("bandwidth",)))
SMOKE_SHAPES = ((1, 64, ("long",)), (2, 48, ("long", "bandwidth")))

DEADLINE_S = 480.0          # the whole run, compile included
EXIT_OK, EXIT_MISSED, EXIT_DEADLINE = 0, 1, 3
DEFAULT_L2_BYTES = 50 * 2**20   # an H100's, where torch does not report the device's


# ---- the pure logic: targets and verdicts, rotation, deadline, exit status (tested on the CPU) ------------------
@dataclass(frozen=True)
class Target:
    """A number the GPU path owes: ``measure`` reads it (None: not measured) from the results; it passes when at
    least ``threshold`` (``higher=True``) or at most ``threshold``."""

    key: str
    text: str
    section: str
    threshold: float
    higher: bool
    measure: Callable[[dict], float | None]


def _worst(rows: Sequence[dict], role: str, value: Callable[[dict], float | None], higher: bool) -> float | None:
    """The worst ``value`` over the attention rows with ``role`` (None if a row has none, or no row has the role)."""
    values = [value(r) for r in rows if role in r.get("roles", ())]
    if not values or any(v is None for v in values):
        return None
    return min(values) if higher else max(values)   # type: ignore[type-var]


def _fp8_of_copy(result: dict) -> float | None:
    return _worst(result.get("attention", []), "bandwidth", lambda r: r.get("fp8_e4m3", {}).get("of_copy"), True)


def _fp8_over_bf16(result: dict) -> float | None:
    return _worst(result.get("attention", []), "long", lambda r: r.get("fp8_over_bf16"), True)


def _bf16_over_sdpa(result: dict) -> float | None:
    rows = result.get("attention", [])
    values = [r.get("bf16_over_sdpa") for r in rows]
    return None if not rows or any(v is None for v in values) else max(values)   # type: ignore[type-var]


def _engine_ratio(result: dict) -> float | None:
    return result.get("engine", {}).get("fp8_over_bf16_at_budget")


def _tests_passed(result: dict) -> float | None:
    tests = result.get("tests")
    return None if tests is None or tests.get("returncode") is None else float(tests["returncode"] == 0)


TARGETS = (
    Target("fp8_of_copy", "FP8 decode attention reads >= 70% of the copy rate at 32 x 4k and above", "attention",
           0.70, True, _fp8_of_copy),
    Target("fp8_over_bf16", "FP8 decode attention >= 1.6x the bf16 paged kernel at long context", "attention",
           1.6, True, _fp8_over_bf16),
    Target("bf16_over_sdpa", "bf16 paged attention takes at most 1.25x SDPA's (flash) time", "attention",
           1.25, False, _bf16_over_sdpa),
    Target("engine_fp8_over_bf16", "end-to-end decode tok/s, FP8 KV >= 1.3x bf16 KV at one KV budget", "engine",
           1.3, True, _engine_ratio),
    Target("tests", "the GPU tests pass (pytest's return code 0)", "tests", 1.0, True, _tests_passed),
)


def verdicts(result: dict, ran: Sequence[str]) -> list[dict]:
    """One verdict per target: PASS / FAIL, or SKIP when its section was not asked for (``ran``: the sections
    run, finished or not). A target of a section that ran without giving its number fails."""
    out = []
    for t in TARGETS:
        value = t.measure(result) if t.section in ran else None
        if t.section not in ran:
            verdict = "SKIP"
        elif value is None:
            verdict = "FAIL"
        else:
            verdict = "PASS" if (value >= t.threshold if t.higher else value <= t.threshold) else "FAIL"
        out.append({"target": t.key, "text": t.text, "threshold": t.threshold, "value": value, "verdict": verdict})
    return out


def exit_status(results: Sequence[dict], deadline_hit: bool) -> int:
    """:data:`EXIT_DEADLINE` when the deadline cut the run short, else :data:`EXIT_MISSED` when a verdict is
    FAIL, else :data:`EXIT_OK`."""
    if deadline_hit:
        return EXIT_DEADLINE
    return EXIT_MISSED if any(v["verdict"] == "FAIL" for v in results) else EXIT_OK


def format_verdicts(results: Sequence[dict]) -> str:
    lines = ["verdicts:"]
    for v in results:
        value = "not measured" if v["value"] is None else f"{v['value']:.3f}"
        bound = (">=" if next(t for t in TARGETS if t.key == v["target"]).higher else "<=") + f" {v['threshold']:g}"
        lines.append(f"  {v['verdict']:4s}  {v['text']}: {value} ({bound})")
    return "\n".join(lines)


def rotation_count(working_set: int, l2_bytes: int, max_bytes: int) -> int:
    """Copies of a call's inputs (``working_set`` bytes) to rotate through so that the L2 cache (``l2_bytes``) holds
    none of a call's bytes when it starts: at least two (never the previous call's copy), and enough that the
    other copies stream twice the L2 between two uses of one. ``ValueError`` when they need more than
    ``max_bytes``."""
    if working_set <= 0 or l2_bytes < 0:
        raise ValueError(f"working_set={working_set} must be > 0 and l2_bytes={l2_bytes} >= 0")
    n = max(2, 1 + math.ceil(2 * l2_bytes / working_set))
    if n * working_set > max_bytes:
        raise ValueError(f"{n} copies of {working_set} bytes (to stream 2 x {l2_bytes} bytes of L2 between two uses "
                         f"of one) exceed {max_bytes} bytes")
    return n


class DeadlineExceeded(BaseException):
    """Raised in the main thread when the run's deadline passes (:meth:`Deadline.arm`); a ``BaseException``, so that
    no ``except Exception`` on the way (a failed CUDA graph capture) takes it for an error of its own."""


class Deadline:
    """The run's deadline: ``seconds`` from construction on ``clock``. :meth:`left` for subprocess timeouts;
    :meth:`arm` makes it raise :class:`DeadlineExceeded` in the main thread when it passes (SIGALRM), and ends
    the process ``grace`` seconds later with ``on_hard_stop`` if Python has not got back control by then (a
    kernel compile or a CUDA call that does not return)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not seconds > 0:
            raise ValueError(f"deadline={seconds} must be > 0 seconds")
        self.seconds, self.clock = seconds, clock
        self.start = clock()
        self._timer: threading.Timer | None = None

    def left(self) -> float:
        return max(0.0, self.start + self.seconds - self.clock())

    def elapsed(self) -> float:
        return self.clock() - self.start

    def expired(self) -> bool:
        return self.left() <= 0

    def arm(self, on_hard_stop: Callable[[], None], grace: float = 30.0) -> None:
        def alarm(signum: int, frame: object) -> None:
            raise DeadlineExceeded(f"the deadline of {self.seconds:.0f} s passed")

        signal.signal(signal.SIGALRM, alarm)
        signal.setitimer(signal.ITIMER_REAL, max(self.left(), 1e-3))
        self._timer = threading.Timer(self.left() + grace, on_hard_stop)
        self._timer.daemon = True
        self._timer.start()

    def disarm(self) -> None:
        signal.setitimer(signal.ITIMER_REAL, 0)
        if self._timer is not None:
            self._timer.cancel()


# ---- timing --------------------------------------------------------------------------------------------------
TIMING = {"launches": 30, "repeats": 5}   # per timing: launches between one pair of events, median of repeats


def l2_bytes(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or DEFAULT_L2_BYTES)


def time_launches(calls: Sequence[Callable[[], object]], device: torch.device) -> tuple[float, str]:
    """Seconds per launch and how they were timed: ``TIMING["launches"]`` calls, rotating through ``calls`` (one
    per copy of the inputs), back to back between one pair of CUDA events, median of ``TIMING["repeats"]``. On
    CUDA the launches are captured in one CUDA graph ("graph"), or launched eagerly where capture fails ("eager";
    the host work of each call is then in the interval too); on the CPU, perf_counter ("cpu")."""
    n = TIMING["launches"]
    for call in calls:   # compile, allocate, warm up
        call()
    if device.type != "cuda":
        times = []
        for _ in range(TIMING["repeats"]):
            t0 = time.perf_counter()
            for i in range(n):
                calls[i % len(calls)]()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) / n, "cpu"
    torch.cuda.synchronize()
    graph: torch.cuda.CUDAGraph | None = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for i in range(n):
                calls[i % len(calls)]()
        graph.replay()
        method = "graph"
    except Exception:   # not capturable here: eager launches, said so
        graph, method = None, "eager"
    torch.cuda.synchronize()
    times = []
    for _ in range(TIMING["repeats"]):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        if graph is not None:
            graph.replay()
        else:
            for i in range(n):
                calls[i % len(calls)]()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times) / n, method


def copy_rate(device: torch.device, nbytes: int, l2: int) -> tuple[float, str]:
    """Bytes read + written per second by ``dst.copy_(src)`` of ``nbytes``, and how it was timed."""
    n = rotation_count(2 * nbytes, l2, 8 * 2 * nbytes)
    pairs = [(torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255),
              torch.empty(nbytes, dtype=torch.uint8, device=device)) for _ in range(n)]
    seconds, method = time_launches([lambda s=s, d=d: d.copy_(s) for s, d in pairs], device)
    return 2 * nbytes / seconds, method


# ---- 1. decode attention -----------------------------------------------------------------------------------------
def _paged(kv_name: str, batch: int, context: int, heads: int, dim: int, block: int, device: torch.device,
           seed: int):
    """A paged cache of ``kv_name`` (any format or K/V pair) holding ``batch`` sequences of ``context`` tokens in
    shuffled blocks, and its metadata for one decode step (the last token of each sequence). The tokens are random
    normal K/V written by the Triton store, so every format's codes and scales are the ones the engine writes."""
    from kv8.attention.metadata import AttentionMetadata
    from kv8.cache.codec import KVCodec
    from kv8.cache.paged_cache import CacheShape, PagedKVCache
    from kv8.kernels.triton.store import store_kv
    from kv8.quant.formats import resolve_kv_cache_dtypes
    from kv8.quant.scales import KVScales

    k_dtype, v_dtype = resolve_kv_cache_dtypes(kv_name, torch.bfloat16)
    pair = v_dtype is not k_dtype
    per_seq = -(-context // block)
    num_blocks = batch * per_seq
    scales = KVScales.default(1) if k_dtype.is_fp8 and not pair else None
    codec = KVCodec.build(k_dtype, dim, scales=scales, v_dtype=v_dtype if pair else None)
    cache = PagedKVCache(CacheShape(1, num_blocks, heads, block, dim), codec, device=device)
    k_cache, v_cache = cache.layer(0)
    k_scale, v_scale = cache.layer_scales(0) or (None, None)
    k_ts, v_ts = cache.layer_token_scales(0) or (None, None)
    gen = torch.Generator(device=device).manual_seed(seed)
    chunk = 1 << 15   # tokens per store: 64 MiB of bf16 K at 8 x 128
    slots = num_blocks * block
    for start in range(0, slots, chunk):
        n = min(chunk, slots - start)
        k = torch.randn(n, heads, dim, dtype=torch.bfloat16, device=device, generator=gen)
        v = torch.randn(n, heads, dim, dtype=torch.bfloat16, device=device, generator=gen)
        store_kv(k, v, k_cache, v_cache, torch.arange(start, start + n, device=device),
                 fp8=cache.k_dtype.codes, v_fp8=cache.v_dtype.codes, k_scale=k_scale, v_scale=v_scale,
                 k_token_scales=k_ts, v_token_scales=v_ts)
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    tables = [order[i * per_seq:(i + 1) * per_seq] for i in range(batch)]
    meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, block, device=device)
    return cache, meta


def token_head_bytes(cache) -> int:
    """Bytes one (token, KV head) takes in ``cache``: each side's row and its per-token scale, if any."""
    total = 0
    for data, ts in ((cache.k_data, cache.k_token_scales), (cache.v_data, cache.v_token_scales)):
        total += data.shape[-1] * data.element_size() + (0 if ts is None else ts.element_size())
    return total


def _rate(seconds: float, read: int, copy_bps: float, method: str) -> dict:
    return {"us": seconds * 1e6, "gbps": read / seconds / 1e9, "of_copy": read / seconds / copy_bps,
            "timing": method}


def _time_paged(backend, batch: int, heads_q: int, kv_name: str, context: int, heads_kv: int, dim: int, block: int,
                device: torch.device, copy_bps: float, l2: int) -> dict:
    """One decode step's attention over paged caches of ``kv_name``, rotated: time and read rate (the bytes read
    are every cached token's row and scales, :func:`token_head_bytes`)."""
    first = _paged(kv_name, batch, context, heads_kv, dim, block, device, seed=batch * 7 + context)
    read = batch * context * heads_kv * token_head_bytes(first[0])
    n = rotation_count(read, l2, max(8 * read, 2**33))
    calls = []
    for copy in range(n):
        cache, meta = first if copy == 0 else _paged(kv_name, batch, context, heads_kv, dim, block, device,
                                                     seed=batch * 7 + context + copy)
        k_cache, v_cache = cache.layer(0)
        k_scale, v_scale = cache.layer_scales(0) or (None, None)
        k_ts, v_ts = cache.layer_token_scales(0) or (None, None)
        q = torch.randn(batch, heads_q, dim, dtype=torch.bfloat16, device=device)
        out = torch.empty_like(q)
        calls.append(lambda q=q, k=k_cache, v=v_cache, out=out, meta=meta, fp8=cache.k_dtype.codes,
                     v_fp8=cache.v_dtype.codes, ks=k_scale, vs=v_scale, k_ts=k_ts, v_ts=v_ts:
                     backend._attend(q, k, v, out, query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                                     block_tables=meta.block_tables, max_query_len=1, max_seq_len=context,
                                     scale=dim ** -0.5, sliding_window=None, fp8=fp8, v_fp8=v_fp8, k_scale=ks,
                                     v_scale=vs, k_token_scales=k_ts, v_token_scales=v_ts))
    seconds, method = time_launches(calls, device)
    return dict(_rate(seconds, read, copy_bps, method), copies=n, read_bytes=read)


def _time_sdpa(batch: int, heads_q: int, context: int, heads_kv: int, dim: int, device: torch.device,
               copy_bps: float, l2: int) -> dict:
    """torch SDPA pinned to its flash backend over contiguous bf16 caches ``[B, Hkv, context, D]``, rotated; the
    GQA group is the query length (``q [B, Hkv, group, D]``: one decode token per query head, no mask)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    group = heads_q // heads_kv
    read = 2 * batch * heads_kv * context * dim * 2
    n = rotation_count(read, l2, max(8 * read, 2**33))
    inputs = [(torch.randn(batch, heads_kv, group, dim, dtype=torch.bfloat16, device=device),
               torch.randn(batch, heads_kv, context, dim, dtype=torch.bfloat16, device=device),
               torch.randn(batch, heads_kv, context, dim, dtype=torch.bfloat16, device=device)) for _ in range(n)]
    calls = [lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, scale=dim ** -0.5)
             for q, k, v in inputs]
    try:
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            seconds, method = time_launches(calls, device)
    except RuntimeError as e:   # flash cannot run these inputs here: no number, and the target fails
        return {"backend": "flash", "error": str(e).splitlines()[0] if str(e) else type(e).__name__}
    return dict(_rate(seconds, read, copy_bps, method), copies=n, backend="flash")


def attention_rows(shapes: Sequence[tuple[int, int, Sequence[str]]], device: torch.device, copy_bps: float,
                   l2: int, rows: list[dict], heads_q: int = 32, heads_kv: int = 8, dim: int = 128,
                   block: int = 16) -> None:
    """Section 1, appended to ``rows`` as each shape is done (what the deadline leaves is kept)."""
    from kv8.attention.triton import TritonBackend

    backend = TritonBackend()
    for batch, context, roles in shapes:
        row: dict = {"batch": batch, "context": context, "roles": list(roles)}
        for kv_name in ("fp8_e4m3", "bfloat16"):
            row[kv_name] = _time_paged(backend, batch, heads_q, kv_name, context, heads_kv, dim, block, device,
                                       copy_bps, l2)
        row["sdpa"] = _time_sdpa(batch, heads_q, context, heads_kv, dim, device, copy_bps, l2)
        row["fp8_over_bf16"] = row["bfloat16"]["us"] / row["fp8_e4m3"]["us"]
        row["bf16_over_sdpa"] = row["bfloat16"]["us"] / row["sdpa"]["us"] if "us" in row["sdpa"] else None
        rows.append(row)
        sdpa = (f"{row['sdpa']['us']:9.1f} us ({row['sdpa']['of_copy']:.2f})" if "us" in row["sdpa"] else
                f"flash unavailable: {row['sdpa']['error']}")
        ratio = "" if row["bf16_over_sdpa"] is None else f" | bf16 paged / sdpa {row['bf16_over_sdpa']:.2f}x"
        print(f"B {batch:4d} x {context:6d}: fp8 {row['fp8_e4m3']['us']:9.1f} us ({row['fp8_e4m3']['of_copy']:.2f} of "
              f"copy) | bf16 {row['bfloat16']['us']:9.1f} us ({row['bfloat16']['of_copy']:.2f}) | sdpa flash {sdpa} "
              f"| fp8 speed-up over bf16 {row['fp8_over_bf16']:.2f}x{ratio} [{row['fp8_e4m3']['timing']}, "
              f"{row['fp8_e4m3']['copies']} copies]", flush=True)
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()


# (after 1) the other stored formats: int8 and 4-bit per token-head / group and the k8v4 pair, at section 1's shapes
FORMATS = ("int8_per_token_head", "int4_per_token_head", "int4_per_group32", "k8v4")


def format_rows(rows: list[dict], device: torch.device, copy_bps: float, l2: int, heads_q: int = 32,
                heads_kv: int = 8, dim: int = 128, block: int = 16) -> None:
    """Section ``formats``: each of :data:`FORMATS` timed at every shape section 1 timed, into that row's
    ``formats`` with its speed against the row's FP8 kernel (``over_fp8``: FP8's time over this one's). Judged
    by no target: issue 40's speed targets are the CPU's; this row says what the same kernels do on a GPU."""
    from kv8.attention.triton import TritonBackend

    backend = TritonBackend()
    for row in rows:
        batch, context = row["batch"], row["context"]
        out = row.setdefault("formats", {})
        for kv_name in FORMATS:
            timing = _time_paged(backend, batch, heads_q, kv_name, context, heads_kv, dim, block, device, copy_bps,
                                 l2)
            timing["over_fp8"] = row["fp8_e4m3"]["us"] / timing["us"]
            out[kv_name] = timing
        print(f"B {batch:4d} x {context:6d}: " + " | ".join(
            f"{k} {v['us']:8.1f} us ({v['of_copy']:.2f} of copy, {v['over_fp8']:.2f}x fp8)" for k, v in out.items()),
            flush=True)
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()


# (after formats) leads for the next change: the FP8 decode's stages and warps; 4-bit codes above head_dim 128
def _with_config(**fields):
    """A context in which every attention launch's :class:`LaunchConfig` has ``fields`` replaced (the kernel
    compiles once per distinct config: stages and warps are compile options, tile sizes constexprs)."""
    from dataclasses import replace

    from kv8.kernels.triton import attention as A

    original = A.launch_config
    return mock.patch.object(A, "launch_config", lambda *a, **k: replace(original(*a, **k), **fields))


#: (name, LaunchConfig fields) of the FP8 decode launches the sweep times: the default, then fewer stages (less
#: shared memory a program, more programs an SM) and two warps
SWEEP_VARIANTS = (("default", {}), ("3 stages", {"num_stages": 3}), ("2 stages", {"num_stages": 2}),
                  ("3 stages, 2 warps", {"num_stages": 3, "num_warps": 2}))


def sweep_rows(rows: list[dict], device: torch.device, copy_bps: float, l2: int, heads_q: int = 32,
               heads_kv: int = 8, dim: int = 128, block: int = 16) -> None:
    """Section ``sweep``: the fp8_e4m3 decode attention of section 1's first two shapes with each of
    :data:`SWEEP_VARIANTS` (into the row's ``sweep``). The H200 run read FP8 at about half the bytes per second
    of bf16 with one warp and 48.5 KB of shared memory a program (4 programs an SM): this says whether more programs
    an SM, or more warps a program, read faster. No target."""
    from kv8.attention.triton import TritonBackend

    backend = TritonBackend()
    for row in rows[:2]:
        out = row.setdefault("sweep", {})
        for name, fields in SWEEP_VARIANTS:
            with _with_config(**fields):
                out[name] = _time_paged(backend, row["batch"], heads_q, "fp8_e4m3", row["context"], heads_kv, dim,
                                        block, device, copy_bps, l2)
        print(f"sweep fp8 B {row['batch']:4d} x {row['context']:6d}: " + " | ".join(
            f"{k} {v['us']:8.1f} us ({v['gbps']:.0f} GB/s)" for k, v in out.items()), flush=True)


#: (name, LaunchConfig fields) the 4-bit probe tries at head_dim 256: the default (16-key tiles; the tensor cores'
#: B operand then spans fewer keys than 8 x its warps, which repeat it), and 32-key tiles on 4 warps (no repeat)
PROBE_VARIANTS = (("default", {}), ("32 keys, 4 warps", {"tile_n": 32, "tile_in_block": True, "num_warps": 4}))
PROBE_FORMATS = ("int4_per_token_head", "int4_per_group32", "fp4_e2m1", "int8_per_token_head")


def probe_packed(device: torch.device, result: dict, head_dim: int = 256,
                 formats: Sequence[str] = PROBE_FORMATS) -> None:
    """Section ``probe``: 4-bit caches at ``head_dim`` 256, which the compiled kernels refuse
    (:data:`kv8.kernels.triton.formats.COMPILED_PACKED_MAX_HEAD_DIM`; on an H200 their outputs were wrong): the
    refusal lifted here alone, each of ``formats`` x :data:`PROBE_VARIANTS` is compared with the
    reference attention on the CPU (a decode row, a prefill chunk and a fresh prompt over blocks of 32, bf16
    queries, one KV head), and the Triton store's bytes with the reference store's. No target: it says whether the
    refusal can go, and with which tiles."""
    from kv8.attention.metadata import AttentionMetadata
    from kv8.attention.reference import paged_attention_reference
    from kv8.cache.codec import KVCodec
    from kv8.cache.paged_cache import CacheShape, PagedKVCache
    from kv8.kernels.triton import attention as A
    from kv8.kernels.triton.store import store_kv
    from kv8.quant.formats import resolve_kv_cache_dtype

    gen = torch.Generator().manual_seed(7)
    q_lens, seq_lens, bs, heads_q = [1, 6, 19], [37, 40, 19], 32, 2
    tables = [[0, 1], [2, 3], [4]]
    for kv_name in formats:
        kv_dtype = resolve_kv_cache_dtype(kv_name, torch.bfloat16)
        shape, codec = CacheShape(1, 5, 1, bs, head_dim), KVCodec.build(kv_dtype, head_dim)
        cache = PagedKVCache(shape, codec, device="cpu")
        slots = torch.tensor([tables[s][i // bs] * bs + i % bs for s, n in enumerate(seq_lens) for i in range(n)])
        k = torch.randn(len(slots), 1, head_dim, generator=gen)
        v = torch.randn(len(slots), 1, head_dim, generator=gen)
        cache.store(0, k, v, slots)
        # the Triton store of the same tokens into a cache on the device: the written slots' bytes and scales bit for
        # bit the reference store's?
        twin = PagedKVCache(shape, codec, device=device)
        tk, tv = twin.layer(0)
        tts = twin.layer_token_scales(0) or (None, None)
        store_kv(k.to(device), v.to(device), tk, tv, slots.to(device), fp8=kv_dtype.codes, k_token_scales=tts[0],
                 v_token_scales=tts[1])
        blocks, offsets = slots // bs, slots % bs
        store_same = all(torch.equal(a.cpu()[0, blocks, :, offsets], b[0, blocks, :, offsets])
                         for a, b in zip(twin.tensors, cache.tensors))
        meta = AttentionMetadata.build(q_lens, seq_lens, tables, bs)
        query = torch.randn(sum(q_lens), heads_q, head_dim, generator=gen).to(torch.bfloat16)
        ref = paged_attention_reference(query, cache, 0, meta, head_dim ** -0.5).float()
        row = result.setdefault(kv_name, {"store_bit_exact": store_same})
        kc, vc = (c.to(device) for c in cache.layer(0))
        ts = cache.layer_token_scales(0) or (None, None)
        for name, fields in PROBE_VARIANTS:
            out = torch.full_like(query, 7.0).to(device)
            with _lifted(A), _with_config(**fields):
                A.unified_attention(
                    query.to(device), kc, vc, out, query_start_loc=meta.query_start_loc.to(device),
                    seq_lens=meta.seq_lens.to(device), block_tables=meta.block_tables.to(device),
                    max_query_len=max(q_lens), max_seq_len=max(seq_lens), scale=head_dim ** -0.5,
                    sliding_window=None, fp8=kv_dtype.codes,
                    k_token_scales=None if ts[0] is None else ts[0].to(device),
                    v_token_scales=None if ts[1] is None else ts[1].to(device), num_kv_splits=1)
            err = float((out.cpu().float() - ref).abs().max())
            bound = float(torch.finfo(torch.bfloat16).eps) * (1.0 + float(ref.abs().max()))
            row[name] = {"max_abs_err": err, "right": err <= 2 * bound}
        print(f"probe {kv_name:20s} D {head_dim}: store {'bit-exact' if store_same else 'DIFFERS'} | " + " | ".join(
            f"{n}: {'right' if row[n]['right'] else 'WRONG'} ({row[n]['max_abs_err']:.3g})" for n, _ in PROBE_VARIANTS),
            flush=True)


def _lifted(A):
    """A context without the compiled kernels' refusal of 4-bit codes above head_dim 128 (the probe's alone)."""
    return mock.patch.object(A, "check_compiled_packed_head_dim", lambda sides, head_dim: None)


# ---- 2. the engine -----------------------------------------------------------------------------------------------
def make_model_dir(path: Path, config: dict) -> str:
    """A model directory with a Llama config.json and a word-level tokenizer of ``vocab_size`` tokens (t0, t1, ...):
    all ``load_format="dummy"`` needs."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = config["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", unk_token="t0")
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    cfg = dict(config, model_type="llama", architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2,
               torch_dtype="bfloat16")
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def admissible_batch(num_blocks: int, block_size: int, prompt: int, total: int) -> int:
    """The most sequences of ``prompt`` tokens growing to ``total`` that run at once in ``num_blocks`` blocks: each
    holds its blocks at the end, and the scheduler admits the last one only with every running sequence's growth
    reserve free (:data:`kv8.engine.scheduler.GROWTH_RESERVE_TOKENS` each, at most a quarter of the pool)."""
    from kv8.engine.scheduler import GROWTH_RESERVE_TOKENS

    final, first = -(-total // block_size), -(-prompt // block_size)
    reserve = -(-GROWTH_RESERVE_TOKENS // block_size)
    n = num_blocks // final
    while n > 0 and n * first + min((n - 1) * reserve, num_blocks // 4) > num_blocks:
        n -= 1
    return n


def max_batched_tokens(context: int) -> int:
    """Section 2's token budget per step (``max_num_batched_tokens``): 8192, or one whole prompt if longer."""
    return max(8192, context)


def request_tokens(batch: int, context: int, decode_steps: int) -> int:
    """The tokens each of ``batch`` requests generates (``max_tokens``) so that all of them are still running in
    each of the ``decode_steps`` timed steps: the prompts are prefilled in chunks over
    ``ceil(batch * context / max_batched_tokens)`` steps, and a sequence whose prompt is done decodes a token in
    each later one of them (mixed batches), so the first may have that many before the timed steps begin; 4 more
    keep the last timed step's batch whole."""
    prefill_steps = -(-batch * context // max_batched_tokens(context))
    return prefill_steps + decode_steps + 4


def _engine_args(model: str, kv_name: str, batch: int, context: int, new_tokens: int, kv_budget: int, device: str,
                 attention_backend: str):
    from kv8.engine.args import EngineArgs

    return EngineArgs(model=model, load_format="dummy", dtype="bfloat16", device=device, kv_cache_dtype=kv_name,
                      kv_cache_memory=kv_budget, max_model_len=context + new_tokens + 16, max_num_seqs=batch,
                      max_num_batched_tokens=max_batched_tokens(context), attention_backend=attention_backend)


def batch_in_budget(model: str, kv_name: str, context: int, decode_steps: int, kv_budget: int, device: str,
                    attention_backend: str) -> int:
    """The largest batch a ``kv_name`` cache of ``kv_budget`` bytes runs at once, each request growing to
    ``context`` + :func:`request_tokens` (from the engine's own sizing, nothing loaded). The batch sets the
    prefill's length, which sets each request's tokens: sized first for ``decode_steps + 4`` tokens (an upper
    bound on the batch), then for that batch's :func:`request_tokens` (the most any smaller batch needs)."""
    from kv8.loader.model import read_model_config

    # the pool's size does not depend on max_model_len (the budget checks that one sequence fits)
    args = _engine_args(model, kv_name, 1, context, decode_steps + 4, kv_budget, device, attention_backend)
    budget = args.create_engine_config(read_model_config("hf", model), "hf", model).kv_budget()
    blocks, block_size = budget.num_blocks()[0], budget.cache.block_size
    bound = admissible_batch(blocks, block_size, context, context + decode_steps + 4)
    return admissible_batch(blocks, block_size, context, context + request_tokens(bound, context, decode_steps))


def engine_decode(model: str, kv_name: str, batch: int, context: int, decode_steps: int, kv_budget: int,
                  device: str, attention_backend: str) -> dict:
    """Decode tokens/s of ``batch`` sequences of ``context`` prompt tokens: prefill them all, then time
    ``decode_steps`` engine steps of the full batch."""
    from kv8 import LLM, SamplingParams

    new_tokens = request_tokens(batch, context, decode_steps)
    args = _engine_args(model, kv_name, batch, context, new_tokens, kv_budget, device, attention_backend)
    llm = LLM(**{f: getattr(args, f) for f in args.field_names()})
    eng = llm.engine
    capacity = eng.stats().kv_capacity_tokens
    rng = random.Random(0)
    vocab = eng.config.arch.vocab_size
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(batch):
        eng.add_request([rng.randrange(3, vocab) for _ in range(context)], params, request_id=str(i))
    start = time.perf_counter()
    while eng.stats().num_prefilling or eng.stats().num_waiting:
        eng.step()
    prefill_s = time.perf_counter() - start
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    steps, tokens, start = 0, 0, time.perf_counter()
    # a hand loop, not run_to_completion: it times decode_steps steps of the full batch, then aborts the requests
    while steps < decode_steps and eng.has_unfinished_requests():
        eng.step()
        tokens += eng.stats().last_step_decode_tokens
        steps += 1
    sync()
    seconds = time.perf_counter() - start
    for i in range(batch):
        eng.abort_request(str(i))
    free = eng.stats()
    assert free.num_free_blocks == free.num_blocks, "blocks were not returned"
    eng.shutdown()
    del llm, eng
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    row = {"kv": kv_name, "batch": batch, "context": context, "decode_steps": steps, "decode_tokens": tokens,
           "tok_s": tokens / seconds, "ms_per_step": 1e3 * seconds / max(steps, 1), "prefill_s": prefill_s,
           "kv_capacity_tokens": capacity,
           # every timed step held the whole batch (none finished or was preempted); else the rate is a smaller one's
           "full_batch": tokens == batch * steps}
    print(f"engine {kv_name:9s} B {batch:4d} x {context}: {row['tok_s']:9.1f} tok/s ({row['ms_per_step']:.2f} ms "
          f"per step; prefill {prefill_s:.1f} s)" + ("" if row["full_batch"] else
                                                     f"; NOT full: {tokens} tokens in {steps} steps"), flush=True)
    return row


def engine_rows(model: str, context: int, decode_steps: int, kv_budget: int, device: str, attention_backend: str,
                result: dict) -> None:
    """Section 2 into ``result``: each cache at the largest batch it runs in ``kv_budget``, and their ratio."""
    rows = result.setdefault("at_max_batch", [])
    for kv in ("bfloat16", "fp8_e4m3"):
        batch = batch_in_budget(model, kv, context, decode_steps, kv_budget, device, attention_backend)
        rows.append(engine_decode(model, kv, batch, context, decode_steps, kv_budget, device, attention_backend))
    result["kv_budget_bytes"] = kv_budget
    full = rows[0]["full_batch"] and rows[1]["full_batch"]
    # a rate of partly empty steps is no rate of the batch: the target then has no number and fails
    result["fp8_over_bf16_at_budget"] = rows[1]["tok_s"] / rows[0]["tok_s"] if full else None
    ratio = f"{result['fp8_over_bf16_at_budget']:.2f}x" if full else "not measured (a timed step was not full)"
    print(f"engine: fp8 / bf16 KV decode tok/s at one KV budget ({kv_budget / 2**30:.2f} GiB; batches "
          f"{rows[0]['batch']} and {rows[1]['batch']}): {ratio}", flush=True)


# ---- 3. tests ----------------------------------------------------------------------------------------------------
TEST_FILES = ("tests/kernels/test_triton_store.py", "tests/kernels/test_triton_attention.py",
              "tests/kernels/test_triton_formats.py", "tests/kernels/test_triton_kv_pairs.py",
              "tests/engine/test_device.py", "tests/engine/test_triton_engine.py")


def run_tests(timeout: float, result: dict, log: Path | None = None) -> None:
    """pytest over the GPU path's tests in a subprocess (compiled: TRITON_INTERPRET removed), into ``result``:
    its return code (None when it ran out of time), its summary line, every ``FAILED`` / ``ERROR`` line with its
    message (``-rfE``) and the output's last 30 lines; the whole output to ``log`` where given."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env["COLUMNS"] = "400"   # room for each failure's message in the short summary
    # the kernels compile on the host's cores: pytest-xdist's workers compile them side by side where it is there
    workers = ["-n", str(min(8, os.cpu_count() or 1))] if importlib.util.find_spec("xdist") is not None else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "--tb=short", "-p", "no:cacheprovider", *workers,
           *TEST_FILES]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        out, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        out, rc = out + f"\n(stopped after {timeout:.0f} s)", None
    lines = out.strip().splitlines()
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(out)
    # pytest's own last line ("3 failed, 40 passed in 9.1s"), not a plugin's warning printed after it
    counts = [ln for ln in lines if re.search(r"\d+ (passed|failed|error)", ln) and " in " in ln]
    summary = counts[-1].strip("= ") if counts else (lines[-1] if lines else "")
    failures = [ln for ln in lines if ln.startswith(("FAILED ", "ERROR "))]
    seconds = time.perf_counter() - start
    print(f"tests ({seconds:.0f} s, return code {rc}): {summary}", flush=True)
    for ln in failures:
        print(f"  {ln}", flush=True)
    result.update(returncode=rc, summary=summary, failures=failures, tail=lines[-30:],
                  seconds=seconds, log=None if log is None else str(log))


# ---- the run -----------------------------------------------------------------------------------------------------
def _finish(result: dict, ran: Sequence[str], deadline_hit: bool, json_path: Path | None) -> int:
    result["verdicts"] = verdicts(result, ran)
    result["deadline_hit"] = deadline_hit
    print(format_verdicts(result["verdicts"]), flush=True)
    status = exit_status(result["verdicts"], deadline_hit)
    result["exit_status"] = status
    if json_path:
        json_path.parent.mkdir(parents=True, exist_ok=True)
        json_path.write_text(json.dumps(result, indent=1))
    return status


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the results and verdicts here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (the test suite's run; CPU + interpreter)")
    ap.add_argument("--skip", nargs="*", default=[],
                    choices=("attention", "formats", "sweep", "probe", "engine", "tests"))
    ap.add_argument("--deadline", type=float, default=DEADLINE_S,
                    help="seconds for the whole run, compile included; then it prints what it has and exits 3")
    ap.add_argument("--kv-budget-gib", type=float, default=17.0, help="section 2's KV budget")
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("no CUDA GPU: run with TRITON_INTERPRET=1 (and --smoke) to check the script on the CPU")
    if not args.deadline > 0:
        ap.error(f"--deadline={args.deadline} must be > 0 seconds")
    if args.smoke:
        TIMING.update(launches=2, repeats=1)
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
                    "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "smoke": args.smoke,
                    "deadline_s": args.deadline}
    try:
        import triton
        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    print(f"kv8 GPU check on {result['device']} (torch {result['torch']}, triton {result['triton']}), deadline "
          f"{args.deadline:.0f} s", flush=True)
    deadline = Deadline(args.deadline)
    ran: list[str] = []

    def hard_stop() -> None:   # the main thread did not get control back after the deadline: report and leave
        print(f"the deadline passed during {ran[-1] if ran else 'start-up'} and it did not return", flush=True)
        os._exit(_finish(result, ran, True, args.json))

    deadline.arm(hard_stop)
    try:
        if "attention" not in args.skip:
            ran.append("attention")
            l2 = l2_bytes(device)
            copy_bps, method = copy_rate(device, 2**20 if args.smoke else 2**30, l2)
            result.update(copy_GBps=copy_bps / 1e9, l2_bytes=l2, copy_timing=method)
            print(f"device-to-device copy: {copy_bps / 1e9:.0f} GB/s (read + written; {method}); L2 {l2} bytes",
                  flush=True)
            dims = dict(heads_q=4, heads_kv=2, dim=32) if args.smoke else {}
            attention_rows(SMOKE_SHAPES if args.smoke else SHAPES, device, copy_bps, l2,
                           result.setdefault("attention", []), **dims)
            if "formats" not in args.skip:
                ran.append("formats")
                format_rows(result["attention"], device, copy_bps, l2, **dims)
            if "sweep" not in args.skip:
                ran.append("sweep")
                sweep_rows(result["attention"], device, copy_bps, l2, **dims)
        if "probe" not in args.skip:
            ran.append("probe")
            probe_packed(device, result.setdefault("probe", {}),
                         formats=PROBE_FORMATS[1:2] if args.smoke else PROBE_FORMATS)
        if "engine" not in args.skip:
            ran.append("engine")
            with tempfile.TemporaryDirectory() as tmp:
                model = make_model_dir(Path(tmp) / "model", TINY_LLAMA if args.smoke else LLAMA_8B)
                if args.smoke:
                    # 8 bf16 blocks of 16 tokens: 3 sequences of 20 + 6 tokens at once in bf16 (2 blocks each and
                    # the admission reserve), 6 in fp8
                    engine_rows(model, context=20, decode_steps=2, kv_budget=64 * 1024, device=device.type,
                                attention_backend="triton", result=result.setdefault("engine", {}))
                else:
                    engine_rows(model, context=2048, decode_steps=32, kv_budget=int(args.kv_budget_gib * 2**30),
                                device=device.type, attention_backend="auto", result=result.setdefault("engine", {}))
        if "tests" not in args.skip:
            ran.append("tests")
            run_tests(max(1.0, deadline.left() - 5), result.setdefault("tests", {}),
                      None if args.json is None else args.json.with_name(args.json.stem + "_tests.log"))
        deadline_hit = False
    except DeadlineExceeded as e:
        print(f"{e} during {ran[-1] if ran else 'start-up'}: the verdicts of what was measured", flush=True)
        deadline_hit = True
    finally:
        deadline.disarm()
    result["seconds"] = deadline.elapsed()
    print(f"done in {result['seconds']:.0f} s", flush=True)
    return _finish(result, ran, deadline_hit, args.json)


if __name__ == "__main__":
    sys.exit(main())
