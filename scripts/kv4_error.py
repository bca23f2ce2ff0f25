"""Candidate 4-bit KV formats compared on a model's real keys and values: error per byte, before building one.

    .venv/bin/python scripts/kv4_error.py smollm2-135m --data ~/.cache/kv8-peers/data/wiki.test.txt \\
        --window 512 --num-windows 2

Runs MODEL in float32 with a float32 cache over windows of the data (each window one prompt), keeps every layer's
queries, keys and values in the model's basis (``EngineObserver.on_attention_inputs``), then quantizes and
dequantizes K and V with each candidate below (plain torch, written here: most candidates are not kv8 formats) and
recomputes the layer's causal attention (its sliding window included) in float64. Per candidate, averaged over
layers and windows: the relative RMS error of K and of V, and ``out err``, the relative RMS error of the attention
output with K and V both round-tripped (what ``scripts/attention_error.py`` reports as ``out err``).

Candidates (``D`` = head_dim; bits per value include the scales):

* ``int4/tok``: int4 codes (-7..7), one float32 scale ``amax / 7`` per (token, KV head): ``4 + 32 / D`` bits;
* ``int4/g32``: int4 codes, a float16 scale ``amax / 7`` per group of 32 channels: 4.5 bits;
* ``e2m1/g16 1``: FP4 E2M1 codes, an E4M3 scale ``e4m3(amax / 6)`` per group of 16 channels, no other scale
  (the tensor scale fixed at 1): 4.5 bits;
* ``e2m1/g16 L``: the same with a float32 scale per (layer, K or V) -- ``amax of the layer / (6 * 448)``, taken
  from the very data measured, so optimistic for a scale a calibration would fix -- that the E4M3 group
  scales are relative to (NVFP4's per-tensor scale): 4.5 bits;
* ``e2m1/g16 tok``: the same with the float32 scale per (token, KV head), ``amax / (6 * 448)``: ``4.5 + 32 / D``;
* ``e2m1/g16 f16``: E2M1 codes with a float16 group scale (no E4M3 rounding): 5 bits, to show what E4M3 costs.

Each with and without the Hadamard rotation (``KVCodec``'s, per head). Scale rounding is round-to-nearest-even;
codes round to nearest even and saturate.
"""

from __future__ import annotations

import argparse
import collections
import sys
from collections.abc import Callable

import torch

from kv8.observer import AttentionCapture
from kv8.quant.rotation import hadamard
from kv8.sampling_params import SamplingParams
from kv8.tools.calibrate import build_engine, run_prompts
from kv8.tools.data import read_corpus, token_windows, tokenize_corpus
from kv8.tools.plan_search import causal_attention

E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], dtype=torch.float64)
E4M3_MAX = 448.0


def e2m1(x: torch.Tensor) -> torch.Tensor:
    """Values rounded to the E2M1 grid (nearest, ties to the even code), saturating at 6."""
    mags = x.abs()
    mid = (E2M1_GRID[1:] + E2M1_GRID[:-1]) / 2                    # 7 midpoints between codes i and i + 1
    code = torch.zeros_like(mags, dtype=torch.int64)
    for i, t in enumerate(mid.tolist()):
        code += (mags > t) if i % 2 == 0 else (mags >= t)         # a tie goes to the even code
    return torch.sign(x) * E2M1_GRID[code]


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """Positive values rounded to E4M3 (nearest even, subnormals kept, saturating at 448)."""
    return x.clamp(max=E4M3_MAX).to(torch.float32).to(torch.float8_e4m3fn).to(torch.float64)


