"""The ``kv8 calibrate`` and ``kv8 eval`` subcommands (registered by :mod:`kv8.entrypoints.cli`).

Their engine flags come from :meth:`EngineArgs.add_cli_args`, like every other subcommand's. Each tool builds
its own engines and fixes the options that define what it measures (the cache dtype, its size, prefix
caching); those are left out of its flags, and :data:`CALIBRATE_EXCLUDED` / :data:`EVAL_EXCLUDED` say which and
why. The flags declared here are the tools' own.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from kv8.engine.args import EngineArgs
from kv8.quant.formats import FP8_FORMATS, fp8_format
from kv8.quant.scales import ScaleGranularity

# Engine options the tools set themselves: the cache holds exactly the windows of one batch (--seq-len /
# --window, --batch / --gen-prompts) and computes every token once (no prefix caching).
SIZED_BY_TOOL = ("kv_cache_memory", "gpu_memory_utilization", "num_kv_blocks", "block_size", "enable_prefix_caching",
                 "max_num_seqs", "max_model_len")
# Engine options calibrate() and evaluate() do not take: greedy runs do not use the seed; the dense backend is
# the engine's default (auto).
NOT_PASSED = ("seed", "dense_backend")
# calibrate observes the K/V of the checkpoint's weights as loaded (a GGUF file's blocks dequantized; never random
# ones: no load_format); eval sets the weights' quantization per configuration (--config "--kv-cache-dtype ...
# --quantization fp8"; unset: as loaded), beside a reference with the checkpoint's weights as loaded.
WEIGHTS_AS_LOADED = ("quantization", "load_format")
# The tools run the model in one process with one cache pool (every layer's K/V observed or compared alike).
ONE_PROCESS_ONE_POOL = ("cpu_threads_per_rank", "kv_cache_dtype_skip_layers", "kv_cache_plan",
                        "disable_hybrid_kv_cache_manager")
# calibrate observes K/V before any rounding: an unquantized float32 cache, so no scales of its own.
# --tensor-parallel-size N makes per-rank scales (the model still runs in one process and sees every head).
CALIBRATE_EXCLUDED = SIZED_BY_TOOL + NOT_PASSED + WEIGHTS_AS_LOADED + ONE_PROCESS_ONE_POOL + (
    "kv_cache_dtype", "quantization_param_path", "kv_cache_scale_mode")
# eval builds one engine per configuration; --config (repeatable) names the configurations.
EVAL_EXCLUDED = SIZED_BY_TOOL + NOT_PASSED + WEIGHTS_AS_LOADED + ONE_PROCESS_ONE_POOL + (
    "kv_cache_dtype", "quantization_param_path", "kv_cache_scale_mode", "kv_cache_rotation", "tensor_parallel_size")
# eval compares caches: by default every engine reads its cache through the same reference attention, so only
# what the cache stores differs (--attention-backend auto puts the fused kernels' numerics in the comparison).
EVAL_DEFAULTS = {"attention_backend": "reference"}

CALIBRATE_EPILOG = """examples:
  kv8 calibrate smollm2-135m --data wiki.xml.bz2 --output kv_cache_scales.json          # vLLM JSON
  kv8 calibrate smollm2-135m --data text.jsonl --granularity head --output scales.json  # kv8 JSON
  kv8 calibrate ./my-model --data a.txt b.txt --statistic percentile --percentile 99.9 --save-model ./my-model-fp8kv
  kv8 calibrate ./my-70b --data wiki.xml.bz2 --tensor-parallel-size 4 --output kv_cache_scales.json  # per-rank scales
  kv8 calibrate smollm2-135m --data wiki.xml.bz2 --plan --kld-budget 1e-3 -o plan.json     # a per-layer plan
  kv8 calibrate smollm2-135m --data wiki.xml.bz2 --plan --bytes-budget fp8_e4m3 -o plan.json
outputs: --output-format vllm (one scale per layer, the larger of K and V; tensor granularity, fp8_e4m3[fnuz])
  or kv8 ({"format": "kv8-kv-scales", ...}: any granularity, K and V separate); both are accepted by
  --quantization-param-path. --save-model writes a model directory with k_scale/v_scale/kv_scale tensors.
--tensor-parallel-size N (tensor granularity, vLLM output) writes scaling_factor[tp_rank] for N ranks, each from the
  statistics of the KV heads that rank holds; the model runs in one process.
--kv-cache-rotation hadamard calibrates for a cache that rotates K/V (kv8 JSON output only); serve with the
  same --kv-cache-rotation.
