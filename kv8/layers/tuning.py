"""Per-machine choice of the dense layers' method, made by timing the candidates on the model's own shapes.

Which linear method is fastest depends on the CPU: kv8's packed kernels (AVX-512 BF16 / AMX, or AVX2 + FMA) where
they build, torch's bf16 GEMM (oneDNN) where the CPU has native bf16, float32 GEMMs on weights widened at load where
it does not (AVX2 without AVX-512 BF16: torch's bf16 GEMM there runs 5-20x slower than its float32 one, and kv8's
AVX2 kernels read half the float32 weights' bytes). So
``dense_backend="auto"`` measures instead of guessing:

1. the candidates (:func:`candidates`) each build one layer of every distinct linear shape of the model (once:
   candidates whose layers hold the same buffers share them, so ``packed_bf16`` and ``packed_bf16+f32_from_512``
   pack each shape once), and multiply 1 row (a decode step), :data:`PREFILL_ROWS` rows (a short prefill chunk) and
   :data:`~kv8.layers.linear.WIDE_ROWS` rows (a long prompt's chunk) through it (:data:`TIMED_ROWS`), in up to
   :data:`TUNE_ROUNDS` rounds that take the candidates in turn (in a rotated order, so that none is always timed
   first or last); each keeps its fastest time per shape and row count, so a burst of other work during one
   candidate's turn does not decide the choice. The LM head multiplies only the rows whose logits a step computes
   (one per sequence), so it is timed at 1 and :data:`PREFILL_ROWS` rows, and counts its 1-row time in a long
   prompt's chunk (:func:`timed_rows`): timing it at 512 rows, a 49,152 x 576 GEMM for SmolLM2, was 89% of the
   multiply-adds timed at 512 rows (one layer of each shape), for a call the engine never makes;
2. each candidate's time over the model (shape time x layers of that shape) is divided by the best candidate's
   at the same rows; the lowest sum of the ratios wins (each row count counts alike). From the second round on, a
   candidate that had the lowest sum in every round so far (each round by its own times) and whose sum on the
   fastest times is :data:`EARLY_MARGIN` below every other's ends the timing: a third round could change the choice
   only if it were the fastest by more than that margin for a candidate that lost both rounds;
3. the winner and the timings go into a plan file, ``<KV8_CACHE_DIR>/tuning/<machine>.json``, keyed by the model's
   shapes, dtype and quantization, and are used from then on. The file names the CPU model, its ISA flags, kv8's
   and torch's versions: a plan from another machine or version is ignored, a corrupt or unwritable file falls
   back to timing (and then to the fixed rule of :func:`kv8.layers.dense_backend.select_dense_backend`). A plan
   also records what it timed (:func:`candidate_ids`: each candidate's name, and for kv8's kernels the build of
   the library, which changes with their source, compiler and flags): it is reused only while the candidates are
   the same, so a kernel that was added or rebuilt since is timed rather than passed over.

A plan also records how busy the machine was while it was timed (:attr:`TuneResult.others`: cores' worth of CPU
time other processes took, from ``/proc/stat``, :mod:`kv8.cpu_load`). On a 2-core machine a compiler at ``nice 10``
beside the timing made kv8's packed kernel look 6x slower at 64 rows than it is (its two OpenMP threads wait at
every barrier for the one the scheduler parked) and the plan chose ``torch``, 2x slower at one row. A plan timed
while others took more than :data:`BUSY_CORES` cores is provisional: it is used, and timed again at the next
start; of two timings the quieter is kept, and ``kv8 tune`` says how busy the machine was.

With ``quantization="gguf"`` the choice is made per block type: the layers of each type the kernels read are timed
on their own (:func:`tuning_groups`: every shape of the decoder's blocks in its own type, so Gemma-3-270M's Q4_K_M
file times its nine Q6_K down projections as Q6_K and the other nine as Q4_K), each type gets a plan of its own, and
each layer's segment of blocks switches at its type's choice (:attr:`~kv8.layers.dense_backend.DenseBackend.
gguf_wide_rows`). The LM head is not timed: its switch is its own, fixed
(:data:`~kv8.layers.vocab_parallel.GGUF_HEAD_DEQUANTIZE_ROWS`), whatever the decoder's layers do.

Invariant: the choice changes only speed, within the kernels' documented rounding. Every candidate for 16-bit and
FP8 weights computes ``x @ W.T + b`` with float32 sums and one rounding to the compute dtype (bf16 products are exact
in float32), so outputs differ by the order of the float32 additions, as the packed kernel's already do. With GGUF
blocks the candidates differ where one runs the int8 kernel and another a GEMM on the dequantized blocks (calls of
32 rows or more; of 256 or more for the bf16 expansion): the int8 kernel rounds the activations to int8 per block of
32, as llama.cpp does, within :func:`~kv8.quant.gguf_blocks.gguf_activation_bound` (docs/benchmarks.md, "GGUF blocks
kept quantized", measures what that costs in KL divergence); the bf16 expansion rounds each dequantized weight to
bf16 (2^-9 relative), as a file dequantized to bf16 at load does.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

from kv8 import envs
from kv8.cpu_load import others_cores, read_cpu_clock, this_process_cpus
from kv8.kernels.cpu.build import KernelUnavailable
from kv8.kernels.cpu.dense import FP8_REGISTER_ROWS, DenseKernels, load_dense_kernels
from kv8.layers.dense_backend import GGUF_BF16_ROWS, GGUF_DEQUANTIZE_ROWS, DenseBackend, select_dense_backend
from kv8.layers.linear import WIDE_ROWS, Linear, gguf_segment, linear_method
from kv8.machine_plans import MachinePlans, fastest_call
from kv8.quant.gguf_blocks import random_blocks
from kv8.validators import memory_available

logger = logging.getLogger("kv8")

__all__ = ["BUSY_CORES", "EARLY_MARGIN", "GGUF_PATH_MIN_GAIN", "HEAD_GROUP", "PREFILL_ROWS", "TIMED_ROWS",
           "TUNE_ROUNDS", "LinearShape", "PathResult", "PlanStore", "choose_gguf_path", "gguf_path_groups",
           "stored_gguf_path", "tuned_gguf_paths", "TuneResult", "candidates", "choose",
           "candidate_ids", "plan_key", "static_dense_backend", "time_layer", "timed_rows", "tuned_dense_backend",
           "tuning_groups"]

PREFILL_ROWS = 64            # rows of the prefill timing (a chunk's rows pass the same weights; kept short)
TIMED_ROWS = (1, PREFILL_ROWS, WIDE_ROWS)   # a decode step, a short chunk, a long prompt's chunk
#: FP8 weights on the vdpbf16ps path (AVX-512 BF16 without AMX): besides the fixed rule's
#: :data:`~kv8.kernels.cpu.dense.FP8_REGISTER_ROWS`, candidates that decode the codes in registers only up to this many
#: rows (one or two blocks of rows) and into a buffer once per call beyond. On an Intel Xeon without AMX (SmolLM2's
#: 30 layers, 2 threads, ``bench_linear.py``) the buffer ran 1.06x the registers at 32 rows and 1.10x at 64, 0.97x at
#: 16; on an AMD EPYC (Zen 5) the registers won at 32 rows (1.3x)
FP8_SHORT_REGISTER_ROWS = 16
TUNE_ROUNDS = 3              # rounds over the candidates, each keeping its fastest time (module docstring, step 1)
EARLY_MARGIN = 0.10          # a leader of every round this much ahead after two rounds ends the timing (step 2)
BUSY_CORES = 0.25            # other processes' CPU use while timing above which a plan is provisional
#: ``measure(backend, shape, rows)``: seconds of one call of a layer of ``shape`` on ``backend`` at ``rows`` rows
Measure = Callable[[DenseBackend, "LinearShape", int], float]


@dataclass(frozen=True)
class LinearShape:
    """One shape of the model's linear layers on this rank, and how many layers have it. With
    ``quantization="gguf"`` a shape is one run of a layer's rows in one block type (``qtype``, the file's: a merged
    layer whose projections differ in type is a shape per type, as :class:`~kv8.layers.linear.GGUFLinearMethod` holds
    and multiplies it), and a shape of the same ``(out_features, in_features)`` in two types is two shapes."""

    out_features: int
    in_features: int
    count: int
    quantize: bool = True    # the layer follows the weights' quantization (False: the LM head)
    qtype: str | None = None  # quantization="gguf": the GGUF block type of its weights in the file
    lm_head: bool = False    # the LM head: it multiplies only the rows whose logits a step computes (timed_rows)


def timed_rows(shape: LinearShape, rows: int) -> int:
    """The rows a layer of ``shape`` multiplies in a step of ``rows`` rows: ``rows``, but the LM head
    (:attr:`LinearShape.lm_head`) multiplies only the rows whose logits the step computes, one per sequence, so a
    long prompt's chunk (more than :data:`PREFILL_ROWS` rows) is one row for it (module docstring, step 1)."""
    return rows if not shape.lm_head or rows <= PREFILL_ROWS else 1


