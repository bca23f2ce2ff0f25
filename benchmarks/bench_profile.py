"""Where the time of one engine step goes, per op family (issue 38, item 1).

For each kv8 configuration (engine flags, ``--config``, repeatable; default: bf16 cache, FP8 cache, FP8 cache
with FP8 weights) on the default model (SmolLM2-135M), three steps are timed and split by op family:

* a prefill step: 1 sequence x 1,024 new tokens (a fresh prompt: no prefix-cache hit);
* a decode step of B = 1 and of B = 32 sequences at ~1,024 tokens of context.

Families (wall-clock time, ms):

* ``linear``: the decoder's linear layers (``LinearBase``: qkv, o, gate_up, down projections);
* ``attention``: ``PagedAttention`` (storing the new K/V in the paged cache and attending over it);
* ``norm``: ``RMSNorm`` (with its fused residual add); ``rope``: the rotary module and the step's cos/sin
  (``RotaryEmbedding.angles``); ``activation``: ``SiluAndMul`` / ``GeluAndMul``;
  ``embedding``: ``VocabParallelEmbedding``;
* ``lm_head``: the model's ``compute_logits`` (``ParallelLMHead``'s matmul and the cast of the logits to
  float32), apart from the decoder's linears;
* ``sampling``: the sampler (``kv8.engine.sampler.sample`` as the runner calls it);
* ``rest``: the step less all the above: Python around the modules, scheduling, attention metadata, the input
  tensors, the logits' finiteness check, output processing (detokenizing).

How: forward pre/post hooks on every module of those classes (and wrappers of ``angles``, ``compute_logits`` and
the runner's ``sample``) read ``time.perf_counter``; the CPU runs ops synchronously, so a module's wall time is its
ops' time. Each family gets its *self* time: while a timed module runs inside another (``SiluAndMul`` inside
``GateUpLinear``'s torch method, ``ParallelLMHead`` inside ``compute_logits``) the outer one's clock stops, so
nothing is counted twice (the outermost call alone would hide the activation inside the linears) and the
families sum to at most the step.

The hooks cost time (torch's slower call path for a module with hooks, and two Python calls, around each of ~280
modules a step). Their cost per call is calibrated each round on a module that does nothing (the part the
family's clock sees and the part outside it), and taken out: each family loses its calls' share, ``rest`` is the
hooked step less the families and the hooks' whole cost, and ``step`` = families + rest is the step without
hooks. To check that, each step is also run without hooks (alternating with the hooked ones): ``plain`` is that
step as measured and ``hooks`` = hooked - plain, the hooks' cost as the same-step comparison sees it. The
calibration is a lower bound (a hot loop; in a step the same Python runs from caches that large ops have
flushed): where ``hooks`` is consistently above the calibrated cost, the difference is still in the families
and ``rest`` (a few ms at decode B = 1 on a slow VM; it vanishes in the larger steps). ``hooks`` is noisy on a
busy machine (it can come out negative); the calibration is not, which is why it is the one taken out.

Rounds alternate over the configurations (the order rotated each round so that none gains from its position)
and each cell is the median over the rounds, with the spread (min-max over rounds) under it. Within a round a
decode step is the median of ``--decode-steps`` hooked steps (its families are that step's) and of as many
plain steps, interleaved; a prefill step is one hooked and one plain prefill. The decode batches' prompts are the
same each round (re-added, found in the prefix cache, the last block recomputed); the prefill's prompt is new.
When it is built, each engine is warmed up by one prefill and prefills its decode prompts once (33 x 1,024 tokens:
most of the run's time on a small CPU, ~4 minutes per configuration on 2 Zen 3 cores; a round takes ~1.5). The
tool checks that each timed step ran the whole prefill or decode batch. ``--threads`` sets torch's threads; the
engines' thread governor (``adaptive_cpu_threads``) may lower them while other processes keep cores busy. The
engines run eagerly (``enforce_eager``): a decode step replayed from a CPU graph (kv8.kernels.cpu.graph) calls no
module to hook; what the graph saves is Python counted here in the families' calls and in ``rest``.

    .venv/bin/python benchmarks/bench_profile.py                               # the three configurations, 3 rounds
    .venv/bin/python benchmarks/bench_profile.py --quick --rounds 1 --config "--kv-cache-dtype fp8_e4m3"
    .venv/bin/python benchmarks/bench_profile.py --config "--kv-cache-dtype fp8_e4m3 --dense-backend torch" \\
        --rounds 5 --json profile.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from engine_steps import time_prefill_step, until_first_tokens

import kv8.engine.runner as runner_module
from kv8 import LLM, SamplingParams
from kv8.engine.args import DEFAULT_MODEL, EngineArgs
from kv8.engine.engine import LLMEngine
from kv8.layers.activation import GeluAndMul, SiluAndMul
from kv8.layers.attention import PagedAttention
from kv8.layers.linear import LinearBase
from kv8.layers.norm import GemmaRMSNorm, RMSNorm
from kv8.layers.rotary import RotaryEmbedding
from kv8.layers.vocab_parallel import ParallelLMHead, VocabParallelEmbedding

FAMILIES = ("linear", "attention", "norm", "rope", "activation", "embedding", "lm_head", "sampling")
COLUMNS = (*FAMILIES, "rest", "step", "plain", "hooks")   # a table's columns, in ms
DEFAULT_CONFIGS = ("--kv-cache-dtype bfloat16", "--kv-cache-dtype fp8_e4m3",
                   "--kv-cache-dtype fp8_e4m3 --quantization fp8")
# module classes -> family; the first match wins (ParallelLMHead is a LinearBase)
MODULE_FAMILIES: tuple[tuple[type | tuple[type, ...], str], ...] = (
    (ParallelLMHead, "lm_head"),
    (LinearBase, "linear"),
    (PagedAttention, "attention"),
    ((RMSNorm, GemmaRMSNorm), "norm"),
    (RotaryEmbedding, "rope"),
    ((SiluAndMul, GeluAndMul), "activation"),
    (VocabParallelEmbedding, "embedding"),
)
VOCAB_LOW, VOCAB_HIGH = 100, 40000   # random prompt tokens: ordinary ids of SmolLM2's vocabulary
WARMUP_DECODE_STEPS = 2
# decode tokens a sequence may generate beyond the measured steps: its first tokens while the other prompts of its
# batch are still being prefilled, when they are not in the prefix cache
DECODE_SLACK = 64


def family_of(module: torch.nn.Module) -> str | None:
    for cls, family in MODULE_FAMILIES:
        if isinstance(module, cls):
            return family
    return None


class FamilyTimer:
    """Self time per family: a stack of the timed calls in progress; entering a call stops the clock of the one
    it runs inside (its family is credited up to now), leaving it restarts that clock. Also counts the calls per
    family and the calls made inside each family's calls (whose hooks' dispatch that family's clock saw)."""

    def __init__(self) -> None:
        self._stack: list[list[Any]] = []   # [family, start of its current segment]
        self.reset()

    def reset(self) -> None:
        if self._stack:
            raise RuntimeError(f"timed calls still open: {[f for f, _ in self._stack]}")
        self.seconds = dict.fromkeys(FAMILIES, 0.0)
        self.calls = dict.fromkeys(FAMILIES, 0)
        self.nested = dict.fromkeys(FAMILIES, 0)

    def enter(self, family: str) -> None:
        now = time.perf_counter()
        if self._stack:
            top = self._stack[-1]
            self.seconds[top[0]] += now - top[1]
            self.nested[top[0]] += 1
        self._stack.append([family, now])

    def leave(self) -> None:
        now = time.perf_counter()
        family, start = self._stack.pop()
        self.seconds[family] += now - start
        self.calls[family] += 1
        if self._stack:
            self._stack[-1][1] = now

    def wrap(self, family: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            self.enter(family)
            try:
                return fn(*args, **kwargs)
            finally:
                self.leave()
        return timed

    def add_hooks(self, module: torch.nn.Module, family: str) -> list[Any]:
        """Time ``module``'s calls as ``family``; returns the hooks' handles."""
        return [module.register_forward_pre_hook(lambda m, a: self.enter(family)),
                module.register_forward_hook(lambda m, a, o: self.leave(), always_call=True)]

    def snapshot(self) -> Timed:
        return Timed(dict(self.seconds), dict(self.calls), dict(self.nested))


@dataclass(frozen=True)
class Timed:
    """What a :class:`FamilyTimer` saw in one step: self seconds, calls and calls nested inside, per family."""

    seconds: dict[str, float]
    calls: dict[str, int]
    nested: dict[str, int]


@contextlib.contextmanager
def hooked(eng: LLMEngine, timer: FamilyTimer) -> Iterator[FamilyTimer]:
    """While inside: ``timer`` times the engine's op families (see the module docstring); nothing of it is left
    on the engine afterwards."""
    model, handles = eng.model, []
    wrapped: list[tuple[object, str]] = []   # (object, attribute) given an instance attribute here
    sample = runner_module.sample
    try:
        for module in model.modules():
            family = family_of(module)
            if family is None:
                continue
            handles += timer.add_hooks(module, family)
            if isinstance(module, RotaryEmbedding):   # the step's cos/sin, computed once per forward
                module.angles = timer.wrap("rope", module.angles)   # type: ignore[method-assign]
                wrapped.append((module, "angles"))
        model.compute_logits = timer.wrap("lm_head", model.compute_logits)   # type: ignore[method-assign]
        wrapped.append((model, "compute_logits"))
        runner_module.sample = timer.wrap("sampling", sample)   # the name ModelRunner.execute calls
        yield timer
    finally:
        runner_module.sample = sample
        for h in handles:
            h.remove()
        for obj, attr in wrapped:
            delattr(obj, attr)   # the class's method shows through again


class _Noop(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@dataclass(frozen=True)
class HookCost:
    """Seconds the hooks add to one timed call: ``inside`` its family's clock, ``outside`` it."""

    inside: float
    outside: float


def calibrate(calls: int = 2000, repeats: int = 7) -> HookCost:
    """The hooks' cost per call, from a module that does nothing, called ``calls`` times with and without them
    (the fastest of ``repeats`` runs each, in inference mode as the model runs): what the family clock reads per
    call is inside, the rest of the difference outside. A lower bound: in a step, between large ops, the same
    Python runs from colder caches."""
    module, x, timer = _Noop(), torch.zeros(1), FamilyTimer()

    def run() -> float:
        start = time.perf_counter()
        for _ in range(calls):
            module(x)
        return (time.perf_counter() - start) / calls

    with torch.inference_mode():
        plain = min(run() for _ in range(repeats))
        handles = timer.add_hooks(module, FAMILIES[0])
        try:
            with_hooks, inside = [], []
            for _ in range(repeats):
                timer.reset()
                with_hooks.append(run())
                inside.append(timer.seconds[FAMILIES[0]] / calls)
        finally:
            for h in handles:
                h.remove()
    return HookCost(min(inside), max(0.0, min(with_hooks) - plain - min(inside)))


# ---- measuring ------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shapes:
    prefill: int                 # tokens of the prefill step's one prompt
    context: int                 # prompt tokens of the decode batches
    batches: tuple[int, ...]     # decode batch sizes
    decode_steps: int            # hooked (and as many plain) decode steps per round

    def kinds(self) -> list[str]:
        return [f"prefill 1 x {self.prefill}"] + [f"decode B={b} @ {self.context}" for b in self.batches]


@dataclass(frozen=True)
class Sample:
    """One step kind of one configuration in one round."""

    timed: Timed        # the hooked step's families
    step: float         # seconds of the hooked step
    plain: float        # seconds of the same step without hooks
    cost: HookCost      # the hooks' cost per call, calibrated in this round
    threads: int        # torch threads after the step (the engine's governor may change them)

    @property
    def calls(self) -> int:
        return sum(self.timed.calls.values())

    def row(self) -> dict[str, float]:
        """The table's columns (ms): each family's self time without its hooks' cost; rest = the hooked step less
        the families and all the hooks' cost; step = families + rest (the step, hooks taken out); plain (measured
        without hooks); hooks = hooked - plain (measured)."""
        t, c = self.timed, self.cost
        fams = {f: (t.seconds[f] - t.calls[f] * c.inside - t.nested[f] * c.outside) * 1e3 for f in FAMILIES}
        overhead = self.calls * (c.inside + c.outside) * 1e3
        rest = self.step * 1e3 - sum(fams.values()) - overhead
        return {**fams, "rest": rest, "step": sum(fams.values()) + rest, "plain": self.plain * 1e3,
                "hooks": (self.step - self.plain) * 1e3}

    def overhead_ms(self) -> float:
        """The hooks' calibrated cost in this step."""
        return self.calls * (self.cost.inside + self.cost.outside) * 1e3


@dataclass
class Engine:
    """One configuration's engine and its fixed decode prompts."""

    flags: str
    label: str
    eng: LLMEngine
    decode_prompts: dict[int, list[list[int]]]
    dense_backend: str
    attention_backend: str
    samples: dict[str, list[Sample]] = field(default_factory=dict)


def label_of(flags: str) -> str:
    """A row's name: its flags, the cache dtype's value first and without its flag."""
    return " ".join(flags.replace("--kv-cache-dtype ", "", 1).split())


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(n)]


def build(flags: str, options: dict[str, Any], shapes: Shapes, rounds: int, seed: int) -> Engine:
    """The configuration's engine, warmed up by one prefill of the measured length, its decode prompts prefilled
    once (so that each round finds them in the prefix cache and its decode batch starts in one step)."""
    rng = random.Random(seed)
    max_len = max(shapes.prefill, shapes.context + DECODE_SLACK + WARMUP_DECODE_STEPS + 2 * shapes.decode_steps) + 16
    blocks_per_seq = -(-max_len // 16) + 1
    # room for every decode prompt to stay in the prefix cache beside each round's fresh prefill prompts
    num_blocks = blocks_per_seq * (sum(shapes.batches) + 2 * rounds + 4)
    # eager: a decode step replayed from a CPU graph calls no module to hook (what the graph saves is in `rest`)
    engine_options = {"max_model_len": max_len, "num_kv_blocks": num_blocks,
                      "max_num_seqs": max(64, *shapes.batches), "enforce_eager": True, **options}
    eng = LLM(**engine_options).engine
    time_prefill_step(eng, lambda: random_prompt(rng, shapes.prefill), iter([-1]), prompts=1)   # request p-1
    prompts = {b: [random_prompt(rng, shapes.context) for _ in range(b)] for b in shapes.batches}
    once = SamplingParams(temperature=0, max_tokens=1)
    for b, batch in prompts.items():
        for i, p in enumerate(batch):
            eng.add_request(p, once, request_id=f"w{b}-{i}")
    while eng.has_unfinished_requests():
        eng.step()
    return Engine(flags, label_of(flags), eng, prompts, str(eng.dense_backend), eng.backend.name)


def measure_prefill(e: Engine, shapes: Shapes, rng: random.Random, ids: Iterator[int], hooked_first: bool,
                    cost: HookCost) -> Sample:
    timer = FamilyTimer()
    prompt = lambda: random_prompt(rng, shapes.prefill)   # noqa: E731
    step, plain, timed = 0.0, 0.0, timer.snapshot()
    for with_hooks in (hooked_first, not hooked_first):
        if with_hooks:
            with hooked(e.eng, timer):
                timer.reset()   # add_request runs no module: the timer sees the step only
                step = time_prefill_step(e.eng, prompt, ids, prompts=1)
            timed = timer.snapshot()
        else:
            plain = time_prefill_step(e.eng, prompt, ids, prompts=1)
        # the prompt must be prefilled (and its token sampled) in the one step timed: no later step ran
        check_step(e, "a prefill", e.eng.stats().last_step_prefill_tokens, shapes.prefill)
    return Sample(timed, step, plain, cost, torch.get_num_threads())


def check_step(e: Engine, what: str, tokens: int, expected: int) -> None:
    if tokens != expected:
        raise SystemExit(f"{e.label}: {what} step ran {tokens} tokens, not {expected}: the configuration's limits "
                         "(--max-num-batched-tokens, --max-num-seqs, --no-enable-prefix-caching) split the batch")


def measure_decode(e: Engine, batch: int, shapes: Shapes, ids: Iterator[int], hooked_first: bool,
                   cost: HookCost) -> Sample:
    eng, timer = e.eng, FamilyTimer()
    params = SamplingParams(temperature=0, max_tokens=eng.config.scheduler.max_model_len - shapes.context,
                            ignore_eos=True)
    rids = [eng.add_request(p, params, request_id=f"d{next(ids)}") for p in e.decode_prompts[batch]]
    try:
        until_first_tokens(eng, rids)   # the prompts (mostly prefix-cache hits after the first round)
        for _ in range(WARMUP_DECODE_STEPS):
            eng.step()
        with_hooks: list[tuple[float, Timed]] = []
        plain: list[float] = []
        for i in range(2 * shapes.decode_steps):
            if (i % 2 == 0) == hooked_first:
                with hooked(eng, timer):
                    timer.reset()
                    start = time.perf_counter()
                    eng.step()
                    elapsed = time.perf_counter() - start
                with_hooks.append((elapsed, timer.snapshot()))
            else:
                start = time.perf_counter()
                eng.step()
                plain.append(time.perf_counter() - start)
            check_step(e, f"a B={batch} decode", eng.stats().last_step_decode_tokens, batch)
        threads = torch.get_num_threads()
    finally:
        for rid in rids:
            eng.abort_request(rid)
    step, timed = sorted(with_hooks, key=lambda s: s[0])[(len(with_hooks) - 1) // 2]   # the median hooked step
    return Sample(timed, step, statistics.median(plain), cost, threads)


def measure_round(engines: list[Engine], shapes: Shapes, r: int, rng: random.Random, ids: Iterator[int]) -> None:
    cost = calibrate()
    order = engines[r % len(engines):] + engines[:r % len(engines)]
    kinds = shapes.kinds()
    for i, e in enumerate(order):
        hooked_first = (r + i) % 2 == 0
        e.samples.setdefault(kinds[0], []).append(measure_prefill(e, shapes, rng, ids, hooked_first, cost))
        for kind, batch in zip(kinds[1:], shapes.batches):
            e.samples.setdefault(kind, []).append(measure_decode(e, batch, shapes, ids, hooked_first, cost))


# ---- reporting ------------------------------------------------------------------------------------------------------

def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def kv8_commit() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return rev + (" (with uncommitted changes)" if dirty else "")


def summarize(samples: list[Sample]) -> dict[str, dict[str, float]]:
    """Per column: median, min and max over the rounds (ms)."""
    rows = [s.row() for s in samples]
    return {c: {"median": statistics.median(r[c] for r in rows), "min": min(r[c] for r in rows),
                "max": max(r[c] for r in rows)} for c in COLUMNS}


def shares(samples: list[Sample]) -> dict[str, float]:
    """Per family and rest: the median over the rounds of its share of the step (%)."""
    rows = [s.row() for s in samples]
    return {c: statistics.median(100 * r[c] / r["step"] for r in rows) for c in (*FAMILIES, "rest")}


def print_table(header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, *rows]:
        print(f"{r[0]:<{widths[0]}}" + "".join(f"  {cell:>{w}}" for cell, w in zip(r[1:], widths[1:])))


def print_tables(engines: list[Engine], shapes: Shapes, rounds: int) -> None:
    for kind in shapes.kinds():
        print(f"\n{kind}: ms per step, median of {rounds} round(s), min-max over the rounds under it")
        rows = []
        for e in engines:
            s = summarize(e.samples[kind])
            rows.append([e.label] + [f"{s[c]['median']:.2f}" for c in COLUMNS])
            if rounds > 1:
                rows.append([""] + [f"{s[c]['min']:.1f}-{s[c]['max']:.1f}" for c in COLUMNS])
        print_table(["configuration", *COLUMNS], rows)
        print("share of the step (%, median over the rounds)")
        print_table(["configuration", *FAMILIES, "rest"],
                    [[e.label] + [f"{v:.1f}" for v in shares(e.samples[kind]).values()] for e in engines])
        overhead = [s.overhead_ms() for e in engines for s in e.samples[kind]]
        calls = sorted({s.calls for e in engines for s in e.samples[kind]})
        measured = statistics.median(summarize(e.samples[kind])["hooks"]["median"] for e in engines)
        print(f"hooks: {'/'.join(map(str, calls))} timed calls a step; calibrated cost {min(overhead):.2f}-"
              f"{max(overhead):.2f} ms a step (a lower bound, taken out of the families and rest); measured "
              f"(hooked - plain, noisy) {measured:.2f} ms (median of the 'hooks' column)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", action="append", default=None, metavar='"ENGINE FLAGS"',
                    help="a configuration as engine flags, e.g. \"--kv-cache-dtype fp8_e4m3 --quantization fp8\" "
                         "(repeatable; any engine flag; default: " + "; ".join(DEFAULT_CONFIGS) + ")")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (default 3)")
    ap.add_argument("--decode-steps", type=int, default=None,
                    help="hooked (and as many plain) decode steps per round and batch (default 5; --quick 2)")
    ap.add_argument("--quick", action="store_true",
                    help="small shapes for a smoke test: 128-token prefill, B = 1 and 4 decode at 64 tokens, "
                         "2 decode steps")
    ap.add_argument("--threads", type=int, default=None,
                    help="torch threads (default: as the process has them); the engines' thread governor may "
                         "lower them while other processes keep cores busy")
    ap.add_argument("--json", metavar="PATH", help="also write the numbers to this JSON file")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error(f"--rounds must be at least 1, got {args.rounds}")
    for name in ("decode_steps", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.quick:
        shapes = Shapes(128, 64, (1, 4), args.decode_steps or 2)
    else:
        shapes = Shapes(1024, 1024, (1, 32), args.decode_steps or 5)
    flags = list(dict.fromkeys(args.config or DEFAULT_CONFIGS))
    try:
        options = {f: EngineArgs.parse_flags(f, what="--config") for f in flags}
    except ValueError as e:
        ap.error(str(e))
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    threads = torch.get_num_threads()
    date = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    machine = f"{cpu_model()}, {os.cpu_count()} CPUs, torch threads {threads}"
    commit = kv8_commit()
    print(f"machine: {machine}; kv8 {commit}; {date}")
    print(f"model: {DEFAULT_MODEL}; steps: {', '.join(shapes.kinds())}; {shapes.decode_steps} hooked + "
          f"{shapes.decode_steps} plain decode steps per round")
    build_start = time.perf_counter()
    engines = [build(f, options[f], shapes, args.rounds, args.seed + i) for i, f in enumerate(flags)]
    print(f"built and warmed up {len(engines)} engine(s) in {time.perf_counter() - build_start:.0f} s")
    for e in engines:
        print(f"  {e.label}: dense backend {e.dense_backend}, attention backend {e.attention_backend}")
    rng = random.Random(args.seed + 1000)
    ids = iter(range(10**9))
    start = time.perf_counter()
    for r in range(args.rounds):
        measure_round(engines, shapes, r, rng, ids)
        print(f"round {r + 1}/{args.rounds} done at {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    seen = sorted({s.threads for e in engines for v in e.samples.values() for s in v})
    print(f"measured {args.rounds} round(s) in {time.perf_counter() - start:.0f} s; torch threads after the steps: "
          + ", ".join(map(str, seen)))
    print("columns: each family's self time; rest = the step less the families (Python, scheduler, metadata, "
          "input tensors, logits check, output processing); step = families + rest, the hooks' calibrated cost "
          "taken out; plain = the step measured without hooks; hooks = hooked - plain step")
    print_tables(engines, shapes, args.rounds)

    if args.json:
        doc = {"machine": {"cpu": cpu_model(), "cpus": os.cpu_count(), "torch_threads": threads},
               "kv8_commit": commit, "date": date, "rounds": args.rounds, "quick": args.quick,
               "shapes": {"prefill": shapes.prefill, "context": shapes.context, "batches": list(shapes.batches),
                          "decode_steps": shapes.decode_steps},
               "families": list(FAMILIES), "columns": list(COLUMNS), "unit": "ms",
               "configs": [{"flags": e.flags, "label": e.label, "dense_backend": e.dense_backend,
                            "attention_backend": e.attention_backend,
                            "steps": {kind: {"summary": summarize(v), "share_pct": shares(v),
                                             "rounds": [s.row() for s in v],
                                             "timed_calls": [s.calls for s in v],
                                             "hook_cost": [{"inside_us": s.cost.inside * 1e6,
                                                            "outside_us": s.cost.outside * 1e6,
                                                            "per_step_ms": s.overhead_ms()} for s in v],
                                             "threads": [s.threads for s in v]}
                                      for kind, v in e.samples.items()}} for e in engines]}
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
