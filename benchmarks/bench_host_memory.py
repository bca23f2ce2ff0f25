"""kv8's prefill with its glibc malloc settings (:mod:`kv8.host_memory`) against glibc's defaults, side by side.

Each setting runs in its own worker process (the settings are process-wide): ``tuned`` as kv8 starts, and
``default`` with ``GLIBC_TUNABLES=glibc.malloc.tcache_count=7`` (glibc's default value: a user's glibc setting,
so kv8 leaves malloc alone). Each worker builds SmolLM2-135M with an FP8 cache, then prefills B prompts of P
random tokens (``max_tokens=1``) as often as asked; the workers alternate, and the table gives each one's best
time, its minor page faults (``getrusage``) in that prefill, and the ratio.

    .venv/bin/python benchmarks/bench_host_memory.py                      # B = 1, 8, 32 x 1,024, 3 rounds
    .venv/bin/python benchmarks/bench_host_memory.py --batches 8 --rounds 5
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import time

from kv8.envs import without_malloc_settings

SETTINGS = {"tuned": {}, "default": {"GLIBC_TUNABLES": "glibc.malloc.tcache_count=7"}}


def worker(max_batch: int, prompt: int) -> None:
    """Answer one JSON line per stdin line ``B SEED``: {seconds, faults} of one prefill."""
    import torch

    from kv8 import LLM, SamplingParams
    from kv8.host_memory import tune_malloc

    torch.set_num_threads(2)
    llm = LLM(kv_cache_dtype="fp8_e4m3", max_model_len=prompt + 16, max_num_seqs=max_batch,
              num_kv_blocks=max_batch * (prompt + 16) // 16 + 4, max_num_batched_tokens=2048,
              enable_prefix_caching=False)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    print(json.dumps({"ready": tune_malloc()}), flush=True)
    for line in sys.stdin:
        batch, seed = map(int, line.split())
        rng = random.Random(seed)
        for i in range(batch):
            eng.add_request([rng.randrange(100, 40000) for _ in range(prompt)], params, request_id=f"{seed}-{i}")
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults}),
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes (default 1,8,32)")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens per sequence (default 1024)")
    ap.add_argument("--rounds", type=int, default=3, help="prefills per batch size and setting (default 3)")
    ap.add_argument("--worker", nargs=2, type=int, metavar=("MAX_BATCH", "PROMPT"), help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.worker:
        worker(*ns.worker)
        return
    try:
        batches = [int(b) for b in ns.batches.split(",")]
    except ValueError:
        ap.error(f"--batches takes comma-separated positive integers, got {ns.batches!r}")
    if not batches or min(batches) <= 0:
        ap.error(f"--batches takes comma-separated positive integers, got {ns.batches!r}")
    if ns.prompt <= 0 or ns.rounds <= 0:
        ap.error(f"--prompt and --rounds must be positive, got {ns.prompt} and {ns.rounds}")
    clean = without_malloc_settings()
    procs = {}
    for name, extra in SETTINGS.items():
        procs[name] = subprocess.Popen([sys.executable, __file__, "--worker", str(max(batches)), str(ns.prompt)],
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                       env={**clean, **extra})
    try:
        for name, p in procs.items():
            assert p.stdout is not None
            ready = json.loads(p.stdout.readline())["ready"]
            print(f"{name}: kv8's tune_malloc said {ready!r}")

        def ask(name: str, batch: int, seed: int) -> dict:
            p = procs[name]
            assert p.stdin is not None and p.stdout is not None
            p.stdin.write(f"{batch} {seed}\n")
            p.stdin.flush()
            return json.loads(p.stdout.readline())

        for name in procs:   # warm-up: kernels loaded, first allocations made
            ask(name, min(batches), 0)
        print(f"\n{'prefill':>14} {'tuned s':>9} {'faults':>8} {'default s':>10} {'faults':>8} {'default/tuned':>14}")
        for batch in batches:
            best = {name: (float("inf"), 0) for name in procs}
            for r in range(ns.rounds):
                order = list(procs) if r % 2 == 0 else list(reversed(procs))
                for name in order:
                    got = ask(name, batch, 1000 * batch + r)
                    if got["seconds"] < best[name][0]:
                        best[name] = (got["seconds"], got["faults"])
            (ts, tf), (ds, df) = best["tuned"], best["default"]
            print(f"{batch:>3} x {ns.prompt:<8} {ts:>9.3f} {tf:>8d} {ds:>10.3f} {df:>8d} {ds / ts:>14.2f}")
    finally:
        for p in procs.values():
            if p.stdin:
                p.stdin.close()
            p.wait(timeout=60)


if __name__ == "__main__":
    main()
