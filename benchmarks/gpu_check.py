"""kv8's GPU check: everything the GPU path owes a real GPU, in one run of at most ~8 minutes, compile included.

1. **tests**: the Triton kernel tests and the device tests, compiled for the GPU (pytest without
   ``TRITON_INTERPRET``): the store and attention kernel tests, the device tests and the engine on the triton
   backend (``tests/engine/test_triton_engine.py``, on the GPU there); passed / failed / skipped counts.
2. **attention**: one layer's decode attention at Llama-3.1-8B shapes (32 query heads, 8 KV heads, head_dim 128,
   blocks of 16 in shuffled order) for B x context in {1 x 32k, 32 x 4k, 128 x 2k}: kv8's Triton kernel over an
   fp8_e4m3 and a bf16 paged cache, and torch SDPA over a contiguous bf16 cache of the same tokens; each with the
   cache bytes it reads per second and that rate over the GPU's device-to-device copy rate (bytes read + written
   by ``dst.copy_(src)`` of 1 GiB per second, measured in the same run).
3. **engine**: decode tokens/s of the engine (``LLM``, ``load_format="dummy"``: random bf16 weights of
   Llama-3.1-8B's shapes, no checkpoint) at 2k context, bf16 KV vs fp8_e4m3 KV: at batch 64, and at the largest
   batch each cache runs at once in one KV budget (``--kv-budget-gib``, default 17 GiB: 65 sequences of 2k prompt +
   36 tokens in bf16, 131 in fp8; :func:`admissible_batch` counts the scheduler's admission reserve).

It prints a table per section and writes everything to ``--json PATH``. Timings are medians of CUDA-event-timed
calls after warm-up. ``--smoke`` runs the same code at tiny shapes (a tiny Llama, contexts of a few blocks, on the
CPU through Triton's interpreter when there is no GPU): the test suite runs it that way, so the script works
before a GPU ever sees it.

    PYTHONPATH=. python3 benchmarks/gpu_check.py --json $OUT/gpu_check.json      # on the GPU machine
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/gpu_check.py --smoke --json /tmp/gpu_check.json   # here
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# Llama-3.1-8B (meta-llama/Llama-3.1-8B's config.json, shapes only)
LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=131072,
                rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192})
TINY_LLAMA = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=4096,
                  rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False)


# ---- timing ----------------------------------------------------------------------------------------------------
TIMING = {"warmup": 3, "iters": 10}   # calls per timing (--smoke: 1 and 2)


def median_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Median wall time of ``fn`` (CUDA events on a GPU, perf_counter elsewhere), after warm-up calls."""
    for _ in range(TIMING["warmup"]):
        fn()
    times = []
    for _ in range(TIMING["iters"]):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_rate(device: torch.device, nbytes: int) -> float:
    """Bytes read + written per second by ``dst.copy_(src)`` of ``nbytes``."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    return 2 * nbytes / median_seconds(lambda: dst.copy_(src), device)


# ---- 1. tests ----------------------------------------------------------------------------------------------------
def run_tests(timeout: float) -> dict:
    """pytest over the GPU path's tests in a subprocess (compiled: TRITON_INTERPRET removed)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/kernels/test_triton_store.py",
           "tests/kernels/test_triton_attention.py", "tests/engine/test_device.py",
           "tests/engine/test_triton_engine.py"]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        tail, rc = (proc.stdout + proc.stderr).strip().splitlines()[-30:], proc.returncode
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        tail, rc = out.strip().splitlines()[-30:] + [f"(stopped after {timeout:.0f} s)"], None
    summary = tail[-1] if tail else ""
    print(f"tests ({time.perf_counter() - start:.0f} s): {summary}")
    return {"returncode": rc, "summary": summary, "tail": tail, "seconds": time.perf_counter() - start}


