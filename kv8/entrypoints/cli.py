"""The ``kv8`` command line: a thin layer that turns flags into :class:`EngineArgs` and ``SamplingParams``.

Subcommands: ``generate`` (text from a prompt), ``info`` (architecture and KV-cache capacity per dtype),
``serve`` (the OpenAI-compatible HTTP server; ``run`` is its alias).
``calibrate`` / ``eval`` (fp8 KV-scale calibration and accuracy evaluation, :mod:`kv8.tools.commands`).
Engine flags use vLLM's names (``--kv-cache-dtype``, ``--quantization-param-path``, ``--max-model-len`` ...) and
are generated from the fields of :class:`EngineArgs` (``EngineArgs.add_cli_args`` / ``from_cli_args``); the
server and data-parallel flags from :class:`ServerArgs`; the flags declared here are sampling and output ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kv8.cache.budget import KVBudget, default_kv_cache_memory, default_max_model_len
from kv8.cache.config import CacheConfig
from kv8.engine.args import EngineArgs
from kv8.engine.config import EngineConfig, resolve_dtype
from kv8.entrypoints.openai.cli_args import ServerArgs, add_serve_args
from kv8.kernels.cpu.build import KernelUnavailable
from kv8.models.config import ModelArchConfig
from kv8.models.registry import arch_config
from kv8.platform import CPU, Platform
from kv8.quant.formats import KV_PAIR_ALIASES, resolve_kv_cache_dtype, resolve_kv_cache_dtypes
from kv8.validators import format_bytes, parse_memory

EPILOG = """examples:
  kv8 generate "London is the capital of"                       # default model, 16-bit cache
  kv8 generate "London is the capital of" --kv-cache-dtype fp8  # FP8 (E4M3) cache, scale 1.0
  kv8 generate "Hi" --kv-cache-dtype fp8 --quantization-param-path kv_cache_scales.json
  kv8 info smollm2-135m --kv-cache-memory 1GiB
  kv8 serve smollm2-135m --kv-cache-dtype fp8_e5m2 --port 8000  # OpenAI-compatible server (--model-id too)
  kv8 serve smollm2-135m --kv-cache-dtype fp8 --quantization-param-path kv_cache_scales.json
