"""All-reduce (and gather) through shared memory, for tensor-parallel ranks on one machine.

A gloo all-reduce goes through loopback TCP: on some machines (sandboxes, VMs) that costs about a millisecond
however small the tensor, and a decode step runs two per layer. Ranks that share a machine instead sum through
one shared file mapped by every rank (the same idea as vLLM's CPU shared-memory all-reduce; this is kv8's own):

* layout: ``2 x size`` data slots of ``slot_bytes`` (two per rank, used alternately), then one int64 sequence
  flag per rank;
* ``all_reduce(x)`` (call ``n``): copy ``x`` into this rank's slot ``n % 2``, publish ``flag[rank] = n``,
  wait until every flag is ``>= n``, then sum the ``size`` slots in rank order (float32 accumulation for 16-bit
  inputs) into ``x``. Every rank sums the same bytes in the same order, so all ranks get identical results.
* Why two slots suffice: a rank writes slot ``n % 2`` again at call ``n + 2`` only after it saw every flag
  reach ``n + 1``, i.e. after every rank finished call ``n`` (ranks run the calls in program order, and read
  call ``n``'s slots before publishing call ``n + 1``).
* Ordering: the data copy completes before the flag store, and x86-64 keeps stores (and loads) in program order
  and makes every core see stores in one order (total store order), so a reader that sees the flag sees the
  data, the copy's worker threads' stores included (they finish before the copy returns). Weaker memory models
  (ARM, POWER) would need fences that Python cannot issue, so :func:`supported` allows this path on x86-64 only;
  elsewhere the group sums through gloo.

Waiting spins briefly, then yields the core each poll (``os.sched_yield``), so more ranks than cores still make
progress. A wait fails with :class:`~kv8.distributed.group.TensorParallelError` when ``alive()`` says a rank is
gone (checked every ``CHECK_S``), or after the group's operation timeout.

The file is created by rank 0 in ``/dev/shm`` and unlinked as soon as every rank has mapped it, so nothing is
left behind even if every process is killed. Tensors larger than a slot go through the fallback (gloo).
"""

from __future__ import annotations

import os
import platform
import tempfile
import time
from collections.abc import Callable

import torch

__all__ = ["ShmAllReduce", "create_shm_file", "supported"]

CHECK_S = 0.2        # how often a waiting rank asks whether the others are alive
SPINS = 200          # polls before a waiting rank starts yielding its core


def supported(machine: str | None = None) -> bool:
    """Whether this machine (``platform.machine()``, or ``machine``) keeps the store order the flags rely on
    (module docstring): x86-64."""
    return (machine if machine is not None else platform.machine()).lower() in ("x86_64", "amd64")


def create_shm_file(size: int, slot_bytes: int) -> str:
    """Rank 0: create the zero-filled file for :class:`ShmAllReduce` and return its path."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else None
    fd, path = tempfile.mkstemp(prefix="kv8-tp-", dir=directory)
    with os.fdopen(fd, "wb") as f:
        f.truncate(_file_bytes(size, slot_bytes))
    return path


def _file_bytes(size: int, slot_bytes: int) -> int:
    return 2 * size * slot_bytes + 8 * size


class ShmAllReduce:
    """One rank's view of the shared all-reduce file (see the module docstring). Not thread-safe: one thread per
    rank runs the collectives, as a model forward does."""

    def __init__(self, path: str, rank: int, size: int, slot_bytes: int, timeout_s: float,
                 alive: Callable[[], str | None]) -> None:
        if slot_bytes <= 0 or slot_bytes % 8:
            raise ValueError(f"slot_bytes must be a positive multiple of 8, got {slot_bytes}")
        self.rank, self.size, self.slot_bytes, self.timeout_s = rank, size, slot_bytes, timeout_s
        self.alive = alive   # None while every rank lives, else a description of the dead one(s)
        total = _file_bytes(size, slot_bytes)
        self._buf = torch.from_file(path, shared=True, size=total, dtype=torch.uint8)
        data = self._buf[: 2 * size * slot_bytes].view(2, size, slot_bytes)
        self._slots = data
        self._flags = self._buf[2 * size * slot_bytes:].view(torch.int64).numpy()
        self._calls = 0

    def fits(self, x: torch.Tensor) -> bool:
        return x.numel() * x.element_size() <= self.slot_bytes

    def _exchange(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Publish ``x`` as this rank's part of the next call and wait for every rank's: ``(the call's slots
        [size, slot_bytes], bytes of x)``."""
        self._calls += 1
        n, nbytes = self._calls, x.numel() * x.element_size()
        slots = self._slots[n % 2]
        slots[self.rank, :nbytes].copy_(x.reshape(-1).view(torch.uint8))
        self._flags[self.rank] = n
        self._wait(n)
        return slots, nbytes

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum contiguous ``x`` over the ranks, in place (``fits(x)`` must hold); returns it."""
        slots, nbytes = self._exchange(x)
        acc_dtype = torch.float32 if x.element_size() < 4 else x.dtype
        total = slots[0, :nbytes].view(x.dtype).to(acc_dtype, copy=True)   # never add into the shared slot
        for r in range(1, self.size):
            total += slots[r, :nbytes].view(x.dtype)
        x.copy_(total.view(x.shape))
        return x

    def gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's contiguous ``x`` (equal shapes and dtypes; ``fits(x)`` must hold), in rank order, on
        rank 0 (copies); None on the other ranks. Uses the same slots and flags as :meth:`all_reduce` (every
        rank waits for every flag, so the two-slot argument holds for both)."""
        slots, nbytes = self._exchange(x)
        if self.rank != 0:
            return None
        return [slots[r, :nbytes].view(x.dtype).view(x.shape).clone() for r in range(self.size)]

    def _wait(self, n: int) -> None:
        flags = self._flags
        spins = 0
        next_check = deadline = 0.0
        while int(flags.min()) < n:
            spins += 1
            if spins < SPINS:
                continue
            os.sched_yield()
            now = time.monotonic()
            if not deadline:
                next_check, deadline = now + CHECK_S, now + self.timeout_s
            elif now >= next_check:
                next_check = now + CHECK_S
                gone = self.alive()
                if gone is not None:
                    raise RuntimeError(f"{gone} (shared-memory all-reduce {n} of rank {self.rank})")
                if now >= deadline:
                    late = [r for r in range(self.size) if int(flags[r]) < n]
                    raise RuntimeError(f"shared-memory all-reduce {n}: ranks {late} did not arrive within "
                                       f"{self.timeout_s:.0f} s")
