"""How fast this machine reads memory, and what that makes the floor of a decode step.

A decode step must read every weight once and each sequence's KV cache once per layer; with the batch this
small, those bytes, not the arithmetic, bound it. This prints the read bandwidth of ``torch.sum`` over float32
buffers of growing size (the same buffer summed repeatedly: small ones stay in the caches, large ones come from
DRAM), with 1 and with the given threads, then the bytes of one SmolLM2-135M decode step at the issue's shapes
(bf16 weights, FP8 and bf16 KV at 1,024 + 64 tokens of context) over the largest buffer's bandwidth: the time a
step cannot go below on this machine.

    .venv/bin/python benchmarks/bench_bandwidth.py
    .venv/bin/python benchmarks/bench_bandwidth.py --sizes-mib 1 64 512 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

# SmolLM2-135M (kv8's default model): 30 layers, 3 KV heads of 64, hidden 576, intermediate 1,536, vocabulary
# 49,152 (tied embedding: the LM head reads it too).
LAYERS, KV_HEADS, HEAD_DIM, HIDDEN, INTER, VOCAB = 30, 3, 64, 576, 1536, 49152
WEIGHT_ELEMS = LAYERS * (HIDDEN * (HIDDEN + 2 * KV_HEADS * HEAD_DIM) + HIDDEN * HIDDEN + 3 * HIDDEN * INTER) \
    + VOCAB * HIDDEN


def read_gbps(mib: int, threads: int, min_time: float) -> float:
    """Best bytes/s over repeated sums of one float32 buffer of ``mib`` MiB."""
    torch.set_num_threads(threads)
    buf = torch.ones(mib * (1 << 20) // 4, dtype=torch.float32)
    reps = max(1, 256 // mib)
    best = float("inf")
    end = time.perf_counter() + min_time
    while True:
        start = time.perf_counter()
        for _ in range(reps):
            buf.sum()
        best = min(best, (time.perf_counter() - start) / reps)
        if time.perf_counter() > end:
            return buf.numel() * 4 / best / 1e9


def step_bytes(batch: int, context: int, kv_bytes: int) -> tuple[int, int]:
    """(weight bytes, KV bytes) one decode step reads: bf16 weights once, K and V of every layer once."""
    return WEIGHT_ELEMS * 2, batch * context * LAYERS * 2 * KV_HEADS * HEAD_DIM * kv_bytes


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[1, 8, 64, 128, 512], help="buffer sizes")
    ap.add_argument("--threads", type=int, default=2, help="threads for the second column (default 2)")
    ap.add_argument("--min-time", type=float, default=1.0, help="seconds per measurement (default 1)")
    ns = ap.parse_args()
    if any(s <= 0 for s in ns.sizes_mib):
        ap.error(f"--sizes-mib takes positive sizes, got {ns.sizes_mib}")
    if ns.threads <= 0:
        ap.error(f"--threads must be positive, got {ns.threads}")
    print(f"{'buffer':>10} {'1 thread':>12} {f'{ns.threads} threads':>12}")
    rates = {}
    for mib in ns.sizes_mib:
        one, many = read_gbps(mib, 1, ns.min_time), read_gbps(mib, ns.threads, ns.min_time)
        rates[mib] = many
        print(f"{mib:>6} MiB {one:>8.1f} GB/s {many:>8.1f} GB/s")
    dram = rates[max(rates)]
    print(f"\nfloor of a SmolLM2-135M decode step at {dram:.1f} GB/s ({max(rates)} MiB buffer, {ns.threads} threads):")
    for kv_name, kv_bytes in (("fp8", 1), ("bf16", 2)):
        for batch in (1, 8, 32):
            w, kv = step_bytes(batch, 1024 + 64, kv_bytes)
            print(f"  {kv_name:4s} B = {batch:2d}: weights {w / 1e6:6.1f} MB + KV {kv / 1e6:6.1f} MB -> "
                  f"{(w + kv) / dram / 1e6:6.2f} ms")


if __name__ == "__main__":
    main()
