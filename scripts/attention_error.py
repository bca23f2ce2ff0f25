"""Per layer, how much each FP8 mode of the KV cache changes attention, against a float64 oracle.

    .venv/bin/python scripts/attention_error.py gemma3-270m --data enwiki.xml.bz2 --skip-tokens 400000 \\
        --window 1024 --num-windows 2

Runs MODEL in float32 with a float32 cache over windows of the data (each window one prompt) and keeps every
layer's queries, keys and values in the model's basis (``EngineObserver.on_attention_inputs``). Then, for each
mode -- E4M3 with scale 1.0, with dynamic per-token scales, each with the Hadamard rotation -- it round-trips K
and V through that mode's codec (``KVCodec.round_trip``: exactly what the cache stores and reads) and recomputes
the layer's causal attention (its sliding window included) in float64:

* ``attn KL``: the mean KL divergence of the attention weights, exact keys against round-tripped keys, over
  queries and heads (what K's error does to where a query looks);
* ``out err``: the relative RMS error of the attention output with K and V round-tripped;
* ``q2~k2``: the correlation, over the head's channels, of the queries' mean energy with the keys' (the mode
  independent statistic that tells whether the rotation helps: see the last paragraph);
* below the table, averaged over layers: K and V's relative RMS round-trip error, the RMS error of the
  attention logits (``q.k / sqrt(d)`` scaled as the model scales them), and the fraction of stored values below
  E4M3's smallest normal (2^-6), whose relative precision is lower.

Which mode is best depends on the model (docs/accuracy.md): the rotation leaves the round-trip error of a
vector unchanged (an orthonormal basis change; E4M3's error is relative to each value) but moves it between
channels. Without it, a key's error sits in its large channels; a logit ``q.k`` feels that error as much as the
query reads those channels. Where queries and keys are large in the same channels (``q2~k2`` > 0) spreading
the error lowers what the logit feels; where keys carry a large channel the queries ignore (``q2~k2`` <= 0,
e.g. a constant the softmax cancels), the rotation moves that channel's error into the channels the queries do
read, and the logits get worse.
"""

from __future__ import annotations

import argparse
import collections
import sys
from dataclasses import dataclass, field

import torch

from kv8.cache.codec import K, KVCodec, V
from kv8.observer import AttentionCapture
from kv8.quant.formats import resolve_kv_cache_dtype
from kv8.quant.scales import KVScales
from kv8.sampling_params import SamplingParams
from kv8.tools.calibrate import build_engine, run_prompts
from kv8.tools.data import read_corpus, token_windows, tokenize_corpus
from kv8.tools.plan_search import attention_parts as attention
from kv8.tools.plan_search import causal_mask

MODES = {  # name -> (scale_mode, rotation)
    "1.0": ("static", "none"),
    "dynamic": ("dynamic", "none"),
    "1.0+hadamard": ("static", "hadamard"),
    "dynamic+hadamard": ("dynamic", "hadamard"),
}
METRICS = ("attn_kl", "out_err", "k_err", "v_err", "logit_err", "below_normal")


@dataclass
class LayerErrors:
    sums: dict[tuple[str, str], float] = field(default_factory=lambda: collections.defaultdict(float))
    count: int = 0