@dataclass(frozen=True)
class TuneResult:
    """``seconds[candidate][rows]``: one pass of the model's linear layers at that many rows."""

    choice: str
    seconds: dict[str, dict[int, float]]
    measured: str = ""       # when (UTC, ISO 8601)
    timed: tuple[str, ...] = ()   # what was timed (:func:`candidate_ids`); empty in plans written before it existed
    others: float = 0.0      # cores' worth of CPU time other processes took while it was timed (0.0: unknown)
    rounds: int = 0          # rounds over the candidates it took (0: unknown, a plan written before it was kept)

    @property
    def provisional(self) -> bool:
        """Timed beside other work (:data:`BUSY_CORES`): used, and timed again at the next start."""
        return self.others > BUSY_CORES

    @property
    def compared_with(self) -> str:
        """The candidate the choice's speed-ups are quoted against: ``torch`` where it was timed, else the fastest
        other candidate at the most rows timed (``quantization="gguf"``: the other switch); the choice itself when it
        was the only one."""
        if "torch" in self.seconds:
            return "torch"
        others = [name for name in self.seconds if name != self.choice]
        if not others:
            return self.choice
        most = max(r for per in self.seconds.values() for r in per)
        return min(others, key=lambda name: self.seconds[name][most])

    def speedup(self, over: str, rows: int) -> float:
        """How many times faster the choice is than ``over`` at ``rows`` rows."""
        return self.seconds[over][rows] / self.seconds[self.choice][rows]

    def table(self) -> str:
        rows = sorted({r for per in self.seconds.values() for r in per})
        width = max(14, *(len(name) + 2 for name in self.seconds))
        head = f"{'dense backend':<{width}}" + "".join(f"{f'{r} row' + ('s' if r > 1 else '') + ' (ms)':>16}"
                                                       for r in rows)
        lines = [head]
        for name, per in self.seconds.items():
            mark = "  <- chosen" if name == self.choice else ""
            lines.append(f"{name:<{width}}" + "".join(f"{per[r] * 1e3:>16.3f}" for r in rows) + mark)
        if self.provisional:
            lines.append(f"timed beside other work (other processes took {self.others:.2f} cores): provisional, "
                         "timed again at the next start")
        return "\n".join(lines)


