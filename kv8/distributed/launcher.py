"""The processes of a tensor-parallel engine: ranks kv8 starts itself (:class:`RankProcess`, a fresh interpreter
running a module given by the caller), or the ones torchrun started (:func:`torchrun_rank`, :func:`torchrun_group`),
and each rank's torch threads (:func:`set_threads`). What a rank runs is :mod:`kv8.engine.worker`'s.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import weakref
from pathlib import Path
from typing import ClassVar

import torch
import torch.distributed as dist

from kv8 import envs
from kv8.distributed.config import ParallelConfig
from kv8.distributed.group import OP_TIMEOUT, STORE_TIMEOUT, TPGroup

__all__ = ["RankProcess", "set_threads", "torchrun_group", "torchrun_rank", "torchrun_store"]

PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent.parent)   # the directory that holds the kv8 package

def torchrun_rank() -> tuple[int, int] | None:
    """``(rank, world size)`` when this process was launched by torchrun (its variables are set), else None."""
    env = envs.torchrun_env()
    if env is None:
        return None
    return int(env["RANK"]), int(env["WORLD_SIZE"])


def set_threads(parallel: ParallelConfig) -> None:
    threads = parallel.threads(os.cpu_count() or 1)
    if threads is not None:
        torch.set_num_threads(threads)


def torchrun_group(size: int) -> TPGroup:
    """This torchrun-started process's rank of a group of ``size`` (``ValueError`` unless torchrun's world size
    is ``size``): the default process group initialised from torchrun's environment (gloo), its store under
    ``kv8/``."""
    launched = torchrun_rank()
    assert launched is not None, "torchrun_group outside torchrun"
    rank, world = launched
    if world != size:
        raise ValueError(f"tensor_parallel_size={size} but torchrun started WORLD_SIZE={world} processes; "
                         "give torchrun --nproc-per-node x --nnodes = the tensor-parallel size")
    if not dist.is_initialized():
        dist.init_process_group("gloo", timeout=OP_TIMEOUT)
    prefixed = dist.PrefixStore("kv8/", dist.distributed_c10d._get_default_store())
    return TPGroup(rank, size, store=prefixed, pg=dist.group.WORLD)


def torchrun_store() -> dist.Store:
    """A new connection to torchrun's store (``MASTER_ADDR:MASTER_PORT``), for a thread of its own: the
    heartbeats must not wait behind the step loop's blocking reads on the default one."""
    env = envs.torchrun_env()
    assert env is not None
    client = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), None, False, timeout=STORE_TIMEOUT,
                           wait_for_workers=False)
    return dist.PrefixStore("kv8/", client)


class RankProcess:
    """A rank kv8 started: ``python -m MODULE`` in a new interpreter (never the caller's main module), with the
    subset of ``multiprocessing.Process``'s interface the group uses (``pid``, ``sentinel``, ``exitcode``,
    ``is_alive``, ``join``, ``terminate``, ``kill``). ``sentinel`` is a pidfd (Linux >= 5.3): it
    becomes readable when the process exits, so ``multiprocessing.connection.wait`` watches it."""

    _live: ClassVar[weakref.WeakSet[RankProcess]] = weakref.WeakSet()

    def __init__(self, popen: subprocess.Popen[bytes], name: str) -> None:
        self._popen = popen
        self.name = name
        self.pid = popen.pid
        self.sentinel = os.pidfd_open(popen.pid)
        RankProcess._live.add(self)

    @classmethod
    def start(cls, module: str, rank: int, size: int, port: int) -> RankProcess:
        """Start rank ``rank`` of ``size`` as ``python -m module --rank R --world-size N --port P`` (it joins rank
        0's store on 127.0.0.1:``port``). The directory that holds the ``kv8`` package goes first on the child's
        ``PYTHONPATH``, so it imports this kv8 however the caller found it."""
        path = os.pathsep.join([PACKAGE_ROOT, *filter(None, [os.environ.get("PYTHONPATH")])])
        popen = subprocess.Popen([sys.executable, "-m", module, "--rank", str(rank),
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