# ---- 2. decode attention -----------------------------------------------------------------------------------------
def _paged(kv_name: str, batch: int, context: int, heads: int, dim: int, block: int, device: torch.device,
           seed: int):
    """A paged cache holding ``batch`` sequences of ``context`` random tokens in shuffled blocks, and its metadata
    for one decode step (the last token of each sequence)."""
    from kv8.attention.metadata import AttentionMetadata
    from kv8.cache.codec import KVCodec
    from kv8.cache.paged_cache import CacheShape, PagedKVCache
    from kv8.quant.formats import resolve_kv_cache_dtype
    from kv8.quant.scales import KVScales

    kv_dtype = resolve_kv_cache_dtype(kv_name, torch.bfloat16)
    per_seq = -(-context // block)
    num_blocks = batch * per_seq
    scales = KVScales.default(1) if kv_dtype.is_fp8 else None
    cache = PagedKVCache(CacheShape(1, num_blocks, heads, block, dim), KVCodec.build(kv_dtype, dim, scales=scales),
                         device=device)
    gen = torch.Generator(device=device).manual_seed(seed)
    if kv_dtype.is_fp8:   # random codes of finite values (E4M3: 0x7f / 0xff are NaN)
        cache.data.random_(0, 0x7f, generator=gen)
    else:
        cache.data.normal_(0, 1, generator=gen)
    order = list(range(num_blocks))
    random.Random(seed).shuffle(order)
    tables = [order[i * per_seq:(i + 1) * per_seq] for i in range(batch)]
    meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, block, device=device)
    return cache, meta


def _rate(seconds: float, read: int, copy_bps: float) -> dict:
    return {"us": seconds * 1e6, "gbps": read / seconds / 1e9, "of_copy": read / seconds / copy_bps}


def _time_paged(backend, q: torch.Tensor, kv_name: str, context: int, heads_kv: int, block: int,
                device: torch.device, copy_bps: float) -> dict:
    """One decode step's attention over a paged cache of ``kv_name``: time and read rate."""
    batch, _, dim = q.shape
    cache, meta = _paged(kv_name, batch, context, heads_kv, dim, block, device, seed=batch * 7 + context)
    k_cache, v_cache = cache.layer(0)
    static = cache.layer_scales(0)
    out = torch.empty_like(q)
    seconds = median_seconds(lambda: backend._attend(
        q, k_cache, v_cache, out, query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
        block_tables=meta.block_tables, max_query_len=1, max_seq_len=context, scale=dim ** -0.5,
        sliding_window=None, fp8=cache.kv_dtype.fp8, k_scale=None if static is None else static[0],
        v_scale=None if static is None else static[1]), device)
    return _rate(seconds, batch * context * heads_kv * dim * 2 * cache.kv_dtype.bytes_per_element, copy_bps)


def _time_sdpa(q: torch.Tensor, context: int, heads_kv: int, device: torch.device, copy_bps: float) -> dict:
    """torch SDPA over a contiguous bf16 cache ``[B, Hkv, context, D]`` (GQA), one query token per sequence."""
    batch, _, dim = q.shape
    k = torch.randn(batch, heads_kv, context, dim, dtype=torch.bfloat16, device=device)
    v = torch.randn_like(k)
    qs = q.unsqueeze(2)   # [B, Hq, 1, D]
    seconds = median_seconds(lambda: F.scaled_dot_product_attention(qs, k, v, scale=dim ** -0.5, enable_gqa=True),
                             device)
    return _rate(seconds, 2 * k.numel() * k.element_size(), copy_bps)


