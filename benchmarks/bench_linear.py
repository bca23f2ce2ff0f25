"""kv8's packed bf16 linear kernel vs torch's ``F.linear`` (oneDNN), side by side in one run.

The weights of 30 SmolLM2-shaped layers (q/k/v packed 960 x 576, o 576 x 576, gate/up packed 3072 x 576,
down 576 x 1536: ~200 MB of bf16, as in a decode step) are multiplied with M rows, every layer in turn, so
the weights stream from DRAM as they do in the engine; torch multiplies the same matrices unpacked. Prints
the time per pass, the weight bandwidth (bytes of weights / time) and the speed-up: the best of 5 passes (2
above M = 256), the variants taking turns within each pass. On a CPU with AMX-BF16 kv8 multiplies with AMX
tiles (what the engine uses there); the ``vdpbf16ps`` columns time the AVX-512 path that other CPUs use, on
the same packed weights in the same run. The ``fp8 ms`` and ``bf16/fp8`` columns time the same matrices quantized as
``quantization="fp8"`` quantizes them (E4M3 codes and a scale per output row, half the bytes; the kernel decodes
them to bf16 on the fly), on the same path. The ``fp32 ms`` and ``fp32/kv8`` columns time ``F.linear`` in float32 on the
same weights widened at load (the ``torch_fp32`` dense backend, twice the bytes: the choice on CPUs whose torch has
no fast bf16 GEMM). The ``gguf ms`` and ``kv8/gguf`` columns time the same matrices as GGUF blocks of ``--gguf-type``
(default Q4_1, SmolLM2's file; written by ``gguf.quants.quantize``) multiplied as ``quantization="gguf"`` does
(the int8 kernel ``kv8_gguf_linear`` below ``GGUF_DEQUANTIZE_ROWS`` rows, the blocks dequantized to float32 and the
float32 GEMM from there); the ``int8 ms`` and ``int8/gguf`` columns time the same layers with the int8 kernel at every
row count (the choice that threshold is measured from); the ``bf16x ms`` and ``int8/bf16x`` columns time them with the
blocks dequantized into the packed kernel's bf16 layout and multiplied by it from ``GGUF_BF16_ROWS`` rows (the tuner's
third candidate, ``packed_bf16+bf16_from_<GGUF_BF16_ROWS>``; below that row count the int8 kernel; these layers are
plain linears, so the gate/up projection runs without its fused SiLU). The header names the kernels'
path (``avx512``: AMX tiles or ``vdpbf16ps``; ``avx2``: fp32 FMA). The process sets glibc's malloc thresholds as an
engine process does (:func:`kv8.host_memory.tune_malloc`), so that the per-call scratch of the GGUF expansions reuses
freed memory instead of faulting in fresh pages each call.

``--shapes`` multiplies other matrices (``OUTxIN`` each, e.g. ``4096x4096,14336x4096``: an 8B model's q/o and up
projections; use ``--layers 1`` for large ones). ``--no-torch-bf16`` leaves out the bf16 ``F.linear`` columns
(``-``), which take minutes at prefill row counts on CPUs without native bf16 GEMMs.

``--before REV`` also builds the dense kernel library as of git revision REV (a temporary ``git worktree``;
REV's dense library must have the current wrapper's argument structs: its layout is checked at load), packs the same
weights with it and times it in the same passes: columns ``before ms`` and ``speed-up`` (before / now), and
the same for the FP8 weights (``fp8 before``) and the GGUF blocks (``gguf before``: REV's kernels on the blocks in
REV's layout, its ``kv8/quant/gguf_blocks.py``'s ``group_blocks``; ``bf16x before``: those blocks expanded to bf16 by
REV's kernels, from the same row count as ``bf16x``), a kernel change's effect under the same machine conditions.

    .venv/bin/python benchmarks/bench_linear.py
    .venv/bin/python benchmarks/bench_linear.py --rows 8,32,2048 --before HEAD~1
    .venv/bin/python benchmarks/bench_linear.py --rows 1,512 --shapes 4096x4096,14336x4096 --layers 1 --no-torch-bf16

``--gguf-paths [PATHS]`` times only the GGUF int8 kernel (``kv8_gguf_linear``), on each path of PATHS (comma-separated;
default: every path this build has, ``DenseKernels.gguf_paths``: ``avx2`` maddubs, ``vnni256``, ``vnni512``), taking
turns within each pass: for each block type of ``--gguf-types`` (default all five), matrix of ``--shapes`` (default
SmolLM2-135M's q/o, k/v, gate/up and down shapes and Gemma-3-270M's: 576x576, 192x576, 1536x576, 576x1536, 640x640,
2048x640, 640x2048; Q4_K only where K is a multiple of 256), row count of ``--rows`` (default 1,2,8) and thread count
of ``--threads`` (default 1,2). ``--layers`` copies of each matrix are multiplied in turn (the weights come from
beyond L2, as in a decode step); the time per call is the median pass over ``--reps`` passes (the order of the paths
rotated each pass) divided by the copies, and each ratio's spread the interquartile range of its per-pass ratios.
Every path computes the same bits, which the run checks.

    .venv/bin/python benchmarks/bench_linear.py --gguf-paths
    .venv/bin/python benchmarks/bench_linear.py --gguf-paths avx2,vnni512 --gguf-types Q4_0 --rows 1 --threads 1
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from unittest import mock

import gguf
import numpy as np
import torch
import torch.nn.functional as F
from revisions import worktree

import kv8
from kv8.host_memory import tune_malloc
from kv8.kernels.cpu.build import KernelUnavailable, build_shared_library
from kv8.kernels.cpu.dense import SOURCE, DenseKernels
from kv8.layers.dense_backend import GGUF_BF16_ROWS, GGUF_DEQUANTIZE_ROWS, DenseBackend, select_dense_backend
from kv8.layers.linear import LinearBase
from kv8.platform import cpu_name
from kv8.quant.gguf_blocks import BLOCK_VALUES, KEPT_TYPES, GGUFWeight, group_blocks

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer, SmolLM2-135M
# --gguf-paths: SmolLM2-135M's q/o, k/v, gate/up (each), down; Gemma-3-270M's q/o, gate/up (each), down
GGUF_SHAPES = [(576, 576), (192, 576), (1536, 576), (576, 1536), (640, 640), (2048, 640), (640, 2048)]


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """``"960x576,576x576"`` -> ``[(960, 576), (576, 576)]`` (out, in): positive integers."""
    shapes = []
    for part in text.split(","):
        out, _, inp = part.strip().partition("x")
        if not (out.isdigit() and inp.isdigit() and int(out) > 0 and int(inp) > 0):
            raise argparse.ArgumentTypeError(f"{part!r} is not OUTxIN with positive integers, e.g. 4096x4096")
        shapes.append((int(out), int(inp)))
    return shapes


def passes(fns: dict[str, Callable[[], None]], reps: int) -> dict[str, list[float]]:
    """The time of each function in each of ``reps`` passes, the functions taking turns within each pass (the order
    rotated each pass); one untimed call of each first."""
    for fn in fns.values():
        fn()
    names = list(fns)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(reps):
        for name in names[r % len(names):] + names[:r % len(names)]:
            start = time.perf_counter()
            fns[name]()
            times[name].append(time.perf_counter() - start)
    return times


def best_of(fns: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """Best time of each function over ``reps`` passes, the functions taking turns within each pass (so a
    change in the machine's speed during the run touches them alike); one untimed call of each first."""
    for fn in fns.values():
        fn()
    best = dict.fromkeys(fns, math.inf)
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,16,32,64,256,2048", help="comma-separated M values")
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--before", metavar="REV", help="also time the kernels as of this git revision")
    ap.add_argument("--shapes", type=parse_shapes, default=None,
                    help="comma-separated OUTxIN matrices per layer (default: SmolLM2-135M's; with --gguf-paths also "
                         "Gemma-3-270M's)")
    ap.add_argument("--gguf-type", default="Q4_1", choices=KEPT_TYPES,
                    help="the GGUF block type of the gguf columns (default: Q4_1, SmolLM2's file)")
    ap.add_argument("--no-torch-bf16", dest="torch_bf16", action="store_false",
                    help="leave out bf16 F.linear (the torch columns print -)")
    ap.add_argument("--gguf-paths", nargs="?", const="", default=None, metavar="PATHS",
                    help="time only the GGUF int8 kernel on these paths (comma-separated; default: all this build has)")
    ap.add_argument("--gguf-types", default=",".join(KEPT_TYPES), help="--gguf-paths: the block types (default: all)")
    ap.add_argument("--threads", default="1,2", help="--gguf-paths: comma-separated thread counts (default 1,2)")
    ap.add_argument("--reps", type=int, default=21, help="--gguf-paths: timed passes per cell (default 21)")
    args = ap.parse_args()
    if args.gguf_paths is not None:
        args.shapes = args.shapes or GGUF_SHAPES
        args.rows = args.rows if args.rows != ap.get_default("rows") else "1,2,8"
        run_gguf_paths(ap, args)
        return
    args.shapes = args.shapes or SHAPES
    tune_malloc()
    bad = [f"{n}x{k}" for n, k in args.shapes if k % BLOCK_VALUES[args.gguf_type]]
    if bad:
        ap.error(f"--gguf-type {args.gguf_type} needs in-features that are multiples of "
                 f"{BLOCK_VALUES[args.gguf_type]}; not {', '.join(bad)} (pass --shapes)")
    with contextlib.ExitStack() as stack:
        before, before_blocks = None, None
        if args.before:
            try:
                tree = stack.enter_context(worktree(args.before, "--before")).path
            except (ValueError, RuntimeError) as e:
                ap.error(str(e))
            source = Path(tree) / SOURCE.relative_to(Path(kv8.__file__).parents[1])
            try:
                before = DenseKernels(build_shared_library(source, "native"))
            except KernelUnavailable as e:   # e.g. a revision with other argument structs
                ap.error(f"--before {args.before}: {e}")
            # REV's layout of GGUF blocks (the module imports only torch)
            spec = importlib.util.spec_from_file_location("kv8_before_gguf_blocks",
                                                          Path(tree) / "kv8" / "quant" / "gguf_blocks.py")
            assert spec is not None and spec.loader is not None
            before_blocks = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = before_blocks   # its dataclasses look their module up
            spec.loader.exec_module(before_blocks)
        run(args, before, before_blocks)


def run_gguf_paths(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--gguf-paths``: the GGUF int8 kernel on each path, per type, shape, row count and thread count (see the
    module docstring); a table with microseconds per call, each path's time over the last path's, and the weight
    bytes per second of the last path."""
    from kv8.kernels.cpu.dense import load_dense_kernels

    kernels = load_dense_kernels()
    paths = [p for p in args.gguf_paths.split(",") if p] or list(kernels.gguf_paths)
    types = [t for t in args.gguf_types.split(",") if t]
    bad = [p for p in paths if p not in kernels.gguf_paths] + [t for t in types if t not in kernels.gguf_types]
    if bad or not paths:
        ap.error(f"not in this build: {', '.join(bad) or 'no path'}; it has paths {list(kernels.gguf_paths)}, "
                 f"types {list(kernels.gguf_types)}")
    rows = [int(v) for v in args.rows.split(",")]
    threads = [int(v) for v in args.threads.split(",")]
    chosen, before_threads = kernels.gguf_path, torch.get_num_threads()
    last = paths[-1]
    print(f"GGUF int8 kernel (kv8_gguf_linear), paths {', '.join(paths)} taking turns; {args.layers} copies of each "
          f"matrix; medians of {args.reps} passes (a ratio's interquartile range over the passes); "
          f"{cpu_name() or 'CPU'}")
    print(f"{'type':<5} {'N x K':>11} {'M':>2} {'thr':>3} " + " ".join(f"{p + ' us':>11}" for p in paths)
          + "".join(f" {p + '/' + last:>16}" for p in paths[:-1]) + f" {last + ' GB/s':>13}")
    gen = torch.Generator().manual_seed(0)
    try:
        for qtype in types:
            for n, k in args.shapes:
                if k % BLOCK_VALUES[qtype]:
                    continue
                w = torch.randn(n, k, generator=gen).bfloat16()
                grouped = group_blocks(gguf_blocks_of(w, qtype), qtype, k)
                copies = [grouped.clone() for _ in range(args.layers)]
                for t in threads:
                    torch.set_num_threads(t)
                    for m in rows:
                        x = torch.randn(m, k, generator=gen).bfloat16()

                        def call(path: str, x: torch.Tensor = x, n: int = n, qtype: str = qtype,
                                 copies: list[torch.Tensor] = copies) -> None:
                            kernels.gguf_path = path
                            for blocks in copies:
                                kernels.gguf_linear(x, blocks, qtype, n, None)

                        outs = {}
                        for p in paths:   # every path computes the same bits
                            kernels.gguf_path = p
                            outs[p] = kernels.gguf_linear(x, copies[0], qtype, n, None)
                        if any(not torch.equal(o, outs[last]) for o in outs.values()):
                            raise SystemExit(f"{qtype} {n}x{k} M={m}: the paths disagree")
                        times = passes({p: functools.partial(call, p) for p in paths}, args.reps)
                        us = {p: statistics.median(v) / args.layers * 1e6 for p, v in times.items()}
                        # the spread of the ratio: its quartiles over the passes (paths timed side by side)
                        q = {p: statistics.quantiles([a / b for a, b in zip(times[p], times[last])], n=4)
                             for p in paths[:-1]}
                        print(f"{qtype:<5} {f'{n}x{k}':>11} {m:>2} {t:>3} " + " ".join(f"{us[p]:>11.1f}" for p in paths)
                              + "".join(f" {us[p] / us[last]:>5.2f} ({q[p][0]:.2f}-{q[p][2]:.2f})" for p in paths[:-1])
                              + f" {grouped.numel() / us[last] / 1e3:>13.1f}", flush=True)
    finally:
        kernels.gguf_path = chosen
        torch.set_num_threads(before_threads)


def packed_layers(weights: list[list[torch.Tensor]], backend: DenseBackend) -> list[list[LinearBase]]:
    """One kv8 ``Linear`` per weight on ``backend``, each packing a copy (the weights stay for torch)."""
    layers = []
    for layer in weights:
        mods = []
        for w in layer:
            lin = LinearBase(w.shape[1], [w.shape[0]], False, backend)   # quantized when the backend says so
            lin.weight.data = w
            lin.process_weights_after_loading()
            mods.append(lin)
        layers.append(mods)
    return layers


def gguf_blocks_of(w: torch.Tensor, qtype: str) -> torch.Tensor:
    """``w [N, K]`` as GGUF blocks of ``qtype`` (uint8 ``[N, row bytes]``, the file's layout): ``gguf.quants.quantize``;
    Q4_K, which that package does not quantize, as random codes, scales and mins with small finite ``d`` and ``dmin``
    (the kernels' time does not depend on the values)."""
    if qtype != "Q4_K":
        blocks = gguf.quants.quantize(w.float().numpy(), gguf.GGMLQuantizationType[qtype])
        return torch.from_numpy(np.ascontiguousarray(blocks))
    n, k = w.shape
    gen = torch.Generator().manual_seed(n * k)
    blocks = torch.randint(0, 256, (n, k // 256, 144), dtype=torch.uint8, generator=gen)
    blocks[..., 0:4] = (torch.rand(n, k // 256, 2, generator=gen) * 0.01).half().view(torch.uint8).reshape(n, -1, 4)
    return blocks.reshape(n, -1)


def gguf_layers(files: list[list[GGUFWeight]], kernels: DenseKernels,
                before_blocks: ModuleType | None = None) -> list[list[LinearBase]]:
    """One kv8 ``Linear`` per weight holding its GGUF blocks (``quantization="gguf"``); with ``before_blocks`` (an
    older revision's ``kv8.quant.gguf_blocks``) in that revision's layout, for its ``kernels``."""
    backend = DenseBackend("packed_bf16", kernels, "gguf", wide_rows=GGUF_DEQUANTIZE_ROWS)
    group = before_blocks.group_blocks if before_blocks is not None else kv8.layers.linear.group_blocks
    layers = []
    with mock.patch("kv8.layers.linear.group_blocks", group):
        for layer in files:
            mods = []
            for weight in layer:
                lin = LinearBase(weight.in_features, [weight.shape[0]], False, backend)
                lin.load_gguf(weight)
                lin.process_weights_after_loading()
                mods.append(lin)
            layers.append(mods)
    return layers


def run(args: argparse.Namespace, before: DenseKernels | None, before_blocks: ModuleType | None = None) -> None:
    backend = select_dense_backend("packed_bf16", torch.bfloat16)
    torch.manual_seed(0)
    weights = [[torch.randn(n, k).bfloat16() for n, k in args.shapes] for _ in range(args.layers)]
    packed = packed_layers(weights, backend)
    weights_f32 = [[w.float() for w in layer] for layer in weights]
    nbytes = sum(w.numel() * 2 for layer in weights for w in layer)
    kernels = backend.kernels
    assert kernels is not None
    fp8 = packed_layers(weights, DenseBackend("packed_bf16", kernels, "fp8"))
    files = [[GGUFWeight(args.gguf_type, gguf_blocks_of(w, args.gguf_type), w.shape[1]) for w in layer]
             for layer in weights]
    blocks = gguf_layers(files, kernels)
    gguf_before = gguf_layers(files, before, before_blocks) if before is not None else []
    gguf_bytes = sum(s.nbytes() for layer in blocks for p in layer for s in p.gguf_segments)
    amx = kernels.amx
    # the same layers on the library of --before (the same Python path, AMX tiles where the current one uses them)
    packed_before = packed_layers(weights, DenseBackend("packed_bf16", before)) if before is not None else []
    fp8_before = packed_layers(weights, DenseBackend("packed_bf16", before, "fp8")) if before is not None else []
    if before is not None:
        before.amx = amx
    shapes = "" if args.shapes == SHAPES else " (" + ", ".join(f"{n}x{k}" for n, k in args.shapes) + " each)"
    print(f"{args.layers} layers{shapes}, {nbytes / 1e6:.0f} MB of bf16 weights, {torch.get_num_threads()} threads, "
          f"kv8 path: {kernels.isa} ({'AMX tiles' if amx else 'vdpbf16ps' if kernels.isa == 'avx512' else 'fp32 FMA'})"
          + (f"; before = kv8's kernels as of {args.before}" if before is not None else "")
          + f"; gguf = {args.gguf_type} blocks, {gguf_bytes / 1e6:.0f} MB")
    extra = f" {'fp8 ms':>8} {'bf16/fp8':>9} {'fp32 ms':>9} {'fp32/kv8':>9} {'fp32/fp8':>9}"
    extra += f" {'gguf ms':>8} {'kv8/gguf':>9} {'fp32/gguf':>10} {'int8 ms':>8} {'int8/gguf':>10}"
    extra += f" {'bf16x ms':>9} {'int8/bf16x':>11}"
    extra += f" {'vdpbf16ps ms':>13} {'AMX/vdpbf16ps':>14}" if amx else ""
    extra += (f" {'before ms':>10} {'speed-up':>9} {'fp8 before':>11} {'speed-up':>9} {'gguf before':>12} "
              f"{'speed-up':>9} {'bf16x before':>13} {'speed-up':>9}" if before is not None else "")
    print(f"{'M':>6} {'torch ms':>10} {'kv8 ms':>10} {'torch GB/s':>11} {'kv8 GB/s':>10} {'speed-up':>9}{extra}")
    with torch.inference_mode():
        for m in (int(v) for v in args.rows.split(",")):
            xs = {k: torch.randn(m, k).bfloat16() for k in {k for _, k in args.shapes}}
            reps = 5 if m <= 256 else 2

            def run_torch(xs: dict[int, torch.Tensor] = xs) -> None:
                for layer in weights:
                    for w in layer:
                        F.linear(xs[w.shape[1]], w)

            def run_fp32(xs: dict[int, torch.Tensor] = xs) -> None:
                for layer in weights_f32:
                    for w in layer:
                        F.linear(xs[w.shape[1]].float(), w).bfloat16()

            def run_kv8(xs: dict[int, torch.Tensor] = xs, layers: list[list[LinearBase]] = packed) -> None:
                for layer in layers:
                    for p in layer:
                        p(xs[p.in_features])

            def run_fp8(xs: dict[int, torch.Tensor] = xs) -> None:
                run_kv8(xs, fp8)

            def run_gguf(xs: dict[int, torch.Tensor] = xs) -> None:
                run_kv8(xs, blocks)

            def run_gguf_as(xs: dict[int, torch.Tensor] = xs, layers: list[list[LinearBase]] = blocks,
                            **switch: object) -> None:
                """GGUF ``layers`` with their methods' ``switch`` attributes set for the call, restored after."""
                with contextlib.ExitStack() as stack:
                    for layer in layers:
                        for p in layer:
                            for name, value in switch.items():
                                stack.enter_context(mock.patch.object(p.method, name, value))
                    run_kv8(xs, layers)

            def run_gguf_int8(xs: dict[int, torch.Tensor] = xs) -> None:
                run_gguf_as(xs, dequantize_rows=sys.maxsize)

            def run_gguf_bf16(xs: dict[int, torch.Tensor] = xs) -> None:
                run_gguf_as(xs, dequantize_rows=GGUF_BF16_ROWS, expansion="bf16")

            def run_before(xs: dict[int, torch.Tensor] = xs) -> None:
                run_kv8(xs, packed_before)

            def run_fp8_before(xs: dict[int, torch.Tensor] = xs) -> None:
                run_kv8(xs, fp8_before)

            def run_gguf_before(xs: dict[int, torch.Tensor] = xs) -> None:
                run_kv8(xs, gguf_before)

            def run_bf16x_before(xs: dict[int, torch.Tensor] = xs) -> None:
                run_gguf_as(xs, gguf_before, dequantize_rows=GGUF_BF16_ROWS, expansion="bf16")

            def run_avx512(xs: dict[int, torch.Tensor] = xs) -> None:
                kernels.amx = False
                try:
                    run_kv8(xs)
                finally:
                    kernels.amx = True

            fns: dict[str, Callable[[], None]] = {"torch": run_torch} if args.torch_bf16 else {}
            fns.update({"kv8": run_kv8, "fp8": run_fp8, "fp32": run_fp32, "gguf": run_gguf, "int8": run_gguf_int8,
                        "bf16x": run_gguf_bf16})
            if amx:
                fns["vdpbf16ps"] = run_avx512
            if before is not None:
                fns["before"] = run_before
                fns["fp8 before"] = run_fp8_before
                fns["gguf before"] = run_gguf_before
                fns["bf16x before"] = run_bf16x_before
            t = best_of(fns, reps)
            t_kv8 = t["kv8"]
            if "torch" in t:
                torch_cols = (f"{t['torch'] * 1e3:>10.2f} {t_kv8 * 1e3:>10.2f} {nbytes / t['torch'] / 1e9:>11.1f} "
                              f"{nbytes / t_kv8 / 1e9:>10.1f} {t['torch'] / t_kv8:>9.2f}")
            else:
                torch_cols = f"{'-':>10} {t_kv8 * 1e3:>10.2f} {'-':>11} {nbytes / t_kv8 / 1e9:>10.1f} {'-':>9}"
            row = (f"{m:>6} {torch_cols} {t['fp8'] * 1e3:>8.2f} "
                   f"{t_kv8 / t['fp8']:>9.2f} {t['fp32'] * 1e3:>9.2f} {t['fp32'] / t_kv8:>9.2f} "
                   f"{t['fp32'] / t['fp8']:>9.2f} {t['gguf'] * 1e3:>8.2f} {t_kv8 / t['gguf']:>9.2f} "
                   f"{t['fp32'] / t['gguf']:>10.2f} {t['int8'] * 1e3:>8.2f} {t['int8'] / t['gguf']:>10.2f}"
                   f" {t['bf16x'] * 1e3:>9.2f} {t['int8'] / t['bf16x']:>11.2f}")
            if amx:
                row += f" {t['vdpbf16ps'] * 1e3:>13.2f} {t['vdpbf16ps'] / t_kv8:>14.2f}"
            if before is not None:
                row += (f" {t['before'] * 1e3:>10.2f} {t['before'] / t_kv8:>9.2f} {t['fp8 before'] * 1e3:>11.2f} "
                        f"{t['fp8 before'] / t['fp8']:>9.2f} {t['gguf before'] * 1e3:>12.2f} "
                        f"{t['gguf before'] / t['gguf']:>9.2f} {t['bf16x before'] * 1e3:>13.2f} "
                        f"{t['bf16x before'] / t['bf16x']:>9.2f}")
            print(row)


if __name__ == "__main__":
    main()
