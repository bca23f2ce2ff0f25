"""One engine step of SmolLM2 with torch's dense layers vs kv8's CPU kernels, side by side in one run.

Two engines on the default model (bf16, FP8 cache) that differ only in ``dense_backend``: ``torch``
(``F.linear`` / oneDNN and torch elementwise ops) and ``packed_bf16`` (packed-weight linear, fused add+RMSNorm,
SiLU*up and RoPE). Prints the median time of a prefill step (4 prompts x 512 tokens = 2,048 tokens) and of a
decode step (``--batch`` sequences at ~``--context`` tokens), and the speed-up. On a CPU with AMX-BF16, where
``packed_bf16`` multiplies with AMX tiles, a third row times it with its ``vdpbf16ps`` path (the kernels'
``amx`` flag off), as other CPUs run it.

    .venv/bin/python benchmarks/bench_engine_step.py
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from kv8 import LLM, SamplingParams
from kv8.kernels.dense import load_dense_kernels


def measure(backend: str, args: argparse.Namespace) -> tuple[float, float]:
    llm = LLM(kv_cache_dtype="fp8_e4m3", kv_cache_memory="1GiB", max_model_len=4096, dense_backend=backend)
    eng = llm.engine
    rng = random.Random(0)
    counter = iter(range(10**9))

    def prefill_step() -> float:
        for _ in range(4):
            eng.add_request([rng.randrange(100, 40000) for _ in range(512)],
                            SamplingParams(temperature=0, max_tokens=1), request_id=f"p{next(counter)}")
        start = time.perf_counter()
        eng.step()
        elapsed = time.perf_counter() - start
        while eng.has_unfinished_requests():
            eng.step()
        return elapsed

    prefill_step()
    prefill = statistics.median(prefill_step() for _ in range(args.repeats))
    params = SamplingParams(temperature=0, max_tokens=args.repeats * 2 + 20, ignore_eos=True)
    for i in range(args.batch):
        eng.add_request([rng.randrange(100, 40000) for _ in range(args.context)], params, request_id=f"d{i}")
    while eng.scheduler.waiting or any(r.num_computed_tokens < args.context for r in eng.scheduler.running):
        eng.step()
    for _ in range(5):
        eng.step()
    times = []
    for _ in range(args.repeats * 2):
        start = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - start)
    return prefill, statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    rows = {b: measure(b, args) for b in ("torch", "packed_bf16")}
    kernels = load_dense_kernels()
    if kernels.amx:   # the same backend on the vdpbf16ps path
        kernels.amx = False
        try:
            rows["packed_bf16 (vdpbf16ps)"] = measure("packed_bf16", args)
        finally:
            kernels.amx = True
    print(f"SmolLM2-135M, bf16, fp8_e4m3 cache; decode batch {args.batch} at ~{args.context} tokens; medians; "
          f"packed_bf16 path: {'AMX tiles' if kernels.amx else 'vdpbf16ps'}")
    print(f"{'dense_backend':<24}{'prefill 2048 tok ms':>21}{'decode step ms':>16}")
    for name, (p, d) in rows.items():
        print(f"{name:<24}{p * 1e3:>21.1f}{d * 1e3:>16.1f}")
    (tp, td), (cp, cd) = rows["torch"], rows["packed_bf16"]
    print(f"{'speed-up vs torch':<24}{tp / cp:>21.2f}{td / cd:>16.2f}")
    if "packed_bf16 (vdpbf16ps)" in rows:
        vp, vd = rows["packed_bf16 (vdpbf16ps)"]
        print(f"{'AMX vs vdpbf16ps':<24}{vp / cp:>21.2f}{vd / cd:>16.2f}")


if __name__ == "__main__":
    main()