def plan_key(shapes: Sequence[LinearShape], dtype: torch.dtype, quantization: str | None) -> str:
    """The model's part of a plan's key: its linear shapes, compute dtype and weight quantization."""
    described = [{k: v for k, v in asdict(s).items() if not (k in ("qtype", "lm_head") and not v)} for s in shapes]
    text = json.dumps([described, str(dtype), quantization])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def candidate_ids(found: dict[str, DenseBackend]) -> tuple[str, ...]:
    """What a plan timed, sorted: each candidate's name, with ``@<build>`` for kv8's kernels (the library file's
    name, a hash of their source, compiler and flags: a rebuilt library is a new candidate)."""
    return tuple(sorted(f"{name}@{Path(backend.kernels.path).stem}" if backend.kernels is not None else name
                        for name, backend in found.items()))


def _timing_layer(shape: LinearShape, backend: DenseBackend, dtype: torch.dtype,
                  weight: torch.Tensor | None = None) -> Linear:
    """A layer of ``shape`` on ``backend`` with random weights (the speed does not depend on the values), or with
    ``weight`` (``[out, in]`` in ``dtype``, left unchanged)."""
    generator = torch.Generator().manual_seed(0)
    layer = Linear(shape.in_features, shape.out_features, bias=False, backend=backend)
    layer.method = linear_method(backend, shape.quantize)
    if backend.quantization == "gguf" and shape.quantize:
        if shape.qtype is None:
            raise ValueError(f"a GGUF layer of shape {shape} needs its block type (qtype) to be timed")
        layer.load_gguf(random_blocks(shape.qtype, shape.out_features, shape.in_features, generator))
    else:
        layer.weight.data = (weight.clone() if weight is not None else
                             torch.randn(shape.out_features, shape.in_features, generator=generator).to(dtype) * 0.02)
    layer.process_weights_after_loading()
    return layer