def layer_errors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, window: int | None,
                 codec: KVCodec, layer: int) -> dict[str, float]:
    """The metrics of the module docstring for one layer and one sequence (``q, k, v`` float64, model basis)."""
    mask = causal_mask(q.shape[0], window)
    logits, weights, out = attention(q, k, v, scale, mask)

    def round_trip(x: torch.Tensor, which: int) -> tuple[torch.Tensor, float]:
        stored = codec.to_stored_basis(x.float(), which)
        back, _ = codec.round_trip(stored, layer, which)
        small = ((stored.abs() < 2.0 ** -6) & (stored != 0)).double().mean().item()
        return codec.to_stored_basis(back, which).double(), small   # the rotation is its own inverse

    kr, k_small = round_trip(k, K)
    vr, v_small = round_trip(v, V)
    logits_k, weights_k, _ = attention(q, kr, v, scale, mask)
    _, _, out_kv = attention(q, kr, vr, scale, mask)
    visible = mask[None].expand_as(logits)
    kl = (weights * (weights.clamp_min(1e-300).log() - weights_k.clamp_min(1e-300).log())).nan_to_num().sum(-1)
    return {"attn_kl": kl.mean().item(), "out_err": ((out_kv - out).norm() / out.norm()).item(),
            "k_err": ((kr - k).norm() / k.norm()).item(), "v_err": ((vr - v).norm() / v.norm()).item(),
            "logit_err": (logits_k - logits)[visible].pow(2).mean().sqrt().item(),
            "below_normal": (k_small + v_small) / 2}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--data", nargs="+", required=True)
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--num-windows", type=int, default=2)
    ap.add_argument("--skip-tokens", type=int, default=0)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}")
    args = ap.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        ap.error(f"--modes: {unknown} not known; choose from {', '.join(MODES)}")
    capture = AttentionCapture()
    engine = build_engine(args.model, observer=capture, dtype="float32", kv_cache_dtype="float32",
                          attention_backend="reference", enable_prefix_caching=False,
                          max_model_len=args.window + 1, max_num_batched_tokens=args.window)
    arch, layout = engine.config.arch, engine.layout
    windows = [layout.groups[layout.layer_group[i]].sliding_window for i in range(arch.num_layers)]
    scales = [engine.model.model.layers[i].self_attn.attn.scale for i in range(arch.num_layers)]
    fp8 = resolve_kv_cache_dtype("fp8_e4m3", torch.float32)
    codecs = {m: KVCodec.build(fp8, arch.head_dim, scale_mode=MODES[m][0], rotation=MODES[m][1],
                               scales=KVScales.default(arch.num_layers) if MODES[m][0] == "static" else None)
              for m in modes}
    tokens = tokenize_corpus(read_corpus(args.data), engine.tokenizer)
    data = token_windows(tokens, args.window, args.num_windows, args.skip_tokens, "--window", "--skip-tokens")
    errors = [LayerErrors() for _ in range(arch.num_layers)]
    for w in data:
        capture.steps.clear()
        run_prompts(engine, [list(w)], SamplingParams(temperature=0.0, max_tokens=1), 1)
        for layer in range(arch.num_layers):
            q, k, v = (torch.cat(parts) for parts in zip(*capture.steps[layer]))   # the prompt's chunks in order
            energy = torch.stack([q.pow(2).mean(dim=(0, 1)), k.pow(2).mean(dim=(0, 1))])   # [2, D] per channel
            errors[layer].sums[("", "q2~k2")] += torch.corrcoef(energy)[0, 1].item()
            for m, codec in codecs.items():
                for metric, value in layer_errors(q, k, v, scales[layer], windows[layer], codec, layer).items():
                    errors[layer].sums[(m, metric)] += value
            errors[layer].count += 1
    print(f"{args.model}: {arch.num_layers} layers, head_dim {arch.head_dim}, {arch.num_heads} query / "
          f"{arch.num_kv_heads} KV heads; {len(data)} windows of {args.window} tokens; E4M3, float64 attention")
    head = f"{'layer':>5} {'window':>6} {'q2~k2':>6}" + "".join(f"{m + ' ' + metric:>{max(14, len(m) + 9)}}"
                                                   for metric in ("attn_kl", "out_err") for m in modes)
    print(head)
    means: dict[tuple[str, str], float] = collections.defaultdict(float)
    for layer, e in enumerate(errors):
        row = f"{layer:>5} {str(windows[layer] or 'full'):>6} {e.sums[('', 'q2~k2')] / e.count:>6.2f}"
        for metric in ("attn_kl", "out_err"):
            for m in modes:
                value = e.sums[(m, metric)] / e.count
                row += f"{value:>{max(14, len(m) + 9)}.3e}"
        print(row)
        for metric in METRICS:
            for m in modes:
                means[(m, metric)] += e.sums[(m, metric)] / e.count / arch.num_layers
    print(f"{'mean':>5} {'':>6} {'':>6}" + "".join(f"{means[(m, metric)]:>{max(14, len(m) + 9)}.3e}"
                                           for metric in ("attn_kl", "out_err") for m in modes))
    for metric in ("k_err", "v_err", "logit_err", "below_normal"):
        print(f"mean {metric}: " + ", ".join(f"{m} {means[(m, metric)]:.4f}" for m in modes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
