"""Every rank of an engine: loading a rank's shard (:func:`load_shard`, rank 0 included), starting ranks 1..N-1
from rank 0 (:func:`start_ranks`), and their loop (:func:`run_worker`): build the config from the same options as
rank 0, load the rank's shard with rank 0's KV cache size, report ready, then run one forward per step rank 0
publishes, until it publishes ``None`` (stop) or goes away. A worker never samples and never schedules.

How ranks start (the processes themselves: :mod:`kv8.distributed.launcher`):

* **Started by kv8** (the default): rank 0 is the calling process. It serves a ``TCPStore`` on 127.0.0.1 (a free
  port), publishes the KV cache size and the engine options (pickled ``EngineArgs``), and starts ranks 1..N-1
  as fresh interpreters, ``python -m kv8.engine.rank_main`` (:data:`WORKER_MODULE`, which calls :func:`main`;
  :class:`kv8.distributed.launcher.RankProcess`); gloo
  runs over the loopback. Unlike a ``multiprocessing`` spawn, a rank never imports the caller's main module, so
  a script without an ``if __name__ == "__main__":`` guard, or one fed on stdin, starts its ranks like any other
  (vLLM's spawn has that limit; kv8 does not). :meth:`kv8.distributed.group.TPGroup.close` stops the ranks (the
  engine's ``shutdown``, or its finalizer when it is garbage collected); those still running when rank 0's
  interpreter exits are terminated then, and a rank whose rank 0 died leaves on its own (its store is gone).
* **torchrun** (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set; one process per rank, on one or
  several machines): every process runs the same command. The entry point asks :func:`run_torchrun_worker`
  first: on ranks 1..N-1 it runs the worker loop and returns True once rank 0 stopped (``kv8``'s commands then
  exit 0; ``LLM(...)`` raises ``SystemExit(0)``), on rank 0 it returns False and the entry point builds the
  engine, whose :func:`start_ranks` joins the others. ``WORLD_SIZE`` must equal ``tensor_parallel_size``. An
  ``LLMEngine`` is never built on a rank other than 0.

Each rank sets its torch threads to ``ParallelConfig.threads`` (``--cpu-threads-per-rank``) so that N ranks do
not oversubscribe the cores.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import pickle
import traceback
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from kv8 import envs
from kv8.attention.backend import get_backend
from kv8.attention.cpu_fused import FusedCPUBackend
from kv8.attention.tuning import StreamCase, tuned_stream_tiles
from kv8.cache.budget import KVBudget
from kv8.cache.codec import KVCodec
from kv8.cache.paged_cache import CacheShape, PagedKVCache
from kv8.cache.scale_sources import engine_key_offsets, engine_key_scaling, engine_kv_scales
from kv8.distributed.group import SINGLE_RANK, STORE_TIMEOUT, TPGroup
from kv8.distributed.launcher import RankProcess, set_threads, torchrun_group, torchrun_rank, torchrun_store
from kv8.distributed.shard import kv_head_shard
from kv8.engine.config import EngineConfig
from kv8.engine.runner import ModelRunner
from kv8.host_memory import tune_malloc
from kv8.loader.model import LoadedModel, load_model, read_model_config
from kv8.loader.sources import resolve_model_path
from kv8.observer import EngineObserver
from kv8.quant.scales import ModelScaleInfo

if TYPE_CHECKING:
    from kv8.engine.args import EngineArgs

__all__ = ["Shard", "allreduce_slot_bytes", "load_shard", "main", "run_torchrun_worker", "run_worker", "start_ranks",
           "stream_cases", "worker_main"]

logger = logging.getLogger("kv8")

WORKER_ARGS_KEY = "worker_args"   # the store key of the pickled EngineArgs the started ranks build their shard from
WORKER_MODULE = "kv8.engine.rank_main"   # what ranks 1..N-1 run with -m (a module that nothing imports: see it)


@dataclass(frozen=True)
class Shard:
    """What one rank runs: its part of the model, its KV cache pools (each with its own codec), and the runner
    over them."""

    loaded: LoadedModel
    caches: tuple[PagedKVCache, ...]
    runner: ModelRunner


def load_shard(config: EngineConfig, budget: KVBudget, num_blocks: Sequence[int], tp: TPGroup,
               observer: EngineObserver | None = None) -> Shard:
    """Load rank ``tp.rank``'s shard of the model, build each pool's codec from its spec (``budget.plan``; the
    static scales of FP8 pools resolved for the rank), allocate its pools (``num_blocks[p]`` blocks of pool ``p``,
    its own KV heads only) and build its runner. Sets this process's malloc up for activations first
    (:func:`kv8.host_memory.tune_malloc`)."""
    tune_malloc()
    platform = config.platform
    device = platform.rank_device(tp.rank)
    loaded = load_model(config.model_kind, config.model, config.dtype, config.dense_backend, tp,
                        config.quantization, platform=platform, device=device, load_format=config.load_format,
                        seed=config.seed)
    arch, cc = config.arch, config.cache
    kv_heads = kv_head_shard(arch.num_kv_heads, tp)
    model_info = ModelScaleInfo(arch.model_type, arch.num_layers, arch.num_kv_heads, arch.head_dim)
    budget.check_fits_memory(num_blocks)   # before allocating the cache, with the weights loaded
    layout, plan = budget.layout, budget.plan
    # One codec per pool, from its spec (spec 0, kv_cache_dtype's, first; skipped layers: the compute dtype).
    caches = []
    key_offsets = engine_key_offsets(cc, model_info, kv_heads)   # key centering: every pool, this rank's heads
    key_scaling = engine_key_scaling(cc, model_info, kv_heads)   # key scaling, beside the offsets
    for pool, n in zip(layout.pools, num_blocks):
        spec = plan.specs[pool.spec]
        scales = engine_kv_scales(cc, model_info, loaded.scale_tensors, loaded.hf_config, tp.rank, tp.size,
                                  kv_heads, spec)
        codec = KVCodec.build(spec.kv_dtype, arch.head_dim, scale_mode="dynamic" if spec.dynamic else "static",
                              rotation=spec.rotation, scales=scales, key_offsets=key_offsets,
                              key_scaling=key_scaling, v_dtype=spec.v_dtype)
        shape = CacheShape(arch.num_layers, n, kv_heads[1], cc.block_size, arch.head_dim)
        caches.append(PagedKVCache(shape, codec, {i: layout.layer_slot[i] for i in pool.layers}, device))
    backend = get_backend(config.attention_backend, platform)
    if isinstance(backend, FusedCPUBackend) and tp.size == 1 and envs.tuning():   # (as the dense tuner: one rank)
        choices = tuned_stream_tiles(backend.lib, stream_cases(config, budget), backend.plan_threads)
        backend.stream_tiles = {case.formats: choice.stream_tiles for case, choice in choices.items()}
    runner = ModelRunner(loaded.model, caches, layout, backend, observer, tp, device, platform)
    if (config.uses_cuda_graphs or config.uses_cpu_graphs) and observer is None:   # an observer sees every step: eager
        runner.enable_decode_graphs(config.scheduler.max_num_seqs, config.scheduler.max_model_len)
    return Shard(loaded, tuple(caches), runner)


def stream_cases(config: EngineConfig, budget: KVBudget) -> list[StreamCase]:
    """The cache formats of an engine's pools with the heads of its decode calls, as the stream-distance tuner
    (:mod:`kv8.attention.tuning`) times them: one tensor-parallel rank, as it runs (the tuner runs where there is
    one)."""
    arch = config.arch
    return [StreamCase(budget.plan.specs[pool.spec], num_q_heads=arch.num_heads, num_kv_heads=arch.num_kv_heads,
                       head_dim=arch.head_dim, block_size=config.cache.block_size, dtype=config.dtype)
            for pool in budget.layout.pools]


def allreduce_slot_bytes(config: EngineConfig) -> int:
    """The largest tensor a decode or prefill step sends through a collective, in the compute dtype: an
    all-reduce of ``[max_num_batched_tokens, hidden_size]`` or the LM head's gather of ``[max_num_seqs,
    ceil(vocab / ranks)]`` (prompt-logprob batches may be larger and go through gloo)."""
    sched, arch, n = config.scheduler, config.arch, config.parallel.tensor_parallel_size
    elements = max(sched.max_num_batched_tokens * arch.hidden_size, sched.max_num_seqs * -(-arch.vocab_size // n))
    return elements * torch.empty((), dtype=config.dtype).element_size()


def start_ranks(args: EngineArgs, config: EngineConfig, num_blocks: list[int]) -> TPGroup:
    """Rank 0's group with ranks 1..N-1 started, or joined under torchrun (the single rank when
    ``tensor_parallel_size`` is 1). ``args`` are the options the started ranks rebuild the config from;
    ``num_blocks`` (rank 0's KV cache size) is shared so that every rank's pools have the same blocks.
    ``RuntimeError`` on a torchrun rank other than 0, which runs :func:`run_torchrun_worker` instead."""
    size = config.parallel.tensor_parallel_size
    if size == 1:
        return SINGLE_RANK
    set_threads(config.parallel)
    if torchrun_rank() is not None:
        tp = torchrun_group(size)
        if tp.rank != 0:
            raise RuntimeError(f"torchrun rank {tp.rank} builds no engine: it serves rank 0's steps; call "
                               "kv8.engine.worker.run_torchrun_worker(args) first (kv8's commands and LLM do)")
        tp.share("num_blocks", num_blocks)
        tp.watch_heartbeats(torchrun_store())
        return tp
    store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=STORE_TIMEOUT, wait_for_workers=False)
    tp = TPGroup(0, size, store=store, local=True)
    tp.share("num_blocks", num_blocks)
    tp.store.set(WORKER_ARGS_KEY, pickle.dumps(dataclasses.replace(args, model=config.model)))   # resolved path
    for rank in range(1, size):
        tp.procs.append(RankProcess.start(WORKER_MODULE, rank, size, store.port))
    tp.watch()
    return tp


def run_worker(tp: TPGroup, args: EngineArgs) -> None:
    """Load the shard of ``tp.rank`` for ``args`` and serve steps until rank 0 stops."""
    try:
        kind, path = resolve_model_path(args.model)
        config = args.create_engine_config(read_model_config(kind, path), kind, path)
        set_threads(config.parallel)
        num_blocks = tp.share("num_blocks")
        shard = load_shard(config, config.kv_budget(), num_blocks, tp)
    except BaseException as e:
        tp.set_ready(error=f"{type(e).__name__}: {e}")
        raise
    tp.set_ready()
    tp.connect(slot_bytes=allreduce_slot_bytes(config), platform=config.platform)
    while (inputs := tp.receive()) is not None:
        shard.runner.worker_step(inputs)


def run_torchrun_worker(args: EngineArgs) -> bool:
    """Under torchrun with ``tensor_parallel_size`` > 1, on a rank other than 0: join the group, count up this
    rank's heartbeat, serve rank 0's steps until it stops, and return True. Anywhere else return False at once
    (the caller then builds the engine). Entry points call this before they build an engine."""
    launched = torchrun_rank()
    if launched is None or launched[0] == 0 or args.tensor_parallel_size == 1:
        return False
    tp = torchrun_group(args.tensor_parallel_size)
    tp.start_heartbeat(torchrun_store())
    try:
        run_worker(tp, args)
    finally:
        tp.stop_heartbeats()
        tp.release()
    return True


def worker_main(rank: int, size: int, port: int) -> None:
    """A rank kv8 started (:class:`kv8.distributed.launcher.RankProcess`): join rank 0's store on
    127.0.0.1:``port``, read the engine options rank 0 put there and run :func:`run_worker`."""
    logging.basicConfig(level=logging.WARNING)
    store = dist.TCPStore("127.0.0.1", port, size, False, timeout=STORE_TIMEOUT)
    tp = TPGroup(rank, size, store=store, local=True)
    try:
        run_worker(tp, pickle.loads(store.get(WORKER_ARGS_KEY)))
    except Exception:
        logger.error("tensor-parallel rank %d failed:\n%s", rank, traceback.format_exc())
        raise SystemExit(1) from None


def main(argv: list[str] | None = None) -> None:
    """``python -m kv8.engine.rank_main --rank R --world-size N --port P`` (what rank 0 starts; not for users)."""
    parser = argparse.ArgumentParser(prog=f"python -m {WORKER_MODULE}")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    ns = parser.parse_args(argv)
    worker_main(ns.rank, ns.world_size, ns.port)
