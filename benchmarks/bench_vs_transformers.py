"""kv8 vs Hugging Face transformers ``generate`` on the same model and prompts, side by side in one run.

transformers is what a CPU user would reach for: it loads the same GGUF file (dequantized), runs batched
``generate`` in bf16 with left padding and its own (contiguous) KV cache. kv8 runs the same prompts with its
paged cache (bf16 and FP8). Both decode greedily for exactly ``--max-tokens`` tokens.

    .venv/bin/python benchmarks/bench_vs_transformers.py            # 16 prompts x ~512 tokens, 128 new
    .venv/bin/python benchmarks/bench_vs_transformers.py --quick
"""

from __future__ import annotations

import argparse
import os
import random
import time

import torch

from kv8 import LLM, SamplingParams
from kv8.loader.sources import default_model_path


def bench_transformers(prompts: list[list[int]], max_tokens: int, batch: int) -> float:
    from transformers import AutoModelForCausalLM

    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                 dtype=torch.bfloat16)
    model.eval()
    pad = model.config.eos_token_id if isinstance(model.config.eos_token_id, int) else 2
    generated = 0
    start = time.perf_counter()
    for i in range(0, len(prompts), batch):
        group = prompts[i:i + batch]
        width = max(len(p) for p in group)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in group])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in group])
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                 min_new_tokens=max_tokens, do_sample=False, pad_token_id=pad)
        generated += (out.shape[1] - width) * len(group)
    return generated / (time.perf_counter() - start)


def bench_kv8(prompts: list[list[int]], max_tokens: int, kv: str) -> float:
    llm = LLM(kv_cache_dtype=kv, kv_cache_memory="1GiB", max_model_len=2048)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    return sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - start)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--hf-batch", type=int, default=16, help="transformers batch size")
    ap.add_argument("--quick", action="store_true", help="8 prompts x 128 tokens, 32 new tokens")
    args = ap.parse_args()
    if args.quick:
        args.num_prompts, args.prompt_len, args.max_tokens, args.hf_batch = 8, 128, 32, 8
    rng = random.Random(0)
    # Ragged lengths (75%..100% of --prompt-len) as in real traffic; transformers pads them.
    prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(args.prompt_len * 3 // 4, args.prompt_len))]
               for _ in range(args.num_prompts)]
    print(f"workload: {args.num_prompts} prompts of {args.prompt_len * 3 // 4}-{args.prompt_len} tokens, "
          f"{args.max_tokens} new tokens each, SmolLM2-135M, bf16 compute, greedy")
    rows = [("transformers generate (bf16)", bench_transformers(prompts, args.max_tokens, args.hf_batch))]
    rows.append(("kv8 bf16 cache", bench_kv8(prompts, args.max_tokens, "bfloat16")))
    rows.append(("kv8 fp8_e4m3 cache", bench_kv8(prompts, args.max_tokens, "fp8_e4m3")))
    base = rows[0][1]
    print(f"{'engine':<30}{'tok/s':>10}{'x transformers':>16}")
    for name, tps in rows:
        print(f"{name:<30}{tps:>10.1f}{tps / base:>16.2f}")


if __name__ == "__main__":
    main()