def grouped(x: torch.Tensor, g: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // g, g)


def int4_tok(x: torch.Tensor, tensor_amax: float) -> torch.Tensor:
    s = x.abs().amax(-1, keepdim=True).float().double() / 7
    s = torch.where(s > 0, s, torch.ones_like(s))
    return torch.round(x / s).clamp(-7, 7) * s


def int4_g32(x: torch.Tensor, tensor_amax: float) -> torch.Tensor:
    xg = grouped(x, 32)
    s = (xg.abs().amax(-1, keepdim=True) / 7).half().double()
    s = torch.where(s > 0, s, torch.ones_like(s))
    return (torch.round(xg / s).clamp(-7, 7) * s).reshape(x.shape)


def fp4(x: torch.Tensor, outer: torch.Tensor | float, fp16_scale: bool = False) -> torch.Tensor:
    """E2M1 codes per group of 16 with scale ``outer * e4m3(amax / 6 / outer)`` (or a float16 ``amax / 6``)."""
    xg = grouped(x, 16)
    if isinstance(outer, torch.Tensor):
        outer = outer.unsqueeze(-1)                               # [T, H, 1] -> [T, H, 1, 1]: every group
    amax = xg.abs().amax(-1, keepdim=True)
    s = (amax / 6).half().double() if fp16_scale else e4m3(amax / 6 / outer) * outer
    safe = torch.where(s > 0, s, torch.ones_like(s))
    return (e2m1(xg / safe) * s).reshape(x.shape)


#: name -> (round trip of ``[T, H, D]`` given the tensor's amax, bits per value at head_dim D)
CANDIDATES: dict[str, tuple[Callable[[torch.Tensor, float], torch.Tensor], Callable[[int], float]]] = {
    "int4/tok": (int4_tok, lambda d: 4 + 32 / d),
    "int4/g32": (int4_g32, lambda d: 4.5),
    "e2m1/g16 1": (lambda x, a: fp4(x, 1.0), lambda d: 4.5),
    "e2m1/g16 L": (lambda x, a: fp4(x, a / (6 * E4M3_MAX)), lambda d: 4.5),
    "e2m1/g16 tok": (lambda x, a: fp4(x, x.abs().amax(-1, keepdim=True).float().double().clamp_min(1e-30)
                                      / (6 * E4M3_MAX)), lambda d: 4.5 + 32 / d),
    "e2m1/g16 f16": (lambda x, a: fp4(x, 1.0, fp16_scale=True), lambda d: 5.0),
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--data", nargs="+", required=True)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--num-windows", type=int, default=2)
    ap.add_argument("--skip-tokens", type=int, default=0)
    args = ap.parse_args(argv)
    capture = AttentionCapture()
    engine = build_engine(args.model, observer=capture, dtype="float32", kv_cache_dtype="float32",
                          attention_backend="reference", enable_prefix_caching=False,
                          max_model_len=args.window + 1, max_num_batched_tokens=args.window)
    arch, layout = engine.config.arch, engine.layout
    windows = [layout.groups[layout.layer_group[i]].sliding_window for i in range(arch.num_layers)]
    scales = [engine.model.model.layers[i].self_attn.attn.scale for i in range(arch.num_layers)]
    rot = hadamard(arch.head_dim).double()
    tokens = tokenize_corpus(read_corpus(args.data), engine.tokenizer)
    data = token_windows(tokens, args.window, args.num_windows, args.skip_tokens, "--window", "--skip-tokens")
    sums: dict[tuple[str, str], float] = collections.defaultdict(float)
    count = 0
    for w in data:
        capture.steps.clear()
        run_prompts(engine, [list(w)], SamplingParams(temperature=0.0, max_tokens=1), 1)
        for layer in range(arch.num_layers):
            q, k, v = (torch.cat(parts) for parts in zip(*capture.steps[layer]))
            out = causal_attention(q, k, v, scales[layer], windows[layer])
            for rotation in ("none", "hadamard"):
                r = rot if rotation == "hadamard" else None
                ks, vs = (x if r is None else x @ r for x in (k, v))
                for name, (fn, _) in CANDIDATES.items():
                    kq, vq = fn(ks, ks.abs().max().item()), fn(vs, vs.abs().max().item())
                    if r is not None:
                        kq, vq = kq @ r, vq @ r            # the rotation is its own inverse
                    out_q = causal_attention(q, kq, vq, scales[layer], windows[layer])
                    key = f"{name}{'+H' if r is not None else ''}"
                    sums[(key, "k")] += ((kq - k).norm() / k.norm()).item()
                    sums[(key, "v")] += ((vq - v).norm() / v.norm()).item()
                    sums[(key, "out")] += ((out_q - out).norm() / out.norm()).item()
            count += 1
    print(f"{args.model}: {arch.num_layers} layers, head_dim {arch.head_dim}, {arch.num_kv_heads} KV heads; "
          f"{len(data)} windows of {args.window} tokens; float64 attention; means over layers and windows")
    print(f"{'candidate':<18} {'bits':>9} {'K rel err':>10} {'V rel err':>10} {'out err':>10}")
    for name, (_, bits) in CANDIDATES.items():
        for suffix in ("", "+H"):
            key = name + suffix
            errs = " ".join(f"{sums[(key, m)] / count:>10.4f}" for m in ("k", "v", "out"))
            print(f"{key:<18} {bits(arch.head_dim):>9.3g} {errs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