def attention_rows(shapes: list[tuple[int, int]], device: torch.device, copy_bps: float, heads_q: int = 32,
                   heads_kv: int = 8, dim: int = 128, block: int = 16) -> list[dict]:
    """Section 2: per (batch, context), kv8's Triton kernel over fp8_e4m3 and bf16 paged caches, and SDPA."""
    from kv8.attention.triton import TritonBackend

    backend = TritonBackend()
    rows = []
    for batch, context in shapes:
        q = torch.randn(batch, heads_q, dim, dtype=torch.bfloat16, device=device)
        row: dict = {"batch": batch, "context": context}
        for kv_name in ("fp8_e4m3", "bfloat16"):
            row[kv_name] = _time_paged(backend, q, kv_name, context, heads_kv, block, device, copy_bps)
        row["sdpa"] = _time_sdpa(q, context, heads_kv, device, copy_bps)
        row["fp8_over_bf16"] = row["bfloat16"]["us"] / row["fp8_e4m3"]["us"]
        row["bf16_over_sdpa"] = row["bfloat16"]["us"] / row["sdpa"]["us"]
        rows.append(row)
        print(f"B {batch:4d} x {context:6d}: fp8 {row['fp8_e4m3']['us']:9.1f} us ({row['fp8_e4m3']['of_copy']:.2f} of "
              f"copy) | bf16 {row['bfloat16']['us']:9.1f} us ({row['bfloat16']['of_copy']:.2f}) | sdpa "
              f"{row['sdpa']['us']:9.1f} us ({row['sdpa']['of_copy']:.2f}) | fp8 speed-up over bf16 "
              f"{row['fp8_over_bf16']:.2f}x | bf16 paged / sdpa {row['bf16_over_sdpa']:.2f}x", flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


# ---- 3. the engine -----------------------------------------------------------------------------------------------
def make_model_dir(path: Path, config: dict) -> str:
    """A model directory with a Llama config.json and a word-level tokenizer of ``vocab_size`` tokens (t0, t1, ...):
    all ``load_format="dummy"`` needs."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = config["vocab_size"]
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="t1", eos_token="t2", unk_token="t0")
    path.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(path))
    cfg = dict(config, model_type="llama", architectures=["LlamaForCausalLM"], bos_token_id=1, eos_token_id=2,
               torch_dtype="bfloat16")
    (path / "config.json").write_text(json.dumps(cfg))
    return str(path)


def admissible_batch(num_blocks: int, block_size: int, prompt: int, total: int) -> int:
    """The most sequences of ``prompt`` tokens growing to ``total`` that run at once in ``num_blocks`` blocks: each
    holds its blocks at the end, and the scheduler admits the last one only with every running sequence's growth
    reserve free (:data:`kv8.engine.scheduler.GROWTH_RESERVE_TOKENS` each, at most a quarter of the pool)."""
    from kv8.engine.scheduler import GROWTH_RESERVE_TOKENS

    final, first = -(-total // block_size), -(-prompt // block_size)
    reserve = -(-GROWTH_RESERVE_TOKENS // block_size)
    n = num_blocks // final
    while n > 0 and n * first + min((n - 1) * reserve, num_blocks // 4) > num_blocks:
        n -= 1
    return n


def engine_decode(model: str, kv_name: str, batch: int, context: int, decode_steps: int, kv_budget: int,
                  device: str, attention_backend: str) -> dict:
    """Decode tokens/s of ``batch`` sequences of ``context`` prompt tokens: prefill them all, then time
    ``decode_steps`` engine steps of the full batch."""
    from kv8 import LLM, SamplingParams

    llm = LLM(model=model, load_format="dummy", dtype="bfloat16", device=device, kv_cache_dtype=kv_name,
              kv_cache_memory=kv_budget, max_model_len=context + decode_steps + 16, max_num_seqs=batch,
              max_num_batched_tokens=max(8192, context), attention_backend=attention_backend)
    eng = llm.engine
    capacity = eng.stats().kv_capacity_tokens
    rng = random.Random(0)
    vocab = eng.config.arch.vocab_size
    params = SamplingParams(temperature=0, max_tokens=decode_steps + 4, ignore_eos=True)
    for i in range(batch):
        eng.add_request([rng.randrange(3, vocab) for _ in range(context)], params, request_id=str(i))
    start = time.perf_counter()
    while eng.stats().num_prefilling or eng.stats().num_waiting:
        eng.step()
    prefill_s = time.perf_counter() - start
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    sync()
    steps, tokens, start = 0, 0, time.perf_counter()
    # a hand loop, not run_to_completion: it times decode_steps steps of the full batch, then aborts the requests
    while steps < decode_steps and eng.has_unfinished_requests():
        eng.step()
        stats = eng.stats()
        tokens += stats.last_step_decode_tokens
        steps += 1
    sync()
    seconds = time.perf_counter() - start
    for i in range(batch):
        eng.abort_request(str(i))
    free = eng.stats()
    assert free.num_free_blocks == free.num_blocks, "blocks were not returned"
    eng.shutdown()
    del llm, eng
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    row = {"kv": kv_name, "batch": batch, "context": context, "decode_steps": steps, "decode_tokens": tokens,
           "tok_s": tokens / seconds, "ms_per_step": 1e3 * seconds / max(steps, 1), "prefill_s": prefill_s,
           "kv_capacity_tokens": capacity,
           "max_batch_in_budget": admissible_batch(free.num_blocks, free.block_size, context, context + steps + 4)}
    print(f"engine {kv_name:9s} B {batch:4d} x {context}: {row['tok_s']:9.1f} tok/s ({row['ms_per_step']:.2f} ms "
          f"per step; prefill {prefill_s:.1f} s; the budget holds {row['max_batch_in_budget']} such sequences)",
          flush=True)
    return row


def engine_rows(model: str, batch: int, context: int, decode_steps: int, kv_budget: int, device: str,
                attention_backend: str) -> dict:
    at_batch = [engine_decode(model, kv, batch, context, decode_steps, kv_budget, device, attention_backend)
                for kv in ("bfloat16", "fp8_e4m3")]
    at_max = []
    for row in at_batch:   # the largest batch each cache holds in the same budget
        most = row["max_batch_in_budget"]
        at_max.append(row if most == batch else
                      engine_decode(model, row["kv"], most, context, decode_steps, kv_budget, device,
                                    attention_backend))
    result = {"at_batch": at_batch, "at_max_batch": at_max,
              "fp8_over_bf16_at_batch": at_batch[1]["tok_s"] / at_batch[0]["tok_s"],
              "fp8_over_bf16_at_budget": at_max[1]["tok_s"] / at_max[0]["tok_s"]}
    print(f"engine: fp8 / bf16 KV decode tok/s at batch {batch}: {result['fp8_over_bf16_at_batch']:.2f}x; at one KV "
          f"budget ({kv_budget / 2**30:.2f} GiB; batches {at_max[0]['batch']} and {at_max[1]['batch']}): "
          f"{result['fp8_over_bf16_at_budget']:.2f}x", flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (the test suite's run; CPU + interpreter)")
    ap.add_argument("--skip", nargs="*", default=[], choices=("tests", "attention", "engine"))
    ap.add_argument("--tests-timeout", type=float, default=240.0, help="seconds for section 1")
    ap.add_argument("--kv-budget-gib", type=float, default=17.0, help="section 3's KV budget")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        TIMING.update(warmup=1, iters=2)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error("no CUDA GPU: run with TRITON_INTERPRET=1 (and --smoke) to check the script on the CPU")
    result: dict = {"device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
                    "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "smoke": args.smoke}
    try:
        import triton
        result["triton"] = triton.__version__
    except ImportError:
        result["triton"] = None
    print(f"kv8 GPU check on {result['device']} (torch {result['torch']}, triton {result['triton']})", flush=True)
    start = time.perf_counter()
    if "tests" not in args.skip:
        result["tests"] = run_tests(args.tests_timeout)
    if "attention" not in args.skip:
        copy_bps = copy_rate(device, 2**20 if args.smoke else 2**30)
        result["copy_GBps"] = copy_bps / 1e9
        print(f"device-to-device copy: {copy_bps / 1e9:.0f} GB/s (read + written)", flush=True)
        shapes = [(1, 64), (2, 48)] if args.smoke else [(1, 32768), (32, 4096), (128, 2048)]
        dims = dict(heads_q=4, heads_kv=2, dim=32) if args.smoke else {}
        result["attention"] = attention_rows(shapes, device, copy_bps, **dims)
    if "engine" not in args.skip:
        with tempfile.TemporaryDirectory() as tmp:
            model = make_model_dir(Path(tmp) / "model", TINY_LLAMA if args.smoke else LLAMA_8B)
            if args.smoke:
                # 8 bf16 blocks of 16 tokens: 3 sequences of 20 + 6 tokens at once in bf16 (2 blocks each and the
                # admission reserve), 6 in fp8
                result["engine"] = engine_rows(model, batch=2, context=20, decode_steps=2, kv_budget=64 * 1024,
                                               device=device.type, attention_backend="triton")
            else:
                result["engine"] = engine_rows(model, batch=64, context=2048, decode_steps=32,
                                               kv_budget=int(args.kv_budget_gib * 2**30), device=device.type,
                                               attention_backend="auto")
    result["seconds"] = time.perf_counter() - start
    print(f"done in {result['seconds']:.0f} s", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
