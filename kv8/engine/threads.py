"""How many threads kv8's parallel regions use: all its cores while the machine is otherwise idle, fewer while
other processes keep some of them busy.

Why: kv8's kernels and torch's run on OpenMP (libgomp), whose threads spin after each parallel region so that
the next one starts without a wake-up. On an idle machine that spinning is what makes a decode step fast (a
sleeping worker costs ~40 us to wake on a VM, ~180 regions per step). Beside another busy process it is what
makes kv8 collapse: the spinning threads burn the time slices they share with the other process, and a region
waits for a worker the scheduler has parked (``benchmarks/bench_contention.py``: 0.15-0.25 of the idle speed with
every core busy elsewhere, single runs down to 0.01). The wait policy is read once, when libgomp loads, so it
cannot follow the load; the number of threads a region asks for can.

:class:`ThreadGovernor` samples, at most every :attr:`ThreadGovernor.window` seconds and only from the engine's
step, how much CPU time *other* processes took on this process's CPUs (``/proc/stat`` busy time, steal time
included -- on a VM that is other guests' -- minus this process's own CPU time) and sets the threads to the
cores they left free, between 1 and the configured count: fewer at once, more after the same answer twice in a
row (so a single quiet window does not bring the spinning back). With one thread no region has a worker to wait
for or to spin, and the pool's idle workers sleep after their spin; when the other load goes, the next windows
see the cores free again and the threads come back.

Only windows in which the engine was stepping decide. The engine calls :meth:`ThreadGovernor.observe` as a step
starts and :meth:`ThreadGovernor.idle` when it is built and whenever a step ends. A window in which the engine sat
idle for more than :attr:`ThreadGovernor.idle_gap` seconds says nothing about the load the next steps meet (a
benchmark pauses its other engines before it measures this one; a server idles while a batch job runs, then gets a
burst after the job ended): it only starts a new window. Without this, the first step after an idle minute beside a
finished job dropped to one thread and needed two more windows (~0.5 s, a whole 1k-token prefill) to come back.
A long window in which the engine was stepping does decide, however long its steps: beside a busy process per
core, steps whose spinning threads wait for parked ones can take seconds each (a first 8 x 64-token batch at 25
tok/s where one thread then ran 210-300 tok/s, Intel Xeon with AMX, 2 cores, 2026-12-01), and a governor that read
long windows as idle ones never gave the threads up.

Invariants: the governor changes only the thread count (``torch.set_num_threads``, read by every kv8 kernel call
and by torch's ops on the engine's thread), never the results: every kernel's rows are independent of the thread
count. It never raises above the count the engine was configured with. Where ``/proc/stat`` cannot be read it
does nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kv8.cpu_load import CpuClock, others_cores, read_cpu_clock, this_process_cpus

__all__ = ["ThreadGovernor"]


@dataclass
class ThreadGovernor:
    """Follows the cores other processes leave free (module docstring). Call :meth:`observe` once per engine
    step; it returns the thread count in force."""

    max_threads: int
    window: float = 0.25                      # seconds between two readings
    idle_gap: float = 1.0                     # a reading older than this spans an idle engine: a new window only
    cpus: frozenset[int] = field(default_factory=this_process_cpus)
    clock: Callable[[frozenset[int]], CpuClock | None] = read_cpu_clock
    set_threads: Callable[[int], None] = torch.set_num_threads
    now: Callable[[], float] = time.monotonic
    threads: int = 0                          # the count in force (max_threads until a change)
    _last: CpuClock | None = None
    _idle_from: float | None = None           # when the engine last went idle (idle()); None while a step runs
    _pending: int | None = None               # the previous window's answer, applied when this one agrees

    def __post_init__(self) -> None:
        if self.max_threads < 1:
            raise ValueError(f"max_threads={self.max_threads} must be >= 1")
        self.threads = self.threads or self.max_threads

    def others(self, before: CpuClock, after: CpuClock) -> float:
        """Cores' worth of CPU time other processes took on :attr:`cpus` between two readings."""
        return others_cores(before, after)

    def target(self, others: float) -> int:
        """The threads for a window in which others took ``others`` cores: the cores left, rounded, in
        ``[1, max_threads]``."""
        return max(1, min(self.max_threads, round(len(self.cpus) - others)))

    def idle(self) -> None:
        """The engine is idle from now on (it was built, or a step ended) until the next :meth:`observe`; the
        first call takes the first reading."""
        if self._last is None:
            self._last = self.clock(self.cpus)
        self._idle_from = self.now()

    def observe(self) -> int:
        """A step starts: decide on the window since the last reading if it is at least :attr:`window` long and
        the engine was idle for at most :attr:`idle_gap` of it (since the last :meth:`idle`; stepping throughout
        where there was none). Returns the thread count in force."""
        idle_from, self._idle_from = self._idle_from, None
        if self._last is not None and self.now() - self._last.wall < self.window:
            return self.threads
        reading = self.clock(self.cpus)
        if reading is None:
            return self.threads
        if self._last is not None and (idle_from is None or reading.wall - idle_from <= self.idle_gap):
            want = self.target(self.others(self._last, reading))
            # fewer threads at once (spinning beside a busy process costs a lot), more only when two windows
            # in a row agree (a single quiet window does not bring the spinning back)
            if want < self.threads or (want > self.threads and want == self._pending):
                self.threads = want
                self.set_threads(want)
            self._pending = want
        self._last = reading
        return self.threads
