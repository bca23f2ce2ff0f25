"""Serving throughput at a fixed KV-cache memory budget: bf16 cache vs FP8 cache, side by side in one run.

Many concurrent requests with long prompts go through kv8's continuous batching (default engine settings:
prefix caching on, so a preempted request's blocks can be found again when it is resumed). The KV budget is the same
for every configuration, so an FP8 cache holds twice the tokens and can run about twice the sequences at
once. Prints generated tokens per second, peak concurrent sequences, preemptions, and the ratio to bf16; then
where the time went: prompt tokens computed (recomputation after preemption included) and the seconds of the
steps that computed them, and for the decode-only steps the mean batch, ms per step, tokens per second and
its ratio to bf16.

    .venv/bin/python benchmarks/bench_serving.py                  # 64 x (128 + 512 new), 68MiB (a few minutes)
    .venv/bin/python benchmarks/bench_serving.py --quick          # small smoke run
    .venv/bin/python benchmarks/bench_serving.py --gemma          # Gemma-3-270M, sliding windows: freeing on/off

A configuration is engine flags (``--config "--kv-cache-dtype fp8_e4m3 --disable-hybrid-kv-cache-manager"``,
repeatable); ``--disable-hybrid-kv-cache-manager`` keeps every block of sliding-window layers instead of freeing
those that left the window. ``--gemma`` runs
Gemma-3-270M (15 of its 18 layers keep a 512-token window) with prompts longer than the window, bf16 and FP8,
each with and without freeing, at one budget.
"""

from __future__ import annotations

import argparse
import random
import time

from kv8 import LLM, SamplingParams
from kv8.engine.args import EngineArgs

# the engine options a configuration may set (the workload sets the others)
CONFIG_OPTIONS = ("kv_cache_dtype", "disable_hybrid_kv_cache_manager", "kv_cache_scale_mode", "kv_cache_rotation",
                  "quantization", "enable_prefix_caching")
DEFAULT_CONFIGS = ("--kv-cache-dtype bfloat16", "--kv-cache-dtype fp8_e4m3", "--kv-cache-dtype fp8_e5m2")
GEMMA_CONFIGS = ("--kv-cache-dtype bfloat16 --disable-hybrid-kv-cache-manager", "--kv-cache-dtype bfloat16",
                 "--kv-cache-dtype fp8_e4m3 --disable-hybrid-kv-cache-manager", "--kv-cache-dtype fp8_e4m3")


def config_name(flags: str) -> str:
    """A row's name: its flags, the cache dtype's value first and without its flag."""
    return flags.replace("--kv-cache-dtype ", "", 1).strip()


def run(flags: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    options = EngineArgs.parse_flags(flags, include=CONFIG_OPTIONS, what="--config")
    llm = LLM(model=args.model, **options, kv_cache_memory=args.kv_cache_memory,
              max_model_len=args.prompt_len + args.max_tokens + 16, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(p, params, request_id=str(i))
    peak, generated, steps = 0, 0, 0
    prefill_tokens, prefill_seconds, decode_steps, decode_tokens, decode_seconds = 0, 0.0, 0, 0, 0.0
    start = time.perf_counter()
    # a hand loop, not run_to_completion: each step is timed and read with eng.stats() after it
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        stats = eng.stats()
        steps += 1
        peak = max(peak, stats.num_running)
        generated += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
        if stats.last_step_prefill_tokens:  # a step with prompt (or recomputed) tokens in it
            prefill_tokens += stats.last_step_prefill_tokens
            prefill_seconds += dt
        else:
            decode_steps += 1
            decode_tokens += stats.last_step_decode_tokens
            decode_seconds += dt
    elapsed = time.perf_counter() - start
    stats = eng.stats()
    assert stats.num_free_blocks == stats.num_blocks
    return {"kv": config_name(flags), "seconds": elapsed, "tok_s": generated / elapsed, "peak": peak, "steps": steps,
            "preemptions": stats.num_preemptions, "blocks": stats.num_blocks, "capacity": stats.kv_capacity_tokens,
            "generated": generated, "prefill_tokens": prefill_tokens, "prefill_seconds": prefill_seconds,
            "decode_batch": decode_tokens / max(decode_steps, 1),
            "decode_ms": 1e3 * decode_seconds / max(decode_steps, 1),
            "decode_tok_s": decode_tokens / decode_seconds if decode_seconds else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--kv-cache-memory", default="68MiB",
                    help="the same budget for every configuration (68MiB holds ~4.8 bf16 / ~9.7 fp8 sequences of "
                         "640 tokens of SmolLM2)")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--config", action="append", default=None, metavar='"ENGINE FLAGS"',
                    help="a configuration as engine flags, e.g. \"--kv-cache-dtype fp8_e4m3\" (repeatable; flags of "
                         + ", ".join(map(EngineArgs.flag, CONFIG_OPTIONS)) + "; default: "
                         + "; ".join(DEFAULT_CONFIGS) + ")")
    ap.add_argument("--quick", action="store_true", help="16 requests, 256-token prompts, 64 new tokens, 24MiB")
    ap.add_argument("--gemma", action="store_true",
                    help="gemma3-270m, 12 requests x 1024-token prompts + 128 new tokens, 48MiB, bf16 and fp8_e4m3 "
                         "each with and without freeing out-of-window blocks")
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.prompt_len, args.max_tokens, args.kv_cache_memory = 16, 256, 64, "24MiB"
    if args.gemma:
        args.model, args.num_requests, args.prompt_len, args.max_tokens = "gemma3-270m", 12, 1024, 128
        args.kv_cache_memory = "48MiB"
        args.config = args.config or list(GEMMA_CONFIGS)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    print(f"workload: {args.num_requests} requests x {args.prompt_len} prompt tokens + {args.max_tokens} new "
          f"tokens, KV budget {args.kv_cache_memory}, model {args.model}")
    try:
        results = [run(flags, prompts, args) for flags in args.config or DEFAULT_CONFIGS]
    except ValueError as e:
        ap.error(str(e))
    base, base_dec = results[0]["tok_s"], results[0]["decode_tok_s"]
    width = max(17, *(len(r["kv"]) + 2 for r in results))
    print(f"{'configuration':<{width}}{'blocks':>8}{'peak seqs':>10}{'preempt':>8}{'seconds':>9}{'gen tok/s':>10}"
          f"{'x first':>11} |{'prefill tok':>12}{'prefill s':>10}{'dec batch':>10}{'ms/step':>9}"
          f"{'dec tok/s':>10}{'dec x':>7}")
    for r in results:
        print(f"{r['kv']:<{width}}{r['blocks']:>8}{r['peak']:>10}{r['preemptions']:>8}{r['seconds']:>9.1f}"
              f"{r['tok_s']:>10.1f}{r['tok_s'] / base:>11.2f} |{r['prefill_tokens']:>12}{r['prefill_seconds']:>10.1f}"
              f"{r['decode_batch']:>10.1f}{r['decode_ms']:>9.1f}{r['decode_tok_s']:>10.1f}"
              f"{r['decode_tok_s'] / base_dec:>7.2f}")
    print(f"x first, dec x: ratios to the first configuration ({results[0]['kv']})")


if __name__ == "__main__":
    main()
