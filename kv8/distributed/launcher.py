"""Start the ranks of a tensor-parallel engine: processes kv8 spawns itself, or the ones torchrun started.

* **Spawned** (the default): rank 0 is the calling process. It serves a ``TCPStore`` on 127.0.0.1 (a free
  port), publishes the KV cache size, and starts ranks 1..N-1 as daemonic ``multiprocessing`` *spawn* processes
  (:func:`kv8.distributed.worker.worker_main`); gloo runs over the loopback. Daemonic children are terminated
  when the parent exits; :meth:`kv8.distributed.group.TPGroup.close` stops them earlier (the engine's
  ``shutdown``, or its finalizer when it is garbage collected). As with any spawn start, a script that builds an
  engine must guard its entry point with ``if __name__ == "__main__":``.
* **torchrun** (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set; one process per rank, on one or
  several machines): every process runs the same command; the default process group is initialised from the
  environment (gloo), rank 0 returns to build the engine and drive, and every other rank runs its worker loop
  and exits when rank 0 stops (``SystemExit(0)`` from the engine's constructor). ``WORLD_SIZE`` must equal
  ``tensor_parallel_size``.

Each rank sets its torch threads to ``ParallelConfig.threads`` (``--cpu-threads-per-rank``) so that N ranks do
not oversubscribe the cores.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from kv8 import envs
from kv8.config import EngineConfig
from kv8.distributed.group import OP_TIMEOUT, SINGLE_RANK, STORE_TIMEOUT, TPGroup

if TYPE_CHECKING:
    from kv8.engine.args import EngineArgs

__all__ = ["allreduce_slot_bytes", "start_ranks", "torchrun_rank"]

def torchrun_rank() -> tuple[int, int] | None:
    """``(rank, world size)`` when this process was launched by torchrun (its variables are set), else None."""
    env = envs.torchrun_env()
    if env is None:
        return None
    return int(env["RANK"]), int(env["WORLD_SIZE"])


def set_threads(config: EngineConfig) -> None:
    threads = config.parallel.threads(os.cpu_count() or 1)
    if threads is not None:
        torch.set_num_threads(threads)


def allreduce_slot_bytes(config: EngineConfig) -> int:
    """The largest tensor a decode or prefill step sends through a collective, in the compute dtype: an
    all-reduce of ``[max_num_batched_tokens, hidden_size]`` or the LM head's gather of ``[max_num_seqs,
    ceil(vocab / ranks)]`` (prompt-logprob batches may be larger and go through gloo)."""
    sched, arch, n = config.scheduler, config.arch, config.parallel.tensor_parallel_size
    elements = max(sched.max_num_batched_tokens * arch.hidden_size, sched.max_num_seqs * -(-arch.vocab_size // n))
    return elements * torch.empty((), dtype=config.dtype).element_size()


def start_ranks(args: EngineArgs, config: EngineConfig, num_blocks: list[int]) -> TPGroup:
    """Rank 0's group with ranks 1..N-1 started (the single rank when ``tensor_parallel_size`` is 1).

    ``args`` are the options the workers rebuild the config from; ``num_blocks``
    (rank 0's KV cache size) is shared so that every rank's pools have the same blocks. Under torchrun, a rank
    other than 0 runs its worker loop here and raises ``SystemExit(0)`` when rank 0 stops.
    """
    size = config.parallel.tensor_parallel_size
    if size == 1:
        return SINGLE_RANK
    set_threads(config)
    launched = torchrun_rank()
    if launched is not None:
        rank, world = launched
        if world != size:
            raise ValueError(f"tensor_parallel_size={size} but torchrun started WORLD_SIZE={world} processes; "
                             "give torchrun --nproc-per-node x --nnodes = the tensor-parallel size")
        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=OP_TIMEOUT)
        prefixed = dist.PrefixStore("kv8/", dist.distributed_c10d._get_default_store())
        tp = TPGroup(rank, size, store=prefixed, pg=dist.group.WORLD)
        if rank != 0:
            from kv8.distributed.worker import run_worker

            run_worker(tp, args)
            raise SystemExit(0)
        tp.share("num_blocks", num_blocks)
        return tp
    store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=STORE_TIMEOUT, wait_for_workers=False)
    tp = TPGroup(0, size, store=store, local=True)
    tp.share("num_blocks", num_blocks)
    from kv8.distributed.worker import worker_main

    ctx = multiprocessing.get_context("spawn")
    worker_args = dataclasses.replace(args, model=config.model)   # the resolved path
    for rank in range(1, size):
        proc = ctx.Process(target=worker_main, args=(rank, size, store.port, worker_args), daemon=True,
                           name=f"kv8-tp-rank-{rank}")
        proc.start()
        tp.procs.append(proc)
    tp.watch()
    return tp
