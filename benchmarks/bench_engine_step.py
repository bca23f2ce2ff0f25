"""One engine step of SmolLM2 (or ``--model``) on each dense backend this CPU runs, side by side in one run.

Engines on the default model (bf16, FP8 cache) that differ only in ``dense_backend``: ``torch`` (``F.linear`` /
oneDNN and torch elementwise ops), ``torch_fp32`` (the same on float32 copies of the linear weights) and, where
kv8's dense kernels build, ``packed_bf16`` (packed-weight linear, fused add+RMSNorm, SiLU*up and RoPE). Prints
the median time of a prefill step (4 prompts x ``--prompt`` tokens, default 512: 2,048 tokens) and of a decode
step (``--batch`` sequences at ~``--context`` tokens) over ``--rounds`` rounds that alternate the backends (the
order rotated each round), and each one's speed-up over torch (over the first listed where ``--backends`` leaves torch
out). On a CPU with AMX-BF16, where ``packed_bf16``
multiplies with AMX tiles, another row times it with its ``vdpbf16ps`` path (the kernels' ``amx`` flag off), as
other CPUs run it.

``--kv-cache-dtypes fp8_e4m3,int8,int4`` instead compares KV cache formats on one backend (``--backend``), the
same alternation and medians, each format's speed-up over the first listed: what a narrower cache buys a whole
step (the issue-40 shape: ``--batch 8 --context 4096``).

    .venv/bin/python benchmarks/bench_engine_step.py
    .venv/bin/python benchmarks/bench_engine_step.py --backends torch,torch_fp32 --rounds 5
    .venv/bin/python benchmarks/bench_engine_step.py --before HEAD~3   # now vs that revision
    .venv/bin/python benchmarks/bench_engine_step.py --before main --quantization gguf --batch 1   # GGUF blocks kept
    .venv/bin/python benchmarks/bench_engine_step.py --kv-cache-dtypes fp8_e4m3,int4 --batch 8 --context 4096

``--quantization`` builds every engine with that quantization (e.g. ``gguf``: the default model's Q4_1 blocks kept;
``none``: its weights dequantized to bf16, also in a ``--before`` revision older than that choice). Without it each
engine runs its kv8's default: a quantized GGUF file's blocks (a revision older than that default: the weights
dequantized).
``--quantizations none,fp8`` instead times each backend of ``--backends`` with each weight quantization (none: the
model's own weights), alternating. A backend may be a tuner candidate's label (``packed_bf16+f32_from_512``: the
packed kernels with long chunks in float32), pinned as ``dense_backend="auto"``'s choice without timing:

    .venv/bin/python benchmarks/bench_engine_step.py --quantizations none,fp8 \
        --backends packed_bf16,packed_bf16+f32_from_512 --batch 1 --rounds 5
``--gguf-paths avx2,vnni512`` compares the GGUF int8 kernel's paths (``DenseKernels.gguf_path``) on one backend with
``--quantization gguf``, the same alternation, medians and speed-ups over the first listed:

    .venv/bin/python benchmarks/bench_engine_step.py --quantization gguf --gguf-paths avx2,vnni512 --batch 1

``--graphs`` compares decode steps replayed from CPU graphs (kv8.kernels.cpu.graph; the default for batches of up
to 8) with eager ones (``enforce_eager``) on one backend (``--backend``), the same alternation, medians and
speed-ups over eager: what the replay saves of the Python around a step's ~270 kernel calls.

    .venv/bin/python benchmarks/bench_engine_step.py --graphs --batch 1 --context 1024 --rounds 6

``--stream-tiles FORMAT`` compares, in one engine with a ``FORMAT`` cache (eager: a CPU graph keeps the distance it
was recorded with), decode steps with the decode attention's stream distance this machine's plan chose
(kv8.attention.tuning: the engine times it at start-up, or reads it) and with the build's default, alternating
``--rounds`` times (several steps each, the order swapped each round); medians, spreads and chosen / default:

    .venv/bin/python benchmarks/bench_engine_step.py --stream-tiles int4_per_token_head --batch 8 --context 4096

``--before REV`` measures one backend (``--backend``; default ``packed_bf16`` where the kernels build, else
``torch``) as of git revision REV (a temporary worktree) and now (this checkout), each engine in a fresh
subprocess, alternating ``--rounds`` times, and prints now / before: a change's effect on the whole step under the
same machine conditions (``--model``: another model than SmolLM2, e.g. ``gemma3-270m``). The measuring code is
this file's and drives the engine through ``add_request`` / ``step`` /
``has_unfinished_requests`` only, which every revision has.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

from engine_steps import time_prefill_step
from revisions import worktree

from kv8 import LLM, SamplingParams
from kv8.platform import cpu_name

RESULT_MARK = "@@RESULT "
#: this checkout's root: ``--before`` measures it in a fresh subprocess too, as it measures the other revision (not in
#: a process that already built the previous rounds' engines)
_TREE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Unset:
    """The default of an argument that None would not tell apart (a quantization of None: the model's weights)."""


UNSET = Unset()


@contextlib.contextmanager
def pinned_backend(backend: str) -> Iterator[str]:
    """The engine option for ``backend``: itself for a dense_backend name; for a tuner candidate's label (a name with
    ``+``, e.g. ``packed_bf16+f32_from_512``), ``auto`` with the tuner's choice pinned to that candidate while the
    engine is built (no timing, no plan read or written)."""
    if "+" not in backend:
        yield backend
        return
    import kv8.loader.model as loader_model
    from kv8.layers.tuning import candidates

    def tuned(shapes: Any, dtype: Any, quantization: Any, *rest: Any, **kw: Any) -> tuple[Any, dict[Any, Any]]:
        found = candidates(shapes, dtype, quantization)
        if backend not in found:
            raise SystemExit(f"{backend!r} is not a tuner candidate here; the candidates are {', '.join(found)}")
        return found[backend], {}

    saved = loader_model.tuned_dense_backend
    loader_model.tuned_dense_backend = tuned   # type: ignore[assignment]
    try:
        yield "auto"
    finally:
        loader_model.tuned_dense_backend = saved


def engine_quantization(name: str | None) -> str | None:
    """``name`` as this process's kv8 takes it: "none" (the weights as loaded) is None to a kv8 without that choice
    (a ``--before`` revision whose unset quantization meant the weights as loaded)."""
    from kv8.engine import config

    return None if name == "none" and "none" not in getattr(config, "QUANTIZATION_CHOICES", ()) else name


def measure(backend: str, args: argparse.Namespace, kv_cache_dtype: str = "fp8_e4m3",
            enforce_eager: bool = False, quantization: str | None | Unset = UNSET) -> tuple[float, float]:
    """(prefill step s, decode step s) of a new engine with this dense backend (or a tuner candidate's label, pinned:
    :func:`pinned_backend`), KV cache format and weight quantization (default ``args.quantization``)."""
    max_len = max(4096, args.context + args.repeats * 2 + 64)
    quant = engine_quantization(args.quantization if isinstance(quantization, Unset) else quantization)
    with pinned_backend(backend) as option:
        llm = LLM(model=args.model, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=args.kv_cache_memory,
                  max_model_len=max_len, dense_backend=option, enforce_eager=enforce_eager, quantization=quant)
    eng = llm.engine
    rng = random.Random(0)
    counter = iter(range(10**9))

    def prefill_step() -> float:
        return time_prefill_step(eng, lambda: [rng.randrange(100, 40000) for _ in range(args.prompt)], counter)

    prefill_step()
    prefill = statistics.median(prefill_step() for _ in range(args.repeats))
    params = SamplingParams(temperature=0, max_tokens=args.repeats * 2 + 20, ignore_eos=True)
    ids = {eng.add_request([rng.randrange(100, 40000) for _ in range(args.context)], params, request_id=f"d{i}")
           for i in range(args.batch)}
    decoding: set[str] = set()
    while decoding != ids:   # until every prompt is in the cache (each request has its first token)
        decoding.update(out.request_id for out in eng.step() if out.outputs[0].token_ids)
    for _ in range(5):
        eng.step()
    times = []
    for _ in range(args.repeats * 2):
        start = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - start)
    return prefill, statistics.median(times)


