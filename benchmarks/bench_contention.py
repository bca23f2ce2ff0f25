"""kv8 on an idle CPU and beside competing CPU work, for its thread policies and OpenMP wait policies, side by side
in one run.

    .venv/bin/python benchmarks/bench_contention.py            # SmolLM2-135M, fp8 cache, 8 x 128 greedy tokens
    .venv/bin/python benchmarks/bench_contention.py --quick --loads cores

OpenMP worker threads that finish a parallel region spin before they sleep (libgomp's ``OMP_WAIT_POLICY`` /
``GOMP_SPINCOUNT``). On an idle machine spinning saves the wake-up at the next region; when another process wants
the same cores, the spinning threads take its time slices and a step can take many times longer. kv8's default
(``adaptive_cpu_threads``, :mod:`kv8.engine.threads`) gives its parallel regions only the cores other processes
leave free. Each setting runs in a fresh process (the wait policy is read when the OpenMP runtime loads), on an
idle machine and beside each load:

* ``cores``: one busy process per core (every core wanted by someone else);
* ``half``: one busy process per two cores;
* ``kv8``: a second kv8 process generating the same batch over and over, with the same setting.

The table gives generated tokens per second (medians of ``--repeats`` runs, the settings alternating), each
loaded rate over the same setting's idle rate, and over the default's idle rate.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time

# name -> (environment for the kv8 processes, LLM keyword arguments); kv8's default first
SETTINGS: dict[str, tuple[dict[str, str], dict[str, object]]] = {
    "kv8 default": ({}, {}),
    "fixed threads": ({}, {"adaptive_cpu_threads": False}),
    "fixed + OMP_WAIT_POLICY=passive": ({"OMP_WAIT_POLICY": "passive"}, {"adaptive_cpu_threads": False}),
}
LOADS = ("cores", "half", "kv8")

CHILD = r"""
import json, sys, time
from kv8 import LLM, SamplingParams
n, tokens, kwargs, forever = int(sys.argv[1]), int(sys.argv[2]), json.loads(sys.argv[3]), sys.argv[4] == "1"
llm = LLM(kv_cache_dtype="fp8", kv_cache_memory="256MiB", max_model_len=1024, **kwargs)
prompts = [f"Write a short story about the number {i}." for i in range(n)]
params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)   # warm-up
print("ready", flush=True)
while True:
    start = time.perf_counter()
    out = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    if not forever:
        break
print(json.dumps({"tok_s": sum(len(o.outputs[0].token_ids) for o in out) / seconds, "seconds": seconds}))
"""


def _busy(stop_at: float) -> None:
    x = 0
    while time.monotonic() < stop_at:
        x += 1


def _env(extra: dict[str, str]) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(extra)
    return env


def _kv8(setting: str, n: int, tokens: int, forever: bool) -> subprocess.Popen[str]:
    env, kwargs = SETTINGS[setting]
    return subprocess.Popen([sys.executable, "-c", CHILD, str(n), str(tokens), json.dumps(kwargs),
                             "1" if forever else "0"], env=_env(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def run(setting: str, n: int, tokens: int, load: str | None) -> float:
    """Generated tokens per second of one kv8 process with ``setting`` beside ``load`` (None: idle)."""
    burners: list[mp.Process] = []
    rival = None
    cores = os.cpu_count() or 1
    if load in ("cores", "half"):   # busy processes, for at most 15 minutes
        stop_at = time.monotonic() + 900
        count = cores if load == "cores" else max(1, cores // 2)
        burners = [mp.Process(target=_busy, args=(stop_at,), daemon=True) for _ in range(count)]
        for b in burners:
            b.start()
    elif load == "kv8":   # a second kv8, generating before the measured one starts and until it ends
        rival = _kv8(setting, n, tokens, forever=True)
        assert rival.stdout is not None
        if rival.stdout.readline().strip() != "ready":
            raise SystemExit(f"the rival kv8 process failed:\n{rival.communicate()[1][-2000:]}")
    try:
        proc = _kv8(setting, n, tokens, forever=False)
        out, err = proc.communicate(timeout=1800)
    finally:
        for b in burners:
            b.terminate()
            b.join()
        if rival is not None:
            rival.kill()
            rival.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"kv8 run failed ({setting}):\n{err[-2000:]}")
    return float(json.loads(out.strip().splitlines()[-1])["tok_s"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 x 64 tokens")
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell, alternating settings; the median counts")
    ap.add_argument("--loads", default=",".join(LOADS), help=f"comma-separated, of: {', '.join(LOADS)}")
    ap.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of: {', '.join(SETTINGS)}")
    args = ap.parse_args()
    loads = [x for x in args.loads.split(",") if x]
    settings = [x for x in args.settings.split(",") if x]
    for name, allowed in (("--loads", LOADS), ("--settings", tuple(SETTINGS))):
        bad = [x for x in (loads if name == "--loads" else settings) if x not in allowed]
        if bad:
            raise SystemExit(f"{name}: {bad} not known; choose from {', '.join(allowed)}")
    n, tokens = (8, 64) if args.quick else (8, 128)
    print(f"SmolLM2-135M, fp8 cache, {n} prompts x {tokens} greedy tokens, {os.cpu_count()} cores; loads: cores = "
          "one busy process per core, half = one per two cores, kv8 = a second kv8 with the same setting")
    runs: dict[tuple[str, str | None], list[float]] = {}
    for _ in range(args.repeats):
        for load in (None, *loads):
            for name in settings:
                runs.setdefault((name, load), []).append(run(name, n, tokens, load))
    res = {key: statistics.median(values) for key, values in runs.items()}
    base = res[(settings[0], None)]
    head = f"{'setting':<32}{'idle tok/s':>11}{'x ' + settings[0]:>16}"
    for load in loads:
        head += f"{load + ' tok/s':>13}{'/idle':>7}{'/' + settings[0][:8]:>10}"
    print(head)
    for name in settings:
        idle = res[(name, None)]
        line = f"{name:<32}{idle:>11.1f}{idle / base:>16.2f}"
        for load in loads:
            loaded = res[(name, load)]
            line += f"{loaded:>13.1f}{loaded / idle:>7.2f}{loaded / base:>10.2f}"
        print(line)


if __name__ == "__main__":
    main()