def time_layer(shape: LinearShape, backend: DenseBackend, dtype: torch.dtype, rows: int) -> float:
    """Seconds of one call of a layer of ``shape`` on ``backend`` with ``rows`` input rows (random weights: the
    speed does not depend on the values)."""
    layer = _timing_layer(shape, backend, dtype)
    x = torch.randn(rows, shape.in_features, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode():
        return fastest_call(lambda: layer(x))


def choose(candidates: dict[str, DenseBackend], shapes: Sequence[LinearShape], dtype: torch.dtype,
           measure: Measure | None = None, rows: Sequence[int] = TIMED_ROWS, rounds: int = TUNE_ROUNDS,
           early_margin: float = EARLY_MARGIN) -> TuneResult:
    """Time every candidate on ``shapes`` at each of ``rows`` (:func:`timed_rows`; ``measure``, default
    :func:`time_layer` on layers built once and kept for the rounds) in up to ``rounds`` rounds, the candidates in
    turn and in a rotated order, each keeping its fastest time per shape and row count; and choose (module docstring,
    step 2). From the second round on, a candidate that led every round so far, by its own times, and whose score
    on the fastest times is ``early_margin`` below every other's, ends the timing."""
    if not candidates:
        raise ValueError("no dense backend to choose from")
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be >= 1")
    timer = _LayerTimer(dtype) if measure is None else None
    run = measure if measure is not None else timer.measure   # type: ignore[union-attr]
    names = list(candidates)
    fastest: dict[tuple[str, int, int], float] = {}
    leaders: set[str] = set()
    try:
        for round_ in range(rounds):
            order = names[round_ % len(names):] + names[:round_ % len(names)]
            this_round: dict[tuple[str, int, int], float] = {}
            for i, shape in enumerate(shapes):
                for n in dict.fromkeys(timed_rows(shape, r) for r in rows):
                    for name in order:
                        key = (name, i, n)
                        this_round[key] = took = run(candidates[name], shape, n)
                        fastest[key] = min(fastest.get(key, float("inf")), took)
            leaders.add(_lowest(_scores(_pass_seconds(names, shapes, rows, this_round))))
            score = _scores(_pass_seconds(names, shapes, rows, fastest))
            leader = _lowest(score)
            if round_ >= 1 and leaders == {leader} and all(score[name] >= score[leader] * (1 + early_margin)
                                                           for name in names if name != leader):
                break
    finally:
        del timer   # the layers built for timing
    seconds = _pass_seconds(names, shapes, rows, fastest)
    return TuneResult(_lowest(_scores(seconds)), seconds, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                      rounds=round_ + 1)


def _pass_seconds(names: Sequence[str], shapes: Sequence[LinearShape], rows: Sequence[int],
                  times: dict[tuple[str, int, int], float]) -> dict[str, dict[int, float]]:
    """Each candidate's pass over the model's layers at each row count, from ``times[(name, shape index, rows)]``:
    shape time x layers of that shape."""
    return {name: {r: sum(s.count * times[(name, i, timed_rows(s, r))] for i, s in enumerate(shapes)) for r in rows}
            for name in names}


def _scores(seconds: dict[str, dict[int, float]]) -> dict[str, float]:
    """Each candidate's sum over the row counts of its time over the best candidate's (module docstring, step 2)."""
    rows = list(next(iter(seconds.values())))
    best = {r: min(per[r] for per in seconds.values()) for r in rows}
    return {name: sum(per[r] / best[r] if best[r] > 0 else 1.0 for r in rows) for name, per in seconds.items()}


def _lowest(score: dict[str, float]) -> str:
    return min(score, key=lambda name: score[name])   # ties: the first listed


class _LayerTimer:
    """:func:`time_layer`'s measurement on layers and inputs built once per (candidate, shape) and row count, so
    that the rounds of :func:`choose` time the same layers without building them again. Candidates whose layers
    hold the same buffers (``packed_bf16`` and ``packed_bf16+f32_from_512``: the same packed weights) share them: the
    weights are packed once, each candidate's layer is a shallow copy with its own method; the random weights of a
    shape are drawn once."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.layers: dict[tuple[str, LinearShape], Linear] = {}   # by (candidate label, shape)
        self.built: dict[tuple[object, LinearShape], Linear] = {}   # by (the layers' buffers: _layout, shape)
        self.weights: dict[LinearShape, torch.Tensor] = {}
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.warm: set[tuple[str, LinearShape, int]] = set()

    @staticmethod
    def _layout(backend: DenseBackend) -> object:
        """What a layer's buffers depend on: the backend but its ``wide_rows``, ``gguf_expand`` and
        ``fp8_register_rows`` (which only its method reads)."""
        return replace(backend, wide_rows=0, gguf_expand="f32", fp8_register_rows=FP8_REGISTER_ROWS)

    def _layer(self, backend: DenseBackend, shape: LinearShape) -> Linear:
        layer = self.layers.get((backend.label, shape))
        if layer is not None:
            return layer
        built = self.built.get((self._layout(backend), shape))
        if built is None:
            blocks = backend.quantization == "gguf" and shape.quantize   # (random blocks: no float weight to draw)
            if shape not in self.weights and not blocks:
                generator = torch.Generator().manual_seed(0)
                self.weights[shape] = torch.randn(shape.out_features, shape.in_features,
                                                  generator=generator).to(self.dtype) * 0.02
            layer = built = self.built[(self._layout(backend), shape)] = _timing_layer(shape, backend, self.dtype,
                                                                                       self.weights.get(shape))
        else:   # the same buffers, this candidate's method
            layer = copy.copy(built)
            layer.method = linear_method(backend, shape.quantize)
        self.layers[(backend.label, shape)] = layer
        return layer

    def measure(self, backend: DenseBackend, shape: LinearShape, rows: int) -> float:
        layer = self._layer(backend, shape)
        x = self.inputs.get((shape.in_features, rows))
        warm = (backend.label, shape, rows) not in self.warm
        self.warm.add((backend.label, shape, rows))
        if x is None:
            generator = torch.Generator().manual_seed(1)
            x = self.inputs[(shape.in_features, rows)] = torch.randn(rows, shape.in_features,
                                                                     generator=generator).to(self.dtype)
        with torch.inference_mode():
            return fastest_call(lambda: layer(x), min_time=0.01, warm_up=warm)   # (warmed up in the first round)


class PlanStore(MachinePlans):
    """The dense layers' plans in this machine's plan file (:class:`~kv8.machine_plans.MachinePlans`): ``{plan_key:
    {"dense_backend", "seconds", "measured", ...}}``, one plan per group of shapes (:func:`tuning_groups`). Reading
    never raises: a missing, corrupt or foreign file or a damaged entry is no plan (timed again)."""

    def get(self, key: str) -> TuneResult | None:
        entry: Any = self.entry(key)
        try:
            seconds = {name: {int(r): float(t) for r, t in per.items()} for name, per in entry["seconds"].items()}
            timed = tuple(str(t) for t in entry.get("timed", ()))
            return TuneResult(str(entry["dense_backend"]), seconds, str(entry.get("measured", "")), timed,
                              float(entry.get("others", 0.0)), int(entry.get("rounds", 0)))
        except (TypeError, KeyError, ValueError, AttributeError):
            return None

    def put(self, key: str, result: TuneResult) -> bool:
        return self.keep(key, {"dense_backend": result.choice, "measured": result.measured, "timed": list(result.timed),
                               "others": round(result.others, 3), "rounds": result.rounds,
                               "seconds": {name: {str(r): t for r, t in per.items()}
                                           for name, per in result.seconds.items()}})


def candidates(shapes: Sequence[LinearShape], dtype: torch.dtype, quantization: str | None) -> dict[str, DenseBackend]:
    """The CPU dense backends that can run a model of ``shapes`` in ``dtype``, by label
    (:attr:`~kv8.layers.dense_backend.DenseBackend.label`): ``packed_bf16`` where kv8's kernels load (bf16 models),
    and ``packed_bf16+f32_from_<WIDE_ROWS>`` (the same kernels, long chunks in float32: bf16 weights widened, FP8
    codes decoded times their scales), with FP8 weights on the vdpbf16ps path (no AMX) each also with the codes
    decoded into a buffer from :data:`FP8_SHORT_REGISTER_ROWS` + 1 rows (``+fp8_buffer_from_17``); ``torch``; and
    ``torch_fp32`` for 16-bit models while its float32 weights take at most half of the free memory.
    ``quantization="gguf"``: where the kernels load (bf16) and some decoder shape has a block type they read
    (:attr:`LinearShape.qtype`; the shapes :func:`tuning_groups` times, type by type),
    ``packed_bf16+f32_from_<GGUF_DEQUANTIZE_ROWS>`` (the blocks dequantized for the float32 GEMM from that many rows)
    ``packed_bf16`` (the int8 kernel at every row count) and ``packed_bf16+bf16_from_<GGUF_BF16_ROWS>`` (the blocks
    dequantized into the packed kernel's bf16 layout and multiplied by it from that many rows: AMX tiles where the CPU
    has them, else ``vdpbf16ps`` or the AVX2 path); else one candidate, not timed (the fixed rule: the first, or
    ``torch``, the GGUF reference)."""
    found: list[DenseBackend] = []
    if quantization == "gguf":
        fixed = select_dense_backend("auto", dtype, quantization)
        kernels = fixed.kernels
        if kernels is None or not _gguf_switched(shapes, kernels.gguf_types):
            return {fixed.label: fixed}
        found = [DenseBackend("packed_bf16", kernels, quantization, wide_rows=GGUF_DEQUANTIZE_ROWS),
                 DenseBackend("packed_bf16", kernels, quantization),
                 DenseBackend("packed_bf16", kernels, quantization, wide_rows=GGUF_BF16_ROWS, gguf_expand="bf16")]
        return {backend.label: backend for backend in found}
    if dtype == torch.bfloat16:
        try:
            kernels = load_dense_kernels()
        except KernelUnavailable:
            pass
        else:
            found.append(DenseBackend("packed_bf16", kernels, quantization))
            found.append(DenseBackend("packed_bf16", kernels, quantization, wide_rows=WIDE_ROWS))
            if quantization == "fp8" and kernels.isa == "avx512" and not kernels.amx:
                # FP8 codes decoded into a buffer from FP8_SHORT_REGISTER_ROWS + 1 rows (vdpbf16ps: the same bits)
                found += [replace(b, fp8_register_rows=FP8_SHORT_REGISTER_ROWS) for b in found[-2:]]
    found.append(DenseBackend("torch", None, quantization))
    if dtype in (torch.bfloat16, torch.float16):
        fp32_bytes = sum(4 * s.out_features * s.in_features * s.count for s in shapes)
        free = memory_available()
        if free is None or 2 * fp32_bytes <= free:
            found.append(DenseBackend("torch_fp32", None, quantization))
    return {backend.label: backend for backend in found}


def _gguf_switched(shapes: Sequence[LinearShape], kernel_types: Collection[str]) -> list[LinearShape]:
    """The shapes whose speed ``quantization="gguf"``'s switch decides: the decoder's blocks of a type the kernels read
    (not the LM head, whose switch is fixed; not a type the kernels do not read, multiplied the same at every row
    count)."""
    return [s for s in shapes if s.quantize and not s.lm_head and s.qtype in kernel_types]


def tuning_groups(shapes: Sequence[LinearShape], found: dict[str, DenseBackend]) -> dict[str | None, list[LinearShape]]:
    """The shapes timed together and given one choice, among the candidates ``found``: by block type
    (``quantization="gguf"`` with kv8's kernels: each type they read, sorted, its shapes :func:`_gguf_switched`), or
    under None, every shape (one choice for the model)."""
    first = next(iter(found.values()))
    if first.quantization != "gguf" or first.kernels is None:
        return {None: list(shapes)}
    groups: dict[str | None, list[LinearShape]] = {}
    for shape in sorted(_gguf_switched(shapes, first.kernels.gguf_types), key=lambda s: s.qtype or ""):
        groups.setdefault(shape.qtype, []).append(shape)
    return groups


def _tuned_result(found: dict[str, DenseBackend], shapes: Sequence[LinearShape], dtype: torch.dtype,
                  quantization: str | None, store: PlanStore, measure: Measure | None, retune: bool, what: str
                  ) -> TuneResult:
    """The plan for ``shapes`` (one group of :func:`tuning_groups`; ``what`` names it in the log): the store's, or
    timed now and kept where there is none, it timed other candidates, it is provisional, or ``retune``."""
    key = plan_key(shapes, dtype, quantization)
    timed = candidate_ids(found)
    result = None if retune else store.get(key)
    if result is not None and result.timed != timed:
        logger.warning("this machine's dense-layer plan for %s timed %s; the candidates now are %s: timing again",
                       what, ", ".join(result.timed) or "an older set", ", ".join(timed))
        result = None
    if result is not None and result.provisional:
        logger.warning("this machine's dense-layer plan for %s was timed beside other work (other processes took "
                       "%.2f cores): timing again", what, result.others)
    if result is None or result.choice not in found or result.provisional:   # (not a candidate: a damaged entry)
        start = time.perf_counter()
        logger.warning("timing the dense layers' methods on %s (%s) on this machine: once, then kept in %s",
                       what, ", ".join(found), store.path)
        cpus = this_process_cpus()
        before = read_cpu_clock(cpus)
        fresh = replace(choose(found, shapes, dtype, measure), timed=timed)
        after = read_cpu_clock(cpus)
        if before is not None and after is not None:
            fresh = replace(fresh, others=others_cores(before, after))
        if result is None or result.choice not in found or fresh.others <= result.others:
            result = fresh   # (of two timings beside other work, the quieter one is kept)
            store.put(key, result)
        busy = (f"; beside other work (other processes took {fresh.others:.2f} cores): provisional, timed again at "
                "the next start") if fresh.provisional else ""
        versus = result.compared_with
        logger.warning("dense backend %s for %s: %.1fx %s at 1 row, %.1fx at %d rows, %.1fx at %d (timed in %.1f s%s)",
                       result.choice, what, result.speedup(versus, 1), versus, result.speedup(versus, PREFILL_ROWS),
                       PREFILL_ROWS, result.speedup(versus, WIDE_ROWS), WIDE_ROWS,
                       time.perf_counter() - start, busy)
    return result


def tuned_dense_backend(shapes: Sequence[LinearShape], dtype: torch.dtype, quantization: str | None,
                        store: PlanStore | None = None, measure: Measure | None = None, retune: bool = False
                        ) -> tuple[DenseBackend, dict[str | None, TuneResult]]:
    """``dense_backend="auto"`` on the CPU: the plans' choice for this model on this machine, timed now (and kept)
    where there is none or ``retune``. Returns the backend and the plans by group (:func:`tuning_groups`: None, the
    whole model; with ``quantization="gguf"``, each block type), empty when only one candidate exists. With
    ``quantization="gguf"`` the backend switches each type at its own plan's choice (``gguf_wide_rows``), or is that
    candidate itself where every type chose the same."""
    found = candidates(shapes, dtype, quantization)
    if len(found) == 1:
        return next(iter(found.values())), {}
    store = store if store is not None else PlanStore()
    results = {group: _tuned_result(found, members, dtype, quantization, store, measure, retune,
                                    "this model's shapes" if group is None else f"this model's {group} layers")
               for group, members in tuning_groups(shapes, found).items()}
    chosen = {result.choice for result in results.values()}
    if len(chosen) == 1:
        return found[chosen.pop()], results
    first = next(iter(found.values()))
    by_type = tuple((str(group), found[result.choice].wide_rows) for group, result in results.items())
    bf16 = tuple(str(group) for group, result in results.items() if found[result.choice].gguf_expand == "bf16")
    return DenseBackend(first.name, first.kernels, quantization, gguf_wide_rows=by_type, gguf_bf16=bf16), results


def static_dense_backend(dtype: torch.dtype, quantization: str | None) -> DenseBackend:
    """``dense_backend="auto"`` without timing (``KV8_TUNING=off``, tensor-parallel ranks): the fixed rule."""
    return select_dense_backend("auto", dtype, quantization)


# ---- the GGUF int8 kernel's path per block type -------------------------------------------------------------------

GGUF_PATH_MIN_GAIN = 0.03   # how much faster than the kernels' default path another must be to be chosen
#: ``measure(path, shape, rows)``: seconds of one int8-kernel call of a layer of ``shape`` on ``path`` at ``rows`` rows
PathMeasure = Callable[[str, LinearShape, int], float]


@dataclass(frozen=True)
class PathResult:
    """The int8 kernel's path chosen for the one-row calls of one group of :func:`gguf_path_groups` (a block type's
    decoder layers, or the LM head): ``seconds[path][1]``, one pass over the group's layers at one row on that
    path."""

    group: str
    choice: str
    default: str
    seconds: dict[str, dict[int, float]]
    measured: str = ""
    timed: tuple[str, ...] = ()   # the kernels' build and the paths timed
    others: float = 0.0

    @property
    def provisional(self) -> bool:
        return self.others > BUSY_CORES

    def speedup(self, rows: int) -> float:
        """The default path's time over the choice's at ``rows`` rows."""
        return self.seconds[self.default][rows] / self.seconds[self.choice][rows]

    def table(self) -> str:
        rows = sorted({r for per in self.seconds.values() for r in per})
        heads = (f"{r} row" + ("s" if r > 1 else "") + " (ms)" for r in rows)
        lines = [f"{self.group + ' path':<18}" + "".join(f"{h:>16}" for h in heads)]
        for path, per in self.seconds.items():
            mark = "  <- chosen" if path == self.choice else ("  (default)" if path == self.default else "")
            lines.append(f"{path:<18}" + "".join(f"{per[r] * 1e3:>16.3f}" for r in rows) + mark)
        return "\n".join(lines)


HEAD_GROUP = "lm_head"   # gguf_path_groups' name for the LM head (its own method: its own path)


def gguf_path_groups(shapes: Sequence[LinearShape], kernel_types: Collection[str]) -> dict[str, list[LinearShape]]:
    """The shapes held as blocks of a type the int8 kernel reads, in the groups that get a path each: the decoder's
    by type (sorted), and the LM head's alone (:data:`HEAD_GROUP`: a large matrix read at one row a sequence, whose
    best path may differ from its type's layers')."""
    groups: dict[str, list[LinearShape]] = {}
    for shape in sorted(shapes, key=lambda s: s.qtype or ""):
        if shape.qtype is not None and shape.qtype in kernel_types and (shape.quantize or shape.lm_head):
            groups.setdefault(HEAD_GROUP if shape.lm_head else shape.qtype, []).append(shape)
    return dict(sorted(groups.items(), key=lambda item: item[0] == HEAD_GROUP))


#: bytes read between two timed calls of the int8 kernel, so that each call reads its blocks from memory as a decode
#: step does (each layer's blocks once a step, the whole model between two reads) -- more than a CPU's last-level cache
PATH_EVICT_BYTES = 128 << 20
PATH_CALLS = 5   # timed calls of a layer per measurement (the fastest counts)


class _PathTimer:
    """One int8-kernel call of a layer of each shape (random blocks in the kernel's order, built once) on a path, its
    blocks out of the caches: :data:`PATH_EVICT_BYTES` are read before each timed call. Timed warm (the same blocks
    call after call) the widest path won every Gemma-3-270M layer on an AMD EPYC (Zen 5), while a decode step of one
    sequence with every call on ``vnni256`` ran 1.27x the step on ``vnni512`` (``bench_engine_step.py --gguf-paths``)
    and, timed cold, the narrower paths won every group at one row."""

    def __init__(self, kernels: DenseKernels) -> None:
        self.kernels = kernels
        self.blocks: dict[LinearShape, torch.Tensor] = {}
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.evict = torch.ones(PATH_EVICT_BYTES // 4, dtype=torch.float32)

    def measure(self, path: str, shape: LinearShape, rows: int) -> float:
        blocks = self.blocks.get(shape)
        if blocks is None:
            weight = random_blocks(shape.qtype or "", shape.out_features, shape.in_features,
                                   torch.Generator().manual_seed(0))
            blocks = self.blocks[shape] = gguf_segment([weight], shape.in_features, self.kernels).blocks
        x = self.inputs.get((shape.in_features, rows))
        if x is None:
            x = self.inputs[(shape.in_features, rows)] = torch.randn(
                rows, shape.in_features, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
        best = float("inf")
        for _ in range(PATH_CALLS):
            self.evict.sum()
            start = time.perf_counter()
            self.kernels.gguf_linear(x, blocks, shape.qtype or "", shape.out_features, None, path)
            best = min(best, time.perf_counter() - start)
        return best


def choose_gguf_path(paths: Sequence[str], default: str, members: Sequence[LinearShape], measure: PathMeasure,
                     rounds: int = TUNE_ROUNDS, min_gain: float = GGUF_PATH_MIN_GAIN
                     ) -> tuple[str, dict[str, dict[int, float]]]:
    """Time every path on ``members`` at one row in ``rounds`` rounds, the paths in a rotated order, each keeping its
    fastest time per shape; the fastest pass over the layers wins where it is ``min_gain`` below ``default``'s (else
    ``default``). Returns the choice and each path's pass (``{1: seconds}``)."""
    if rounds < 1:
        raise ValueError(f"rounds={rounds} must be >= 1")
    names = list(dict.fromkeys([default, *paths]))
    fastest: dict[tuple[str, int], float] = {}
    for round_ in range(rounds):
        order = names[round_ % len(names):] + names[:round_ % len(names)]
        for i, shape in enumerate(members):
            for path in order:
                fastest[(path, i)] = min(fastest.get((path, i), float("inf")), measure(path, shape, 1))
    seconds = {path: {1: sum(s.count * fastest[(path, i)] for i, s in enumerate(members))} for path in names}
    best = min(names, key=lambda path: seconds[path][1])
    return (best if seconds[best][1] <= seconds[default][1] * (1 - min_gain) else default), seconds


