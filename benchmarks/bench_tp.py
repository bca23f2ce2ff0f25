"""Tensor parallelism: one rank vs two on the same cores, side by side in one run.

A random Llama model shaped like SmolLM2-135M but with heads that split in two (hidden 512, 8 query heads,
2 KV heads of 64, MLP 1536, 30 layers, SmolLM2's 49,152-token vocabulary and tokenizer, tied embeddings; about
the same weights per token) runs as ``tensor_parallel_size=1`` with ``--threads`` threads and as
``tensor_parallel_size=2`` with ``threads / 2`` threads per rank, FP8 (E4M3) cache, the same
``kv_cache_memory`` per rank. Prints per configuration:

* the KV blocks and tokens each rank's cache holds (a rank holds half the KV heads: twice the tokens);
* the median time of a prefill step (4 prompts x 512 tokens) and of decode steps at ``--batch`` sequences of
  ``--context`` tokens, and the TP=2 / TP=1 ratio;
* for TP=2, what rank 0 spends per decode step in its all-reduces (2 per layer and one for the embedding,
  ``[batch, 512]`` in the compute dtype, through shared memory), which includes waiting for the slower rank, and
  the share of the step;
* the cost of one such all-reduce between two idle processes, gloo over loopback TCP vs shared memory.

On one machine TP trades compute spread over processes for an all-reduce per row-parallel layer: it shows
correctness and capacity here; the all-reduce column is the fixed cost per step that larger machines (more
cores per rank, or ranks on more machines) must amortize.

    .venv/bin/python benchmarks/bench_tp.py                       # batch 8 and 32 x 512 context (a few minutes)
    .venv/bin/python benchmarks/bench_tp.py --quick               # small smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from typing import Any

import torch
from engine_steps import time_prefill_step

from kv8 import LLM, SamplingParams

SHAPE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
             num_key_value_heads=2, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=1e5,
             tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def make_model(out_dir: str) -> str:
    """Write the random model (bf16 safetensors) with SmolLM2's tokenizer into ``out_dir``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kv8.loader.sources import resolve_model_path
    from kv8.loader.tokenizer import load_tokenizer

    tok = load_tokenizer(*resolve_model_path("smollm2-135m"))
    tok.save_pretrained(out_dir)
    config = LlamaConfig(vocab_size=len(tok), **SHAPE)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.05)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


