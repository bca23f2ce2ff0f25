"""A tensor-parallel group: this process's rank, the all-reduce of the row-parallel layers, and the control
channel that carries each step's inputs from rank 0 to the other ranks.

Two channels, one per kind of traffic:

* **control** -- a ``torch.distributed`` key-value store (a ``TCPStore`` served by rank 0, or torchrun's):
  rank 0 publishes the KV cache size, each step's pickled inputs (key ``step/<n>``) and the stop message
  (``None``); the other ranks block on the next key. A store wait has no idle timeout, so an idle server's
  workers simply wait, and they leave with an error the moment rank 0's store goes away.
* **data** -- the one all-reduce of each row-parallel layer: through shared memory when kv8 started the ranks
  itself on this machine (:mod:`kv8.distributed.shm_allreduce`: microseconds where loopback TCP costs about a
  millisecond; a waiting rank notices a dead one within 0.2 s), else (torchrun, or a tensor larger than the
  shared slots) a gloo process group (:data:`OP_TIMEOUT` per collective). A rank that dies closes its sockets:
  the other ranks' next gloo collective raises within milliseconds ("Connection closed by peer"); a rank that
  hangs is reported after :data:`OP_TIMEOUT`.

A worker reports a failure before the step loop (loading its shard) under ``error/<rank>`` and readiness
under ``ready/<rank>``; rank 0 waits for all of them while watching its child processes
(:meth:`TPGroup.wait_ready`).

Liveness while idle: rank 0 watches the ranks it started through their process sentinels (:meth:`TPGroup.watch`).
Ranks torchrun started are no children of rank 0, so each of them counts up ``alive/<rank>`` every
:data:`HEARTBEAT_S` from a thread with its own store connection (:meth:`TPGroup.start_heartbeat`, from the first
moment, loading included), and rank 0 declares a rank gone when its count has not moved for :data:`DEAD_AFTER_S`
(:meth:`TPGroup.watch_heartbeats`): a rank that dies while a server is idle fails it within seconds instead of at
the next request. A hung rank (its heartbeat thread alive) is still caught by the collectives' timeout.

Invariant: every rank runs the same sequence of collectives (one forward per published step), so the
all-reduces of rank 0 and of its workers pair up; a single-rank group (``size == 1``) runs none.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import pickle
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait as wait_for_any
from typing import Any, Protocol

import torch
import torch.distributed as dist

from kv8.distributed.shm_allreduce import ShmAllReduce, create_shm_file
from kv8.distributed.shm_allreduce import supported as shm_allreduce_supported
from kv8.platform import CPU, Platform

__all__ = ["OP_TIMEOUT", "SINGLE_RANK", "RankHandle", "TPGroup", "TensorParallelError"]


class RankHandle(Protocol):
    """What the group needs of a rank process rank 0 started (:class:`kv8.distributed.launcher.RankProcess`
    is one): a sentinel that becomes readable when it exits, its exit code, and the means to wait for and stop
    it."""

    @property
    def sentinel(self) -> int: ...
    @property
    def exitcode(self) -> int | None: ...
    def is_alive(self) -> bool: ...
    def join(self, timeout: float | None = None) -> None: ...
    def terminate(self) -> None: ...
    def kill(self) -> None: ...

logger = logging.getLogger("kv8")

# How long one all-reduce may wait for the slowest rank before it fails (a hung rank, not a dead one).
OP_TIMEOUT = datetime.timedelta(seconds=120)
# Store operations wait for rank 0 as long as it lives (an idle server publishes nothing for hours).
STORE_TIMEOUT = datetime.timedelta(days=365)
HEARTBEAT_S = 1.0      # how often a torchrun-started rank counts up its heartbeat
DEAD_AFTER_S = 10.0    # a torchrun-started rank whose heartbeat has not moved this long is gone


class TensorParallelError(RuntimeError):
    """A rank of the tensor-parallel group failed; the engine cannot go on."""


@dataclass(eq=False)
class TPGroup:
    """One process's view of its tensor-parallel group.

    ``pg`` is set by :meth:`connect` once every rank has loaded its shard (layers built before that keep the
    group object and find ``pg`` when they first run). ``procs`` are the worker processes rank 0 started
    itself (empty under torchrun, and on the workers).
    """

    rank: int
    size: int
    store: Any = None                      # torch.distributed.Store (control channel); None for one rank
    pg: Any = None                         # torch.distributed.ProcessGroup (all-reduce); None for one rank
    procs: list[RankHandle] = field(default_factory=list)
    # Rank 0: called (from the watch thread) with "rank R (exit code C)" when a started worker exits before close()
    on_rank_exit: list[Callable[[str], None]] = field(default_factory=list)
    local: bool = False                    # every rank was started by kv8 on this machine: shared-memory all-reduce
    shm: ShmAllReduce | None = None
    _parent: int = field(default_factory=os.getppid)
    _step: int = 0
    _closed: bool = False
    _silent: dict[int, float] = field(default_factory=dict)   # torchrun ranks without a heartbeat: rank -> seconds
    # the heartbeat threads (their own store connections), stopped and joined by stop_heartbeats(): one left in a
    # store call when the interpreter exits can abort the process ("terminate called without an active exception")
    _beat_stop: threading.Event = field(default_factory=threading.Event)
    _beat_threads: list[threading.Thread] = field(default_factory=list)

    @property
    def is_driver(self) -> bool:
        """Rank 0: runs the scheduler, publishes the steps, samples."""
        return self.rank == 0

    # ---- data channel ------------------------------------------------------------------------------------------
    def connect(self, devices: list[Any] | None = None, slot_bytes: int = 0, platform: Platform = CPU) -> None:
        """Build the collective group over ``store`` for tensors on ``platform``
        (:attr:`kv8.platform.Platform.collective_backend`: NCCL for CUDA, else gloo) and, on the CPU, for
        :attr:`local` ranks with ``slot_bytes > 0`` on x86-64 (:func:`kv8.distributed.shm_allreduce.supported`), map
        the shared-memory all-reduce with slots of that size (every rank calls it, with the same arguments, after
        :meth:`wait_ready` / ``set_ready``)."""
        if self.size == 1 or self.pg is not None:
            return
        if platform.collective_backend == "nccl":
            nccl_opts = dist.ProcessGroupNCCL.Options()
            nccl_opts._timeout = OP_TIMEOUT
            self.pg = dist.ProcessGroupNCCL(
                dist.PrefixStore("nccl/", self.store), self.rank, self.size, nccl_opts)
            return
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = OP_TIMEOUT
        opts._devices = devices or [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        self.pg = dist.ProcessGroupGloo(dist.PrefixStore("gloo/", self.store), self.rank, self.size, opts)
        if self.local and slot_bytes > 0 and shm_allreduce_supported():
            slot_bytes = -(-slot_bytes // 8) * 8
            path = self.share("shm_allreduce", create_shm_file(self.size, slot_bytes) if self.is_driver else None)
            self.shm = ShmAllReduce(path, self.rank, self.size, slot_bytes, OP_TIMEOUT.total_seconds(),
                                    self._gone)
            self.pg.barrier().wait()   # every rank has mapped the file: its name is no longer needed
            if self.is_driver:
                os.unlink(path)

    def _gone(self) -> str | None:
        """What a waiting rank reports as gone: on rank 0 the workers that exited, on a worker rank 0 (its
        parent) when it exited; None while they live."""
        if self.is_driver:
            dead = self.dead_ranks()
            return f"tensor-parallel {dead} exited" if dead else None
        return None if os.getppid() == self._parent else "tensor-parallel rank 0 exited"

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` (contiguous) over the ranks, in place; returns it. The identity for one rank. Every rank
        takes the same path (shared memory or gloo) for a call: it depends only on ``x``'s size."""
        if self.size == 1:
            return x
        try:
            if self.shm is not None and self.shm.fits(x):
                return self.shm.all_reduce(x)
            self.pg.allreduce([x]).wait()
        except RuntimeError as e:
            raise self.failure(e) from e
        return x

    def gather_to_driver(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's contiguous ``x`` (equal shapes) in rank order on rank 0; None on the other ranks. Like
        :meth:`all_reduce`, every rank must call it, and the path (shared memory or gloo) depends on ``x``'s size
        only."""
        if self.size == 1:
            return [x]
        try:
            if self.shm is not None and self.shm.fits(x):
                return self.shm.gather(x)
            parts = [torch.empty_like(x) for _ in range(self.size)]
            self.pg.allgather([parts], [x]).wait()
        except RuntimeError as e:
            raise self.failure(e) from e
        return parts if self.is_driver else None

    # ---- control channel ---------------------------------------------------------------------------------------
    def publish(self, obj: Any) -> None:
        """Rank 0: make ``obj`` (a step's inputs, or None to stop) the next message of every other rank."""
        key = f"step/{self._step}"
        try:
            self.store.set(key, pickle.dumps(obj))
            if self._step >= 2:   # every rank has read it: it ran that step's all-reduces since
                self.store.delete_key(f"step/{self._step - 2}")
        except (RuntimeError, OSError) as e:
            raise self.failure(e) from e
        self._step += 1

    def receive(self) -> Any:
        """A worker: block until rank 0 publishes the next message; returns it."""
        key = f"step/{self._step}"
        self.store.wait([key])
        self._step += 1
        return pickle.loads(self.store.get(key))

    def share(self, key: str, value: Any = None) -> Any:
        """Rank 0 sets ``key`` to ``value`` (JSON); the other ranks wait for it and return it."""
        if self.is_driver:
            self.store.set(f"shared/{key}", json.dumps(value))
            return value
        return json.loads(self.store.get(f"shared/{key}"))

    def set_ready(self, error: str | None = None) -> None:
        """A worker: its shard is loaded (or loading failed with ``error``)."""
        if error is not None:
            self.store.set(f"error/{self.rank}", error)
        else:
            self.store.set(f"ready/{self.rank}", "1")

    def wait_ready(self, timeout: float = 1800.0) -> None:
        """Rank 0: wait until every worker has loaded its shard; raise :class:`TensorParallelError` with the
        worker's own message if one failed, or if a worker process exited or never reported."""
        deadline = time.monotonic() + timeout
        pending = set(range(1, self.size))
        while pending:
            for r in sorted(pending):
                if self.store.check([f"error/{r}"]):
                    msg = self.store.get(f"error/{r}").decode(errors="replace")
                    raise TensorParallelError(f"tensor-parallel rank {r} failed to start: {msg}")
                if self.store.check([f"ready/{r}"]):
                    pending.discard(r)
            dead = self.dead_ranks()
            if pending and dead:
                raise TensorParallelError(f"tensor-parallel {dead} exited while loading its shard; see its "
                                          "output above")
            if pending and time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel rank(s) {sorted(pending)} did not load their shard "
                                          f"within {timeout:.0f} s")
            if pending:
                time.sleep(0.05)

    # ---- failures and shutdown ---------------------------------------------------------------------------------
    def watch(self) -> None:
        """Rank 0: when a started worker exits before :meth:`close`, log it at once and call each of
        :attr:`on_rank_exit` (a served engine fails then, idle or not); without them the next step fails naming
        the rank."""
        def run() -> None:
            wait_for_any([p.sentinel for p in self.procs])
            time.sleep(0.1)   # close() may be under way
            if not self._closed:
                what = f"{self.dead_ranks()} exited" if self.dead_ranks() else "rank exited"
                logger.error("tensor-parallel %s; the engine fails%s", what,
                             "" if self.on_rank_exit else " at its next step")
                for hook in list(self.on_rank_exit):
                    hook(what)

        threading.Thread(target=run, name="kv8-tp-watch", daemon=True).start()

    def start_heartbeat(self, store: Any, period: float = HEARTBEAT_S) -> None:
        """A torchrun-started worker: count up ``alive/<rank>`` in ``store`` (a connection of this thread's own)
        every ``period`` seconds, until the store is gone (rank 0 stopped) or :meth:`stop_heartbeats`."""
        def run() -> None:
            while not self._beat_stop.is_set():
                try:
                    store.add(f"alive/{self.rank}", 1)
                except Exception:   # noqa: BLE001 - rank 0's store went away: nothing left to tell
                    return
                self._beat_stop.wait(period)

        self._start_beat_thread(run, "kv8-tp-heartbeat")

    def watch_heartbeats(self, store: Any, period: float = HEARTBEAT_S, dead_after: float = DEAD_AFTER_S) -> None:
        """Rank 0 under torchrun: read every rank's heartbeat count in ``store`` (a connection of this thread's own)
        every ``period`` seconds; a rank whose count has not moved for ``dead_after`` seconds is gone -- logged and
        reported to :attr:`on_rank_exit` once, as :meth:`watch` reports a started rank's exit. Stops at
        :meth:`close` (or :meth:`stop_heartbeats`)."""
        def run() -> None:
            seen = {r: (-1, time.monotonic()) for r in range(1, self.size)}
            while not self._closed and not self._beat_stop.is_set():
                now = time.monotonic()
                try:
                    counts = {r: int(store.add(f"alive/{r}", 0)) for r in seen}
                except Exception:   # noqa: BLE001 - the store is gone: the engine is shutting down
                    return
                for r, n in counts.items():
                    if n != seen[r][0]:
                        seen[r] = (n, now)
                silent = {r: now - t for r, (_, t) in seen.items() if now - t > dead_after}
                if silent and not self._closed:
                    self._silent = silent
                    what = f"{self.dead_ranks()} stopped"
                    logger.error("tensor-parallel %s; the engine fails%s", what,
                                 "" if self.on_rank_exit else " at its next step")
                    for hook in list(self.on_rank_exit):
                        hook(what)
                    return
                self._beat_stop.wait(period)

        self._start_beat_thread(run, "kv8-tp-heartbeats")

    def _start_beat_thread(self, run: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=run, name=name, daemon=True)
        self._beat_threads.append(thread)
        thread.start()

    def stop_heartbeats(self, timeout: float = 5.0) -> None:
        """Stop this rank's heartbeat threads (:meth:`start_heartbeat`, :meth:`watch_heartbeats`) and wait up to
        ``timeout`` seconds for them to leave their store calls. Idempotent."""
        self._beat_stop.set()
        deadline = time.monotonic() + timeout
        for thread in self._beat_threads:
            if thread is not threading.current_thread():   # a hook of the watch thread may close the group
                thread.join(max(0.0, deadline - time.monotonic()))

    def dead_ranks(self) -> str:
        """'rank 1 (exit code -9), ...' for the started workers that are gone, or 'rank 1 (no heartbeat for 10 s)'
        for torchrun ranks that went silent; '' if none (or not known)."""
        dead = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(self.procs, start=1)
                if p.exitcode is not None]
        dead += [f"rank {r} (no heartbeat for {s:.0f} s)" for r, s in sorted(self._silent.items())]
        return ", ".join(dead)

    def failure(self, exc: BaseException) -> TensorParallelError:
        """The error to raise when a collective or the control channel failed."""
        time.sleep(0.2)   # let a dying worker's exit code show
        dead = self.dead_ranks()
        who = f"tensor-parallel {dead} exited" if dead else "a tensor-parallel rank failed or disconnected"
        return TensorParallelError(f"{who}; the engine cannot continue and must be restarted ({exc})")

    def close(self, timeout: float = 5.0) -> None:
        """Rank 0: tell the workers to stop, wait ``timeout`` seconds for them, then terminate (and kill) any
        left. Idempotent; safe after a failure. No-op on other ranks."""
        if self._closed or not self.is_driver or self.size == 1:
            return
        self._closed = True
        self.stop_heartbeats()
        try:
            self.publish(None)
        except TensorParallelError:
            pass
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
        self.release()

    def release(self) -> None:
        """Drop this rank's collective group; torchrun's default group is destroyed here (left to the interpreter's
        exit, its gloo threads could abort the process: "terminate called without an active exception")."""
        if self.pg is not None and self.pg is dist.group.WORLD and dist.is_initialized():
            dist.destroy_process_group()
        self.pg = None


SINGLE_RANK = TPGroup(0, 1)   # the group of an engine without tensor parallelism
