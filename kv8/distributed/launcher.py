"""Start the ranks of a tensor-parallel engine: processes kv8 spawns itself, or the ones torchrun started.

* **Started by kv8** (the default): rank 0 is the calling process. It serves a ``TCPStore`` on 127.0.0.1 (a free
  port), publishes the KV cache size and the engine options (pickled ``EngineArgs``), and starts ranks 1..N-1
  as fresh interpreters, ``python -m kv8.distributed.worker`` (:class:`RankProcess`); gloo runs over the
  loopback. Unlike a ``multiprocessing`` spawn, a rank never imports the caller's main module, so a script
  without an ``if __name__ == "__main__":`` guard, or one fed on stdin, starts its ranks like any other
  (vLLM's spawn has that limit; kv8 does not). :meth:`kv8.distributed.group.TPGroup.close` stops the ranks (the
  engine's ``shutdown``, or its finalizer when it is garbage collected); those still running when rank 0's
  interpreter exits are terminated then, and a rank whose rank 0 died leaves on its own (its store is gone).
* **torchrun** (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set; one process per rank, on one or
  several machines): every process runs the same command; the default process group is initialised from the
  environment (gloo), rank 0 returns to build the engine and drive, and every other rank runs its worker loop
  and exits when rank 0 stops (``SystemExit(0)`` from the engine's constructor). ``WORLD_SIZE`` must equal
  ``tensor_parallel_size``.

Each rank sets its torch threads to ``ParallelConfig.threads`` (``--cpu-threads-per-rank``) so that N ranks do
not oversubscribe the cores.
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import pickle
import subprocess
import sys
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.distributed as dist

import kv8
from kv8 import envs
from kv8.distributed.group import OP_TIMEOUT, SINGLE_RANK, STORE_TIMEOUT, TPGroup
from kv8.engine.config import EngineConfig

if TYPE_CHECKING:
    from kv8.engine.args import EngineArgs

__all__ = ["WORKER_ARGS_KEY", "RankProcess", "allreduce_slot_bytes", "start_ranks", "torchrun_rank"]

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

            tp.start_heartbeat(_torchrun_store())
            run_worker(tp, args)
            raise SystemExit(0)
        tp.share("num_blocks", num_blocks)
        tp.watch_heartbeats(_torchrun_store())
        return tp
    store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=STORE_TIMEOUT, wait_for_workers=False)
    tp = TPGroup(0, size, store=store, local=True)
    tp.share("num_blocks", num_blocks)
    tp.store.set(WORKER_ARGS_KEY, pickle.dumps(dataclasses.replace(args, model=config.model)))   # resolved path
    for rank in range(1, size):
        tp.procs.append(RankProcess.start(rank, size, store.port))
    tp.watch()
    return tp


def _torchrun_store() -> dist.Store:
    """A new connection to torchrun's store (``MASTER_ADDR:MASTER_PORT``), for a thread of its own: the
    heartbeats must not wait behind the step loop's blocking reads on the default one."""
    env = envs.torchrun_env()
    assert env is not None
    client = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), None, False, timeout=STORE_TIMEOUT,
                           wait_for_workers=False)
    return dist.PrefixStore("kv8/", client)


WORKER_ARGS_KEY = "worker_args"   # the store key of the pickled EngineArgs the started ranks build their shard from


class RankProcess:
    """A rank kv8 started: ``python -m kv8.distributed.worker`` in a new interpreter (never the caller's main
    module), with the subset of ``multiprocessing.Process``'s interface the group uses (``pid``, ``sentinel``,
    ``exitcode``, ``is_alive``, ``join``, ``terminate``, ``kill``). ``sentinel`` is a pidfd (Linux >= 5.3): it
    becomes readable when the process exits, so ``multiprocessing.connection.wait`` watches it."""

    _live: ClassVar[weakref.WeakSet[RankProcess]] = weakref.WeakSet()

    def __init__(self, popen: subprocess.Popen[bytes], name: str) -> None:
        self._popen = popen
        self.name = name
        self.pid = popen.pid
        self.sentinel = os.pidfd_open(popen.pid)
        RankProcess._live.add(self)

    @classmethod
    def start(cls, rank: int, size: int, port: int) -> RankProcess:
        """Start rank ``rank`` of ``size``, which joins rank 0's store on 127.0.0.1:``port``. The directory that
        holds the ``kv8`` package goes first on the child's ``PYTHONPATH``, so it imports this kv8 however the
        caller found it."""
        root = str(Path(kv8.__file__).resolve().parent.parent)
        path = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
        popen = subprocess.Popen([sys.executable, "-m", "kv8.distributed.worker", "--rank", str(rank),
                                  "--world-size", str(size), "--port", str(port)],
                                 env={**os.environ, "PYTHONPATH": path}, stdin=subprocess.DEVNULL)
        return cls(popen, f"kv8-tp-rank-{rank}")

    @property
    def exitcode(self) -> int | None:
        """None while it runs; else its status (minus the signal number if a signal ended it, as Process's)."""
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self.exitcode is None

    def join(self, timeout: float | None = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        if self.is_alive():
            self._popen.terminate()

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()

    @classmethod
    def stop_all(cls) -> None:
        """At interpreter exit: terminate the ranks still running (what ``daemon=True`` does for a Process)."""
        for proc in list(cls._live):
            proc.terminate()
        for proc in list(cls._live):
            proc.join(2.0)
            proc.kill()


atexit.register(RankProcess.stop_all)