class AllReduceTimer:
    """Wraps rank 0's ``TPGroup.all_reduce`` (the layers call it on the group they were built with)."""

    def __init__(self, tp: Any) -> None:
        self.calls, self.seconds = 0, 0.0
        inner = tp.all_reduce

        def timed(x: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            out = inner(x)
            self.seconds += time.perf_counter() - start
            self.calls += 1
            return out

        tp.all_reduce = timed

    def take(self) -> tuple[int, float]:
        out = (self.calls, self.seconds)
        self.calls, self.seconds = 0, 0.0
        return out


def measure(model: str, tp_size: int, args: argparse.Namespace) -> dict[str, Any]:
    threads = max(1, args.threads // tp_size)
    if tp_size == 1:
        torch.set_num_threads(threads)
    llm = LLM(model=model, kv_cache_dtype="fp8_e4m3", kv_cache_memory=args.kv_cache_memory, max_model_len=4096,
              tensor_parallel_size=tp_size, cpu_threads_per_rank=threads if tp_size > 1 else None,
              max_num_seqs=max(args.batches))
    eng = llm.engine
    timer = AllReduceTimer(eng.tp) if tp_size > 1 else None
    rng = random.Random(0)
    ids = iter(range(10**9))
    stats = eng.stats()
    row: dict[str, Any] = {"tp": tp_size, "threads": threads, "blocks": stats.num_blocks,
                           "tokens": stats.kv_capacity_tokens}

    def prompt(n: int) -> list[int]:
        return [rng.randrange(100, 40000) for _ in range(n)]

    def prefill_step() -> float:
        return time_prefill_step(eng, lambda: prompt(512), ids)

    prefill_step()
    row["prefill_ms"] = 1e3 * statistics.median(prefill_step() for _ in range(args.repeats))
    for batch in args.batches:
        params = SamplingParams(temperature=0, max_tokens=args.repeats + 10, ignore_eos=True)
        batch_ids = [eng.add_request(prompt(args.context), params, request_id=f"d{next(ids)}") for _ in range(batch)]
        while (s := eng.stats()).num_waiting or s.num_prefilling:   # until every prompt is in the cache
            eng.step()
        for _ in range(3):
            eng.step()
        if timer is not None:
            timer.take()
        times, reduce_s, calls = [], 0.0, 0
        for _ in range(args.repeats):
            start = time.perf_counter()
            eng.step()
            times.append(time.perf_counter() - start)
        if timer is not None:
            calls, reduce_s = timer.take()
        eng.run_to_completion(batch_ids)
        row[f"decode_ms_{batch}"] = 1e3 * statistics.median(times)
        row[f"reduce_ms_{batch}"] = 1e3 * reduce_s / args.repeats
        row[f"reduces_{batch}"] = calls / args.repeats
    llm.close()
    return row


def _collective_rank(rank: int, port: int, path: str, shape: tuple[int, int], calls: int, out: Any) -> None:
    import torch.distributed as dist

    from kv8.distributed.shm_allreduce import ShmAllReduce

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0)
    pg = dist.ProcessGroupGloo(store, rank, 2)
    shm = ShmAllReduce(path, rank, 2, 1 << 20, 60.0, lambda: None)
    x = torch.randn(shape).to(torch.bfloat16)
    result = {}
    for name, reduce in (("gloo", lambda t: pg.allreduce([t]).wait()), ("shared memory", shm.all_reduce)):
        for _ in range(50):
            reduce(x.clone())
        pg.barrier().wait()
        start = time.perf_counter()
        for _ in range(calls):
            reduce(x.clone())
        result[name] = 1e6 * (time.perf_counter() - start) / calls
    if rank == 0:
        out.put(result)
    pg.barrier().wait()


def collectives(batch: int, calls: int = 300) -> dict[str, float]:
    """Microseconds per all-reduce of ``[batch, 512]`` bf16 between two idle processes: gloo over loopback TCP
    vs kv8's shared-memory all-reduce (what one decode step's 2 x 30 all-reduces cost without compute)."""
    import multiprocessing
    import socket

    from kv8.distributed.shm_allreduce import create_shm_file

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    path = create_shm_file(2, 1 << 20)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_collective_rank, args=(r, port, path, (batch, SHAPE["hidden_size"]), calls, out))
             for r in range(2)]
    try:
        for p in procs:
            p.start()
        return out.get(timeout=300)
    finally:
        for p in procs:
            p.join(30)
        os.unlink(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 2, help="cores for all ranks together")
    ap.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--kv-cache-memory", default="256MiB", help="per rank")
    ap.add_argument("--quick", action="store_true", help="batch 4 x 128 context, 3 repeats")
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    if args.quick:
        args.batches, args.context, args.repeats = [4], 128, 3
    with tempfile.TemporaryDirectory(prefix="kv8-bench-tp-") as d:
        model = make_model(d)
        rows = [measure(model, n, args) for n in (1, 2)]
    one, two = rows
    print(f"\nrandom Llama {SHAPE['num_hidden_layers']} layers x hidden {SHAPE['hidden_size']}, "
          f"{SHAPE['num_attention_heads']}q/{SHAPE['num_key_value_heads']}kv heads, fp8_e4m3 cache, "
          f"{args.kv_cache_memory} per rank, {args.threads} cores in all")
    print(f"{'config':<22}{'KV tokens/rank':>15}{'prefill 4x512':>15}" +
          "".join(f"{f'decode B={b}':>13}{'all-reduce':>12}" for b in args.batches))
    for r in rows:
        cells = "".join(f"{r[f'decode_ms_{b}']:>10.1f} ms" +
                        (f"{r[f'reduce_ms_{b}']:>9.1f} ms" if r["tp"] > 1 else f"{'-':>12}") for b in args.batches)
        name = f"TP={r['tp']} x {r['threads']} thread(s)"
        print(f"{name:<22}{r['tokens']:>15,}"
              f"{r['prefill_ms']:>12.1f} ms{cells}")
    ratios = "".join(f"{two[f'decode_ms_{b}'] / one[f'decode_ms_{b}']:>13.2f}x{'':>11}" for b in args.batches)
    print(f"{'TP=2 / TP=1':<22}{two['tokens'] / one['tokens']:>14.2f}x{two['prefill_ms'] / one['prefill_ms']:>14.2f}x"
          f"{ratios}")
    for b in args.batches:
        reduce_ms, calls = two[f"reduce_ms_{b}"], max(two[f"reduces_{b}"], 1)
        print(f"B={b}: rank 0 runs {calls:.0f} all-reduces per decode step, {reduce_ms:.2f} ms = "
              f"{100 * reduce_ms / two[f'decode_ms_{b}']:.0f}% of the step ({1e3 * reduce_ms / calls:.0f} us each, "
              "waiting for rank 1 included)")
    for b in args.batches:
        us = collectives(b)
        print(f"all-reduce of [{b}, {SHAPE['hidden_size']}] bf16 between two idle processes: "
              + ", ".join(f"{name} {v:.0f} us" for name, v in us.items())
              + f" (x {two[f'reduces_{b}']:.0f} per decode step: gloo {us['gloo'] * two[f'reduces_{b}'] / 1e3:.1f} ms)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
