"""kv8's host-memory settings (:mod:`kv8.host_memory`) against their absence, side by side in one run.

``--compare malloc`` (default): kv8's glibc malloc settings against glibc's defaults, on prefill. Each setting runs
in its own worker process (the settings are process-wide): ``tuned`` as kv8 starts, and ``default`` with
``GLIBC_TUNABLES=glibc.malloc.tcache_count=7`` (glibc's default value: a user's glibc setting, so kv8 leaves malloc
alone). Each worker builds SmolLM2-135M with an FP8 cache, then prefills B prompts of P random tokens
(``max_tokens=1``) as often as asked; the workers alternate, and the table gives each one's best time, its minor
page faults (``getrusage``) in that prefill, and the ratio.

``--compare pages``: the weights in memory advised for 2 MiB pages (as kv8 places them with ``KV8_HUGE_PAGES=1``,
which this run sets) against copies of them on ordinary pages, on decode steps of one engine in this process: B
prompts of P random tokens are prefilled, then groups of ``--steps`` decode steps alternate between the two (every
parameter and buffer swapped with ``.data``; two untimed steps after each swap), ``--rounds`` groups each. Prints
the median step time of each, their ratio, and how many bytes of each the kernel backs with huge pages (the copies
must have none: with transparent huge pages ``always`` the comparison says nothing). Then the first touch of fresh
memory, which is why the KV cache stays on ordinary pages: 256 MiB from :func:`huge_page_empty` and from
``torch.empty``, each filled twice (first touch, then touched), three times. ``--quantization fp8``: FP8 weights.

    .venv/bin/python benchmarks/bench_host_memory.py                      # B = 1, 8, 32 x 1,024, 3 rounds
    .venv/bin/python benchmarks/bench_host_memory.py --batches 8 --rounds 5
    .venv/bin/python benchmarks/bench_host_memory.py --compare pages --batches 1,8,32 --rounds 12
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import statistics
import subprocess
import sys
import time

from kv8.envs import HUGE_PAGES_ENV, without_malloc_settings

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
        ids = [eng.add_request([rng.randrange(100, 40000) for _ in range(prompt)], params, request_id=f"{seed}-{i}")
               for i in range(batch)]
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        start = time.perf_counter()
        eng.run_to_completion(ids)
        seconds = time.perf_counter() - start
        print(json.dumps({"seconds": seconds, "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults}),
              flush=True)


def compare_pages(batches: list[int], prompt: int, steps: int, rounds: int, quantization: str | None) -> None:
    """The ``--compare pages`` run (see the module docstring)."""
    import torch

    from kv8 import LLM, SamplingParams
    from kv8.host_memory import huge_page_bytes, huge_page_empty

    torch.set_num_threads(2)
    os.environ[HUGE_PAGES_ENV] = "1"   # the engine's weights on 2 MiB pages (off by default)
    new = 2 + rounds * 2 * (steps + 2)   # every sequence decodes through all the groups
    llm = LLM(kv_cache_dtype="fp8_e4m3", max_model_len=prompt + new + 16, max_num_seqs=max(batches),
              num_kv_blocks=max(batches) * -(-(prompt + new + 16) // 16) + 4, max_num_batched_tokens=2048,
              enable_prefix_caching=False, quantization=quantization)
    eng = llm.engine
    model = eng.model
    assert isinstance(model, torch.nn.Module)
    tensors = [t for t in [*model.parameters(), *model.buffers()] if t.numel()]
    sets = {"2MiB": [t.data for t in tensors],
            "4KiB": [torch.empty(t.shape, dtype=t.dtype).copy_(t.data) for t in tensors]}

    def use(name: str) -> None:
        for t, data in zip(tensors, sets[name]):
            t.data = data

    print(f"\n{'decode':>14} {'2MiB ms':>9} {'4KiB ms':>9} {'4KiB/2MiB':>10}   ({rounds} groups of {steps} steps each, "
          "medians)")
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    for batch in batches:
        rng = random.Random(batch)
        ids = [eng.add_request([rng.randrange(100, 40000) for _ in range(prompt)], params, request_id=f"{batch}-{i}")
               for i in range(batch)]
        while (s := eng.stats()).num_waiting or s.num_prefilling:   # until every prompt is in the cache
            eng.step()
        times: dict[str, list[float]] = {name: [] for name in sets}
        for r in range(rounds):
            for name in (list(sets) if r % 2 == 0 else list(reversed(sets))):
                use(name)
                eng.step()
                eng.step()
                start = time.perf_counter()
                for _ in range(steps):
                    eng.step()
                times[name].append((time.perf_counter() - start) / steps)
        for rid in ids:
            eng.abort_request(rid)
        use("2MiB")
        huge, small = (statistics.median(times[n]) * 1e3 for n in ("2MiB", "4KiB"))
        print(f"{batch:>3} x {prompt:<8} {huge:>9.2f} {small:>9.2f} {small / huge:>10.3f}")
    for name, ts in sets.items():
        backed = (huge_page_bytes(ts[0].data_ptr()) or 0) / 2**20
        print(f"{name}: huge pages backing the first weight's mapping: {backed:.0f} MiB")
    print(f"\n{'first touch of 256 MiB':>24} {'2MiB ms':>9} {'4KiB ms':>9}   (then touched again)")
    for r in range(3):
        row = []
        for on_huge in (True, False):
            fresh = huge_page_empty((256 << 20,), torch.uint8) if on_huge else torch.empty(256 << 20, dtype=torch.uint8)
            touch = []
            for value in (1, 2):
                start = time.perf_counter()
                fresh.fill_(value)
                touch.append((time.perf_counter() - start) * 1e3)
            row.append(touch)
            del fresh
        print(f"{'round ' + str(r + 1):>24} {row[0][0]:>9.1f} {row[1][0]:>9.1f}   ({row[0][1]:.1f}, {row[1][1]:.1f})")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compare", choices=["malloc", "pages"], default="malloc",
                    help="malloc: glibc settings on prefill (default); pages: 2 MiB vs 4 KiB pages on decode")
    ap.add_argument("--batches", default="1,8,32", help="comma-separated batch sizes (default 1,8,32)")
    ap.add_argument("--prompt", type=int, default=1024, help="prompt tokens per sequence (default 1024)")
    ap.add_argument("--rounds", type=int, default=3,
                    help="prefills (malloc) or groups of decode steps (pages) per batch size and setting (default 3)")
    ap.add_argument("--steps", type=int, default=12, help="decode steps per group with --compare pages (default 12)")
    ap.add_argument("--quantization", choices=["fp8"], help="--compare pages: the weights' quantization (default: as "
                    "loaded)")
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
    if ns.prompt <= 0 or ns.rounds <= 0 or ns.steps <= 0:
        ap.error(f"--prompt, --rounds and --steps must be positive, got {ns.prompt}, {ns.rounds} and {ns.steps}")
    if ns.compare == "pages":
        compare_pages(batches, ns.prompt, ns.steps, ns.rounds, ns.quantization)
        return
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
