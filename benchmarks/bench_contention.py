"""kv8 on an idle CPU and beside a competing CPU load, for OpenMP wait policies, side by side in one run.

    .venv/bin/python benchmarks/bench_contention.py            # SmolLM2-135M, fp8 cache, 8 x 48 greedy tokens
    .venv/bin/python benchmarks/bench_contention.py --quick

OpenMP worker threads that finish a parallel region spin before they sleep (libgomp's ``OMP_WAIT_POLICY``
/ ``GOMP_SPINCOUNT``). On an idle machine spinning saves the wake-up at the next region; when another process
wants the same cores, the spinning threads take its time slices and a step can take many times longer. Each
setting runs in a fresh process (the policy is read when the OpenMP runtime loads), once on an idle machine
and once while one busy process per core competes, and the table gives generated tokens per second and each
setting's ratio to kv8's default (medians of ``--repeats`` runs, the settings alternating).
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

SETTINGS = {  # name -> environment for the kv8 process (kv8's default first)
    "kv8 default": {},
    "OMP_WAIT_POLICY=passive": {"OMP_WAIT_POLICY": "passive"},
    "GOMP_SPINCOUNT=100000": {"GOMP_SPINCOUNT": "100000"},
}

CHILD = r"""
import json, sys, time
from kv8 import LLM, SamplingParams
n, tokens = int(sys.argv[1]), int(sys.argv[2])
llm = LLM(kv_cache_dtype="fp8", kv_cache_memory="256MiB", max_model_len=1024)
prompts = [f"Write a short story about the number {i}." for i in range(n)]
params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)   # warm-up
start = time.perf_counter()
out = llm.generate(prompts, params, use_tqdm=False)
seconds = time.perf_counter() - start
print(json.dumps({"tok_s": sum(len(o.outputs[0].token_ids) for o in out) / seconds, "seconds": seconds}))
"""


def _busy(stop_at: float) -> None:
    x = 0
    while time.monotonic() < stop_at:
        x += 1


def run(env_extra: dict[str, str], n: int, tokens: int, loaded: bool) -> dict[str, float]:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(env_extra)
    burners = []
    if loaded:  # one busy process per core, for at most 15 minutes
        stop_at = time.monotonic() + 900
        burners = [mp.Process(target=_busy, args=(stop_at,), daemon=True) for _ in range(os.cpu_count() or 1)]
        for b in burners:
            b.start()
    try:
        out = subprocess.run([sys.executable, "-c", CHILD, str(n), str(tokens)], env=env, capture_output=True,
                             text=True, timeout=1800)
    finally:
        for b in burners:
            b.terminate()
            b.join()
    if out.returncode != 0:
        raise SystemExit(f"kv8 run failed ({env_extra}):\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 x 24 tokens")
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell, alternating settings; the median counts")
    args = ap.parse_args()
    n, tokens = (4, 24) if args.quick else (8, 48)
    print(f"SmolLM2-135M, fp8 cache, {n} prompts x {tokens} greedy tokens, {os.cpu_count()} cores; "
          f"loaded = one busy process per core beside kv8")
    runs: dict[tuple[str, bool], list[float]] = {}
    for _ in range(args.repeats):
        for loaded in (False, True):
            for name, env in SETTINGS.items():
                runs.setdefault((name, loaded), []).append(run(env, n, tokens, loaded)["tok_s"])
    results = {key: statistics.median(values) for key, values in runs.items()}
    base_idle, base_loaded = results[("kv8 default", False)], results[("kv8 default", True)]
    print(f"{'setting':<26}{'idle tok/s':>11}{'x default':>10}{'loaded tok/s':>14}{'x default':>10}"
          f"{'loaded/idle':>13}")
    for name in SETTINGS:
        idle, loaded = results[(name, False)], results[(name, True)]
        print(f"{name:<26}{idle:>11.1f}{idle / base_idle:>10.2f}{loaded:>14.1f}{loaded / base_loaded:>10.2f}"
              f"{loaded / idle:>13.2f}")


if __name__ == "__main__":
    main()