def tuned_gguf_paths(backend: DenseBackend, shapes: Sequence[LinearShape], dtype: torch.dtype,
                     store: PlanStore | None = None, measure: PathMeasure | None = None, retune: bool = False
                     ) -> tuple[DenseBackend, dict[str, PathResult]]:
    """With ``quantization="gguf"`` on kv8's kernels: the int8 kernel's path for one-row calls (a decode step of one
    sequence) of each group of :func:`gguf_path_groups` (the decoder's layers by block type, the LM head), this
    machine's plan or timed now and kept; ``backend`` with ``gguf_kernel_paths`` / ``gguf_head_path`` set where a
    group's choice is not the kernels' default. Calls of more rows keep the default (the widest path: at 64 rows it
    led every Gemma-3-270M layer type 1.2-2x on an AMD EPYC Zen 5, where at one row, its blocks read from memory, it
    trailed ``avx2`` 1.04-1.36x). Unchanged (and no results) elsewhere: another quantization, no kernels, one path,
    or ``$KV8_GGUF_KERNEL`` naming one (the user's choice)."""
    kernels = backend.kernels
    if backend.quantization != "gguf" or kernels is None or len(kernels.gguf_paths) < 2 or envs.gguf_kernel():
        return backend, {}
    store = store if store is not None else PlanStore()
    paths, default = list(kernels.gguf_paths), kernels.gguf_path
    timed = (Path(kernels.path).stem, *paths)
    timer = _PathTimer(kernels) if measure is None else None
    run = measure if measure is not None else timer.measure   # type: ignore[union-attr]
    results: dict[str, PathResult] = {}
    for group, members in gguf_path_groups(shapes, kernels.gguf_types).items():
        key = "gguf_path/" + plan_key(members, dtype, "gguf")
        kept = None if retune else _stored_path(store.entry(key), group, timed, default)
        if kept is not None and not kept.provisional:
            results[group] = kept
            continue
        start = time.perf_counter()
        logger.warning("timing the GGUF int8 kernel's paths (%s) on this model's %s on this machine: once, then kept "
                       "in %s", ", ".join(paths), _group_words(group, members), store.path)
        cpus = this_process_cpus()
        before = read_cpu_clock(cpus)
        choice, seconds = choose_gguf_path(paths, default, members, run)
        after = read_cpu_clock(cpus)
        others = others_cores(before, after) if before is not None and after is not None else 0.0
        fresh = PathResult(group, choice, default, seconds, time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                           timed, others)
        if kept is None or fresh.others <= kept.others:
            store.keep(key, {"path": fresh.choice, "default": fresh.default, "measured": fresh.measured,
                             "timed": list(fresh.timed), "others": round(fresh.others, 3),
                             "seconds": {p: {str(r): t for r, t in per.items()} for p, per in fresh.seconds.items()}})
            kept = fresh
        results[group] = kept
        logger.warning("GGUF int8 kernel on the %s: its %s path, %.2fx the default %s at 1 row (timed in %.1f s)",
                       _group_words(group, members), kept.choice, kept.speedup(1), default,
                       time.perf_counter() - start)
    del timer
    chosen = tuple((group, result.choice) for group, result in results.items()
                   if group != HEAD_GROUP and result.choice != default)
    head = results.get(HEAD_GROUP)
    return replace(backend, gguf_kernel_paths=chosen,
                   gguf_head_path=head.choice if head is not None and head.choice != default else ""), results


