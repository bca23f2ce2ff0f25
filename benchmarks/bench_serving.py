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

A configuration is a KV dtype, ``+keepall`` to keep every block of sliding-window layers
(``disable_hybrid_kv_cache_manager``) instead of freeing those that left the window. ``--gemma`` runs
Gemma-3-270M (15 of its 18 layers keep a 512-token window) with prompts longer than the window, bf16 and FP8,
each with and without freeing, at one budget.
"""

from __future__ import annotations

import argparse
import random
import time

from kv8 import LLM, SamplingParams


def run(config: str, prompts: list[list[int]], args: argparse.Namespace) -> dict:
    kv_dtype, _, option = config.partition("+")
    if option not in ("", "keepall"):
        raise SystemExit(f"configuration {config!r}: the only option is +keepall")
    llm = LLM(model=args.model, kv_cache_dtype=kv_dtype, kv_cache_memory=args.kv_cache_memory,
              max_model_len=args.prompt_len + args.max_tokens + 16, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, disable_hybrid_kv_cache_manager=option == "keepall")
    eng = llm.engine
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(p, params, request_id=str(i))
    peak, generated, steps = 0, 0, 0
    prefill_tokens, prefill_seconds, decode_steps, decode_tokens, decode_seconds = 0, 0.0, 0, 0, 0.0
    start = time.perf_counter()
    while eng.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = eng.step()
        dt = time.perf_counter() - t0
        so = eng.last_schedule
        assert so is not None
        steps += 1
        peak = max(peak, len(eng.scheduler.running))
        generated += sum(len(o.outputs[0].token_ids) for o in outs if o.finished)
        prefill = sum(c.num_new_tokens for c in so.chunks if c.num_new_tokens > 1)
        if prefill:  # a step with prompt (or recomputed) tokens in it
            prefill_tokens += prefill
            prefill_seconds += dt
        else:
            decode_steps += 1
            decode_tokens += len(so.chunks)
            decode_seconds += dt
    elapsed = time.perf_counter() - start
    assert eng.kv_manager.num_free_blocks == eng.kv_manager.num_blocks
    return {"kv": config, "seconds": elapsed, "tok_s": generated / elapsed, "peak": peak, "steps": steps,
            "preemptions": eng.scheduler.num_preemptions, "blocks": eng.kv_manager.num_blocks,
            "capacity": eng.kv_manager.num_blocks * eng.config.cache.block_size, "generated": generated,
            "prefill_tokens": prefill_tokens, "prefill_seconds": prefill_seconds,
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
    ap.add_argument("--kv-dtypes", default="bfloat16,fp8_e4m3,fp8_e5m2")
    ap.add_argument("--quick", action="store_true", help="16 requests, 256-token prompts, 64 new tokens, 24MiB")
    ap.add_argument("--gemma", action="store_true",
                    help="gemma3-270m, 12 requests x 1024-token prompts + 128 new tokens, 48MiB, bf16 and fp8_e4m3 "
                         "each with and without freeing out-of-window blocks")
    args = ap.parse_args()
    if args.quick:
        args.num_requests, args.prompt_len, args.max_tokens, args.kv_cache_memory = 16, 256, 64, "24MiB"
    if args.gemma:
        args.model, args.num_requests, args.prompt_len, args.max_tokens = "gemma3-270m", 12, 1024, 128
        args.kv_cache_memory, args.kv_dtypes = "48MiB", "bfloat16+keepall,bfloat16,fp8_e4m3+keepall,fp8_e4m3"
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(args.prompt_len)] for _ in range(args.num_requests)]
    print(f"workload: {args.num_requests} requests x {args.prompt_len} prompt tokens + {args.max_tokens} new "
          f"tokens, KV budget {args.kv_cache_memory}, model {args.model}")
    results = [run(kv, prompts, args) for kv in args.kv_dtypes.split(",")]
    base, base_dec = results[0]["tok_s"], results[0]["decode_tok_s"]
    print(f"{'kv_cache_dtype':<17}{'blocks':>8}{'peak seqs':>10}{'preempt':>8}{'seconds':>9}{'gen tok/s':>10}"
          f"{'x ' + results[0]['kv']:>11} |{'prefill tok':>12}{'prefill s':>10}{'dec batch':>10}{'ms/step':>9}"
          f"{'dec tok/s':>10}{'dec x':>7}")
    for r in results:
        print(f"{r['kv']:<17}{r['blocks']:>8}{r['peak']:>10}{r['preemptions']:>8}{r['seconds']:>9.1f}"
              f"{r['tok_s']:>10.1f}{r['tok_s'] / base:>11.2f} |{r['prefill_tokens']:>12}{r['prefill_seconds']:>10.1f}"
              f"{r['decode_batch']:>10.1f}{r['decode_ms']:>9.1f}{r['decode_tok_s']:>10.1f}"
              f"{r['decode_tok_s'] / base_dec:>7.2f}")


if __name__ == "__main__":
    main()