--key-centering also writes key offsets (kv8 JSON output only): the mean post-RoPE key per layer, KV head and channel,
  which an engine loading the file subtracts from every key it stores, whatever its --kv-cache-dtype (int4/int8 and
  dynamic FP8 caches use the file for its offsets only).
--key-scaling (with --key-centering) also writes key scaling's factors: per layer, KV head and channel
  (E[q^2] / E[(k - c)^2])^(1/4), by which an engine multiplies every centered key before storing it and divides every
  query (exact for attention; a 4-bit cache's rounding moves to channels the queries read less). Not for a
  static-scale FP8 cache.
--plan writes a kv_cache_plan file instead of scales: each layer's sensitivity (its KLD against a float32 cache when
  only it is quantized, per candidate of --plan-formats), the cheapest layers' formats within --kld-budget (or the
  least KLD within --bytes-budget), checked end to end on the --plan-check-samples windows after the calibration
  windows (serve with --kv-cache-plan FILE; kv8 info --kv-cache-plan FILE shows its bytes per token)."""

EVAL_EPILOG = """examples:
  kv8 eval smollm2-135m --data wiki.xml.bz2 --config fp8_e4m3 \\
      --config "--kv-cache-dtype fp8_e4m3 --quantization-param-path kv_cache_scales.json"
  kv8 eval smollm2-135m --data held_out.txt --config fp8_e5m2 --json report.json --plot report.png
  kv8 eval smollm2-135m --data wiki.xml.bz2 --config "--kv-cache-dtype fp8_e4m3 --kv-cache-rotation hadamard"
--config X with a KV cache dtype alone is the configuration "--kv-cache-dtype X"; reports name each configuration by
  its dtype, then +dynamic, +hadamard, +fp8-weights (+gguf-weights), +plan:FILE and :SCALES for the options it sets
  (--config "--kv-cache-dtype int8 --kv-cache-plan plan.json": a per-layer plan from kv8 calibrate --plan).