models: the alias smollm2-135m (default), a Hugging Face model directory, or a .gguf file."""

# kv8 info loads no weights: only the options that size the cache table and name the dense plan apply to it (and,
# with --kv-cache-plan, those that store the layers the plan does not name, and the context its table counts in)
INFO_OPTIONS = ("kv_cache_memory", "gpu_memory_utilization", "block_size", "device", "dtype", "quantization",
                "kv_cache_plan", "kv_cache_dtype", "kv_cache_rotation", "kv_cache_scale_mode", "max_model_len",
                "quantization_param_path")
# kv8 tune times the dense layers of a model in one dtype and quantization, and the decode attention over its cache
TUNE_OPTIONS = ("dtype", "quantization", "kv_cache_dtype", "kv_cache_scale_mode", "kv_cache_plan", "block_size")


def cmd_serve(ns: argparse.Namespace) -> int:
    engine_args = EngineArgs.from_cli_args(ns)
    server = ServerArgs.from_cli_args(ns)
    from kv8.engine.worker import run_torchrun_worker

    if run_torchrun_worker(engine_args):   # a torchrun rank other than 0: it served rank 0 until it stopped
        return 0
    if server.data_parallel_backend == "ray":
        from kv8.entrypoints.dp.app import run_ray_server

        return run_ray_server(server, engine_args)
    from kv8.entrypoints.openai.api_server import run_server

    return run_server(server, engine_args)


@dataclass
class _Timings:
    """Wall-clock marks of one ``kv8 generate`` run (seconds from ``time.perf_counter``)."""

    start: float
    prompt_tokens: int = 0
    first_token: float | None = None     # the first sampled token of any sequence
    prefilled: float | None = None       # every sequence has its first token
    end: float = 0.0
    generated: int = 0
    sequences: int = 0

    def summary(self) -> str:
        """One line: time to first token, prefill and decode throughput (what ``-v`` promises)."""
        ttft = (self.first_token or self.end) - self.start
        prefill_s = (self.prefilled or self.end) - self.start
        decode_s = self.end - (self.prefilled or self.end)
        decode_tokens = self.generated - self.sequences
        prefill = f"{self.prompt_tokens / prefill_s:.1f} tok/s" if prefill_s > 0 else "-"
        decode = f"{decode_tokens / decode_s:.1f} tok/s" if decode_s > 0 and decode_tokens > 0 else "-"
        return (f"kv8: {self.prompt_tokens} prompt tokens, {self.generated} generated in "
                f"{self.end - self.start:.2f} s; time to first token {ttft * 1000:.0f} ms; prefill {prefill}; "
                f"decode {decode}")


def _generate(llm: Any, prompts: list[Any], params: Any, stream: bool) -> tuple[list[Any], _Timings]:
    """Run the prompts on ``llm``'s engine step by step (as ``LLM.generate`` does), recording the timings; with
    ``stream`` (one prompt, one sample) the new text goes to stdout as it is produced, holding back what could
    be the start of a stop string."""
    engine = llm.engine
    t = _Timings(start=time.perf_counter())
    ids = [engine.add_request(p, params, request_id=f"cli-{i}") for i, p in enumerate(prompts)]
    holdback = max((len(x) for x in params.stop or ()), default=1) - 1
    started: set[tuple[str, int]] = set()
    shown = 0

    def on_output(out: Any) -> None:
        nonlocal shown
        for c in out.outputs:
            if c.token_ids and (out.request_id, c.index) not in started:
                started.add((out.request_id, c.index))
                t.first_token = t.first_token or time.perf_counter()
                if len(started) == len(ids) * params.n:
                    t.prefilled = time.perf_counter()
        if stream:
            text = out.outputs[0].text
            visible = text if out.finished else text[:max(shown, len(text) - holdback)]
            sys.stdout.write(visible[shown:])
            sys.stdout.flush()
            shown = len(visible)

    outs = engine.run_to_completion(ids, on_output)
    t.end = time.perf_counter()
    t.prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    t.generated = sum(len(c.token_ids) for o in outs for c in o.outputs)
    t.sequences = len(ids) * params.n
    return outs, t


def cmd_generate(ns: argparse.Namespace) -> int:
    from kv8.entrypoints.llm import LLM
    from kv8.sampling_params import SamplingParams

    llm = LLM(**vars(EngineArgs.from_cli_args(ns)))
    params = SamplingParams(n=ns.n, temperature=ns.temperature, top_p=ns.top_p, top_k=ns.top_k, min_p=ns.min_p,
                            seed=ns.sampling_seed, max_tokens=ns.max_tokens, stop=ns.stop or None,
                            ignore_eos=ns.ignore_eos)
    if ns.chat:   # each prompt is its own one-message conversation
        prompts: list[Any] = [llm.chat_prompt_ids([{"role": "user", "content": p}]) for p in ns.prompt]
    else:
        prompts = list(ns.prompt)
    stream = len(prompts) == 1 and ns.n == 1 and not ns.json
    if stream and not ns.chat:
        print(prompts[0], end="", flush=True)
    outs, timings = _generate(llm, prompts, params, stream)
    if stream:
        print(flush=True)
    else:
        for out in outs:
            for c in out.outputs:
                if ns.json:
                    record = {"prompt": out.prompt, "index": c.index, "text": c.text, "token_ids": c.token_ids,
                              "finish_reason": c.finish_reason}
                    print(json.dumps(record | ({"error": c.error} if c.error else {})))
                else:
                    print(c.text if ns.chat else (out.prompt or "") + c.text)
    if ns.verbose:
        print(timings.summary(), file=sys.stderr, flush=True)
    failed = [(i, c) for i, out in enumerate(outs) for c in out.outputs if c.finish_reason == "error"]
    for i, c in failed:   # a request the engine could not finish (e.g. NaN logits): say why, exit 1
        print(f"kv8: error: generation failed for prompt {i}" + (f", sample {c.index}" if ns.n > 1 else "")
              + f": {c.error}", file=sys.stderr)
    return 1 if failed else 0


def cmd_info(ns: argparse.Namespace) -> int:
    from kv8.loader.model import describe_weights, read_model_config
    from kv8.loader.sources import resolve_model_path

    kind, path = resolve_model_path(ns.model)
    hf_config = read_model_config(kind, path)
    arch = arch_config(hf_config)
    platform = Platform.resolve(ns.device)
    if ns.kv_cache_memory:
        memory = parse_memory(ns.kv_cache_memory)
    elif platform.kind == "cuda":   # the engine's rule: what gpu_memory_utilization leaves after weights, activations
        memory = EngineArgs.from_cli_args(ns).create_engine_config(hf_config, kind, path).kv_budget().memory()
    else:
        memory = default_kv_cache_memory(platform)
    # the same checks as an engine's cache (block_size a power of two, memory > 0, the utilization in (0, 1]), for
    # any dtype
    CacheConfig(kv_dtype=resolve_kv_cache_dtype("auto", resolve_dtype("auto")), block_size=ns.block_size,
                kv_cache_memory=memory, gpu_memory_utilization=ns.gpu_memory_utilization)
    print(f"model        {ns.model} ({kind}: {path})")
    print(f"device       {platform.describe()}")
    print(f"architecture {arch.model_type}: {arch.num_layers} layers, hidden {arch.hidden_size}, "
          f"{arch.num_heads} query / {arch.num_kv_heads} KV heads, head_dim {arch.head_dim}, "
          f"vocab {arch.vocab_size}, context {arch.max_position_embeddings}, rope_theta {arch.rope_theta:g}")
    dtype = resolve_dtype(ns.dtype)
    quantization, auto = EngineArgs.from_cli_args(ns).weight_quantization(kind, path, platform)
    plan = _dense_plan(kind, path, hf_config, dtype, quantization) if platform.kind == "cpu" else "torch"
    print(f"dense layers {plan}")
    chosen = (" (the default for a quantized GGUF file on this machine; --quantization none dequantizes it at load)"
              if auto else "")
    print(f"weights      {describe_weights(kind, path, quantization, dtype)}{chosen}")
    if platform.kind == "cpu":
        from kv8.kernels.cpu.dense import describe_dense_kernels

        print(f"dense kernels {describe_dense_kernels()}")
        config = EngineArgs.from_cli_args(ns).create_engine_config(hf_config, kind, path)
        print(f"decode attention {_attention_plan(config)}")
    if ns.quantization_param_path is not None:
        print(f"key centering {_key_centering(ns.quantization_param_path, arch)}")
    print(capacity_table(arch, memory, ns.block_size))
    if ns.kv_cache_plan is not None:
        args = dataclasses.replace(EngineArgs.from_cli_args(ns), kv_cache_memory=memory)
        print()
        print(plan_table(args.create_engine_config(hf_config, kind, path).kv_budget()))
    return 0


def _key_centering(path: str, arch: ModelArchConfig) -> str:
    """Whether the scales file ``path`` turns key centering on for ``arch`` (its offsets validated), in words."""
    from kv8.quant.scale_files import load_key_offsets, load_key_scaling
    from kv8.quant.scales import ModelScaleInfo

    model = ModelScaleInfo(arch.model_type, arch.num_layers, arch.num_kv_heads, arch.head_dim)
    offsets = load_key_offsets(path, model)
    if offsets is None:
        return f"off ({path} has no key offsets; kv8 calibrate --key-centering writes them)"
    if not arch.shift_invariant_scores:
        return f"refused: {path} has key offsets, but this model {arch.score_transform}"
    scaling = load_key_scaling(path, model)
    scaled = ("" if scaling is None else
              f"; key scaling on: centered keys times its factors ({float(scaling.s.min()):.3g}.."
              f"{float(scaling.s.max()):.3g}), queries divided by them")
    return (f"on: keys minus the offsets of {path} (per layer, KV head and channel; |c| up to "
            f"{float(offsets.k.abs().max()):.3g}) before they are stored, for every cache format{scaled}")


def plan_table(budget: KVBudget) -> str:
    """A plan's pools (``kv_cache_plan``): each one's format and rotation, layers and bytes per token, and what fits
    in the budget: tokens keeping every block, blocks per pool (split by need) and sequences of ``max_model_len``."""
    cc, block_size = budget.cache, budget.cache.block_size
    memory = budget.memory()
    blocks, per_seq = budget.split(memory), budget.blocks_per_sequence()
    lines = [f"KV plan      {cc.kv_cache_plan}: {len(budget.layout.pools)} pools; layers it does not name: "
             f"{cc.default_spec.describe()}",
             f"{'pool':<6}{'format':<36}{'layers':<24}{'B/tok':>10}{'blocks':>10}{'seqs of L':>11}"]
    for p, (what, layers, token_bytes) in zip(budget.layout.pools, budget.pool_rows()):
        lines.append(f"{p.pool_id:<6}{what:<36}{_ranges(layers):<24}{token_bytes:>10}{blocks[p.pool_id]:>10}"
                     f"{blocks[p.pool_id] // per_seq[p.pool_id]:>11}")
    keep_all = memory // (budget.bytes_per_token * block_size) * block_size
    seqs = min(n // k for n, k in zip(blocks, per_seq))
    lines.append(f"{'all':<66}{budget.bytes_per_token:>10}{sum(blocks):>10}{seqs:>11}")
    lines.append(f"fits         {keep_all} tokens keeping every block; {seqs} sequences of L = {budget.max_model_len} "
                 f"tokens ({format_bytes(memory)}, blocks of {block_size} tokens)")
    return "\n".join(lines)


def _ranges(layers: Sequence[int]) -> str:
    """``0, 2-5, 9``: ascending layer indices with runs collapsed."""
    runs: list[list[int]] = []
    for i in layers:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _attention_plan(config: EngineConfig) -> str:
    """How far ahead the decode attention streams each of the engine's cache formats on this machine, and why
    (:mod:`kv8.attention.tuning`)."""
    from kv8 import envs
    from kv8.attention.tuning import plan_entry_key, stored_stream_tiles, streams
    from kv8.engine.worker import stream_cases
    from kv8.kernels.cpu.attention import load_kernels
    from kv8.machine_plans import MachinePlans

    try:
        lib = load_kernels()
    except KernelUnavailable as exc:
        return f"the reference path (the fused CPU kernels are unavailable: {exc})"
    plans, said = MachinePlans(), []
    for case in dict.fromkeys(stream_cases(config, config.kv_budget())):
        name = case.spec.name
        if not streams(lib, case):
            said.append(f"{name}: {lib.default_stream_tiles} tiles ahead (not a cache the decode kernels read here)")
        elif not envs.tuning():
            said.append(f"{name}: {lib.default_stream_tiles} tiles ahead (KV8_TUNING=off: the build's default)")
        elif (choice := stored_stream_tiles(plans, plan_entry_key(case), lib)) is None:
            said.append(f"{name}: not timed on this machine yet: the first engine times the stream distance (or run "
                        "kv8 tune)")
        else:
            busy = "; provisional (timed beside other work): the next engine times again" if choice.provisional else ""
            said.append(f"{name}: streams {choice.stream_tiles} tiles ahead (this machine's plan, timed "
                        f"{choice.measured}: {choice.speedup:.2f}x the default {choice.default}{busy})")
    return "; ".join(said)


def _dense_plan(kind: str, path: str, hf_config: dict, dtype: torch.dtype, quantization: str | None) -> str:
    """What ``dense_backend=auto`` runs for this model on this machine, and why (per block type with
    ``quantization="gguf"``: :func:`kv8.layers.tuning.tuning_groups`)."""
    from kv8 import envs
    from kv8.layers.tuning import (
        HEAD_GROUP,
        PREFILL_ROWS,
        PlanStore,
        candidate_ids,
        candidates,
        gguf_path_groups,
        plan_key,
        static_dense_backend,
        stored_gguf_path,
        tuning_groups,
    )
    from kv8.loader.model import tuning_shapes

    shapes = tuning_shapes(kind, path, hf_config, quantization)
    found = candidates(shapes, dtype, quantization)
    if len(found) == 1 or not envs.tuning():
        why = "the only candidate" if len(found) == 1 else "KV8_TUNING=off: the fixed rule"
        return f"{static_dense_backend(dtype, quantization).label if len(found) > 1 else next(iter(found))} ({why})"
    store, said = PlanStore(), []
    for group, members in tuning_groups(shapes, found).items():
        layers = "" if group is None else f"{group} layers: "
        plan = store.get(plan_key(members, dtype, quantization))
        if plan is None:
            said.append(f"{layers}not timed on this machine yet: the first engine times {', '.join(found)} on this "
                        "model's shapes (or run kv8 tune)")
        elif plan.timed != candidate_ids(found):
            said.append(f"{layers}{plan.choice} in this machine's plan, timed {plan.measured} on other candidates "
                        f"than today's ({', '.join(candidate_ids(found))}): the first engine times them again (or run "
                        "kv8 tune)")
        else:
            busy = (f"; timed beside other work ({plan.others:.2f} cores busy elsewhere): provisional, the next engine "
                    "times again" if plan.provisional else "")
            versus = plan.compared_with
            said.append(f"{layers}{plan.choice} (this machine's plan, timed {plan.measured}: "
                        f"{plan.speedup(versus, 1):.2f}x {versus} at 1 row, {plan.speedup(versus, PREFILL_ROWS):.2f}x "
                        f"at {PREFILL_ROWS}{busy})")
    kernels = next(iter(found.values())).kernels
    if quantization == "gguf" and kernels is not None and len(kernels.gguf_paths) > 1 and not envs.gguf_kernel():
        for group, members in gguf_path_groups(shapes, kernels.gguf_types).items():
            kept = stored_gguf_path(store, members, dtype, group, kernels)
            said.append(f"the int8 kernel on the {group if group == HEAD_GROUP else group + ' layers'}: " + (
                "not timed on this machine yet (the first engine times its paths, or run kv8 tune)" if kept is None
                else f"{kept.choice} (this machine's plan, timed {kept.measured}: {kept.speedup(1):.2f}x the default "
                     f"{kept.default} at 1 row)"))
    return "; ".join(said)


def cmd_tune(ns: argparse.Namespace) -> int:
    from kv8.layers.linear import WIDE_ROWS
    from kv8.layers.tuning import (
        HEAD_GROUP,
        PREFILL_ROWS,
        TUNE_ROUNDS,
        PlanStore,
        tuned_dense_backend,
        tuned_gguf_paths,
    )
    from kv8.loader.model import read_model_config, tuning_shapes
    from kv8.loader.sources import resolve_model_path

    args = EngineArgs.from_cli_args(ns)
    kind, path = resolve_model_path(args.model)
    hf_config = read_model_config(kind, path)
    config = args.create_engine_config(hf_config, kind, path)   # dtype and quantization validated and resolved
    dtype, quantization = config.dtype, config.quantization
    store = PlanStore()
    shapes = tuning_shapes(kind, path, hf_config, quantization)
    backend, results = tuned_dense_backend(shapes, dtype, quantization, store, retune=True)
    print(f"model        {args.model} ({kind}: {path}), {str(dtype).removeprefix('torch.')}"
          + (f", {quantization} weights" if quantization else "")
          + (" (the default for a quantized GGUF file; --quantization none times the dequantized weights)"
             if config.quantization_auto else ""))
    print(f"device       {CPU.describe()}")
    if not results:
        print(f"dense layers {backend.name}: the only candidate on this machine, nothing to time")
    for group, result in results.items():
        layers = "the model's linear layers" if group is None else f"the model's {group} layers"
        print(f"one pass of {layers}, fastest of several calls over {result.rounds} rounds (of at most "
              f"{TUNE_ROUNDS}):")
        print(result.table())
        versus = result.compared_with
        print(f"chosen       {result.choice}: {result.speedup(versus, 1):.2f}x {versus} at 1 row, "
              f"{result.speedup(versus, PREFILL_ROWS):.2f}x at {PREFILL_ROWS} rows, "
              f"{result.speedup(versus, WIDE_ROWS):.2f}x at {WIDE_ROWS}")
    backend, paths = tuned_gguf_paths(backend, shapes, dtype, store, retune=True)
    for group, kept in paths.items():
        print(f"the GGUF int8 kernel's paths at one row, the blocks read from memory, on the model's "
              f"{group if group == HEAD_GROUP else group + ' layers'}, fastest of several calls over {TUNE_ROUNDS} "
              "rounds:")
        print(kept.table())
        print(f"chosen       {kept.choice}: {kept.speedup(1):.2f}x the default {kept.default} at 1 row")
    if results or paths:
        print(f"dense layers {backend.label}; kept in {store.path}")
    _tune_attention(config)
    return 0


def _tune_attention(config: EngineConfig) -> None:
    """``kv8 tune``'s second part: the decode attention's stream distance on each of the engine's cache formats
    (:mod:`kv8.attention.tuning`), timed again and kept, with its table."""
    from kv8.attention.tuning import TUNE_BATCH, TUNE_CONTEXT, TUNE_ROUNDS, streams, tuned_stream_tiles
    from kv8.engine.worker import stream_cases
    from kv8.kernels.cpu.attention import load_kernels
    from kv8.machine_plans import MachinePlans

    if config.platform.kind != "cpu":
        return
    try:
        lib = load_kernels()
    except KernelUnavailable as exc:
        print(f"decode attention: the fused CPU kernels are unavailable ({exc}): nothing to time")
        return
    plans = MachinePlans()
    for case, choice in tuned_stream_tiles(lib, stream_cases(config, config.kv_budget()), torch.get_num_threads(),
                                           plans, retune=True).items():
        if not streams(lib, case):
            print(f"decode attention on a {case.describe()}: not read by the AVX-512 BF16 decode kernels here, "
                  f"nothing to time (the default {choice.default} tiles ahead)")
            continue
        print(f"decode attention on a {case.describe()}: one pass over {choice.layers} layers of {TUNE_BATCH} "
              f"sequences x {TUNE_CONTEXT} tokens, median of {TUNE_ROUNDS} rounds:")
        print(choice.table())
        print(f"chosen       streams {choice.stream_tiles} tiles ahead: {choice.speedup:.2f}x the default "
              f"{choice.default}; kept in {plans.path}")


def capacity_table(arch: ModelArchConfig, memory: int, block_size: int) -> str:
    """Per KV dtype (the integer ones with their scale per token and head, the group-scaled ones with their scales
    per group: int4_per_group32 a float16 per 32 values, left out where head_dim is not a multiple of 32, FP4 an
    E4M3 per 16; and the K/V pairs of :data:`KV_PAIR_ALIASES`, k8v4): bytes per token of the full-attention and
    the sliding-window layers, and how much context
    fits in ``memory`` -- keeping every block, and freeing blocks that left a layer's window (the engine's
    default; vLLM's hybrid KV cache manager), counted for sequences of the model's default context ``L``.
    ``x bf16``: sequences of L that fit, freed, relative to a bfloat16 cache freed; ``x bf16 all``: relative to a
    bfloat16 cache that keeps every block."""
    length = default_max_model_len(arch.max_position_embeddings)
    windows = arch.layer_windows
    n_full = sum(w is None for w in windows)
    kinds = [f"{n_full} full attention"] if n_full else []
    if len(windows) > n_full:
        kinds.append(f"{len(windows) - n_full} sliding window ({arch.sliding_window} tokens)")
    lines = [f"layers       {', '.join(kinds)}",
             f"KV budget    {format_bytes(memory)}, blocks of {block_size} tokens; sequences of L = {length} tokens",
             "",
             f"{'kv_cache_dtype':<20}{'B/tok full':>11}{'B/tok window':>13}{'tokens, keep all':>18}"
             f"{'seqs of L':>11}{'seqs of L, freed':>18}{'x bf16':>10}{'x bf16 all':>15}"]
    compute_dtype = resolve_dtype("auto")
    base = None
    for name in ("bfloat16", "float32", "fp8_e4m3", "fp8_e5m2", "fp8_e4m3fnuz", "int8_per_token_head",
                 "int4_per_token_head", "int4_per_group32", "fp4_e2m1", *KV_PAIR_ALIASES):
        sides = resolve_kv_cache_dtypes(name, compute_dtype)
        if any(d.group is not None and arch.head_dim % d.group.head_dim_multiple for d in sides):
            continue
        seqs, seq_bytes = [], []
        for hybrid in (False, True):
            cache = CacheConfig(kv_dtype=sides[0], kv_cache_dtype=name,
                                block_size=block_size, kv_cache_memory=memory,
                                disable_hybrid_kv_cache_manager=not hybrid)
            budget = KVBudget.build(cache, windows, head_dim=arch.head_dim, kv_heads=arch.num_kv_heads,
                                    max_model_len=length, max_num_batched_tokens=1)
            per_seq = budget.blocks_per_sequence()[0]
            seq_bytes.append(budget.block_bytes[0] * per_seq)
            seqs.append(memory // budget.block_bytes[0] // per_seq)
        per_layer = budget.token_bytes[0]
        keep_all = memory // (budget.bytes_per_token * block_size) * block_size
        base = base or seq_bytes   # bfloat16's bytes per sequence of L: keeping all, freed
        lines.append(f"{name:<20}{per_layer * n_full:>11}{per_layer * (len(windows) - n_full):>13}{keep_all:>18}"
                     f"{seqs[0]:>11}{seqs[1]:>18}{base[1] / seq_bytes[1]:>10.2f}{base[0] / seq_bytes[1]:>15.2f}")
    return "\n".join(lines)


def _version() -> str:
    from kv8.version import __version__

    return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kv8", description="LLM inference with an 8-bit floating-point KV cache.",
                                     epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="log engine details (cache size, load time); generate prints time to first token and "
                             "prefill / decode throughput")
    parser.add_argument("--version", action="version", version=f"kv8 {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    g = sub.add_parser("generate", help="generate text for one or more prompts",
                       description="Generate text for one or more prompts and print prompt + completion.",
                       epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    g.add_argument("prompt", nargs="+", help="prompt text (several prompts are batched)")
    EngineArgs.add_model_arg(g, "--model", "-m")
    s = g.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt (default 64)")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--n", type=int, default=1, help="completions per prompt")
    s.add_argument("--sampling-seed", type=int, default=None, help="seed for reproducible sampling")
    s.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object per completion")
    EngineArgs.add_cli_args(g)
    g.set_defaults(func=cmd_generate)

    i = sub.add_parser("info", help="architecture and KV-cache capacity per dtype",
                       description="Show a model's architecture and, for each KV dtype, bytes per token and how "
                                   "many tokens fit in a cache memory budget; with --kv-cache-plan, the plan's pools "
                                   "(format, rotation, layers, bytes per token) and what fits. Loads no weights.")
    EngineArgs.add_model_arg(i, optional=True)
    EngineArgs.add_cli_args(i, include=INFO_OPTIONS)
    i.set_defaults(func=cmd_info)

    t = sub.add_parser("tune", help="time the dense layers' methods on a model's shapes; keep this machine's choice",
                       description="Time every dense backend this CPU can run (packed_bf16, torch, torch_fp32) on "
                                   "the model's linear shapes at 1 row and at a prefill chunk, print the table and "
                                   "keep the winner as this machine's plan for dense_backend=auto (an engine does "
                                   "the same on its first run). Random weights: loads none.")
    EngineArgs.add_model_arg(t, optional=True)
    EngineArgs.add_cli_args(t, include=TUNE_OPTIONS)
    t.set_defaults(func=cmd_tune)

    sv = sub.add_parser("serve", aliases=["run"], help="OpenAI-compatible HTTP server ('run' is an alias)",
                        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
                                    "/metrics on 127.0.0.1 (see --host). 'kv8 run' is the same command.",
                        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_args(sv, "--model-id", "--model", "-m", model_optional=True)
    sv.set_defaults(func=cmd_serve)

    from kv8.tools.commands import add_calibrate_parser, add_eval_parser

    add_calibrate_parser(sub)   # kv8 calibrate: fp8 KV scales from calibration text
    add_eval_parser(sub)        # kv8 eval: KLD / top-1 / PPL of KV configurations vs a float32 cache
    for command in {id(p): p for p in sub.choices.values()}.values():   # -v after the command too (an alias once)
        command.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS,
                             help="log engine details; generate prints its timings")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if ns.verbose else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return ns.func(ns)
    except (ValueError, KernelUnavailable) as e:   # bad input, or a kernel library asked for by name
        print(f"kv8: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kv8: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