def _group_words(group: str, members: Sequence[LinearShape]) -> str:
    return f"LM head ({members[0].qtype} blocks)" if group == HEAD_GROUP else f"{group} layers"


def stored_gguf_path(store: PlanStore, members: Sequence[LinearShape], dtype: torch.dtype, group: str,
                     kernels: DenseKernels) -> PathResult | None:
    """The path kept for the layers ``members`` (group ``group`` of :func:`gguf_path_groups`) on this build of the
    kernels, or None."""
    timed = (Path(kernels.path).stem, *kernels.gguf_paths)
    return _stored_path(store.entry("gguf_path/" + plan_key(members, dtype, "gguf")), group, timed, kernels.gguf_path)


def _stored_path(entry: Any, group: str, timed: tuple[str, ...], default: str) -> PathResult | None:
    """The kept entry as a result where it was timed on the same build and paths and names one of them."""
    try:
        result = PathResult(group, str(entry["path"]), str(entry["default"]),
                            {str(p): {int(r): float(t) for r, t in per.items()} for p, per in entry["seconds"].items()},
                            str(entry["measured"]), tuple(str(t) for t in entry["timed"]),
                            float(entry.get("others", 0.0)))
    except (TypeError, KeyError, ValueError, AttributeError):
        return None
    if result.timed != timed or result.default != default or result.choice not in timed[1:]:
        return None
    return result