every configuration is compared with the same engine using a float32 KV cache; by default all of them attend
through the reference backend, so only what the caches store differs (--attention-backend auto: fused kernels)."""


def _fraction(text: str) -> float:
    value = float(text)
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def _bytes_budget(text: str) -> int | str:
    """A positive byte count, or a KV cache dtype name (the bytes of a cache all in that format)."""
    from kv8.quant.formats import KV_CACHE_DTYPE_NAMES

    names = [n for n in KV_CACHE_DTYPE_NAMES if n != "auto"]   # "auto" would depend on the compute dtype
    if text in names:
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} must be bytes per token (an integer > 0) or a KV cache dtype "
                                         f"({', '.join(names)})") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0")
    return value


ADD_BOS_HELP = ("start every window with the model's BOS token in place of its first token (as llama-perplexity does "
                "for a model whose tokenizer adds BOS, and as chat requests start)")


def add_calibrate_parser(sub: Any) -> None:
    from kv8.tools.plan_search import DEFAULT_PLAN_FORMATS, SENSITIVITY_MODES

    c = sub.add_parser("calibrate", help="compute fp8 KV-cache scales from calibration text",
                       description="Run a model over calibration text with an unquantized (float32) KV cache, "
                                   "observe the K and V it stores and write fp8 scales.",
                       epilog=CALIBRATE_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_model_arg(c)
    c.add_argument("--data", nargs="+", required=True, metavar="FILE",
                   help="calibration text: plain text, .jsonl with a 'text' field, a MediaWiki XML dump; .bz2 ok")
    c.add_argument("--num-samples", type=int, default=None, help="number of samples (default 64; 2 with --plan)")
    c.add_argument("--seq-len", type=int, default=None, help="tokens per sample (default 512; 256 with --plan)")
    c.add_argument("--skip-tokens", type=int, default=0, help="skip this many data tokens first (default 0)")
    c.add_argument("--add-bos", action="store_true",
                   help=ADD_BOS_HELP)
    c.add_argument("--granularity", choices=[g.value for g in ScaleGranularity], default="tensor",
                   help="one scale per layer (tensor), per KV head (head) or per channel (channel)")
    c.add_argument("--statistic", choices=("amax", "percentile", "mse"), default="amax",
                   help="amax = largest |x|; percentile of |x|; mse = clip value minimising the fp8 error")
    c.add_argument("--percentile", type=float, default=99.99, help="for --statistic percentile (default 99.99)")
    c.add_argument("--format", default="fp8_e4m3", choices=list(FP8_FORMATS),
                   help="fp8 format the scales are made for (default fp8_e4m3)")
    c.add_argument("--headroom", type=_fraction, default=1.0, help="multiply every statistic by this (default 1)")
    c.add_argument("--v-headroom", type=_fraction, default=2.0,
                   help="multiply V statistics by this as well (default 2: values have no position-invariant "
                        "bound and new text exceeds the calibrated maxima; see --check-samples)")
    c.add_argument("--key-bound", choices=("position", "observed"), default="position",
                   help="position (default): K statistics over each key's RoPE envelope, the largest value it "
                        "can take at any position; observed: over the stored keys as seen")
    c.add_argument("--scale-rounding", choices=("pow2", "none"), default="pow2",
                   help="pow2 (default): round each scale up to a power of two, which never rounds a value "
                        "worse than scale 1.0 short of clipping; none: use statistic / format max as is")
    c.add_argument("--output", "-o", default=None, metavar="PATH", help="scales file to write (.json)")
    c.add_argument("--output-format", choices=("vllm", "kv8"), default=None,
                   help="default: vllm for tensor granularity with fp8_e4m3[fnuz], else kv8")
    c.add_argument("--save-model", default=None, metavar="DIR",
                   help="also write a copy of the model with the scales as checkpoint tensors")
    c.add_argument("--check-samples", type=int, default=0, metavar="N",
                   help="also run the N windows after the calibration windows and report which K/V values the "
                        "new scales would clip (default 0: no check)")
    c.add_argument("--batch", type=int, default=4, help="samples run together (default 4)")
    c.add_argument("--key-centering", action="store_true",
                   help="also measure the mean post-RoPE key per layer, KV head and channel (a first pass over the "
                        "same windows) and write it as key offsets (kv8 JSON): an engine loading the file subtracts "
                        "it from every key before storing it, for any --kv-cache-dtype (exact for attention; less "
                        "rounding error where keys keep a large constant channel); the scales describe the "
                        "centered keys")
    c.add_argument("--key-scaling", action="store_true",
                   help="with --key-centering: also measure per layer, KV head and channel the factor "
                        "(E[q^2] / E[(k - c)^2])^(1/4) and write it (kv8 JSON): an engine loading the file multiplies "
                        "every centered key by it before storing it and divides every query by it (exact for "
                        "attention; less 4-bit rounding error in the scores); not usable by a static-scale FP8 "
                        "cache")
    c.add_argument("--align-first-key", default=None, metavar="KV_CACHE_DTYPE",
                   help="with --key-centering: also record each window's key at position 0 (where most attention "
                        "goes) and, in the heads where it is the same whatever the text, move the offset so that a "
                        "KV_CACHE_DTYPE cache (int8, int4, int4_per_group32 or fp4_e2m1; with --kv-cache-rotation) "
                        "stores that key exactly (still exact for attention; the file serves that format best)")
    p = c.add_argument_group("per-layer plan (--plan)")
    p.add_argument("--plan", action="store_true",
                   help="write a kv_cache_plan file (--output) chosen from measured per-layer sensitivity, not scales")
    p.add_argument("--kld-budget", type=_fraction, default=None, metavar="NATS",
                   help="the plan of fewest bytes per token whose KLD against a float32 cache stays within this")
    p.add_argument("--bytes-budget", type=_bytes_budget, default=None, metavar="BYTES|DTYPE",
                   help="the plan of least KLD within these bytes per token (all layers), or within the bytes of a "
                        "cache all in DTYPE (e.g. fp8_e4m3: static scales, one byte per value)")
    p.add_argument("--plan-formats", nargs="+", default=None, metavar="FORMAT[+ROTATION]",
                   help="candidate specs per layer, preferred first on ties; FP8 ones keep dynamic scales "
                        f"(default: {' '.join(DEFAULT_PLAN_FORMATS)}, less those the model's head_dim does not "
                        "allow)")
    p.add_argument("--plan-sensitivity", choices=SENSITIVITY_MODES, default="proxy",
                   help="proxy (default): each layer's KLD measured end to end for its least accurate candidate, "
                        "the others scaled by their attention-output error; direct: every layer and candidate end "
                        "to end (one engine each)")
    p.add_argument("--plan-table", default=None, metavar="PLAN.json",
                   help="choose from the per-layer sensitivity an earlier --plan run recorded in its plan file "
                        "instead of measuring it again (its candidates replace --plan-formats); the plan is still "
                        "checked end to end")
    p.add_argument("--plan-check-samples", type=int, default=2, metavar="N",
                   help="held-out windows (after the calibration ones) the chosen plan is measured on (default 2)")
    p.add_argument("--plan-retries", type=int, default=2, metavar="N",
                   help="times a plan measured above --kld-budget is chosen again for a tighter budget (default 2)")
    EngineArgs.add_cli_args(c, exclude=CALIBRATE_EXCLUDED)
    c.add_argument("--no-progress", action="store_true", help="no progress bar")
    c.set_defaults(func=cmd_calibrate)


def cmd_calibrate(ns: argparse.Namespace) -> int:
    if ns.plan:
        return cmd_calibrate_plan(ns)
    for flag, value in (("--kld-budget", ns.kld_budget), ("--bytes-budget", ns.bytes_budget)):
        if value is not None:
            raise ValueError(f"{flag} sets a per-layer plan's budget; give --plan with it")
    num_samples = 64 if ns.num_samples is None else ns.num_samples
    seq_len = 512 if ns.seq_len is None else ns.seq_len
    from kv8.tools.calibrate import calibrate
    from kv8.tools.export import KEY_CENTERING_NEEDS_KV8, RANKS_NEED_VLLM, save_model_with_scales, write_scales
    from kv8.tools.kv_stats import ScaleRecipe

    if ns.output is None and ns.save_model is None:
        raise ValueError("nothing to write: give --output PATH and/or --save-model DIR")
    granularity = ScaleGranularity(ns.granularity)
    output_format = ns.output_format
    if output_format is None:
        vllm_ok = (granularity is ScaleGranularity.TENSOR and ns.format in ("fp8_e4m3", "fp8_e4m3fnuz")
                   and ns.kv_cache_rotation == "none" and ns.output is not None and ns.output.endswith(".json")
                   and not ns.key_centering)
        output_format = "vllm" if vllm_ok else "kv8"
    if ns.key_scaling and not ns.key_centering:
        raise ValueError("--key-scaling: the factors are written only beside key offsets; add --key-centering")
    if ns.align_first_key is not None and not ns.key_centering:
        raise ValueError(f"--align-first-key {ns.align_first_key}: it moves key offsets; add --key-centering")
    if ns.key_centering and (output_format != "kv8" or ns.save_model is not None):
        raise ValueError(f"--key-centering: {KEY_CENTERING_NEEDS_KV8}; give --output PATH with --output-format kv8 "
                         "(or leave it out) and no --save-model")
    if output_format == "vllm" and granularity is not ScaleGranularity.TENSOR:
        raise ValueError(f"--output-format vllm holds one scale per layer; --granularity {ns.granularity} needs "
                         "--output-format kv8")
    args = EngineArgs.from_cli_args(ns)
    per_rank = args.tensor_parallel_size > 1 and granularity is ScaleGranularity.TENSOR
    if per_rank and output_format == "kv8" and ns.output is not None:
        raise ValueError(RANKS_NEED_VLLM if not ns.key_centering else
                         "--key-centering writes kv8's scales JSON, which holds no per-rank scales: with "
                         "--tensor-parallel-size > 1 use --granularity head (an engine cuts per-head scales and the "
                         "key offsets to the heads of its rank)")
    recipe = ScaleRecipe(granularity=granularity, statistic=ns.statistic, fmt=fp8_format(ns.format),
                         percentile=ns.percentile, headroom=ns.headroom, v_headroom=ns.v_headroom,
                         key_bound=ns.key_bound, power_of_two=ns.scale_rounding == "pow2")
    result = calibrate(args.model, ns.data, recipe, num_samples=num_samples, seq_len=seq_len,
                       skip_tokens=ns.skip_tokens, dtype=args.dtype, batch=ns.batch,
                       max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=args.attention_backend,
                       rotation=args.kv_cache_rotation, check_samples=ns.check_samples,
                       tensor_parallel_size=args.tensor_parallel_size, key_centering=ns.key_centering,
                       key_scaling=ns.key_scaling, align_first_key=ns.align_first_key, add_bos=ns.add_bos,
                       show_progress=not ns.no_progress)
    s = result.scales
    print(f"calibrated {result.info.num_layers} layers on {result.num_samples} samples x {seq_len} tokens: "
          f"{s.source}")
    print(f"  K scales: min {float(s.k.min()):.4g}, max {float(s.k.max()):.4g}; "
          f"V scales: min {float(s.v.min()):.4g}, max {float(s.v.max()):.4g}")
    for r, rs in enumerate(result.rank_scales or ()):
        print(f"  rank {r}: K scales {float(rs.k.min()):.4g}..{float(rs.k.max()):.4g}, "
              f"V scales {float(rs.v.min()):.4g}..{float(rs.v.max()):.4g}")
    if result.key_offsets is not None:
        c = result.key_offsets.k
        print(f"  key offsets: |c| up to {float(c.abs().max()):.4g}; largest per layer "
              f"{[round(float(x), 3) for x in c.abs().amax(dim=(1, 2))]}")
    if result.first_key is not None:
        print(f"  {result.first_key.summary()}")
    if result.key_scaling is not None:
        f = result.key_scaling.s
        print(f"  key scaling: factors {float(f.min()):.4g}..{float(f.max()):.4g} (geometric mean 1 per head)")
    if result.check is not None:
        print(result.check.summary())
    if ns.output is not None:
        write_scales(ns.output, s, result.info, output_format, result.rank_scales, result.key_offsets,
                     result.key_scaling)
        ranks = f" for {len(result.rank_scales)} tensor-parallel ranks" if result.rank_scales else ""
        print(f"wrote {output_format} scales{ranks} to {ns.output}")
    if ns.save_model is not None:
        save_model_with_scales(ns.model, ns.save_model, s)
        note = " (one scale per layer for every rank: checkpoint tensors have no ranks)" if per_rank else ""
        print(f"wrote model with KV scales to {ns.save_model}{note}")
    return 0


def _print_now(line: str) -> None:
    print(line, flush=True)


def cmd_calibrate_plan(ns: argparse.Namespace) -> int:
    """``kv8 calibrate --plan``: search, verify and write a per-layer plan (:mod:`kv8.tools.plan_search`)."""
    import torch

    from kv8.cache.plan import KVSpec
    from kv8.quant.formats import resolve_kv_cache_dtype
    from kv8.tools.calibrate import model_arch
    from kv8.tools.plan_search import read_sensitivity_table, search_plan, write_plan_file

    if ns.output is None:
        raise ValueError("--plan writes a plan file: give --output PATH (.json)")
    if (ns.kld_budget is None) == (ns.bytes_budget is None):
        raise ValueError("--plan needs exactly one of --kld-budget NATS and --bytes-budget BYTES|DTYPE")
    for flag, given in (("--save-model", ns.save_model is not None), ("--check-samples", ns.check_samples != 0),
                        ("--kv-cache-rotation", ns.kv_cache_rotation != "none"),
                        ("--tensor-parallel-size", ns.tensor_parallel_size != 1),
                        ("--align-first-key", ns.align_first_key is not None), ("--add-bos", ns.add_bos)):
        if given:
            raise ValueError(f"{flag} does not apply to --plan (rotations are per candidate: --plan-formats "
                             "int8+hadamard; the check is --plan-check-samples)")
    args = EngineArgs.from_cli_args(ns)
    table = read_sensitivity_table(ns.plan_table) if ns.plan_table is not None else None
    bytes_budget = ns.bytes_budget
    if isinstance(bytes_budget, str):
        arch = model_arch(args.model)
        spec = KVSpec.of(resolve_kv_cache_dtype(bytes_budget, torch.float32))   # no "auto": _bytes_budget
        bytes_budget = arch.num_layers * spec.token_bytes(arch.head_dim, arch.num_kv_heads)
        print(f"--bytes-budget {ns.bytes_budget}: {bytes_budget} bytes per token ({spec.describe()} in all "
              f"{arch.num_layers} layers)")
    result = search_plan(args.model, ns.data, kld_budget=ns.kld_budget, bytes_budget=bytes_budget,
                         formats=ns.plan_formats, sensitivity=ns.plan_sensitivity,
                         num_samples=2 if ns.num_samples is None else ns.num_samples,
                         seq_len=256 if ns.seq_len is None else ns.seq_len, skip_tokens=ns.skip_tokens,
                         check_samples=ns.plan_check_samples, retries=ns.plan_retries, dtype=args.dtype,
                         max_num_batched_tokens=args.max_num_batched_tokens, attention_backend=args.attention_backend,
                         table=table, progress=(lambda line: None) if ns.no_progress else _print_now)
    width = max([36] + [len(spec.describe()) for spec in result.specs])
    print(f"layer  {'spec':<{width}} predicted KLD")
    for layer, (spec, kld) in enumerate(zip(result.specs, result.calibration["layer_kld"])):
        print(f"{layer:>5}  {spec.describe():<{width}} {kld:.3g}")
    c = result.choice
    print(f"plan: {c.bytes_per_token} bytes per token, predicted KLD {c.predicted_kld:.3g}, measured "
          f"{result.measured_kld:.3g}" + (f" (budget {ns.kld_budget:.3g})" if ns.kld_budget is not None else ""))
    write_plan_file(ns.output, result.specs, result.calibration)
    scale_mode = (" --kv-cache-scale-mode dynamic" if result.calibration["kv_cache_scale_mode"] == "dynamic"
                  else "")
    print(f"wrote {ns.output}; serve with --kv-cache-plan {ns.output}{scale_mode}")
    return 0


def add_eval_parser(sub: Any) -> None:
    from kv8.tools.evaluate import CONFIG_OPTIONS, DEFAULT_CONFIGS

    e = sub.add_parser("eval", help="accuracy of KV-cache configurations against a float32 cache",
                       description="Teacher-forced perplexity, KL divergence and top-1 agreement against a float32 "
                                   "KV cache, plus greedy-generation agreement, for each KV configuration.",
                       epilog=EVAL_EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_model_arg(e)
    e.add_argument("--data", nargs="+", required=True, metavar="FILE", help="evaluation text (as for calibrate)")
    e.add_argument("--config", dest="kv_configs", action="append", default=[], metavar='"ENGINE FLAGS"',
                   help='a configuration to evaluate, as engine flags in one argument, e.g. "--kv-cache-dtype '
                        'fp8_e4m3 --quantization-param-path kv_cache_scales.json" or "--kv-cache-dtype fp8_e4m3 '
                        '--kv-cache-scale-mode dynamic --kv-cache-rotation hadamard --quantization fp8", or a KV '
                        "cache dtype alone (fp8_e5m2); the flags allowed: "
                        + ", ".join(map(EngineArgs.flag, CONFIG_OPTIONS)) + " (repeatable; default: "
                        + ", ".join(DEFAULT_CONFIGS) + ")")
    e.add_argument("--window", type=int, default=512, help="tokens per window; the second half is scored")
    e.add_argument("--num-windows", type=int, default=16, help="windows to score (default 16)")
    e.add_argument("--skip-tokens", type=int, default=0, help="skip this many data tokens first (held-out data)")
    e.add_argument("--add-bos", action="store_true",
                   help=ADD_BOS_HELP)
    e.add_argument("--gen-prompts", type=int, default=8, help="greedy-generation prompts (0 = none)")
    e.add_argument("--gen-prompt-len", type=int, default=32, help="tokens per greedy prompt")
    e.add_argument("--gen-tokens", type=int, default=32, help="greedy tokens per prompt")
    e.add_argument("--json", nargs="?", const="-", default=None, metavar="PATH",
                   help="write the report as JSON to PATH (no PATH: print it instead of the table)")
    e.add_argument("--plot", default=None, metavar="FILE.png", help="write a figure (needs matplotlib)")
    e.add_argument("--no-progress", action="store_true", help="no progress bars")
    EngineArgs.add_cli_args(e, exclude=EVAL_EXCLUDED, defaults=EVAL_DEFAULTS)
    e.set_defaults(func=cmd_eval)


def cmd_eval(ns: argparse.Namespace) -> int:
    from kv8.tools.evaluate import DEFAULT_CONFIGS, KVConfig, evaluate

    specs = [KVConfig.from_flags(v) for v in ns.kv_configs]
    if not specs:
        specs = [KVConfig(d) for d in DEFAULT_CONFIGS]
    args = EngineArgs.from_cli_args(ns)
    report = evaluate(args.model, ns.data, specs, window=ns.window, num_windows=ns.num_windows,
                      skip_tokens=ns.skip_tokens, gen_prompts=ns.gen_prompts, gen_prompt_len=ns.gen_prompt_len,
                      gen_tokens=ns.gen_tokens, dtype=args.dtype, max_num_batched_tokens=args.max_num_batched_tokens,
                      attention_backend=args.attention_backend, add_bos=ns.add_bos, show_progress=not ns.no_progress)
    if ns.json == "-":
        json.dump(report.to_dict(), sys.stdout, indent=2)
        print()
    else:
        print(report.table())
        if ns.json is not None:
            with open(ns.json, "w", encoding="utf-8") as f:
                json.dump(report.to_dict(), f, indent=2)
                f.write("\n")
    if ns.plot is not None:
        from kv8.tools.plot import plot_report

        plot_report(report, ns.plot)
    return 0