def measure_at(tree: str, args: argparse.Namespace) -> tuple[float, float]:
    """:func:`measure` of ``args.backend`` with kv8 imported from ``tree`` (another revision), in a subprocess."""
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--batch", str(args.batch), "--context",
           str(args.context), "--repeats", str(args.repeats), "--backend", args.backend, "--prompt", str(args.prompt)]
    cmd += ["--model", args.model] + (["--quantization", args.quantization] if args.quantization else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (tree, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    marked = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if proc.returncode != 0 or not marked:
        raise SystemExit(f"the measurement at {tree} failed:\n{proc.stderr[-2000:]}")
    prefill, decode = json.loads(marked[-1][len(RESULT_MARK):])
    return prefill, decode


def compare_with(rev: str, args: argparse.Namespace) -> None:
    """``args.backend`` now and at ``rev``, alternating ``args.rounds`` times; medians and now / before."""
    with worktree(rev, "--before") as before:
        rows: dict[str, list[tuple[float, float]]] = {"now": [], f"at {before.rev}": []}
        for r in range(args.rounds):
            order = ["now", f"at {before.rev}"] if r % 2 == 0 else [f"at {before.rev}", "now"]
            for name in order:
                rows[name].append(measure_at(_TREE if name == "now" else before.path, args))
    med = {name: (statistics.median(p for p, _ in v), statistics.median(d for _, d in v)) for name, v in rows.items()}
    print(f"{args.model}, bf16, fp8_e4m3 cache, {args.backend}; decode batch {args.batch} at ~{args.context} "
          f"tokens; medians of {args.rounds} alternating rounds; {cpu_name() or 'CPU'}, {os.cpu_count()} CPUs")
    print(f"{'kv8':<24}{f'prefill {4 * args.prompt} tok ms':>21}{'decode step ms':>16}")
    for name, (p, d) in med.items():
        print(f"{name:<24}{p * 1e3:>21.1f}{d * 1e3:>16.1f}")
    (np_, nd), (bp, bd) = med["now"], med[f"at {before.rev}"]
    print(f"{'speed-up now / before':<24}{bp / np_:>21.2f}{bd / nd:>16.2f}")


def compare_formats(formats: list[str], args: argparse.Namespace) -> None:
    """``args.backend`` with each KV cache format, alternating ``args.rounds`` times (a rotated order each round);
    medians, spreads and each format's speed-up over the first listed."""
    runs: dict[str, list[tuple[float, float]]] = {f: [] for f in formats}
    for r in range(args.rounds):
        for fmt in formats[r % len(formats):] + formats[:r % len(formats)]:
            runs[fmt].append(measure(args.backend, args, fmt))
    print(f"{args.model}, bf16, {args.backend}; decode batch {args.batch} at ~{args.context} tokens; medians of "
          f"{args.rounds} alternating rounds (min-max); {cpu_name() or 'CPU'}, {os.cpu_count()} CPUs")
    print_rows("kv_cache_dtype", runs, formats[0], args)


def compare_graphs(args: argparse.Namespace) -> None:
    """``args.backend`` with decode steps replayed from CPU graphs (the default) and eager (``enforce_eager``),
    alternating ``args.rounds`` times; medians, spreads and the speed-ups over eager."""
    runs: dict[str, list[tuple[float, float]]] = {"eager": [], "graphs": []}
    for r in range(args.rounds):
        for name in (["eager", "graphs"] if r % 2 == 0 else ["graphs", "eager"]):
            runs[name].append(measure(args.backend, args, enforce_eager=name == "eager"))
    print(f"{args.model}, bf16, fp8_e4m3 cache, {args.backend}; decode batch {args.batch} at ~{args.context} tokens; "
          f"medians of {args.rounds} alternating rounds (min-max); {cpu_name() or 'CPU'}, {os.cpu_count()} CPUs")
    print_rows("decode steps", runs, "eager", args)


def compare_gguf_paths(paths: list[str], args: argparse.Namespace) -> None:
    """``args.backend`` with ``--quantization gguf`` on each path of the GGUF int8 kernel (``DenseKernels.gguf_path``,
    set before each engine is built: its CPU graphs record the path), alternating ``args.rounds`` times (a rotated
    order each round); medians, spreads and the speed-ups over the first listed. Every path computes the same bits."""
    from kv8.kernels.cpu.dense import load_dense_kernels

    kernels = load_dense_kernels()
    runs: dict[str, list[tuple[float, float]]] = {p: [] for p in paths}
    chosen = kernels.gguf_path
    try:
        for r in range(args.rounds):
            for path in paths[r % len(paths):] + paths[:r % len(paths)]:
                kernels.gguf_path = path
                runs[path].append(measure(args.backend, args))
    finally:
        kernels.gguf_path = chosen
    print(f"{args.model}, quantization={args.quantization}, fp8_e4m3 cache, {args.backend}; decode batch {args.batch} "
          f"at ~{args.context} tokens; medians of {args.rounds} alternating rounds (min-max); {cpu_name() or 'CPU'}, "
          f"{os.cpu_count()} CPUs")
    print_rows("GGUF kernel path", runs, paths[0], args)


def compare_stream(kv_cache_dtype: str, args: argparse.Namespace) -> None:
    """Decode steps of one eager engine (``args.backend``, a ``kv_cache_dtype`` cache) with the stream distance its
    plan chose and with the build's default, alternating ``args.rounds`` times; medians, spreads, chosen / default."""
    import kv8.engine.worker as worker
    from kv8.attention.cpu_fused import FusedCPUBackend

    chosen: dict[Any, Any] = {}
    tuned = worker.tuned_stream_tiles

    def tuning(*a: Any, **kw: Any) -> dict[Any, Any]:   # the engine's own choice, timed or read as it starts
        chosen.update(tuned(*a, **kw))
        return chosen

    worker.tuned_stream_tiles = tuning   # type: ignore[assignment]
    try:
        llm = LLM(model=args.model, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=args.kv_cache_memory,
                  max_model_len=max(4096, args.context + args.rounds * args.repeats * 4 + 64),
                  dense_backend=args.backend, enforce_eager=True, quantization=engine_quantization(args.quantization))
    finally:
        worker.tuned_stream_tiles = tuned   # type: ignore[assignment]
    eng = llm.engine
    backend = eng.backend
    if not isinstance(backend, FusedCPUBackend) or not chosen:
        raise SystemExit("--stream-tiles needs the cpu_fused attention backend and KV8_TUNING unset or auto")
    tuned_map = dict(backend.stream_tiles)
    (choice,) = chosen.values()
    rng = random.Random(0)
    params = SamplingParams(temperature=0, max_tokens=args.rounds * args.repeats * 4 + 20, ignore_eos=True)
    ids = {eng.add_request([rng.randrange(100, 40000) for _ in range(args.context)], params, request_id=f"d{i}")
           for i in range(args.batch)}
    decoding: set[str] = set()
    while decoding != ids:
        decoding.update(out.request_id for out in eng.step() if out.outputs[0].token_ids)
    names = [f"chosen ({choice.stream_tiles})", f"default ({choice.default})"]
    runs: dict[str, list[float]] = {n: [] for n in names}
    for r in range(args.rounds):
        for name in (names if r % 2 == 0 else names[::-1]):
            backend.stream_tiles = tuned_map if name == names[0] else {}
            eng.step()
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                eng.step()
                times.append(time.perf_counter() - start)
            runs[name].append(statistics.median(times))
    backend.stream_tiles = tuned_map
    print(f"{args.model}, {kv_cache_dtype} cache, {args.backend}, eager; decode batch {args.batch} at ~{args.context} "
          f"tokens; medians of {args.rounds} alternating rounds of {args.repeats} steps (min-max); the plan's choice "
          f"timed {choice.speedup:.2f}x the default on its own; {cpu_name() or 'CPU'}, {os.cpu_count()} CPUs")
    med = {n: statistics.median(v) for n, v in runs.items()}
    for name, v in runs.items():
        cell = f"{med[name] * 1e3:.2f} ({min(v) * 1e3:.2f}-{max(v) * 1e3:.2f})"
        print(f"{name:<16}{cell:>26} ms a decode step")
    print(f"{'chosen / default':<16}{med[names[1]] / med[names[0]]:>26.3f}x (> 1: the choice is faster)")


def compare_quantizations(backends: list[str], args: argparse.Namespace) -> None:
    """Each of ``backends`` with each weight quantization of ``args.quantizations`` ("none": the model's own weights),
    alternating ``args.rounds`` times (a rotated order each round); medians, spreads and the speed-ups over the
    first configuration listed."""
    quants = [q.strip() for q in args.quantizations.split(",") if q.strip()]
    configs = {f"{b}, {q}": (b, q) for b in backends for q in quants}
    runs: dict[str, list[tuple[float, float]]] = {c: [] for c in configs}
    names = list(configs)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            backend, quant = configs[name]
            runs[name].append(measure(backend, args, quantization=quant))
    print(f"{args.model}, bf16, fp8_e4m3 cache; decode batch {args.batch} at ~{args.context} tokens; medians of "
          f"{args.rounds} alternating rounds (min-max); {cpu_name() or 'CPU'}, {os.cpu_count()} CPUs, "
          f"{os.environ.get('OMP_NUM_THREADS', 'default')} OMP threads")
    print_rows("dense_backend, weights", runs, names[0], args)


def print_rows(label: str, runs: dict[str, list[tuple[float, float]]], ref: str, args: argparse.Namespace) -> None:
    """One row per configuration: prefill and decode step medians (min-max) and the speed-ups over ``ref``."""
    width = max(24, len(label), *(len(name) + 2 for name in runs))
    print(f"{label:<{width}}{f'prefill {4 * args.prompt} tok ms':>28}{'decode step ms':>26}"
          f"   {f'speed-up vs {ref}':>28}")
    med = {n: (statistics.median(p for p, _ in v), statistics.median(d for _, d in v)) for n, v in runs.items()}
    for name, v in runs.items():
        p, d = med[name]
        pre = f"{p * 1e3:.1f} ({min(x for x, _ in v) * 1e3:.0f}-{max(x for x, _ in v) * 1e3:.0f})"
        dec = f"{d * 1e3:.1f} ({min(y for _, y in v) * 1e3:.0f}-{max(y for _, y in v) * 1e3:.0f})"
        speed = f"{med[ref][0] / p:.2f} / {med[ref][1] / d:.2f}"
        print(f"{name:<{width}}{pre:>28}{dec:>26}   {speed:>28}")


def available_backends() -> list[str]:
    """The dense backends this tree runs on this CPU."""
    from kv8.kernels.cpu.build import KernelUnavailable
    from kv8.kernels.cpu.dense import load_dense_kernels

    try:
        load_dense_kernels()
        return ["torch", "torch_fp32", "packed_bf16"]
    except KernelUnavailable:
        return ["torch", "torch_fp32"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--prompt", type=int, default=512, help="tokens of each of the prefill step's 4 prompts")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--backends", default=None, help="comma-separated dense backends (default: all this CPU runs)")
    ap.add_argument("--before", default=None, metavar="REV",
                    help="compare one backend (--backend) now with kv8 at this git revision instead of the backends")
    ap.add_argument("--backend", default=None, help="the backend --before compares (default: packed_bf16 where "
                    "the kernels build, else torch)")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--kv-cache-dtypes", default=None, metavar="FORMATS",
                    help="compare these KV cache formats (comma-separated kv_cache_dtype names, e.g. "
                         "fp8_e4m3,int8,int4) on one backend (--backend) instead of the backends")
    ap.add_argument("--graphs", action="store_true",
                    help="compare decode steps replayed from CPU graphs with eager ones (enforce_eager) on one "
                         "backend (--backend) instead of the backends")
    ap.add_argument("--kv-cache-memory", default="1GiB", help="each engine's KV cache budget (default 1GiB)")
    ap.add_argument("--model", default="smollm2-135m", help="the model (default: smollm2-135m)")
    ap.add_argument("--quantization", default=None, help="every engine's quantization (gguf: the file's blocks kept; "
                    "fp8; none: the weights as loaded; unset: kv8's default, a quantized GGUF file's blocks)")
    ap.add_argument("--quantizations", default=None, metavar="QUANTS",
                    help="compare these weight quantizations (comma-separated; none: the model's weights, fp8) on "
                         "each of --backends, instead of one --quantization")
    ap.add_argument("--gguf-paths", default=None, metavar="PATHS",
                    help="compare these paths of the GGUF int8 kernel (comma-separated, e.g. avx2,vnni512) on one "
                         "backend (--backend) with --quantization gguf, instead of the backends")
    ap.add_argument("--stream-tiles", default=None, metavar="FORMAT",
                    help="compare decode steps with the decode attention's stream distance this machine's plan chose "
                         "and with the default, in one eager engine with a FORMAT cache, instead of the backends")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:   # --before's subprocess: one backend with the kv8 on PYTHONPATH
        print(RESULT_MARK + json.dumps(measure(args.backend, args)), flush=True)
        return
    available = available_backends()
    modes = (args.before is not None, args.kv_cache_dtypes is not None, args.graphs, args.gguf_paths is not None,
             args.stream_tiles is not None)
    if args.quantizations is not None and (any(modes) or args.quantization is not None):
        ap.error("--quantizations compares quantizations on --backends; give neither --quantization nor another mode")
    if sum(modes) > 1:
        ap.error("--before, --kv-cache-dtypes, --graphs, --gguf-paths and --stream-tiles compare different things; "
                 "give one")
    if any(modes):
        args.backend = args.backend or ("packed_bf16" if "packed_bf16" in available else "torch")
    if args.gguf_paths is not None:
        paths = [p for p in args.gguf_paths.split(",") if p]
        if args.quantization != "gguf" or len(paths) < 2:
            ap.error("--gguf-paths compares two or more paths of the GGUF kernel: give them, and --quantization gguf")
        compare_gguf_paths(paths, args)
        return
    if args.graphs:
        compare_graphs(args)
        return
    if args.stream_tiles is not None:
        compare_stream(args.stream_tiles, args)
        return
    if args.before is not None:
        compare_with(args.before, args)
        return
    if args.kv_cache_dtypes is not None:
        from kv8.quant.formats import KV_CACHE_DTYPE_NAMES

        formats = list(dict.fromkeys(f.strip() for f in args.kv_cache_dtypes.split(",") if f.strip()))
        bad = [f for f in formats if f not in KV_CACHE_DTYPE_NAMES]
        if not formats or bad:
            ap.error(f"--kv-cache-dtypes {args.kv_cache_dtypes!r}: {', '.join(bad) or 'no format'}; choose from: "
                     f"{', '.join(KV_CACHE_DTYPE_NAMES)}")
        compare_formats(formats, args)
        return
    backends = args.backends.split(",") if args.backends else available
    if args.quantizations is not None:
        compare_quantizations(backends, args)
        return
    runs: dict[str, list[tuple[float, float]]] = {b: [] for b in backends}
    amx_row = "packed_bf16 (vdpbf16ps)"
    kernels = None
    if "packed_bf16" in backends:
        from kv8.kernels.cpu.dense import load_dense_kernels

        kernels = load_dense_kernels()
        if kernels.amx:
            runs[amx_row] = []
    names = list(runs)
    for r in range(args.rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:   # a rotated order each round
            if name == amx_row and kernels is not None:   # the same backend on the vdpbf16ps path
                kernels.amx = False
                try:
                    runs[name].append(measure("packed_bf16", args))
                finally:
                    kernels.amx = True
            else:
                runs[name].append(measure(name, args))
    print(f"{args.model}, bf16, fp8_e4m3 cache; decode batch {args.batch} at ~{args.context} tokens; medians of "
          f"{args.rounds} alternating rounds (min-max); {cpu_name() or 'CPU'}, {os.cpu_count()} CPUs")
    print_rows("dense_backend", runs, "torch" if "torch" in runs else names[0], args)   # vs torch, else the first


if __name__ == "__main__":
    main()
