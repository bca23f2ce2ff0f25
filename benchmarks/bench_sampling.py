"""Sampling filters: partial selection (kv8's path) vs a sort of the whole vocabulary, side by side in one run.

    .venv/bin/python benchmarks/bench_sampling.py            # batch 1, 16, 64 x SmolLM2's vocabulary (49,152)

Each row is one decode step's logits of a sampling request (temperature 0.8) with the filter named; times are
milliseconds per call of the filter step for the whole batch, best of several calls, and the ratio of the
full sort's time to kv8's.
"""

from __future__ import annotations

import argparse
import time

import torch

from kv8.engine.sampler import _apply_filters, apply_filters_reference
from kv8.sampling_params import SamplingParams

FILTERS = {
    "top_k=50": dict(top_k=50),
    "top_p=0.9": dict(top_p=0.9),
    "top_p=0.95,top_k=100": dict(top_p=0.95, top_k=100),
    "min_p=0.05": dict(min_p=0.05),
}


def best_ms(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--batch", type=int, nargs="*", default=[1, 16, 64])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    print(f"vocabulary {args.vocab}, {torch.get_num_threads()} threads; ms per filter call for the batch")
    print(f"{'filter':<24}{'batch':>6}{'full sort ms':>14}{'kv8 ms':>9}{'speed-up':>10}")
    for name, kw in FILTERS.items():
        for batch in args.batch:
            # logits shaped like a language model's: a few likely tokens, a long tail
            logits = torch.randn(batch, args.vocab, generator=gen) * 3.0
            scaled = (logits - logits.amax(dim=-1, keepdim=True)) / 0.8
            params = [SamplingParams(temperature=0.8, **kw)] * batch
            full = best_ms(lambda s=scaled, p=params: apply_filters_reference(s, p), args.reps)
            ours = best_ms(lambda s=scaled, p=params: _apply_filters(s, p), args.reps)
            print(f"{name:<24}{batch:>6}{full:>14.2f}{ours:>9.2f}{full / ours:>10.2f}")


if __name__ == "__main__":
    main()
