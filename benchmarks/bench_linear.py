"""kv8's packed bf16 linear kernel vs torch's ``F.linear`` (oneDNN), side by side in one run.

The weights of 30 SmolLM2-shaped layers (q/k/v packed 960 x 576, o 576 x 576, gate/up packed 3072 x 576,
down 576 x 1536: ~200 MB of bf16, as in a decode step) are multiplied with M rows, every layer in turn, so
the weights stream from DRAM as they do in the engine; torch multiplies the same matrices unpacked. Prints
the time per pass, the weight bandwidth (bytes of weights / time) and the speed-up, best of 5 passes. On a CPU
with AMX-BF16 kv8 multiplies with AMX tiles (what the engine uses there); the ``vdpbf16ps`` columns time the
AVX-512 path that other CPUs use, on the same packed weights in the same run.

    .venv/bin/python benchmarks/bench_linear.py
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F

from kv8.layers.dense_kernels import select_dense_backend
from kv8.layers.linear import Linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # (out, in) per layer, SmolLM2-135M


def best_of(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", default="1,4,8,16,32,64,256,2048", help="comma-separated M values")
    ap.add_argument("--layers", type=int, default=30)
    args = ap.parse_args()
    backend = select_dense_backend("packed_bf16", torch.bfloat16)
    torch.manual_seed(0)
    weights = [[torch.randn(n, k).bfloat16() for n, k in SHAPES] for _ in range(args.layers)]
    packed = []
    for layer in weights:
        mods = []
        for w in layer:
            lin = Linear(w.shape[1], w.shape[0], False, backend)
            lin.weight.data = w
            lin.process_weights_after_loading()   # packs a copy; ``w`` stays for torch
            mods.append(lin)
        packed.append(mods)
    nbytes = sum(w.numel() * 2 for layer in weights for w in layer)
    kernels = backend.kernels
    assert kernels is not None
    amx = kernels.amx
    print(f"{args.layers} layers, {nbytes / 1e6:.0f} MB of bf16 weights, {torch.get_num_threads()} threads, "
          f"kv8 path: {'AMX tiles' if amx else 'vdpbf16ps'}")
    extra = f" {'vdpbf16ps ms':>13} {'AMX/vdpbf16ps':>14}" if amx else ""
    print(f"{'M':>6} {'torch ms':>10} {'kv8 ms':>10} {'torch GB/s':>11} {'kv8 GB/s':>10} {'speed-up':>9}{extra}")
    with torch.inference_mode():
        for m in (int(v) for v in args.rows.split(",")):
            xs = {k: torch.randn(m, k).bfloat16() for k in {k for _, k in SHAPES}}
            reps = 5 if m <= 256 else 2

            def run_torch(xs: dict[int, torch.Tensor] = xs) -> None:
                for layer in weights:
                    for w in layer:
                        F.linear(xs[w.shape[1]], w)

            def run_kv8(xs: dict[int, torch.Tensor] = xs) -> None:
                for layer in packed:
                    for p in layer:
                        p(xs[p.in_features])

            t_torch, t_kv8 = best_of(run_torch, reps), best_of(run_kv8, reps)
            row = (f"{m:>6} {t_torch * 1e3:>10.2f} {t_kv8 * 1e3:>10.2f} {nbytes / t_torch / 1e9:>11.1f} "
                   f"{nbytes / t_kv8 / 1e9:>10.1f} {t_torch / t_kv8:>9.2f}")
            if amx:
                kernels.amx = False
                try:
                    t_avx = best_of(run_kv8, reps)
                finally:
                    kernels.amx = True
                row += f" {t_avx * 1e3:>13.2f} {t_avx / t_kv8:>14.2f}"
            print(row)


if __name__ == "__main__":
    main()
